"""Registers every strategy name with Lightning, so ``Trainer(strategy="lp_ddp")`` works after import.

Lightning has no entry-point group for strategies, so the names exist once ``lightning_parallel`` is
imported. Each name maps to a class plus fixed init arguments; a class must construct with none. The same
names are ``lp-train``'s strategy choices (``conf/strategy/<name>.yaml``).

A name that no registry holds gets Lightning's ``ValueError``, whose examples are Lightning's own
strategies; ``Trainer.__init__`` is wrapped (once, transparently) so that the error also says which of
ours was meant (``strategy_name_hint``). The wrapper reads only the ``strategy`` argument and the
registry, both public: no Lightning internals.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Callable, Optional

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["STRATEGY_NAMES", "register_strategies", "strategy_name_hint"]

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
    """Add (or refresh) our names in Lightning's registry, and the hint for a misspelt one; safe to call twice."""
    from lightning.pytorch import Trainer

    from lightning_parallel import strategies

    for name, (class_name, init_params, description) in STRATEGY_NAMES.items():
        cls = getattr(strategies, class_name)
        StrategyRegistry.register(name, cls, description=description, override=True, **init_params)
    if not getattr(Trainer.__init__, "_lp_name_hint", False):
        Trainer.__init__ = _with_name_hint(Trainer.__init__)


def strategy_name_hint(strategy: Any) -> Optional[str]:
    """For a strategy name that no registry holds, the ``lp_*`` name closest to it and all of ours; None
    for anything else (a registered name, "auto", a Strategy object)."""
    if not isinstance(strategy, str) or strategy.lower() == "auto" or strategy.lower() in StrategyRegistry:
        return None
    close = difflib.get_close_matches(strategy.lower(), STRATEGY_NAMES, n=1, cutoff=0.6)
    meant = f"Did you mean {close[0]!r}? " if close else ""
    return f"{meant}lightning_parallel's strategies: {', '.join(STRATEGY_NAMES)}."


def _with_name_hint(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValueError as err:
            hint = strategy_name_hint(kwargs.get("strategy"))
            if hint is None:
                raise
            raise ValueError(f"{err}\n{hint}") from None

    __init__._lp_name_hint = True  # type: ignore[attr-defined]
    return __init__
