"""The experts of a mixture-of-experts block as Hugging Face writes them, and how they split over tp.

In ``transformers`` 5, a block's experts are one module holding every expert's weights as 3-D
parameters: ``gate_up_proj`` (experts x 2·intermediate x hidden, gate then up) or ``up_proj`` without a
gate, and ``down_proj`` (experts x hidden x intermediate); ``is_transposed`` swaps the last two
dimensions. Its class is decorated by ``use_experts_implementation``, which sets the flags read here and
runs it by the implementation the config names (an eager loop over the experts the router chose,
``batched_mm``, ``grouped_mm``). Every one of them computes, per expert, ``down(act(gate) * up)`` and
weights it by the router: a column/row pair per expert, so the intermediate features of every expert
can be split over the ranks (the expert dimension stays whole) and the partial outputs summed once.

Nothing here imports ``transformers``: a module is recognised by its flags and its 3-D weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor, nn

from lightning_parallel.tensor.layers import ShardSpec

__all__ = [
    "ExpertsLayout",
    "ExpertsType",
    "experts_layout",
    "experts_shards",
    "find_hf_experts",
    "is_experts",
    "split_refusal",
]

# set on every instance by transformers' ``use_experts_implementation``
FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


def is_experts(module: nn.Module) -> bool:
    """A Hugging Face experts module: the decorator's flags, and its up and down weights 3-D parameters."""
    if not all(isinstance(getattr(module, f, None), bool) for f in FLAGS):
        return False
    up = "gate_up_proj" if module.has_gate else "up_proj"
    held = module._parameters
    return all(isinstance(held.get(n), Tensor) and held[n].dim() == 3 for n in (up, "down_proj"))


def find_hf_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Every Hugging Face experts module in ``module`` (``is_experts``; not those expert parallelism has
    already replaced), by name, in the order of ``named_modules``."""
    return {name: m for name, m in module.named_modules() if is_experts(m)}


class _ExpertsMeta(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, nn.Module) and is_experts(instance)


# Stands for any Hugging Face experts class in type checks (and is named so in messages).
ExpertsType = _ExpertsMeta("Experts", (), {})


@dataclass(frozen=True)
class ExpertsLayout:
    """Where the sizes sit in an experts module's weights."""

    up: str  # "gate_up_proj" (gate|up fused) or "up_proj"
    num_experts: int
    hidden: int
    intermediate: int
    parts: int  # packed blocks along the up projection's output features: 2 for gate|up, else 1
    transposed: bool  # weights stored [experts, in, out]

    def weights(self) -> tuple[str, str]:
        return self.up, "down_proj"


def experts_layout(module: nn.Module) -> ExpertsLayout:
    """The layout of ``module`` (``is_experts(module)`` must hold)."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    down = module.down_proj
    num, hidden, intermediate = down.shape
    if module.is_transposed:
        intermediate, hidden = hidden, intermediate
    return ExpertsLayout(up, num, hidden, intermediate, 2 if module.has_gate else 1, module.is_transposed)


def _default_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    where = (getattr(gate, "__module__", ""), getattr(gate, "__qualname__", ""))
    return where == ("transformers.integrations.moe", "_default_apply_gate")


def split_refusal(module: nn.Module, tp: int) -> Optional[str]:
    """Why ``module``'s experts cannot be split over ``tp`` ranks by their intermediate features, or None."""
    layout = experts_layout(module)
    if module.has_bias:
        return "experts with biases (each rank would add the down projection's bias to its partial sum)"
    if module.has_post_expert_norm:
        return "a norm after each expert reads its whole output"
    if module.has_gate and not (module.is_concatenated and _default_gate(module)):
        return "gate and up interleaved, or combined by a gate function of the model's own"
    if getattr(module, "_is_expert_parallel", False):
        return "the experts are already placed on ranks (expert parallel)"
    if layout.intermediate % tp:
        return f"intermediate size {layout.intermediate} is not divisible by tp={tp}"
    return None


def experts_shards(module: nn.Module) -> dict[str, ShardSpec]:
    """How each weight is cut: the up projection by its output features, per part (gate and up each
    cut: a fused column split), the down projection by its input features (row-parallel)."""
    layout = experts_layout(module)
    out_dim, in_dim = (2, 1) if layout.transposed else (1, 2)
    return {layout.up: ShardSpec(out_dim, layout.parts), "down_proj": ShardSpec(in_dim)}
