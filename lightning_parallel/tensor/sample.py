"""The step ``plan="auto"`` traces (a ``SampleStep``): the user's ``training_step`` on the first training
batch (or ``forward`` on ``example_input_array`` outside ``fit``), with random state, buffers, metrics
and logs left as they were. A leaf of ``tensor/``: ``fake``, ``trace``, ``sequence_plan`` and the
strategies read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.step_effects import capture_logs, untouched

__all__ = ["SampleStep", "forward_on", "sample_forward"]


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
    available. A step that optimizes by itself (``automatic_optimization=False``) is not run: only its
    ``forward``."""
    example = getattr(module, "example_input_array", None)
    if not getattr(module, "automatic_optimization", True):
        batch = None
    if batch is None and example is None:
        return None
    return SampleStep(module, batch if batch is not None else example, batch is not None)
