"""Autograd-aware collectives for tensor parallelism: the Megatron conjugate pairs, and gather/split.

Each operator is one collective in one direction and its conjugate in the other, so that a sharded
layer's backward is exactly the transpose of its forward:

    copy_to_group      identity forward,   all-reduce backward   (Megatron's "f": enters a sharded region)
    copy_all_to_group  the same for several tensors, their gradients in one all-reduce
    reduce_from_group  all-reduce forward, identity backward     (Megatron's "g": leaves a sharded region)
    gather_from_group  all-gather forward, split backward        (gather a sharded last dimension)
    split_to_group     split forward,      all-gather backward   (shard a replicated last dimension)
    gather_sequence          all-gather forward, reduce-scatter backward (sequence parallel: into a pair)
    reduce_scatter_sequence  reduce-scatter forward, all-gather backward (sequence parallel: out of a pair)
    all_to_all_rows          all-to-all of rows forward, the reverse all-to-all backward (expert
                             parallelism: tokens to their experts' ranks and back)

Under ``torch.compile`` each collective is issued in its functional form (``compat.functional_collectives``),
which dynamo traces into the graph, the same sums in the same layout as the eager path; ``COUNTS`` is not
advanced there (a trace runs once for many steps). Eagerly the operators are unchanged.

Every function takes the ``group`` to talk over (None = the whole world). A group of size one makes every
operator the identity and issues no collective. A ``SimulatedGroup`` stands for a group in a one-process dry
run: shapes are those of one of its ranks, nothing is sent, values mean nothing. ``COUNTS`` tallies the
collectives issued, by kind, so benchmarks can compare against the Megatron count without a profiler;
``SIMULATED`` those a dry run stood in for (the planner counts a step's tensor-parallel calls with it).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.compat import (
    foreach_mul,
    foreach_mul_,
    foreach_norm,
    functional_collectives,
    reduce_scatter_single,
)

__all__ = [
    "copy_to_group",
    "copy_all_to_group",
    "reduce_from_group",
    "gather_from_group",
    "split_to_group",
    "gather_sequence",
    "reduce_scatter_sequence",
    "all_reduce_sum",
    "reduce_scatter_dim",
    "all_gather_dim",
    "all_gather_list",
    "group_size",
    "clip_grad_norm_counted",
    "share_found_inf",
    "group_rank",
    "start_gather_numbers",
    "COUNTS",
    "SIMULATED",
    "SimulatedGroup",
    "all_to_all_rows",
    "exchange_counts",
]

COUNTS: Counter = Counter()
SIMULATED: Counter = Counter()


@dataclass(frozen=True)
class SimulatedGroup:
    """A process group of ``size`` ranks seen from rank ``rank`` in one process (``tensor.dry_run``)."""

    size: int
    rank: int = 0


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if isinstance(group, SimulatedGroup):
        return group.size
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if isinstance(group, SimulatedGroup):
        return group.rank
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _count(kind: str) -> None:
    """Tally a collective issued eagerly (``COUNTS``); a compiled trace counts nothing."""
    if not torch.compiler.is_compiling():
        COUNTS[kind] += 1


def _named(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``group`` as functional collectives take it (they have no None for the world)."""
    return group if group is not None else dist.group.WORLD


def _traced_all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The sum of ``tensor`` over ``group`` as a functional collective (a new tensor): under compile."""
    return functional_collectives.all_reduce(tensor, "sum", _named(group))


def all_reduce_sum(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Sum ``tensor`` over ``group`` in place (no autograd); returns it."""
    if isinstance(group, SimulatedGroup):
        if group.size > 1:
            SIMULATED["all_reduce"] += 1
        return tensor
    if group_size(group) > 1 and torch.compiler.is_compiling():
        return tensor.copy_(_traced_all_reduce(tensor, group))
    if group_size(group) > 1:
        _count("all_reduce")
        dist.all_reduce(tensor, group=group)
    return tensor


def _collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a tensor made only to be communicated over ``group`` lives: NCCL takes only device tensors."""
    if group_size(group) > 1 and not isinstance(group, SimulatedGroup) and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.compiler.assume_constant_result  # a group's backend never changes: read when tracing
def _on_host(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` (of more than one rank, not simulated) runs on gloo, whose all-gather and
    reduce-scatter stage the whole tensor in buffers of their own (torch's ``ProcessGroupGloo``: the
    all-gather through flat outputs it allocates and then copies out; the reduce-scatter through a clone
    of the whole input that it all-reduces). On gloo, ``all_gather_dim`` and ``reduce_scatter_dim``
    all-reduce in place instead, in a buffer that is the result (the gather: zeros with this rank's part in
    place, exact: each sum adds zeros to one value) or one copy of the input (the reduce-scatter: the same
    communication as gloo's own). Whole-size temporaries on every call fragment a CPU process's heap: with
    glibc's allocator they kept sequence parallelism's peak resident memory from falling below tensor
    parallelism's (docs/tensor_parallel.md, "Resident memory"). The gather sends twice the bytes of an
    all-gather."""
    return dist.get_backend(group) == "gloo"


