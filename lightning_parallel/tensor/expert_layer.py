"""``ParallelExperts``: a Hugging Face experts module (``tensor.experts``) with each expert's MLP split
over the tensor-parallel group, as a column/row pair is.

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
from lightning_parallel.tensor.experts import experts_layout, experts_shards, split_refusal
from lightning_parallel.tensor.layers import _new_param, _TPLayer

__all__ = ["ParallelExperts"]

# what every nn.Module holds itself (parameters, hooks, ...): not copied from the experts module
_MODULE_STATE = frozenset(vars(nn.Module()))
# attributes holding the intermediate size, which each rank holds a slice of
_INTERMEDIATE = re.compile(r"intermediate|expert_dim")


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
