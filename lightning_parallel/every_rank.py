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

A leaf (it imports nothing of the package): the strategies mark the step (``training_step_scope``), the
layers ask. One counter for the process, not per thread: a CUDA backward (and the recompute inside it)
runs on autograd's device threads while the main thread waits in the step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["every_rank_forward", "training_step_scope"]

_steps = 0  # > 0 while a strategy's training step or backward runs


@contextmanager
def training_step_scope() -> Iterator[None]:
    """Mark the block as a strategy's training step or backward, which every rank runs (nestable)."""
    global _steps
    _steps += 1
    try:
        yield
    finally:
        _steps -= 1


def every_rank_forward() -> bool:
    """True inside a strategy's training step or backward while gradients are recorded: a forward every rank
    of the run takes part in."""
    return _steps > 0 and torch.is_grad_enabled()
