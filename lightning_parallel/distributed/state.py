"""Keeping replicas' parameters and buffers identical: broadcasts of whole modules, coalesced.

One flat tensor per dtype and device is broadcast instead of one collective per tensor: a model with
hundreds of small tensors would otherwise pay hundreds of latencies.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["broadcast_tensors", "broadcast_module_states", "global_rank", "all_reduce_gradients"]


def global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their source globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_tensors(tensors: Iterable[Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite ``tensors`` in place with the values held by group rank ``src``."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=global_rank(group, src), group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_module_states(
    module: nn.Module, src: int = 0, group: Optional[dist.ProcessGroup] = None, buffers_only: bool = False
) -> None:
    """Make ``module``'s parameters (unless ``buffers_only``) and buffers equal to those of rank ``src``."""
    tensors = [] if buffers_only else [p.data for p in module.parameters()]
    tensors += [b for b in module.buffers()]
    if tensors:
        broadcast_tensors(tensors, src=src, group=group)


def all_reduce_gradients(params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup], average: bool) -> None:
    """Sum (or average) ``.grad`` over ``group``, one collective per dtype. A parameter without a
    gradient takes part with zeros, and gets one if any rank had it."""
    params = [p for p in params if p.requires_grad]
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = defaultdict(list)
    for p in params:
        by_kind[(p.dtype, p.device)].append(p)
    size = dist.get_world_size(group)
    for same in by_kind.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same]
                         + [torch.tensor([float(p.grad is not None) for p in same], dtype=same[0].dtype, device=same[0].device)])
        dist.all_reduce(flat, group=group)
        if average:
            flat[: flat.numel() - len(same)].div_(size)
        offset, n = 0, flat.numel() - len(same)
        for i, p in enumerate(same):
            if flat[n + i] > 0:
                value = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
            offset += p.numel()
