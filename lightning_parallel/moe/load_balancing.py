"""A mixture of experts' load-balancing loss on the global batch, under data parallelism.

Hugging Face's MoE models (Mixtral, Qwen2-MoE, OLMoE, ...) add ``load_balancing_loss_func`` to the loss when
``config.output_router_logits`` is set: ``E * sum_e f_e * P_e``, with ``f_e`` the share of the batch's top-k
choices that went to expert ``e`` and ``P_e`` the mean router probability of ``e``. It is not a mean over
samples, so each data-parallel rank computing it on its own batch trains another objective than one device
on the global batch. It is linear in ``P``, and ``f`` carries no gradient: with ``f`` and the row count
taken over the data-parallel group (one all-reduce of ``E + 1`` numbers, no host sync) and this rank's
probability sum scaled so that the ranks' mean is the global ``P``, the mean of the ranks' losses is one
device's loss and the gradients averaged over the group are one device's gradients.

The sum is a collective inside the user's forward, so it runs only in the forwards every rank joins: the
strategy's training step and backward, while autograd records (``every_rank.every_rank_forward``). Elsewhere
(a sample generated on rank 0 in a hook or callback, ``generate``, any forward under ``torch.no_grad``,
validation, test, predict) the function is the modeling module's own: each rank's loss on its own batch, as
under Lightning's ``ddp``.

``install`` swaps the function of each Hugging Face modeling module that the model uses for that version,
after checking on a sample that, on one process, the two agree (a family whose function computes another
formula keeps its own, with a warning that its loss is per rank); ``refusal`` names the layouts where the
loss cannot be one device's (pipeline stages: the routers of a step are on several ranks; sequence
parallelism: a router may see a part of the sequence).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.collectives import group_size
from lightning_parallel.every_rank import every_rank_forward

__all__ = ["install", "refusal", "routes_with_aux_loss"]

FUNCTION = "load_balancing_loss_func"  # the name every Hugging Face MoE modeling module gives it
ORIGINAL = "_lightning_parallel_original"  # on our function: the module's own, which it replaced


def routes_with_aux_loss(module: nn.Module) -> list[str]:
    """The classes of ``module``'s submodules (outermost first) whose config asks for the router logits (and so for the
    load-balancing loss in the model's forward)."""
    names = [
        type(m).__name__
        for m in module.modules()
        if getattr(getattr(m, "config", None), "output_router_logits", False) is True
    ]
    return list(dict.fromkeys(names))  # outermost first


def refusal(module: nn.Module, pipeline_stages: int, sequence_parallel: bool) -> Optional[str]:
    """Why ``module``'s load-balancing loss cannot equal one device's in this layout, or None."""
    users = routes_with_aux_loss(module)
    if not users:
        return None
    if pipeline_stages > 1:
        return (
            f"{users[0]} adds a load-balancing loss over the router logits of all its layers "
            f"(config.output_router_logits=True), but with pipeline_parallel_size={pipeline_stages} each stage "
            "holds only some of the routers, and each micro-batch would get a loss of its own: the loss would not "
            "be one device's. Set config.output_router_logits=False (or router_aux_loss_coef=0), or train it "
            "with data, tensor or expert parallelism"
        )
    if sequence_parallel:
        return (
            f"{users[0]} adds a load-balancing loss over its router logits (config.output_router_logits=True); "
            "under sequence_parallel=True a router may see a part of the sequence, and that loss is not built "
            "over the tensor-parallel group. Set sequence_parallel=False or config.output_router_logits=False"
        )
    return None