def start_gather_numbers(
    value: float, group: Optional[dist.ProcessGroup] = None
) -> Callable[[], list[float]]:
    """Start gathering one number from every rank of ``group``; call the result for the list (in group
    rank order), which waits for it. Started now and read a step later, it costs no rank a wait for the
    slowest (the async pipeline depends on that). Every rank must start the same gathers in one order."""
    if group_size(group) == 1:
        return lambda: [value]
    mine = torch.tensor([value], dtype=torch.float64, device=_collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(group_size(group))]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)

    def numbers() -> list[float]:
        work.wait()
        return [float(t) for t in everyone]

    return numbers


def all_gather_dim(tensor: Tensor, group: Optional[dist.ProcessGroup], dim: int = -1) -> Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (no autograd); shapes must match."""
    size = group_size(group)
    if size == 1:
        return tensor
    if isinstance(group, SimulatedGroup):
        SIMULATED["all_gather"] += 1
        return torch.cat([tensor] * size, dim=dim)
    _count("all_gather")
    if _on_host(group):  # summed in place into the result: its only whole-size buffer (``_on_host``)
        shape = list(tensor.shape)
        shape[dim] *= size
        gathered = tensor.new_zeros(shape)
        gathered.chunk(size, dim=dim)[group_rank(group)].copy_(tensor)
        if torch.compiler.is_compiling():
            return _traced_all_reduce(gathered, group)
        dist.all_reduce(gathered, group=group)
        return gathered
    tensor = tensor.contiguous()
    if torch.compiler.is_compiling():
        return functional_collectives.all_gather_tensor(tensor, dim % tensor.dim(), _named(group))
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim(tensor: Tensor, group: Optional[dist.ProcessGroup], dim: int) -> Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's equal part along ``dim`` (no autograd)."""
    size = group_size(group)
    if size == 1:
        return tensor
    if isinstance(group, SimulatedGroup):
        SIMULATED["reduce_scatter"] += 1
        return _split(tensor, group, dim)
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {tensor.shape[dim]} into {size} equal parts")
    _count("reduce_scatter")
    if _on_host(group):  # gloo's reduce-scatter all-reduces a copy of the whole input: one copy, ours
        whole = tensor.clone(memory_format=torch.contiguous_format)
        if torch.compiler.is_compiling():
            whole = _traced_all_reduce(whole, group)
        else:
            dist.all_reduce(whole, group=group)
        part = tensor.shape[dim] // size
        return whole.narrow(dim, group_rank(group) * part, part).contiguous()
    if torch.compiler.is_compiling():
        return functional_collectives.reduce_scatter_tensor(
            tensor.contiguous(), "sum", dim % tensor.dim(), _named(group)
        )
    front = tensor.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    reduce_scatter_single()(out, front, group=group)
    return out.movedim(0, dim)


def all_gather_list(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """Every rank's ``tensor``, in group-rank order (no autograd); shapes must match."""
    if group_size(group) == 1:
        return [tensor]
    if isinstance(group, SimulatedGroup):
        SIMULATED["all_gather"] += 1
        return [tensor] * group.size
    _count("all_gather")
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _split(tensor: Tensor, group: Optional[dist.ProcessGroup], dim: int) -> Tensor:
    size = group_size(group)
    if size == 1:
        return tensor
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {tensor.shape[dim]} into {size} equal parts")
    return tensor.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _CopyAllToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Optional[dist.ProcessGroup], *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads])
        flat = all_reduce_sum(torch.cat([g.reshape(-1).to(dtype) for g in grads]), ctx.group)
        parts = flat.split([g.numel() for g in grads])
        return (None, *(p.view(g.shape).to(g.dtype) for p, g in zip(parts, grads)))


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        return all_reduce_sum(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


DimOp = Callable[[Tensor, Optional[dist.ProcessGroup], int], Tensor]


def _conjugates(forward_op: DimOp, backward_op: DimOp) -> type[torch.autograd.Function]:
    """An autograd function running ``forward_op(x, group, dim)`` forward and ``backward_op`` on the
    gradient (the collective's conjugate: all-gather and split, all-gather and reduce-scatter)."""

    class Conjugates(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup], dim: int) -> Tensor:
            ctx.group, ctx.dim = group, dim
            return forward_op(x, group, dim)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
            return backward_op(grad, ctx.group, ctx.dim), None, None

    return Conjugates


_GatherFromGroup = _conjugates(all_gather_dim, _split)
_SplitToGroup = _conjugates(_split, all_gather_dim)
_GatherSequence = _conjugates(all_gather_dim, reduce_scatter_dim)
_ReduceScatterSequence = _conjugates(reduce_scatter_dim, all_gather_dim)


