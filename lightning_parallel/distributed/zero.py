"""ZeRO stages 1 and 2 (Rajbhandari et al.): the data-parallel gradient path of a sharded optimizer.

Each gradient bucket's flat buffer is padded to a multiple of the data-parallel size ``W`` and cut into
``W`` equal, contiguous ranges; rank ``r`` owns range ``r``. A parameter whose elements fall in a rank's
range has a *piece* there: a flat ``nn.Parameter`` that is a view of those elements of the model's own
parameter, so updating the piece updates the model in place. The rank's optimizer holds only its
pieces (``optimizer_shards.ShardedOptimizer``), hence 1/W of the optimizer state.

One step, in the order the strategy drives it::

    backward        gradients accumulate in the buckets (as views), as in ``GradientReducer``; a full
                    bucket is reduce-scattered (``_reduce_bucket``), so this rank receives the average of
                    its range only, overlapped with the rest of backward (stage 1: into the bucket's
                    own slice for that range, so the gradients hold the bucket's memory and no more)
    shard_gradients the pieces' ``.grad`` become views of the received range; the model's ``.grad`` are
                    dropped (stage 2 frees the full-size bucket buffers here: a rank keeps 1/W of the
                    gradients between steps, the buffer is allocated again in the next backward)
    optimizer step  on the pieces only (clipping, hooks and the LR schedulers see the pieces)
    gather_parameters  every bucket's ranges all-gathered into the model's parameters

Buckets of *whole* parameters (a pipeline's modules replicated over the stages, whose gradient is summed
over the stages after the data-parallel average) are all-reduced instead, and their pieces read the
summed ``.grad``: their optimizer state is still sharded. The buckets are never rebuilt from the observed
gradient order (the optimizer state lives in the pieces they define). Communication hooks (fp16
compression, PowerSGD) are all-reduce hooks and are refused by the strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.reducer import GradientReducer, _Bucket

__all__ = ["Piece", "BucketShard", "ShardedGradientReducer", "ZERO_STAGES"]

#: 0: off; 1: optimizer state sharded; 2: gradients too
ZERO_STAGES = (0, 1, 2)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Works:
    """Several works, waited for as one; ``then`` runs after the last."""

    def __init__(self, works: list[Any], then: Optional[Any] = None) -> None:
        self.works, self.then = works, then

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return True


def _ranges(buffer: Tensor, group: Optional[dist.ProcessGroup]) -> list[tuple[int, Tensor]]:
    """Each rank of ``group`` (as its global rank) with its equal range of the flat ``buffer``."""
    size = buffer.numel() // dist.get_world_size(group)
    ranks = range(dist.get_world_size(group))
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return [(global_rank(r), buffer[r * size : (r + 1) * size]) for r in ranks]


def _reduce_scatter_by_ranges(output: Tensor, buffer: Tensor, group: Optional[dist.ProcessGroup]) -> _Works:
    """A reduce-scatter as one in-place reduce per rank's range (gloo): gloo's own reduce-scatter left
    tens of MiB to the allocator in every call (docs/benchmarks.md, the collectives), reduces leave none."""
    ranges = _ranges(buffer, group)
    mine = ranges[dist.get_rank(group)][1]
    works = [dist.reduce(part, dst=rank, group=group, async_op=True) for rank, part in ranges]
    return _Works(works, None if output.data_ptr() == mine.data_ptr() else lambda: output.copy_(mine))


def _all_gather_by_ranges(buffer: Tensor, group: Optional[dist.ProcessGroup]) -> _Works:
    """An in-place all-gather of ``buffer``'s ranges (this rank's filled in already) as one broadcast per
    rank (gloo, as ``ZeroRedundancyOptimizer`` does; see ``_reduce_scatter_by_ranges``)."""
    return _Works([dist.broadcast(part, src=rank, group=group, async_op=True) for rank, part in _ranges(buffer, group)])


@dataclass
class Piece:
    """Elements ``start:stop`` of ``param`` (flattened), held by this rank at ``offset`` of its range."""

    param: nn.Parameter
    start: int
    stop: int
    offset: int
    shard: nn.Parameter  # a view of those elements: what the optimizer updates


@dataclass
class BucketShard:
    """This rank's range of one bucket: ``size`` elements per rank (the buffer holds ``W * size``)."""

    size: int
    whole: bool  # all-reduced: the pieces read the (stage-summed) ``.grad`` of their parameters
    pieces: list[Piece] = field(default_factory=list)
    grad: Optional[Tensor] = None  # the received range (stage 1: a slice of the bucket), kept between steps


