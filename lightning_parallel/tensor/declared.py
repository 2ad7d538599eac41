"""A model's own tensor-parallel plan (Hugging Face's ``_tp_plan``, from ``config.base_model_tp_plan``),
translated into our styles: one more source of evidence for ``plan="auto"``, checked against the
traced data flow rather than trusted."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_parallel.module_names import match_pattern

__all__ = ["declared_styles", "disagreements"]

# Hugging Face style -> ours (None: a style we have no equivalent for; reported, never applied)
STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise",
    "embedding_rowwise": "vocab",
    "rowwise_split_input": "rowwise",
    "moe_tp_experts": "experts",
    "local_colwise": None,
    "local_rowwise": None,
    "sequence_parallel": None,
    "gather": None,
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "gradient_sum",
}


def declared_styles(module: nn.Module) -> dict[str, str]:
    """Module name -> the style the model's own plan gives it, for every submodule that declares one."""
    names = [n for n, _ in module.named_modules()]
    found: dict[str, str] = {}
    for prefix, owner in module.named_modules():
        plan: Any = getattr(owner, "_tp_plan", None)
        if not isinstance(plan, dict) or not plan:
            continue
        for pattern, style in plan.items():
            full = f"{prefix}.{pattern}" if prefix else pattern
            for name in names:
                if match_pattern(full, name):
                    found.setdefault(name, STYLES.get(style, None) or f"{style} (no equivalent here)")
    return found


def disagreements(module: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """Name -> what the model's own plan says, for layers where the found ``styles`` differ from it."""
    declared = declared_styles(module)
    return {
        name: f"the model's own plan says {style!r}"
        for name, style in declared.items()
        if styles.get(name, "replicate") != style
    }
