"""Tensor parallelism: sharded layers (``layers``; a mixture of experts' ``expert_layer``), sharding
plans (``plan``, ``auto``), the plan table (``table``) and full/sharded state conversion (``state``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_parallel.tensor.auto import auto_plan, resolve_auto
from lightning_parallel.tensor.expert_layer import ParallelExperts
from lightning_parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelMultiheadAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_parallel.tensor.plan import Plan, PlanError, ResolvedPlan, apply_plan, parse_plan, resolve_plan

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelMultiheadAttention",
    "ParallelExperts",
    "Plan",
    "PlanError",
    "ResolvedPlan",
    "parse_plan",
    "resolve_plan",
    "apply_plan",
    "auto_plan",
    "resolve",
]


def resolve(
    module: nn.Module, plan: Any, tp_size: int, run: Optional[Callable[[], Any]] = None
) -> ResolvedPlan:
    """A validated plan for ``module``: ``"auto"`` (traced from ``run()``, a forward such as a
    ``sample.SampleStep``, on fake tensors, when given), a dict, a YAML path, or a ``Plan``."""
    if isinstance(plan, str) and plan == "auto":
        return resolve_auto(module, tp_size, run)
    return resolve_plan(module, plan, tp_size)
