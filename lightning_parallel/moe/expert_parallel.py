"""Expert parallelism as a transform of a module: whole experts placed on the ranks of an ep group, tokens
sent to their expert's rank and back by all-to-all.

Each Hugging Face experts module (``moe.experts.is_experts``: Mixtral's, Qwen2-MoE's, OLMoE's, ...: the
experts' weights stacked along dim 0, called with the tokens, their top-k expert indices and weights) is
replaced by an ``ExpertParallelExperts`` holding only this rank's ``num_experts / ep`` experts, under the
same state-dict names. Its forward, per call:

    counts      each (token, choice) pair sorted by expert; how many pairs go to each expert exchanged
                over the group (one all-to-all of integers, then the one host read of the split sizes)
    dispatch    each pair's hidden state sent to its expert's rank (``all_to_all_rows``)
    experts     the Hugging Face module's own forward on the rows received, its expert indices renumbered
                to the local experts (whatever loop or kernel ``experts_implementation`` names)
    combine     the rows sent back the same way, weighted by the router's weights and summed per token,
                as the Hugging Face loop sums them

Under ``torch.compile`` this forward runs eagerly, between the graphs of the rest of the model: how many rows
go where is data (a host read of the exchanged counts, sizes that depend on the routing), which a graph
of static shapes cannot hold.

The router and every other part of the model stay as they were (replicated, or tensor-parallel). The
ranks of an ep group hold different batches (ep divides the data-parallel axis), so an expert's gradient on
its rank already sums the group's contributions: ``scale_expert_gradients`` divides it by ep, and the
replicas of the expert (the ``edp`` group) average it, which together is the data-parallel mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.checkpointing.one_device import keep_skeleton
from lightning_parallel.distributed.collectives import all_to_all_rows, exchange_counts
from lightning_parallel.moe.experts import is_experts

__all__ = [
    "ExpertParallelExperts",
    "ExpertSlice",
    "apply_expert_parallel",
    "experts_left_to_expert_parallel",
    "describe_expert_parallel",
    "expert_parallel_problem",
    "find_experts_whole_or_placed",
    "scale_expert_gradients",
]


def find_experts_whole_or_placed(module: nn.Module) -> dict[str, nn.Module]:
    """Every experts module of ``module`` by name: the Hugging Face ones expert parallelism would place and
    those it has already replaced by this rank's experts (``ExpertParallelExperts``)."""
    return {
        name: m for name, m in module.named_modules() if isinstance(m, ExpertParallelExperts) or is_experts(m)
    }


def expert_parallel_problem(module: nn.Module, ep: int) -> Optional[str]:
    """Why ``module`` cannot place its experts on ``ep`` ranks, naming what would work; None if it can."""
    found = find_experts_whole_or_placed(module)
    if not found:
        return (
            f"expert_parallel_size={ep}, but the model has no experts module (a module with num_experts "
            "experts stacked along dim 0 of its parameters, called with (hidden_states, top_k_index, "
            "top_k_weights), as Hugging Face's Mixtral, Qwen2-MoE, OLMoE and GPT-OSS blocks have); use "
            "expert_parallel_size=1"
        )
    for name, m in found.items():
        if m.num_experts % ep:
            fits = [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]
            return (
                f"expert_parallel_size={ep} does not divide the {m.num_experts} experts of {name!r}; use one of "
                f"{fits} (each rank holds whole experts)"
            )
    return None


@dataclass(frozen=True)
class ExpertSlice:
    """Which slice of the experts a rank holds: its place ``ep_rank`` among the ``ep_size`` ranks the experts
    are shared out over, along the experts dimension (``tensor.full_state.expert_pieces`` lists them)."""

    ep_size: int
    ep_rank: int