def install(
    module: nn.Module, group: Optional[dist.ProcessGroup], warn: Callable[[str], None]
) -> Callable[[], None]:
    """Make the load-balancing loss of ``module``'s Hugging Face families the global batch's over ``group``;
    returns the undo. Nothing changes with one process in the group or without such a family."""
    if group_size(group) == 1:
        return _nothing
    swapped: list[tuple[ModuleType, Callable]] = []
    for source in _modeling_modules(module):
        # ours already, left by a fit that did not tear down: start again from the module's own
        original = getattr(getattr(source, FUNCTION), ORIGINAL, getattr(source, FUNCTION))
        if not _agrees(original):
            if routes_with_aux_loss(module):
                warn(
                    f"{source.__name__}.{FUNCTION} computes another formula than the one this package "
                    "takes over the data-parallel group: its load-balancing loss stays each rank's own"
                )
            continue
        setattr(source, FUNCTION, _over_group(original, group))
        swapped.append((source, original))

    def undo() -> None:
        for source, original in swapped:
            setattr(source, FUNCTION, original)

    return undo


def _nothing() -> None:
    pass


def _modeling_modules(module: nn.Module) -> list[ModuleType]:
    """The Python modules defining ``module``'s submodules' classes that hold a load-balancing function."""
    names = {type(m).__module__ for m in module.modules()}
    found = [sys.modules.get(name) for name in sorted(names)]
    return [m for m in found if m is not None and callable(getattr(m, FUNCTION, None))]


def _over_group(original: Callable, group: Optional[dist.ProcessGroup]) -> Callable:
    def summed(totals: Tensor) -> int:
        dist.all_reduce(totals, group=group)
        return group_size(group)

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if not every_rank_forward():  # a forward some ranks may run alone: this rank's own loss
            return original(gate_logits, num_experts, top_k, attention_mask)
        return global_batch_loss(gate_logits, num_experts, top_k, attention_mask, summed)

    setattr(load_balancing_loss_func, ORIGINAL, original)
    return load_balancing_loss_func


def global_batch_loss(
    gate_logits: object,
    num_experts: int,
    top_k: int,
    attention_mask: Optional[Tensor],
    summed: Callable[[Tensor], int],
) -> Tensor | int:
    """Hugging Face's load-balancing loss (statistics summed in float32, padding rows left out by the
    attention mask) with the top-k counts and the row count summed over the data-parallel ranks by
    ``summed`` (in place; it returns how many ranks), and this rank's probabilities weighing the ranks /
    the global row count, so that the ranks' mean is the global batch's loss."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    if attention_mask is None:
        mask = torch.ones(gate_logits[0].shape[0], dtype=torch.float32, device=device)
    else:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    per_choice = mask.repeat_interleave(top_k)  # each row's weight, once per expert it chose
    for layer in gate_logits:  # layer by layer, as Hugging Face's: one layer's probabilities at a time
        weights = torch.softmax(layer.to(device), dim=-1)
        counts.scatter_add_(0, torch.topk(weights, top_k, dim=-1)[1].reshape(-1), per_choice)
        probability_sum = probability_sum + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
    rows = mask.sum() * len(gate_logits)
    totals = torch.cat([counts, rows.reshape(1)])
    ranks = summed(totals)
    counts, rows = totals[:-1], totals[-1]
    return torch.sum((counts / rows) * (probability_sum / rows * ranks)) * num_experts


def _one_process(totals: Tensor) -> int:
    return 1


def _agrees(original: Callable) -> bool:
    """Whether ``original`` gives, on one process, this module's loss and gradient on a sample (two layers,
    with and without a padding mask), to float32 round-off."""
    generator = torch.Generator().manual_seed(0)
    for masked in (False, True):
        logits = torch.randn(2, 12, 4, generator=generator, dtype=torch.float64)
        mask = (torch.arange(12) < 9).to(torch.long).view(2, 6) if masked else None
        values, grads = [], []
        for function in (original, lambda *a: global_batch_loss(*a, _one_process)):
            leaf = logits.clone().requires_grad_(True)
            try:
                loss = function(tuple(leaf.unbind(0)), 4, 2, mask)
                loss.backward()
            except Exception:  # another signature or formula
                return False
            if leaf.grad is None:
                return False
            values.append(loss.detach().double())
            grads.append(leaf.grad)
        if not torch.allclose(values[0], values[1], rtol=1e-6, atol=0) or not torch.allclose(
            grads[0], grads[1], rtol=1e-5, atol=1e-9
        ):
            return False
    return True
