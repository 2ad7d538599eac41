"""Stop at the first non-finite training loss, saying where it appeared.

A NaN or infinite loss, once back-propagated, turns every weight into NaN at the optimizer step, and the
run carries on silently (or fails much later in a way that names nothing). The base strategy checks the
loss right after the user's ``training_step``, before backward and before the optimizer step, and raises
``NonFiniteLossError`` naming the global step, the batch index and the rank on which the loss was computed.
The failure watchdog (``distributed/watchdog.py``) then stops the other ranks within ``failure_timeout``,
naming this rank, instead of leaving them waiting in the next collective.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["NonFiniteLossError", "check_finite_loss", "training_loss"]


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite; raised before the optimizer step could corrupt the weights."""


def training_loss(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``), or None."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def check_finite_loss(loss: Tensor | None, global_step: int, batch_idx: int | None, rank: int) -> None:
    """Raise ``NonFiniteLossError`` if ``loss`` holds a NaN or infinity (one scalar read: a device sync)."""
    if loss is None or loss.numel() == 0:
        return
    value = float(loss.detach().float().sum())
    if math.isfinite(value):
        return
    raise NonFiniteLossError(
        f"non-finite training loss ({value}) at global step {global_step}, batch {batch_idx}, on rank {rank}; "
        "stopped before the optimizer step so the weights stay finite. Check that batch and the learning rate, "
        "or use precision='64-true' / gradient clipping to find where it starts."
    )
