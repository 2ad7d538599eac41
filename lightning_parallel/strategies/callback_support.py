"""Lightning callbacks that a layout cannot run, named before training with the reason: SWA on a split model
(tensor-parallel shards, pipeline stages, experts placed over ranks, parameters sharded by ``zero_stage=3``),
a finetuning callback where the layout fixes at set-up which parameters train, and a gradient accumulation
schedule where it takes one update per batch.

``StochasticWeightAveraging`` copies the whole LightningModule in its ``setup`` hook, before the strategy
splits it, then averages that copy's parameters with the module's by position (``zip``) and copies them
back at the end. On a split model this rank holds part of the parameters, in other shapes: the pairs are
different tensors, and the average is wrong where it does not fail. Under ``zero_stage=3`` the module's
parameters are NaN placeholders between steps: the average is NaN, and the copy back fails at the end of fit.
"""

from __future__ import annotations

from typing import Iterable, Optional

from lightning.pytorch.callbacks import (
    BaseFinetuning,
    GradientAccumulationScheduler,
    StochasticWeightAveraging,
)

from lightning_parallel.distributed.mesh import MeshShape

__all__ = ["accumulation_refusal", "finetuning_refusal", "split_model_refusal"]

SPLITTING_AXES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "ep": "expert_parallel_size"}


def split_model_refusal(
    callbacks: Iterable[object], strategy: str, shape: MeshShape, zero_stage: int = 0
) -> Optional[str]:
    """Why ``strategy``, on a mesh of ``shape`` with ``zero_stage``, refuses one of the trainer's
    ``callbacks``; None when it refuses none (also whenever no axis of ``shape`` splits the model and the
    parameters are not sharded: ``zero_stage=3`` over more than one data-parallel rank splits them too)."""
    split = [f"{name}={shape.size(axis)}" for axis, name in SPLITTING_AXES.items() if shape.size(axis) > 1]
    if zero_stage == 3 and shape.dp > 1:
        split.append("zero_stage=3, whose parameters are NaN placeholders between steps")
    if not split:
        return None
    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            return (
                f"{strategy} does not support the StochasticWeightAveraging callback with a split model "
                f"({', '.join(split)}): the callback copies the whole module before the split and averages its "
                "parameters by position with what this rank holds of the model, which are other tensors. Use "
                "lp_ddp with zero_stage 0, 1 or 2 (the whole model on every rank), or remove the callback."
            )
    return None


def finetuning_refusal(callbacks: Iterable[object], strategy: str, fixed: Optional[str]) -> Optional[str]:
    """Why ``strategy`` refuses a Lightning finetuning callback (``BackboneFinetuning``, any
    ``BaseFinetuning``), which freezes and unfreezes parameters during fit, given ``fixed``: why its layout
    cannot follow such a change (``trainable_set_fixed``; None: it can). None when it refuses none."""
    names = [type(c).__name__ for c in callbacks if isinstance(c, BaseFinetuning)]
    if not names or fixed is None:
        return None
    return (
        f"{strategy}: the {names[0]} callback freezes and unfreezes parameters during fit, and {fixed}. "
        "Remove the callback, or use a layout that follows the change (docs/changing_state.md)."
    )


def accumulation_refusal(
    callbacks: Iterable[object], strategy: str, per_batch: Optional[str]
) -> Optional[str]:
    """Why ``strategy`` refuses Lightning's ``GradientAccumulationScheduler``, which raises
    ``accumulate_grad_batches`` at the epochs it names (after set-up checked it), given ``per_batch``: why the
    layout cannot accumulate batches (``accumulation_refused``; None: it can). None when it refuses none."""
    if per_batch is None or not any(isinstance(c, GradientAccumulationScheduler) for c in callbacks):
        return None
    return (
        f"{strategy} does not support the GradientAccumulationScheduler callback: it accumulates batches from "
        f"the epochs it names, and {per_batch}. Remove the callback."
    )
