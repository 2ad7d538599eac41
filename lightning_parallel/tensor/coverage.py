"""What a plan covers, said at start-up, and refused when it splits (almost) nothing: what each rank holds,
the experts that expert parallelism places counted as split."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.moe.experts import find_hf_experts
from lightning_parallel.tensor.plan import KEPT_STYLES, PlanError, ResolvedPlan
from lightning_parallel.tensor.table import collectives_per_step, plan_rows

__all__ = ["check_coverage", "sharded_share"]


def sharded_share(module: nn.Module, resolved: ResolvedPlan) -> float:
    """The share of the model's parameters that no rank holds whole: those the plan splits over tp, and with
    expert parallelism (``resolved.experts``) the experts placed on the ep ranks (each holds ``1/ep`` of
    them)."""
    total = sum(p.numel() for p in module.parameters())
    split = {
        id(p): p.numel()
        for a in resolved.assignments
        if a.style not in KEPT_STYLES
        for p in a.module.parameters()
    }
    if resolved.experts is not None:
        split.update({id(p): p.numel() for m in find_hf_experts(module).values() for p in m.parameters()})
    parameters = dict(module.named_parameters())
    split.update({id(parameters[n]): parameters[n].numel() for n in resolved.features if n in parameters})
    return sum(split.values()) / max(total, 1)


def check_coverage(module: nn.Module, resolved: ResolvedPlan, required: float) -> None:
    """Say what the plan covers (rank 0); fail before training if it splits less than ``required``."""
    rows = plan_rows(module, resolved)
    total = sum(p.numel() for p in module.parameters())
    per_rank = sum(r.params_per_rank for r in rows)
    forward, backward = collectives_per_step(rows)
    share = sharded_share(module, resolved)
    per_feature = [a.name or "(root)" for a in resolved.assignments if a.style == "per_feature"]
    ep = f" x ep={resolved.experts.ep}" if resolved.experts is not None else ""
    rank_zero_info(
        f"lp_tensor_parallel: tp={resolved.tp_size}{ep} splits {share:.0%} of the parameters; each rank holds "
        f"{per_rank:,} of {total:,} ({per_rank / max(total, 1):.0%}); {forward} collectives forward and "
        f"{backward} backward per step"
        + (f"; per-feature layers split with their pair: {', '.join(per_feature)}" if per_feature else "")
    )
    for name, why in resolved.report:
        rank_zero_info(f"lp_tensor_parallel: {name} stays replicated: {why}")
    if share < required:
        whole = "; ".join(f"{n}: {why}" for n, why in resolved.report[:8]) or "no layer was planned"
        raise PlanError(
            f"the plan splits only {share:.0%} of the model's parameters (require_sharded={required}): "
            f"tensor parallelism would only add communication. Left whole: {whole}. Write a plan "
            "(see docs/tensor_parallel.md and conf/plan/), or pass require_sharded=0 to train anyway"
        )
