"""The parameter-server collective of master-based data parallelism: everyone's gradients to one rank.

Deliberately not a reduce: rank 0 receives every rank's full gradient (a gather) and sums them itself,
which is what a parameter server does and what makes it a bottleneck.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["gather_mean_to_master"]


def gather_mean_to_master(
    params: Sequence[nn.Parameter], master: int = 0, group: Optional[dist.ProcessGroup] = None
) -> None:
    """Leave in the master's ``.grad`` the average of all ranks' gradients; other ranks are unchanged.

    A parameter that got no gradient on any rank keeps ``grad=None`` on the master (the optimizer
    then skips it, as with torch DDP); one that got a gradient somewhere is averaged with zeros.
    """
    world = dist.get_world_size(group)
    is_master = dist.get_rank(group) == master
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = defaultdict(list)
    for p in params:
        by_kind[(p.dtype, p.device)].append(p)
    for same in by_kind.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same])
        has_grad = torch.tensor([p.grad is not None for p in same], dtype=flat.dtype, device=flat.device)
        packed = torch.cat([flat, has_grad])
        inbox = [torch.empty_like(packed) for _ in range(world)] if is_master else None
        dist.gather(
            packed, inbox, dst=master if group is None else dist.get_global_rank(group, master), group=group
        )
        if not is_master:
            continue
        total = inbox[0].clone()
        for other in inbox[1:]:
            total += other
        offset, n = 0, flat.numel()
        for i, p in enumerate(same):
            if total[n + i] == 0:
                p.grad = None
            else:
                grad = total[offset : offset + p.numel()].view_as(p) / world
                p.grad = grad if p.grad is None else p.grad.copy_(grad)
            offset += p.numel()
