"""The data-parallel axes of a step: the gradient average over the dp group (``DataParallel``), ZeRO's
pieces of it (``Zero``), both driving the strategy's one reducer (``strategy.reducer``, rebuilt when the
trainable parameters change), and ZeRO-3's sharded parameters (``ZeroParameters``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from lightning_parallel.checkpointing.contract import unwrapped
from lightning_parallel.strategies.axes import Axis

__all__ = ["DataParallel", "Zero", "ZeroParameters"]


class DataParallel(Axis):
    """The gradients averaged over the data-parallel group by the strategy's reducer.

    Args:
        strategy: reads its ``reducer`` and ``_sync_grads`` (False on accumulating micro-steps).
        after_schedule: a pipeline's schedule runs the step's backwards inside the training step and fills
            the buckets itself; after Lightning's backward the average is only finished, once per optimizer
            step (not on accumulating micro-steps).
        overlapped: under ``after_schedule``, the schedule started the average during the stage's last
            backward (its hooks), so it is waited for; otherwise it runs at once here (several chunks per
            rank, split backwards, or the async pipeline's gradient finished a step earlier).
    """

    name = "data_parallel"

    def __init__(self, strategy: Any, after_schedule: bool = False, overlapped: bool = True) -> None:
        self.strategy, self.after_schedule, self.overlapped = strategy, after_schedule, overlapped

    def reducer(self) -> Any:
        """The reducer this axis drives (None: nothing to average)."""
        return self.strategy.reducer

    def pre_backward(self) -> None:
        reducer = self.reducer()
        if reducer is not None and not self.after_schedule:
            reducer.prepare_for_backward()

    def post_backward(self) -> None:
        reducer = self.reducer()
        if reducer is None:
            return
        if not self.after_schedule:
            reducer.finish_sync()
        elif self.strategy._sync_grads:
            reducer.finish_sync() if self.overlapped else reducer.average_now()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        reducer = self.reducer()
        if reducer is None:
            yield
            return
        previous, reducer.sync_enabled = reducer.sync_enabled, False
        try:
            yield
        finally:
            reducer.sync_enabled = previous

    def teardown(self) -> None:
        reducer = self.reducer()
        if reducer is not None:  # kept (without hooks) so its stats can be read after fit
            reducer.remove_hooks()


class Zero(Axis):
    """ZeRO-1/2 (``zero_stage``): once the step's gradients are finished, each of this rank's pieces takes
    its range of them; the optimizer steps the pieces, then every rank's updated ranges are all-gathered
    into the model (``distributed.zero``, ``distributed.optimizer_shards``)."""

    name = "zero"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def post_backward(self) -> None:
        self.strategy.shard_gradients()

    @contextmanager
    def optimizer_step(self, optimizer: Any) -> Iterator[None]:
        shards = self.strategy._optimizer_shards.get(id(unwrapped(optimizer)))
        if shards is None:
            yield
            return
        with shards.sharded():
            yield
        self.strategy.reducer.gather_parameters()


class ZeroParameters(Axis):
    """ZeRO-3 (``zero_stage=3``, ``distributed.zero3.ShardedParameters``): the root unit gathered around the
    training step's forward (``strategy.sharded_forward``); once the step's gradients are in the pieces,
    every unit still gathered is freed; at teardown the module is gathered whole and its hooks removed. A
    block's gathers around its own forward and backward are module hooks, not step hooks (under pipeline
    stages, every unit of the stage is gathered around the schedule's run: ``PipelineStages._run``)."""

    name = "zero_parameters"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @contextmanager
    def training_step(self) -> Iterator[None]:
        with self.strategy.sharded_forward():
            yield

    def post_backward(self) -> None:
        for shards in self.strategy.parameter_shards:
            shards.after_backward()

    def teardown(self) -> None:
        for shards in self.strategy.parameter_shards:
            shards.teardown()
        self.strategy.parameter_shards = []
