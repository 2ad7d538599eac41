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
                    own slice for that range, so the gradients hold the bucket's memory and no more;
                    stage 2: into a range of its own, the bucket allocated at its first gradient and
                    freed as soon as its reduce-scatter is done, at most ``IN_FLIGHT`` in flight; a
                    freed buffer is the next bucket's of its size, ``SPARES``)
    shard_gradients the pieces' ``.grad`` become views of the received range; the model's ``.grad`` were
                    dropped after the reduce-scatter (they held this rank's local sums)
    optimizer step  on the pieces only (clipping, hooks and the LR schedulers see the pieces)
    gather_parameters  every bucket's ranges all-gathered in place into a buffer of the bucket's size
                    (stage 1: the kept bucket), then copied into the model's parameters

Several synchronised backwards before one step (manual optimization's accumulation, each
``manual_backward`` synchronised) accumulate as ``.grad`` does: a bucket's first backward after a sync
starts this rank's range at ``W`` times what it received (``_start``), so the next reduce-scatter, of the
buffer divided by ``W``, receives what the range held plus the new average. The step consumes the
received ranges (``gather_parameters``). ``accumulate_grad_batches`` instead accumulates in the buckets
and synchronises once, as under ``GradientReducer``.

HSDP (``replicate_group``): the ranges are cut over ``group``, the shard group, and the ranks of
``replicate_group`` hold the same range. A bucket is divided by the whole data-parallel size
(``group`` x ``replicate_group``), reduce-scattered within the shard group, and the received range is then
all-reduced across the replicas (started once the reduce-scatter is done, ``_Then``), so it holds the
average over every data-parallel rank; accumulation starts the range at the shard size times what it
received, which the all-reduce's sum over the replicas makes the whole size times it again.

Buckets of *whole* parameters (a pipeline's modules replicated over the stages, whose gradient is summed
over the stages after the data-parallel average) are all-reduced instead, and their pieces read the
summed ``.grad``: their optimizer state is still sharded. The buckets are never rebuilt from the observed
gradient order (the optimizer state lives in the pieces they define). Communication hooks (fp16
compression, PowerSGD) are all-reduce hooks and are refused by the strategies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.compat import all_gather_single, foreach_copy_, reduce_scatter_single
from lightning_parallel.distributed.page_pool import host_mapping
from lightning_parallel.distributed.reducer import GradientReducer, _Bucket

__all__ = [
    "Piece",
    "BucketShard",
    "ShardedGradientReducer",
    "ZERO_STAGES",
    "all_gather_by_ranges",
    "reduce_scatter_by_ranges",
]

#: 0: off; 1: optimizer state sharded; 2: gradients too; 3: parameters too (``zero3.py``)
ZERO_STAGES = (0, 1, 2, 3)

#: stage 2: full-size buffers at once, at most (a bucket's reduce-scatter or the parameters' all-gather in
#: flight); one more is waited for before it starts
IN_FLIGHT = 1
#: stage 2's buffers of this size or more are mapped memory of their own on the CPU (``_scratch``)
MAPPED_BYTES = 2**20
#: stage 2: freed buckets' buffers kept for the next buckets of their size. A new mapped buffer costs a page
#: fault per page when first written: ZeRO-3 at dp=2 (4 blocks of 27 MiB) took 35,000 faults per step for
#: its buckets. Two spares (the one in flight's, the root unit's) leave one new buffer per step where every
#: bucket was new; between steps they hold their size (at most a block and the root unit's)
SPARES = 2


class _Works:
    """Several works, waited for as one; ``then`` runs after the last."""

    def __init__(self, works: list[Any], then: Optional[Any] = None) -> None:
        self.works, self.then = works, then

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return True


class _Then:
    """A collective started once ``first`` is done (it reads what ``first`` wrote): ``then()`` starts it
    when ``first`` is found complete or is waited for; the two are waited for as one. The reducer polls and
    waits for its buckets in their order, so every rank starts these second collectives in that order."""

    def __init__(self, first: Any, then: Any) -> None:
        self.first, self.then, self.second = first, then, None

    def _started(self) -> Any:
        if self.second is None:
            self.first.wait()
            self.second = self.then()
        return self.second

    def is_completed(self) -> bool:
        if self.second is None and not self.first.is_completed():
            return False
        return self._started().is_completed()

    def wait(self, timeout: Any = None) -> bool:
        self._started().wait()
        return True


def _ranges(buffer: Tensor, group: Optional[dist.ProcessGroup]) -> list[tuple[int, Tensor]]:
    """Each rank of ``group`` (as its global rank) with its equal range of the flat ``buffer``."""
    size = buffer.numel() // dist.get_world_size(group)
    ranks = range(dist.get_world_size(group))
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return [(global_rank(r), buffer[r * size : (r + 1) * size]) for r in ranks]


def reduce_scatter_by_ranges(output: Tensor, buffer: Tensor, group: Optional[dist.ProcessGroup]) -> _Works:
    """A reduce-scatter as one in-place reduce per rank's range (gloo): gloo's own reduce-scatter left
    tens of MiB to the allocator in every call (docs/benchmarks.md, the collectives), reduces leave none."""
    ranges = _ranges(buffer, group)
    mine = ranges[dist.get_rank(group)][1]
    works = [dist.reduce(part, dst=rank, group=group, async_op=True) for rank, part in ranges]
    return _Works(works, None if output.data_ptr() == mine.data_ptr() else lambda: output.copy_(mine))


def all_gather_by_ranges(buffer: Tensor, group: Optional[dist.ProcessGroup]) -> _Works:
    """An in-place all-gather of ``buffer``'s ranges (this rank's filled in already) as one broadcast per
    rank (gloo, as ``ZeroRedundancyOptimizer`` does; see ``reduce_scatter_by_ranges``)."""
    return _Works(
        [dist.broadcast(part, src=rank, group=group, async_op=True) for rank, part in _ranges(buffer, group)]
    )


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A buffer that stage 2 allocates and frees in every step (a bucket, a gather). On the CPU, one of
    ``MAPPED_BYTES`` or more is memory mapped for it alone, handed back to the system when it is freed:
    glibc serves such sizes from its heap once a large block has been freed, and the pages of freed buckets
    stayed resident there, which put stage 2's peak resident memory above stage 1's."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.frombuffer(host_mapping(nbytes), dtype=dtype, count=numel)


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
        stage: 1 (the full-size buffers are kept between steps) or 2 (each allocated at its first gradient
            of a backward and freed once its reduce-scatter is done).
        whole: parameters whose buckets are all-reduced (their gradients are summed over pipeline stages
            after the average); the optimizer state of their pieces is still sharded.
        replicate_group: HSDP: the ranks that hold this rank's ranges too, across which each received
            range is all-reduced (None: ``group`` is the whole data-parallel group); not with ``whole``.
        **kwargs: as for ``GradientReducer``.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        stage: int = 1,
        whole: Iterable[nn.Parameter] = (),
        replicate_group: Optional[dist.ProcessGroup] = None,
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
        if not kwargs.get("gradient_as_bucket_view", True):
            raise ValueError(
                f"zero_stage={stage} needs gradient_as_bucket_view=True (the gradients are the buckets)"
            )
        self.stage = stage
        self.rank = dist.get_rank(group)
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        # gloo: collectives made of per-rank reduces and broadcasts (``reduce_scatter_by_ranges``)
        self._by_ranges = dist.get_backend(group) == "gloo"
        self._whole = set(whole)
        if replicate_group is not None and self._whole:
            raise ValueError(
                "HSDP (replicate_group) takes no whole buckets (a pipeline's replicated modules)"
            )
        self.shards: list[BucketShard] = []
        # synchronised backwards whose averages the received ranges hold, not yet consumed by a step
        self.syncs_since_step = 0
        self._unused_since_step: Optional[set[nn.Parameter]] = None  # no gradient in any of those syncs
        self._in_flight: deque[_Bucket] = deque()  # stage 2: reduce-scatters started, buffers not yet freed
        self._spares: list[Tensor] = []  # stage 2: freed buckets' buffers, the next buckets' (``SPARES``)
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
        if self.stage == 2:  # allocated again by the first gradient of a backward
            for bucket, shard in zip(self.buckets, self.shards):
                if not shard.whole and all(p.grad is None for p in bucket.params):
                    self._free(bucket)

    def _cut(self, bucket: _Bucket) -> BucketShard:
        size = bucket.buffer.numel() // self.world_size
        shard = BucketShard(size=size, whole=bucket.params[0] in self._whole)
        low, high, offset = self.rank * size, (self.rank + 1) * size, 0
        for p in bucket.params:
            start, stop = max(low, offset) - offset, min(high, offset + p.numel()) - offset
            if start < stop:
                view = self._piece_view(bucket, p, start, stop, start + offset - low)
                shard.pieces.append(Piece(p, start, stop, start + offset - low, nn.Parameter(view)))
            offset += p.numel()
        return shard

    def _piece_view(self, bucket: _Bucket, p: nn.Parameter, start: int, stop: int, offset: int) -> Tensor:
        """What a piece is a view of: elements ``start:stop`` of ``p`` (``offset``: where they fall in this
        rank's range; ZeRO-3's pieces view the range it keeps instead)."""
        return p.detach().view(-1)[start:stop]

    def pieces(self) -> list[Piece]:
        """This rank's pieces, bucket by bucket."""
        return [piece for shard in self.shards for piece in shard.pieces]

    # ------------------------------------------------------------------ a bucket's buffer
    def _own(self, buffer: Tensor, shard: BucketShard) -> Tensor:
        """This rank's range of a bucket's flat buffer."""
        return buffer[self.rank * shard.size : (self.rank + 1) * shard.size]

    def _start(self, bucket: _Bucket) -> None:
        """The bucket's first backward since its gradients were last reduced: every ``.grad`` becomes its
        view, zeroed, except that this rank's range starts at ``world_size`` times what it received in the
        syncs since the step (accumulation over several synchronised backwards, as manual optimization
        does). The buffer is divided by ``world_size`` before the reduce-scatter, so the range then receives
        what it held plus the new average, as ``.grad`` accumulates (exact for a power-of-two size)."""
        shard = self._shard_of[id(bucket)]
        if not self._seeds(bucket, shard):
            bucket.buffer.zero_()
        else:
            own = self._own(bucket.buffer, shard)
            torch.mul(shard.grad, self.world_size, out=own)  # stage 1: own is shard.grad itself
            bucket.buffer[: self.rank * shard.size].zero_()
            bucket.buffer[(self.rank + 1) * shard.size :].zero_()
        for p, view in zip(bucket.params, bucket.views):
            p.grad = view

    def _seeds(self, bucket: _Bucket, shard: BucketShard) -> bool:
        """Whether ``_start`` puts what this rank's range received since the step into the bucket (ZeRO-3's
        cast gradients add it after the reduce-scatter instead)."""
        return not shard.whole and bool(self.syncs_since_step) and shard.grad is not None

    def _open(self, bucket: _Bucket, arrived: Optional[nn.Parameter] = None) -> None:
        """Stage 2: allocate and start the bucket's buffer at its first gradient of a backward (``arrived``,
        whose fresh ``.grad`` is added to its slot), or before its reduce-scatter if none came."""
        fresh = None if arrived is None else arrived.grad
        self._allocate(bucket)
        self._start(bucket)
        if fresh is not None:
            bucket.views[self._where[arrived][1]].add_(fresh)

    def _new_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Stage 2: a spare of that size if one was kept (its memory already the process's), else new."""
        if self.stage != 2:
            return super()._new_buffer(numel, dtype, device)
        for i, spare in enumerate(self._spares):
            if spare.numel() == numel and spare.dtype == dtype and spare.device == device:
                return self._spares.pop(i)
        return _scratch(numel, dtype, device)

    def _free(self, bucket: _Bucket) -> None:
        """Stage 2: the bucket's gradients dropped and its buffer kept as a spare (the oldest spare beyond
        ``SPARES`` handed back)."""
        for p in bucket.params:
            p.grad = None
        if bucket.buffer.numel():
            self._spares = [bucket.buffer, *self._spares][:SPARES]
        bucket.buffer, bucket.views = bucket.buffer.new_empty(0), []

    # ------------------------------------------------------------------ step
    def prepare_for_backward(self) -> None:
        """As ``GradientReducer``'s, except: a bucket whose gradients were reduced starts from this rank's
        received range (``_start``), and at stage 2 a freed bucket stays freed until its first gradient."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = bucket.future = None
            if all(p.grad is None for p in bucket.params):
                if bucket.buffer.numel():
                    self._start(bucket)
                continue
            if not bucket.buffer.numel():  # a .grad set from outside: adopted by a fresh buffer
                self._allocate(bucket)
            for p, view in zip(bucket.params, bucket.views):
                self._attach(p, view)
        self._next_bucket = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self.buckets[self._where[p][0]]
        if not bucket.buffer.numel():
            self._open(bucket, p)
        super()._on_grad_ready(p)

    def _launch_ready(self, in_backward: bool = False) -> None:
        """Start the full buckets' collectives; stage 2 then frees the buckets whose reduce-scatter is done
        (asked without waiting), and waits for the oldest while more than ``IN_FLIGHT`` are in flight."""
        super()._launch_ready(in_backward)
        while self._in_flight and (
            len(self._in_flight) > IN_FLIGHT or self._in_flight[0].work.is_completed()
        ):
            self._wait(self._in_flight.popleft())

    def _reduce_bucket(self, bucket: _Bucket) -> Any:
        shard = self._shard_of[id(bucket)]
        if shard.whole:
            return super()._reduce_bucket(bucket)
        if not bucket.buffer.numel():  # no gradient of this bucket on this rank
            self._open(bucket)
        if self.stage == 1:  # received in place, into this rank's own slice of the kept bucket
            shard.grad = self._own(bucket.buffer, shard)
        elif shard.grad is None:  # stage 2: kept apart, the bucket is freed after the reduce-scatter
            shard.grad = _scratch(shard.size, bucket.buffer.dtype, bucket.buffer.device)
        bucket.buffer.div_(self.world_size * self.replicas)
        if self._by_ranges:
            work: Any = reduce_scatter_by_ranges(shard.grad, bucket.buffer, self.group)
        else:
            work = reduce_scatter_single()(shard.grad, bucket.buffer, group=self.group, async_op=True)
        if self.stage == 2:
            self._in_flight.append(bucket)
        return self._across_replicas(work, shard.grad)

    def _across_replicas(self, work: Any, received: Tensor) -> Any:
        """``work`` (the collective within the shard group into ``received``), followed under HSDP by the
        all-reduce of ``received`` across the replicas."""
        if self.replicate_group is None:
            return work
        group = self.replicate_group
        return _Then(work, lambda: dist.all_reduce(received, group=group, async_op=True))

    def _sum_over_ranks(self, tensor: Tensor) -> None:
        super()._sum_over_ranks(tensor)
        if self.replicate_group is not None:
            dist.all_reduce(tensor, group=self.replicate_group)

    def _wait(self, bucket: _Bucket) -> None:
        """After a reduce-scatter the model's ``.grad`` of the bucket hold only this rank's local sums: they
        are dropped, and stage 2 frees the bucket's buffer."""
        super()._wait(bucket)
        if self._shard_of[id(bucket)].whole:
            return
        if self.stage == 2:
            self._free(bucket)
        else:
            for p in bucket.params:
                p.grad = None

    def finish_sync(self) -> None:
        """Send what is left and wait (``_wait``); the received ranges now hold the averages of every
        synchronised backward since the step."""
        if not self.sync_enabled:
            return
        super().finish_sync()
        self._in_flight.clear()
        self.syncs_since_step += 1
        unused = self._unused_since_step
        self._unused_since_step = (
            set(self.unused_last_sync) if unused is None else unused & self.unused_last_sync
        )

    def shard_gradients(self) -> None:
        """After the strategy's gradient path is complete (pipelines: after the sum over the stages): each
        piece's ``.grad`` is its part of the averaged gradient (None where its parameter had none in every
        sync since the step, as one device would leave it); the whole buckets' ``.grad`` are dropped (the
        next step starts at zero)."""
        unused = self._unused_since_step or set()
        for bucket, shard in zip(self.buckets, self.shards):
            for piece in shard.pieces:
                if shard.whole:
                    g = piece.param.grad
                    grad = None if g is None else g.detach().reshape(-1)[piece.start : piece.stop]
                    # ZeRO-3 with a param_dtype: the pieces (of the shards) are in another dtype
                    piece.shard.grad = None if grad is None else grad.to(piece.shard.dtype)
                elif piece.param in unused or shard.grad is None:
                    piece.shard.grad = None
                else:
                    piece.shard.grad = shard.grad[piece.offset : piece.offset + piece.stop - piece.start]
            if shard.whole:
                for p in bucket.params:
                    p.grad = None

    def zero_grad(self) -> None:
        """Drop what the ranges received since the step, as an optimizer's ``zero_grad`` drops ``.grad``:
        the next synchronised backward starts from zero (the model's parameters hold no ``.grad`` under
        ZeRO for the optimizer's own ``zero_grad`` to clear)."""
        self.syncs_since_step, self._unused_since_step = 0, None
        for piece in self.pieces():
            piece.shard.grad = None

    def gather_parameters(self) -> None:
        """After the optimizer step, which consumed the received ranges: every rank's updated ranges into
        every rank's parameters, one in-place all-gather per bucket (stage 1: in the kept bucket, all
        started before the first wait; stage 2: in a buffer of the bucket's size, at most ``IN_FLIGHT``
        at once); the pieces' gradients are dropped."""
        self.syncs_since_step, self._unused_since_step = 0, None
        started: deque[tuple[Any, Tensor, _Bucket]] = deque()
        for bucket, shard in zip(self.buckets, self.shards):
            started.append((*self._start_gather(bucket, shard), bucket))
            if self.stage == 2 and len(started) > IN_FLIGHT:
                self._finish_gather(*started.popleft())
        while started:
            self._finish_gather(*started.popleft())

    def _start_gather(self, bucket: _Bucket, shard: BucketShard) -> tuple[Any, Tensor]:
        """This rank's updated pieces into its range of a buffer of the bucket's size (the bucket's own when
        it is allocated: the model's ``.grad`` no longer alias it), and that buffer's all-gather started."""
        first = bucket.params[0]
        full = bucket.buffer
        if not full.numel():
            full = _scratch(shard.size * self.world_size, first.dtype, first.device)
        own = self._own(full, shard)
        held = sum(piece.stop - piece.start for piece in shard.pieces)
        if held:  # the pieces tile the range from its start, in order
            torch.cat([piece.shard.detach() for piece in shard.pieces], out=own[:held])
        own[held:].zero_()
        for piece in shard.pieces:
            piece.shard.grad = None
        if self._by_ranges:
            return all_gather_by_ranges(full, self.group), full
        return all_gather_single()(full, own, group=self.group, async_op=True), full

    @staticmethod
    def _finish_gather(work: Any, full: Tensor, bucket: _Bucket) -> None:
        work.wait()
        sizes = [p.numel() for p in bucket.params]
        parts = full.split([*sizes, full.numel() - sum(sizes)])
        with torch.no_grad():
            foreach_copy_([p.view(-1) for p in bucket.params], list(parts[: len(sizes)]))

    def gradient_tensors(self) -> list[Tensor]:
        return [*super().gradient_tensors(), *(s.grad for s in self.shards if s.grad is not None)]