class ShardedGradientReducer(GradientReducer):
    """``GradientReducer`` with each bucket reduce-scattered over ``group``; see the module docstring.

    Args:
        stage: 1 (the full-size buffers are kept between steps) or 2 (freed after each reduce-scatter).
        whole: parameters whose buckets are all-reduced (their gradients are summed over pipeline stages
            after the average); the optimizer state of their pieces is still sharded.
        **kwargs: as for ``GradientReducer``.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        stage: int = 1,
        whole: Iterable[nn.Parameter] = (),
        **kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ShardedGradientReducer: stage must be 1 or 2, got {stage!r}")
        strided = [n for n, p in named_params if p.requires_grad and not p.is_contiguous()]
        if strided:
            raise ValueError(
                f"zero_stage={stage} views each parameter's elements flat, and these parameters are not "
                f"contiguous: {strided[:5]}; make them contiguous (p.data = p.data.contiguous()) or use zero_stage=0"
            )
        self.stage = stage
        self.rank = dist.get_rank(group)
        # gloo: collectives made of per-rank reduces and broadcasts (``_reduce_scatter_by_ranges``)
        self._by_ranges = dist.get_backend(group) == "gloo"
        self._whole = set(whole)
        self.shards: list[BucketShard] = []
        super().__init__(named_params, group=group, **kwargs)
        self._arrivals = None  # never rebuilt: the optimizer state lives in the pieces the buckets define

    # ------------------------------------------------------------------ layout
    def _buffer_size(self, numel: int) -> int:
        return -(-numel // self.world_size) * self.world_size

    def _build_buckets(self, order: list[nn.Parameter], unused: int = 0) -> None:
        """Buckets as ``GradientReducer`` makes them, whole parameters apart; then this rank's pieces."""
        whole = [p for p in order if p in self._whole]
        super()._build_buckets([p for p in order if p not in self._whole] + whole, len(whole))
        self.shards = [self._cut(bucket) for bucket in self.buckets]
        self._shard_of = {id(bucket): shard for bucket, shard in zip(self.buckets, self.shards)}

    def _cut(self, bucket: _Bucket) -> BucketShard:
        size = bucket.buffer.numel() // self.world_size
        shard = BucketShard(size=size, whole=bucket.params[0] in self._whole)
        low, high, offset = self.rank * size, (self.rank + 1) * size, 0
        for p in bucket.params:
            start, stop = max(low, offset) - offset, min(high, offset + p.numel()) - offset
            if start < stop:
                view = p.detach().view(-1)[start:stop]
                shard.pieces.append(Piece(p, start, stop, start + offset - low, nn.Parameter(view)))
            offset += p.numel()
        return shard

    def pieces(self) -> list[Piece]:
        """This rank's pieces, bucket by bucket."""
        return [piece for shard in self.shards for piece in shard.pieces]

    # ------------------------------------------------------------------ step
    def prepare_for_backward(self) -> None:
        for bucket in self.buckets:
            if bucket.buffer.numel() == 0:  # freed by stage 2 after the last reduce-scatter
                self._allocate(bucket)
        super().prepare_for_backward()

    def _reduce_bucket(self, bucket: _Bucket) -> dist.Work:
        shard = self._shard_of[id(bucket)]
        if shard.whole:
            return super()._reduce_bucket(bucket)
        if self.stage == 1:  # received in place, into this rank's own slice of the kept bucket
            low = self.rank * shard.size
            shard.grad = bucket.buffer[low : low + shard.size]
        elif shard.grad is None:  # stage 2: kept apart, the bucket is freed after the reduce-scatter
            shard.grad = bucket.buffer.new_empty(shard.size)
        bucket.buffer.div_(self.world_size)
        if self._by_ranges:
            return _reduce_scatter_by_ranges(shard.grad, bucket.buffer, self.group)
        return _reduce_scatter(shard.grad, bucket.buffer, group=self.group, async_op=True)

    def finish_sync(self) -> None:
        """Send what is left and wait; the model's ``.grad`` of reduce-scattered buckets hold only this
        rank's local sums, so they are dropped, and stage 2 frees those buckets' buffers."""
        if not self.sync_enabled:
            return
        super().finish_sync()
        for bucket, shard in zip(self.buckets, self.shards):
            if shard.whole:
                continue
            for p in bucket.params:
                p.grad = None
            if self.stage == 2:
                bucket.buffer, bucket.views = bucket.buffer.new_empty(0), []

    def shard_gradients(self) -> None:
        """After the strategy's gradient path is complete (pipelines: after the sum over the stages): each
        piece's ``.grad`` is its part of the averaged gradient (None where its parameter has none, as one
        device would leave it); the whole buckets' ``.grad`` are dropped (the next step starts at zero)."""
        for bucket, shard in zip(self.buckets, self.shards):
            for piece in shard.pieces:
                if shard.whole:
                    g = piece.param.grad
                    piece.shard.grad = None if g is None else g.detach().reshape(-1)[piece.start : piece.stop]
                elif piece.param in self.unused_last_sync or shard.grad is None:
                    piece.shard.grad = None
                else:
                    piece.shard.grad = shard.grad[piece.offset : piece.offset + piece.stop - piece.start]
            if shard.whole:
                for p in bucket.params:
                    p.grad = None

    def gather_parameters(self) -> None:
        """After the optimizer step: every rank's updated ranges into every rank's parameters (one
        all-gather per bucket, all started before the first wait); the pieces' gradients are dropped."""
        started = []
        for bucket, shard in zip(self.buckets, self.shards):
            first = bucket.params[0]
            # the bucket's buffer is free until the next backward (the model's .grad no longer alias it)
            full = bucket.buffer
            if not full.numel():
                full = torch.empty(shard.size * self.world_size, dtype=first.dtype, device=first.device)
            own = full[self.rank * shard.size : (self.rank + 1) * shard.size]
            send = own if self._by_ranges else torch.empty_like(own)  # gloo: in place
            send.zero_()
            for piece in shard.pieces:
                send[piece.offset : piece.offset + piece.stop - piece.start].copy_(piece.shard.detach())
                piece.shard.grad = None
            if self._by_ranges:
                work = _all_gather_by_ranges(full, self.group)
            else:  # NCCL: the fused collective
                work = _all_gather(full, send, group=self.group, async_op=True)
            started.append((work, full, bucket))
        with torch.no_grad():
            for work, full, bucket in started:
                work.wait()
                offset = 0
                for p in bucket.params:
                    p.view(-1).copy_(full[offset : offset + p.numel()])
                    offset += p.numel()

    def gradient_tensors(self) -> list[Tensor]:
        return [*super().gradient_tensors(), *(s.grad for s in self.shards if s.grad is not None)]
