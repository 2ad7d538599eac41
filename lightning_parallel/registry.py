"""Registers every strategy name with Lightning, so ``Trainer(strategy="lp_ddp")`` works after import.

Lightning has no entry-point group for strategies, so the names exist once ``lightning_parallel`` is
imported. Each name maps to a class plus fixed init arguments; a class must construct with none.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["STRATEGY_NAMES", "register_strategies"]

# name -> (class path in lightning_parallel.strategies, init arguments, description)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any], str]] = {
    "lp_ddp": (
        "DDPStrategy",
        {},
        "lightning_parallel DDP: own bucketing, all-reduce overlapped with backward",
    ),
    "lp_ddp_spawn": ("DDPStrategy", {"start_method": "spawn"}, "lp_ddp with processes started by spawn"),
    "lp_ddp_find_unused_parameters_true": (
        "DDPStrategy",
        {"find_unused_parameters": True},
        "lp_ddp that allows parameters without gradients",
    ),
    "lp_dp": ("DataParallelStrategy", {}, "master-based data parallel: gradients to rank 0, parameters back"),
    "lp_tensor_parallel": (
        "TensorParallelStrategy",
        {},
        "Megatron-style tensor parallelism (plan='auto'), optionally 2-D with data parallelism",
    ),
    "lp_parallel": (
        "ParallelStrategy",
        {},
        "data x tensor x pipeline parallelism on one mesh (3-D), the parallelisms applied in one order",
    ),
    "lp_pipeline_gpipe": (
        "PipelineParallelStrategy",
        {"schedule": "gpipe"},
        "pipeline parallel, GPipe fill-drain",
    ),
    "lp_pipeline_1f1b": (
        "PipelineParallelStrategy",
        {"schedule": "1f1b"},
        "pipeline parallel, 1F1B with a flush",
    ),
    "lp_pipeline_interleaved": (
        "PipelineParallelStrategy",
        {"schedule": "interleaved_1f1b"},
        "pipeline parallel, Megatron's interleaved 1F1B (virtual_stages chunks per rank, a smaller bubble)",
    ),
    "lp_pipeline_zb": (
        "PipelineParallelStrategy",
        {"schedule": "zb_h1"},
        "pipeline parallel, zero bubble ZB-H1 (weight gradients deferred into 1F1B's bubble)",
    ),
    "lp_pipeline_zbv": (
        "PipelineParallelStrategy",
        {"schedule": "zbv"},
        "pipeline parallel, zero bubble ZBV (two chunks per rank in a V, split backwards)",
    ),
    "lp_pipeline_async": (
        "PipelineParallelStrategy",
        {"schedule": "async"},
        "pipeline parallel with PipeDream-2BW's one-step-stale, double-buffered weight update",
    ),
}


def register_strategies() -> None:
    """Add (or refresh) our names in Lightning's registry; safe to call twice."""
    from lightning_parallel import strategies

    for name, (class_name, init_params, description) in STRATEGY_NAMES.items():
        cls = getattr(strategies, class_name)
        StrategyRegistry.register(name, cls, description=description, override=True, **init_params)
