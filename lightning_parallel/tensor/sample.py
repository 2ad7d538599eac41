"""The step ``plan="auto"`` traces (a ``SampleStep``): the user's ``training_step`` on the first training
batch (or ``forward`` on ``example_input_array`` outside ``fit``), with random state, buffers, metrics
and logs left as they were. A leaf of ``tensor/``: ``fake``, ``trace``, ``sequence_plan`` and the
strategies read it.

A step that optimizes by itself (``automatic_optimization=False``) is traced too, with its optimization
made inert while it runs (``inert_optimization``): ``manual_backward``, the optimizers' ``step`` and
``zero_grad``, the schedulers' ``step`` and ``clip_gradients`` do nothing (a closure given to ``step``
still runs, as it holds the forward). The trace runs before Lightning sets up the optimizers, so
``self.optimizers()`` gives inert stand-ins for the ones ``configure_optimizers`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.compat import compiled_runs_eagerly
from lightning_parallel.step_effects import capture_logs, untouched

__all__ = ["SampleStep", "forward_on", "inert_optimization", "sample_forward"]


def sample_forward(module: Any, to_device: Callable[[Any], Any]) -> SampleStep | None:
    """The module's computation on the first training batch, or None when there is nothing to run."""
    trainer = getattr(module, "_trainer", None)
    batch = None
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        try:  # a loader's iterator draws its base seed from the global random state: left as it was
            with torch.random.fork_rng(devices=[]):
                batch = to_device(next(iter(trainer.fit_loop._data_source.dataloader())))
        except (StopIteration, TypeError, AttributeError):
            batch = None
    return forward_on(module, batch)


@dataclass
class SampleStep:
    """The user's computation on one input, as ``plan="auto"`` traces it: ``training_step(inputs, 0)``
    on a batch, else ``forward`` on ``example_input_array``. Calling it runs ``step`` on ``inputs``
    inside ``kept``; ``tensor.fake`` runs the same step on fake copies of the inputs instead."""

    module: Any
    inputs: Any
    is_batch: bool

    def step(self, inputs: Any) -> Any:
        # eager even in a compiled module (``trainer.fit(torch.compile(model))``): it runs on fake tensors
        # and under dispatch modes, and dynamo would compile and cache the user's frames against those,
        # so that the real steps then ran without a graph
        with compiled_runs_eagerly(self.module):
            return self._step(inputs)

    def _step(self, inputs: Any) -> Any:
        if self.is_batch and not getattr(self.module, "automatic_optimization", True):
            with inert_optimization(self.module):
                return self.module.training_step(inputs, 0)
        if self.is_batch:
            return self.module.training_step(inputs, 0)
        return self.module(*inputs) if isinstance(inputs, tuple) else self.module(inputs)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Random state, buffers, metrics and logs are as they were after the block."""
        with untouched(self.module), capture_logs(self.module, log_objects=False):
            yield

    def __call__(self) -> Any:
        with self.kept():
            return self.step(self.inputs)


def forward_on(module: Any, batch: Any = None) -> SampleStep | None:
    """``training_step(batch, 0)``, else ``forward`` on ``example_input_array``; None when neither is
    available."""
    example = getattr(module, "example_input_array", None)
    if batch is None and example is None:
        return None
    return SampleStep(module, batch if batch is not None else example, batch is not None)


class _Inert:
    """An optimizer or scheduler whose updates do nothing while a step is traced; what it holds
    (``param_groups``, ``state``, ``optimizer``) reads through to the real one."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped

    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    @contextmanager
    def toggle_model(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def _one_or_list(items: list) -> Any:
    """As ``LightningModule.optimizers()`` and ``lr_schedulers()`` give them: one alone, else the list."""
    return items[0] if len(items) == 1 else items


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _no_toggle(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


@contextmanager
def inert_optimization(module: Any) -> Iterator[None]:
    """While the block runs, ``module``'s manual optimization does nothing (see the module docstring):
    its ``manual_backward``, ``optimizers()``, ``lr_schedulers()``, ``clip_gradients``,
    ``(un)toggle_optimizer`` and ``toggled_optimizer`` are replaced on the instance, and restored after."""
    with torch.random.fork_rng(devices=[]):
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    stand_ins = [_Inert(o) for o in optimizers]
    scheduled = [_Inert(config.scheduler) for config in schedulers]
    replaced = {
        "manual_backward": _nothing,
        "clip_gradients": _nothing,
        "toggle_optimizer": _nothing,
        "untoggle_optimizer": _nothing,
        "toggled_optimizer": _no_toggle,
        "optimizers": lambda use_pl_optimizer=True: _one_or_list(stand_ins),
        "lr_schedulers": lambda: _one_or_list(scheduled) if scheduled else None,
    }
    for name, value in replaced.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name in replaced:
            module.__dict__.pop(name, None)
