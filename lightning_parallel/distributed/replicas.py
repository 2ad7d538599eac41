"""Keeping replicas' parameters and buffers identical: broadcasts of whole modules, coalesced.

Small tensors are broadcast as one flat tensor per dtype and device, of at most ``BROADCAST_BYTES``, instead
of one collective per tensor (a model with hundreds of small tensors would otherwise pay hundreds of
latencies); large ones alone, in place: one flat copy of the whole model doubled the set-up's peak memory
(every rank held the model twice while its parameters were made equal to rank 0's).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "ALONE_BYTES",
    "BROADCAST_BYTES",
    "broadcast_tensors",
    "broadcast_module_states",
    "global_rank",
    "start_gradient_sum",
    "start_sum_at",
]


#: a tensor of this size or more is broadcast alone, in place; smaller ones are coalesced into flat copies of
#: at most ``BROADCAST_BYTES``
ALONE_BYTES = 2**20
BROADCAST_BYTES = 16 * 2**20


def _coalesced(tensors: list[Tensor]) -> list[list[Tensor]]:
    """``tensors`` in runs: each one of ``ALONE_BYTES`` or more alone, the smaller ones together up to
    ``BROADCAST_BYTES`` a run."""
    alone = [[t] for t in tensors if t.numel() * t.element_size() >= ALONE_BYTES]
    runs: list[list[Tensor]] = [[]]
    size = 0
    for t in (t for t in tensors if t.numel() * t.element_size() < ALONE_BYTES):
        nbytes = t.numel() * t.element_size()
        if runs[-1] and size + nbytes > BROADCAST_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += nbytes
    return alone + [run for run in runs if run]


def global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their source globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_tensors(
    tensors: Iterable[Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None
) -> None:
    """Overwrite ``tensors`` in place with the values held by group rank ``src``."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    for same in (run for kind in by_kind.values() for run in _coalesced(kind)):
        if len(same) == 1 and same[0].is_contiguous():  # alone: in place, no copy
            dist.broadcast(same[0].detach(), src=global_rank(group, src), group=group)
            continue
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


def start_gradient_sum(
    params: Sequence[nn.Parameter],
    grads: Sequence[Optional[Tensor]],
    group: Optional[dist.ProcessGroup],
) -> Callable[[], list[Optional[Tensor]]]:
    """Start summing ``grads`` (one per parameter, None where this rank has none) over ``group`` (the
    pipeline stages' parts of a replicated module's gradient), one non-blocking collective per dtype; the
    returned function waits for them and gives the sums (None where no rank had one). Started early, the
    collective overlaps other work. Averaging over data-parallel replicas is ``reducer.GradientReducer``'s."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        by_kind[(p.dtype, p.device)].append(i)
    started = []
    for same in by_kind.values():
        like = params[same[0]]
        flat = torch.cat(
            [(grads[i] if grads[i] is not None else torch.zeros_like(params[i])).reshape(-1) for i in same]
            + [
                torch.tensor(
                    [float(grads[i] is not None) for i in same], dtype=like.dtype, device=like.device
                )
            ]
        )
        started.append((same, flat, dist.all_reduce(flat, group=group, async_op=True)))

    def finish() -> list[Optional[Tensor]]:
        reduced: list[Optional[Tensor]] = [None] * len(params)
        for same, flat, work in started:
            work.wait()
            n = flat.numel() - len(same)
            had = flat[n:].tolist()
            offset = 0
            for k, i in enumerate(same):
                if had[k] > 0:
                    reduced[i] = flat[offset : offset + params[i].numel()].view_as(params[i])
                offset += params[i].numel()
        return reduced

    return finish


def start_sum_at(
    positions: Sequence[int],
    params: Sequence[nn.Parameter],
    grads: Sequence[Optional[Tensor]],
    group: Optional[dist.ProcessGroup],
) -> Callable[[], list[Optional[Tensor]]]:
    """Start summing over ``group`` only the gradients at ``positions`` (those of the parameters every
    rank holds a part of the gradient of); the returned function waits and gives ``grads`` with those
    replaced by their sums."""
    finish = start_gradient_sum([params[i] for i in positions], [grads[i] for i in positions], group)

    def summed() -> list[Optional[Tensor]]:
        out = list(grads)
        for i, value in zip(positions, finish()):
            out[i] = value
        return out

    return summed