def copy_to_group(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Identity forward, all-reduce (sum) of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def copy_all_to_group(xs: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> tuple[Tensor, ...]:
    """Identity forward on each of ``xs``; backward, their gradients summed over the group in one
    all-reduce (in their common dtype: a float32 gradient is rounded once, after the sum)."""
    return tuple(xs) if group_size(group) == 1 else _CopyAllToGroup.apply(group, *xs)


def reduce_from_group(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """All-reduce (sum) forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: Tensor, group: Optional[dist.ProcessGroup], dim: int = -1) -> Tensor:
    """All-gather along ``dim`` forward, keep this rank's slice of the gradient backward."""
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, group, dim)


def split_to_group(x: Tensor, group: Optional[dist.ProcessGroup], dim: int = -1) -> Tensor:
    """Keep this rank's slice of ``dim`` forward, all-gather the gradient backward."""
    return x if group_size(group) == 1 else _SplitToGroup.apply(x, group, dim)


def gather_sequence(x: Tensor, group: Optional[dist.ProcessGroup], dim: int) -> Tensor:
    """All-gather along ``dim`` forward, reduce-scatter of the gradient backward: the whole sequence
    into a column-parallel pair, whose ranks each return a partial gradient of it."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: Tensor, group: Optional[dist.ProcessGroup], dim: int) -> Tensor:
    """Reduce-scatter along ``dim`` forward, all-gather of the gradient backward: a row-parallel layer's
    partial sums, each rank keeping its part of the sequence."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group, dim)


def clip_grad_norm_counted(
    parameters: Iterable[Tensor],
    max_norm: float,
    counted: set[int],
    group: Optional[dist.ProcessGroup],
    weights: Optional[dict[int, Tensor]] = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a model spread across ``group``: the squared norms of the
    gradients whose parameter's ``id`` is in ``counted`` are summed over the group, where every part of
    the model is counted on exactly one rank (a shard by its holder, a copy by one of its holders).
    Every rank joins the sum, a rank without gradients (a pipeline stage that got none this step) with
    0, so no rank waits for one that skipped it. Every rank gets the same norm and scales all of its
    gradients alike, as one device holding the whole model would. A few foreach kernels per device and
    dtype, no host sync. Returns the total norm. A counted parameter with ``weights`` (id -> a tensor that
    broadcasts over it) adds the squares of its gradient times the weight (a shard part of which other
    ranks hold too: ``tensor.replicated_blocks.norm_weight``)."""
    params = list(parameters)
    weights = weights or {}
    grads = [p.grad for p in params if p.grad is not None]
    mine = [p.grad for p in params if p.grad is not None and id(p) in counted and id(p) not in weights]
    scaled = [p for p in params if p.grad is not None and id(p) in counted and id(p) in weights]
    if scaled:
        mine += foreach_mul([p.grad for p in scaled], [weights[id(p)] for p in scaled])
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    device = params[0].device if params else _collective_device(group)
    with torch.no_grad():
        # summed in float64 whatever each rank's dtype: every rank sends the same kind of tensor
        total = all_reduce_sum(_sum_of_squares(mine, device), group).to(dtype).sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for same in _by_device_and_dtype(grads):
            foreach_mul_(same, scale.to(device=same[0].device, dtype=same[0].dtype))
    return total


def _sum_of_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """The squared 2-norm of ``grads`` together, in float64 on ``device``: one foreach norm per device and
    dtype (in the gradients' dtype, as torch's own ``clip_grad_norm_``), their squares summed."""
    total = torch.zeros((), device=device, dtype=torch.float64)
    for same in _by_device_and_dtype(grads):
        norms = torch.stack(foreach_norm(same, 2))
        total += norms.to(device=device, dtype=torch.float64).square().sum()
    return total


def _by_device_and_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    """``tensors`` grouped by (device, dtype), the unit a foreach kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def share_found_inf(scaler: Any, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make a ``torch.amp.GradScaler`` skip a step on every rank of ``group`` when any rank saw inf/NaN.

    With parameters split over ranks, an overflow can show up in one rank's shard only; a scaler that
    decides per rank would then step on some ranks and not others, and the shards would stop belonging
    to one model. Wraps ``unscale_`` of this scaler instance (``step`` calls it too): after unscaling,
    the found-inf flags are max-reduced over ``group``."""
    original = scaler.unscale_

    def unscale_(optimizer: Any) -> None:
        original(optimizer)
        for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            if group_size(group) > 1:
                COUNTS["all_reduce"] += 1
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)

    scaler.unscale_ = unscale_


def exchange_counts(send: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``send`` (group size x k integers: row r for rank r) exchanged: row r of the result is what rank r
    sent this one (one all-to-all; no autograd)."""
    if group_size(group) == 1:
        return send
    COUNTS["all_to_all"] += 1
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=group)
    return received


def _all_to_all(x: Tensor, send: list[int], receive: list[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    COUNTS["all_to_all"] += 1
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, send: list[int], receive: list[int], group: Optional[dist.ProcessGroup]
    ) -> Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def all_to_all_rows(
    x: Tensor, send: list[int], receive: list[int], group: Optional[dist.ProcessGroup]
) -> Tensor:
    """Rows of ``x`` to the ranks of ``group``: the first ``send[0]`` to rank 0, the next ``send[1]`` to
    rank 1, ...; returns the rows received, ``receive[r]`` from rank r, in rank order. Backward sends each
    row's gradient back the same way (the all-to-all with the split sizes swapped)."""
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, send, receive, group)
