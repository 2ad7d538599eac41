"""The ``Trainer`` arguments of a fit the package runs only to measure or check something (the planner's
timed steps, ``lp-verify``'s runs): no logger, checkpoints, progress bar or model summary, and no
validation, so that the fit writes nothing and prints nothing but what its caller reports."""

from __future__ import annotations

from typing import Any

__all__ = ["QUIET_TRAINER"]

QUIET_TRAINER: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)