class ExpertParallelExperts(nn.Module):
    """This rank's experts of a Hugging Face experts module, under the module's own parameter names; the
    tokens of every rank of ``group`` reach them by all-to-all (see the module docstring)."""

    def __init__(
        self, experts: nn.Module, group: Optional[dist.ProcessGroup], ep_size: int, ep_rank: int
    ) -> None:
        super().__init__()
        keep_skeleton(self, experts)
        self.num_experts, self.ep_size, self.ep_rank = experts.num_experts, ep_size, ep_rank
        self.num_local = experts.num_experts // ep_size
        self.group = group
        first = ep_rank * self.num_local
        for name, p in experts._parameters.items():
            part = p.detach()[first : first + self.num_local].clone()
            self.register_parameter(name, nn.Parameter(part, requires_grad=p.requires_grad))
        experts.num_experts = self.num_local
        experts._parameters = self._parameters  # one registry: set-up's new tensors reach both
        self.__dict__["_local"] = experts  # unregistered: the names stay the experts module's own
        self._scaled = False

    # eager under torch.compile (said at set-up): the split sizes depend on the routing, read on the host
    @torch.compiler.disable
    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        ep, local = self.ep_size, self.num_local
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.num_experts).view(ep, local)
        received = exchange_counts(per_expert, self.group)
        sizes = torch.cat([per_expert.sum(1), received.sum(1)]).tolist()  # the split sizes, on the host
        send, receive = sizes[:ep], sizes[ep:]
        tokens = order // top_k_index.shape[1]
        rows = all_to_all_rows(hidden_states[tokens], send, receive, self.group)
        which = torch.arange(local, device=flat.device).repeat(ep)
        experts = torch.repeat_interleave(which, received.reshape(-1), output_size=sum(receive))
        if experts.numel():
            out = self._local(rows, experts[:, None], top_k_weights.new_ones(experts.numel(), 1))
        else:  # no token for this rank's experts: their gradients are zero, and backward still meets
            out = rows * 0 + sum(p.reshape(-1)[:1].sum() * 0 for p in self._parameters.values())
        back = all_to_all_rows(out, receive, send, self.group)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted.to(hidden_states.dtype))

    def extra_repr(self) -> str:
        first = self.ep_rank * self.num_local
        return f"experts {first}..{first + self.num_local - 1} of {self.num_experts}, ep={self.ep_size}"


def apply_expert_parallel(
    module: nn.Module, group: Optional[dist.ProcessGroup], ep_size: int, ep_rank: int
) -> dict[str, ExpertParallelExperts]:
    """Replace every experts module of ``module`` (real or meta) by this rank's experts; returns them by
    name. Raises ``ValueError`` naming the fix where the model cannot be split so
    (``expert_parallel_problem``)."""
    problem = expert_parallel_problem(module, ep_size)
    if problem:
        raise ValueError(problem)
    placed = {}
    for name, experts in find_experts_whole_or_placed(module).items():
        if isinstance(experts, ExpertParallelExperts):
            continue
        parent, _, child = name.rpartition(".")
        placed[name] = ExpertParallelExperts(experts, group, ep_size, ep_rank)
        placed[name].train(experts.training)
        setattr(module.get_submodule(parent), child, placed[name])
    return placed


def describe_expert_parallel(placed: dict[str, ExpertParallelExperts], replicas: int) -> str:
    """What set-up did, for rank 0 to say: the modules, the experts per rank, the communication per step."""
    first = next(iter(placed.values()))
    names = ", ".join(list(placed)[:2]) + (", ..." if len(placed) > 2 else "")
    return (
        f"expert parallelism: {len(placed)} experts module(s) ({names}), {first.num_local} of "
        f"{first.num_experts} experts per rank (ep={first.ep_size}); per micro-batch, each sends the routed "
        "tokens to their experts' ranks and back: 1 all-to-all of the counts and 2 of the tokens forward, 2 "
        f"backward; the experts' gradients are averaged over their {replicas} replica(s)"
    )


def _scaled(factor: float, grad: Tensor) -> Tensor:
    return grad * factor


def scale_expert_gradients(module: nn.Module) -> None:
    """Divide each fresh gradient of the experts' parameters by ep (once per module, on the final
    parameter objects): the expert saw the tokens of the ep group's ranks, and the data-parallel mean
    divides by dp = ep x its replicas."""
    for m in module.modules():
        if isinstance(m, ExpertParallelExperts) and not m._scaled and m.ep_size > 1:
            for p in m._parameters.values():
                if p.requires_grad:
                    p.register_hook(partial(_scaled, 1.0 / m.ep_size))
            m._scaled = True


def experts_left_to_expert_parallel(resolved: Any, placement: Any) -> None:
    """With expert parallelism the experts are placed whole on ranks, so a tensor-parallel plan
    (``tensor.plan.ResolvedPlan``) that splits them (style ``experts``) keeps them whole instead, saying why;
    the plan then holds ``placement`` (a ``moe.expert_traffic.ExpertPlacement``), which its table and
    coverage read for what each rank holds of the experts."""
    resolved.experts = placement
    for a in resolved.assignments:
        if a.style == "experts":
            a.style, a.options = "replicate", {}
            resolved.report.append(
                (a.name, "experts stay whole under tp: expert_parallel_size > 1 places them")
            )
