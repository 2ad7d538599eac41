"""The experts of a mixture-of-experts block as Hugging Face writes them: found, and their sizes read.

In ``transformers`` 5, a block's experts are one module holding every expert's weights as 3-D
parameters: ``gate_up_proj`` (experts x 2·intermediate x hidden, gate then up) or ``up_proj`` without a
gate, and ``down_proj`` (experts x hidden x intermediate); ``is_transposed`` swaps the last two
dimensions. Its class is decorated by ``use_experts_implementation``, which sets the flags read here and
runs it by the implementation the config names (an eager loop over the experts the router chose,
``batched_mm``, ``grouped_mm``). Every one of them computes, per expert, ``down(act(gate) * up)`` and
weights it by the router. Tensor parallelism splits every expert's intermediate features
(``tensor.expert_layer``); expert parallelism places whole experts on ranks (``moe.expert_parallel``).

Nothing here imports ``transformers``: a module is recognised by its flags and its 3-D weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = [
    "ExpertsLayout",
    "ExpertsType",
    "experts_layout",
    "find_hf_experts",
    "is_experts",
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
