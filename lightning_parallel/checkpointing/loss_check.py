"""Opt-in: stop at the first non-finite training loss, saying where it appeared.

By default a NaN or infinite loss is Lightning's business, as under its ``ddp``: training goes on, and
``EarlyStopping(check_finite=True)`` or ``SpikeDetection`` decide. With ``check_finite_loss=True`` on a
strategy, ``NonFiniteLossError`` names the global step, the batch index and the rank on which the loss
was computed; the failure watchdog (``distributed/watchdog.py``) then stops the other ranks within
``failure_timeout``, naming this rank, instead of leaving them waiting in the next collective.

The check never makes the host wait for an accelerator (``FiniteLossCheck``): a loss on the CPU is read
at once, before backward and the optimizer step; a loss on a GPU is copied to pinned host memory without
blocking, and read once its CUDA event has completed (normally at the next step, whose optimizer step may
then already have used it), or at the end of training.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["FiniteLossCheck", "NonFiniteLossError", "check_finite_loss", "training_loss"]


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite."""


def training_loss(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``), or None."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def _raise_if_not_finite(
    value: float, global_step: int, batch_idx: int | None, rank: int, late: bool
) -> None:
    if math.isfinite(value):
        return
    when = (
        "read without stopping the device, so later optimizer steps may already have used it"
        if late
        else "stopped before the optimizer step so the weights stay finite"
    )
    raise NonFiniteLossError(
        f"non-finite training loss ({value}) at global step {global_step}, batch {batch_idx}, on rank {rank}; "
        f"{when}. Check that batch and the learning rate, or use precision='64-true' / gradient clipping to "
        "find where it starts."
    )


def check_finite_loss(loss: Tensor | None, global_step: int, batch_idx: int | None, rank: int) -> None:
    """Raise ``NonFiniteLossError`` now if ``loss`` holds a NaN or infinity (one scalar read: on a GPU, a
    device sync; ``FiniteLossCheck`` avoids it)."""
    if loss is None or loss.numel() == 0:
        return
    _raise_if_not_finite(float(loss.detach().float().sum()), global_step, batch_idx, rank, late=False)


class _Pending(NamedTuple):
    event: Any  # torch.cuda.Event
    host: Tensor
    global_step: int
    batch_idx: Optional[int]
    rank: int


class FiniteLossCheck:
    """Checks every training loss given to ``observe`` without a per-step host-device synchronisation."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def observe(self, loss: Tensor | None, global_step: int, batch_idx: int | None, rank: int) -> None:
        """Check ``loss`` (now on the CPU, when its copy has arrived on a GPU), and the earlier ones that
        have arrived since."""
        self.poll()
        if loss is None or loss.numel() == 0:
            return
        if loss.device.type != "cuda":
            check_finite_loss(loss, global_step, batch_idx, rank)
            return
        value = loss.detach().float().sum()
        host = torch.empty((), dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append(_Pending(event, host, global_step, batch_idx, rank))

    def poll(self, wait: bool = False) -> None:
        """Read the copies that have arrived (all of them, waiting, with ``wait``); raise at a non-finite one."""
        while self._pending and (wait or self._pending[0].event.query()):
            pending = self._pending.popleft()
            pending.event.synchronize()
            _raise_if_not_finite(
                float(pending.host), pending.global_step, pending.batch_idx, pending.rank, late=True
            )
