"""Whether the forward running now is one that every rank joins: the strategy's training step or backward,
while autograd records.

Lightning calls a strategy's ``training_step`` and ``backward`` on every rank, so a collective inside them
is joined by all. Anything else may run on some ranks only: a hook or a callback (a sample generated under
``if self.global_rank == 0``), ``generate`` or any forward under ``torch.no_grad``, validation, test and
predict. The package's collectives that only make the training step equal one device's run where
``every_rank_forward()`` is True; elsewhere the layer computes on this rank's input alone, as the user's
module does on one device:

- the load-balancing loss's statistics summed over the data-parallel group (``moe/load_balancing.py``): only
  the gradient and loss of the training step need the global batch's;
- a ``SyncBatchNorm``'s statistics gathered over the data-parallel group (``distributed/sync_batchnorm.py``):
  outside the step a forward in training mode normalizes with its own input's statistics, as a BatchNorm on
  one device does with that input.

Whether a call at all is one every rank joins, whatever the grad mode (``every_rank_runs``: the training step,
the backward, and the evaluation step), is what ZeRO-3 asks before it gathers a block's parameters from a
module hook: elsewhere (a hook or callback) it refuses rather than start a collective some ranks may never
join (``distributed/zero3.py``).

A leaf (it imports nothing of the package): the strategies mark the step (``training_step_scope``), the
layers ask. One counter for the process, not per thread: a CUDA backward (and the recompute inside it)
runs on autograd's device threads while the main thread waits in the step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["every_rank_forward", "every_rank_runs", "every_rank_scope", "training_step_scope"]

_steps = 0  # > 0 while a strategy's training step or backward runs
_joined = (
    0  # > 0 while a strategy hook that Lightning calls on every rank runs (training_step_scope included)
)


@contextmanager
def every_rank_scope() -> Iterator[None]:
    """Mark the block as a strategy hook that Lightning calls on every rank (an evaluation step; nestable)."""
    global _joined
    _joined += 1
    try:
        yield
    finally:
        _joined -= 1


@contextmanager
def training_step_scope() -> Iterator[None]:
    """Mark the block as a strategy's training step or backward, which every rank runs (nestable)."""
    global _steps
    _steps += 1
    try:
        with every_rank_scope():
            yield
    finally:
        _steps -= 1


def every_rank_forward() -> bool:
    """True inside a strategy's training step or backward while gradients are recorded: a forward every rank
    of the run takes part in."""
    return _steps > 0 and torch.is_grad_enabled()


def every_rank_runs() -> bool:
    """True inside a strategy hook that Lightning calls on every rank (training step, backward, evaluation
    step), in any grad mode; False in the user's hooks and callbacks, which may run on some ranks only."""
    return _joined > 0
