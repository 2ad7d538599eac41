"""``ParallelExperts``: a Hugging Face experts module (``moe.experts``) with each expert's MLP split
over the tensor-parallel group, as a column/row pair is; ``split_refusal`` says why a module cannot be.

Each rank keeps every expert, with its slice of the intermediate features: the fused gate|up weights cut
on their output features per part (gate and up each cut), the down weights on their input features.
The module's own forward (eager loop, ``batched_mm`` or ``grouped_mm``, whichever its config names) runs
on the slices unchanged; its weighted combine of the experts' outputs is linear, so each rank's output
is a partial sum, and one all-reduce after the combine completes it. Backward, the gradients of the
hidden states and of the routing weights (each rank's is partial) are summed in one all-reduce: the
router and everything before it see the gradient of one device.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.collectives import copy_all_to_group, reduce_from_group
from lightning_parallel.moe.experts import experts_layout
from lightning_parallel.tensor.layers import ShardSpec, _new_param, _TPLayer

__all__ = ["ParallelExperts", "experts_shards", "split_refusal"]

# what every nn.Module holds itself (parameters, hooks, ...): not copied from the experts module
_MODULE_STATE = frozenset(vars(nn.Module()))
# attributes holding the intermediate size, which each rank holds a slice of
_INTERMEDIATE = re.compile(r"intermediate|expert_dim")


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
    if layout.intermediate % tp:
        return f"intermediate size {layout.intermediate} is not divisible by tp={tp}"
    return None


def experts_shards(module: nn.Module) -> dict[str, ShardSpec]:
    """How each weight is cut: the up projection by its output features, per part (gate and up each
    cut: a fused column split), the down projection by its input features (row-parallel)."""
    layout = experts_layout(module)
    out_dim, in_dim = (2, 1) if layout.transposed else (1, 2)
    return {layout.up: ShardSpec(out_dim, layout.parts), "down_proj": ShardSpec(in_dim)}


class ParallelExperts(_TPLayer):
    """The experts module ``experts`` with this rank's slice of every expert's intermediate features;
    the same parameter names, attributes and forward as the module it replaces."""

    def __init__(
        self, experts: nn.Module, group: Optional[dist.ProcessGroup], tp_size: int, tp_rank: int
    ) -> None:
        super().__init__()
        why = split_refusal(experts, tp_size)
        if why is not None:
            raise ValueError(f"the experts of {type(experts).__name__} cannot be split: {why}")
        layout = experts_layout(experts)
        self.__dict__.update({k: v for k, v in vars(experts).items() if k not in _MODULE_STATE})
        self._init_tp(group, tp_size, tp_rank)
        self.experts_class = type(experts)
        self.SHARDS = experts_shards(experts)
        for name, child in experts.named_children():
            self.add_module(name, child)
        for name, buffer in experts.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in experts._non_persistent_buffers_set)
        for name, p in experts.named_parameters(recurse=False):
            spec = self.SHARDS.get(name)
            setattr(self, name, p if spec is None else _new_param(p, spec, tp_size, tp_rank))
        for k, v in list(vars(self).items()):
            if _INTERMEDIATE.search(k) and isinstance(v, int) and v == layout.intermediate:
                setattr(self, k, v // tp_size)
        self.full_intermediate = layout.intermediate

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # the routing weights in the dtype they are combined in (exact: a widening cast), so that their
        # gradient is rounded to their own dtype once, after the sum over the ranks
        dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        hidden_states, weights = copy_all_to_group((hidden_states, top_k_weights.to(dtype)), self.group)
        partial = self.experts_class.forward(self, hidden_states, top_k_index, weights)
        return reduce_from_group(partial, self.group)

    def _apply_gate(self, gate_up_out: Tensor) -> Tensor:
        """The experts class's gate (act(gate) * up), on this rank's gate and up features."""
        return self.experts_class._apply_gate(self, gate_up_out)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.down_proj.shape[0]}, intermediate={self.full_intermediate} "
            f"(local {self.full_intermediate // self.tp_size}), implementation "
            f"{getattr(getattr(self, 'config', None), '_experts_implementation', None)!r}"
        )
