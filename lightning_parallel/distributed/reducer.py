"""Gradient synchronisation for data parallelism, overlapped with backward.

How it works, in the order a training step sees it::

    prepare_for_backward()   every .grad becomes a view into its bucket's flat buffer
    backward                 autograd accumulates in place into those views; a hook per parameter
                             counts arrivals, and a full bucket is all-reduced asynchronously, in
                             bucket order (every rank must issue collectives in the same order)
    finish_sync()            the buckets not yet sent are sent, then one wait; gradients are now the
                             average over the data-parallel group

While ``sync_enabled`` is False (gradient accumulation) the hooks only count; the last micro-step
sends the accumulated buffers. After the first step the buckets are rebuilt in the order gradients
actually arrived on rank 0 (every rank must bucket identically, so rank 0's order is broadcast).

Parameters that get no gradient are handled as torch DDP does: with ``find_unused_parameters`` their
(zero) slots are sent anyway and a parameter unused on every rank ends the step with ``grad=None``;
without it, the step fails with the names of the parameters, instead of hanging. With ``static_graph``
the same parameters are used every step: unused ones are allowed, found once (first synchronised step),
and the per-step search (a collective of flags) is skipped afterwards.

Every strategy with a data-parallel axis averages its gradients here (lp_ddp, tensor parallel, pipeline
stages). A pipeline stage runs several backwards per step: its hooks only count until the stage's last
backward, before which the strategy calls ``prepare_for_backward`` again (sync on), so the buckets are sent
while that backward still runs. The async pipeline applies a gradient finished a step earlier: its reducer
has no hooks, and ``average_now`` sends the buckets at once. A *held* parameter (``held``: one whose
gradient is summed over the tensor-parallel group at the end of each backward, ``tensor.gradient_sums``)
has no hook here: its owner calls ``grad_ready`` once the gradient is complete, and it comes last in the
first bucket order. The bucket collective is one method, ``_reduce_bucket``: optimizer sharding
(``zero.py``) reduce-scatters there instead of all-reducing.

A communication hook (torch DDP's ``hook(state, bucket) -> Future[Tensor]``, e.g. torch's
``fp16_compress_hook`` or ``PowerSGD``) replaces the built-in all-reduce of a bucket: it receives a
``HookBucket`` with torch's ``GradBucket`` methods, and the future's value is copied into the bucket.
With ``gradient_as_bucket_view=False`` the ``.grad`` tensors are separate from the buckets (torch's
default): copied into them when ready and back after the reduce, at the cost of a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_parallel.distributed.buckets import assign_buckets
from lightning_parallel.distributed.replicas import global_rank

__all__ = [
    "GradientReducer",
    "HookBucket",
    "ReducerStats",
    "UnusedParametersError",
    "COMM_HOOKS",
    "CommHook",
    "resolve_comm_hook",
]

#: a torch DDP communication hook: ``hook(state, bucket) -> Future[Tensor]`` (the averaged bucket)
CommHook = Callable[[Any, Any], torch.futures.Future]
#: names for torch's own hooks; None is the built-in all-reduce (what ``allreduce_hook`` does, without a Future)
COMM_HOOKS: dict[Optional[str], Optional[CommHook]] = {
    None: None,
    "none": None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


def resolve_comm_hook(
    spec: Union[str, CommHook, None], wrapper: Optional[Callable[[CommHook], CommHook]] = None
) -> Optional[CommHook]:
    """The hook that ``spec`` names (a key of ``COMM_HOOKS`` or a callable), wrapped by ``wrapper`` if given
    (torch's ``fp16_compress_wrapper(hook)``); None for the built-in all-reduce."""
    if callable(spec):
        hook = spec
    elif spec in COMM_HOOKS:
        hook = COMM_HOOKS[spec]
    else:
        raise ValueError(
            f"comm hook {spec!r} is not supported; use one of None, 'fp16', 'bf16', or a torch DDP "
            "communication hook hook(state, bucket) -> Future (torch.distributed.algorithms.ddp_comm_hooks)."
        )
    if wrapper is not None:
        hook = wrapper(hook if hook is not None else default_hooks.allreduce_hook)
    return hook


class UnusedParametersError(RuntimeError):
    """Raised when parameters got no gradient and ``find_unused_parameters`` is off."""


@dataclass
class ReducerStats:
    """Counters that make the reducer's behaviour observable (tests and benchmarks read them)."""

    bucket_all_reduces: int = 0  # collectives on gradient buckets
    launched_in_backward: int = 0  # of those, launched from a gradient hook while backward still ran
    synced_steps: int = 0
    rebuilt: bool = False


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: Tensor
    views: list[Tensor]
    pending: int = 0
    work: Optional[dist.Work] = None  # the built-in all-reduce in flight
    future: Optional[torch.futures.Future] = None  # a comm hook's result in flight
    names: list[str] = field(default_factory=list)


class HookBucket:
    """What a torch DDP communication hook sees of one bucket: the methods of ``dist.GradBucket``."""

    def __init__(self, bucket: _Bucket, index: int, last: bool) -> None:
        self._bucket, self._index, self._last = bucket, index, last
        self._buffer = bucket.buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket.params)


class GradientReducer:
    """Buckets a module's gradients and averages them over ``group`` during backward."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        comm_hook: Optional[CommHook] = None,
        comm_state: Any = None,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        hooks: bool = True,
        held: Iterable[nn.Parameter] = (),
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = min(first_bucket_cap_mb, bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters or static_graph
        self.static_graph = static_graph
        self.as_views = gradient_as_bucket_view
        self.comm_hook = comm_hook
        # torch's hooks take the process group as their state; None here means this reducer's group
        self.comm_state = comm_state if comm_state is not None else group
        self._static_unused: Optional[list[nn.Parameter]] = None  # found once, with static_graph
        self.sync_enabled = True
        self.stats = ReducerStats()
        self._names = {p: n for n, p in named_params if p.requires_grad}
        held = set(held)
        # Gradients roughly arrive in reverse registration order; that is the first guess, with the held
        # parameters last (they are reported at the end of backward).
        self._order: list[nn.Parameter] = sorted(reversed(list(self._names)), key=lambda p: p in held)
        # Arrival order, recorded until the first synchronised step (a dict keeps first arrivals only).
        self._arrivals: Optional[dict[nn.Parameter, None]] = {} if hooks else None
        self._synced_once = False
        self._used: set[nn.Parameter] = set()
        self.unused_last_sync: set[nn.Parameter] = set()  # no gradient on any rank in the last sync
        self._next_bucket = 0
        # without hooks (``average_now``), the gradients are not watched as they arrive
        self._watching = hooks
        hooked = [p for p in self._names if p not in held] if hooks else []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in hooked]
        self._build_buckets(self._order)

    # ------------------------------------------------------------------ buckets
    def _build_buckets(self, order: list[nn.Parameter], unused: int = 0) -> None:
        """Buckets over ``order``; its last ``unused`` parameters (no gradient in the first step) get buckets
        of their own, so they do not hold back, until ``finish_sync``, the buckets filled in backward (a
        pipeline stage never gives a gradient to the modules other stages use)."""
        self.buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for b, indices in enumerate(self._bucket_groups(order, len(order) - unused)):
            params = [order[i] for i in indices]
            bucket = _Bucket(params=params, buffer=torch.empty(0), views=[])
            bucket.names = [self._names[p] for p in params]
            self._allocate(bucket)
            for slot, (p, view) in enumerate(zip(params, bucket.views)):
                self._where[p] = (b, slot)
                if p.grad is not None:  # keep what was already accumulated
                    view.copy_(p.grad)
                    if self.as_views:
                        p.grad = view
            self.buckets.append(bucket)

    def _bucket_groups(self, order: list[nn.Parameter], used: int) -> list[list[int]]:
        """Which of ``order`` share each bucket (indices), by size: the first ``used`` apart from the rest
        (ZeRO-3 buckets by its units instead)."""
        caps = (self.bucket_cap_mb, self.first_bucket_cap_mb)
        groups = assign_buckets(order[:used], *caps)
        return groups + [[used + i for i in b] for b in assign_buckets(order[used:], *caps)]

    def _buffer_size(self, numel: int) -> int:
        """Elements of a bucket's flat buffer holding ``numel`` gradient elements (a sharding subclass pads)."""
        return numel

    def _allocate(self, bucket: _Bucket) -> None:
        """The bucket's flat buffer and a view of it per parameter. Empty: every slot is zeroed or written
        before it is read (prepare_for_backward), so the gradient memory is touched by the first backward,
        not at set-up; only padding past the gradients is zeroed."""
        params = bucket.params
        numel = sum(p.numel() for p in params)
        bucket.buffer = self._new_buffer(self._buffer_size(numel), params[0].dtype, params[0].device)
        bucket.buffer[numel:].zero_()
        bucket.views, offset = [], 0
        for p in params:
            bucket.views.append(bucket.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _new_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A bucket's flat buffer (uninitialised); a subclass that frees its buckets every step allocates
        them its own way."""
        return torch.empty(numel, dtype=dtype, device=device)

    def bucket_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in the order buckets are sent."""
        return [list(b.names) for b in self.buckets]

    def _rebuild_from_arrivals(self) -> None:
        arrived = list(self._arrivals or {})
        self._arrivals = None
        if self.world_size > 1:  # every rank must bucket the same way: use rank 0's order
            names = [self._names[p] for p in arrived]
            holder = [names]
            dist.broadcast_object_list(holder, src=global_rank(self.group, 0), group=self.group)
            by_name = {n: p for p, n in self._names.items()}
            arrived = [by_name[n] for n in holder[0]]
        seen = set(arrived)
        unused = [p for p in self._order if p not in seen]
        order = arrived + unused
        if unused or [id(p) for p in order] != [id(p) for p in self._order]:
            self._order = order
            self._build_buckets(order, len(unused))
        self.stats.rebuilt = True

    # ------------------------------------------------------------------ step
    def prepare_for_backward(self) -> None:
        """Point every ``.grad`` at its bucket slot (zeroed if the optimizer set it to None)."""
        if self._arrivals is not None and self._synced_once:
            self._rebuild_from_arrivals()
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = bucket.future = None
            if not self.as_views:  # gradients stay separate: slots are filled when they are ready
                bucket.buffer.zero_()
                continue
            if all(p.grad is None for p in bucket.params):
                bucket.buffer.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
                continue
            for p, view in zip(bucket.params, bucket.views):
                self._attach(p, view)
        self._next_bucket = 0

    @staticmethod
    def _attach(p: nn.Parameter, view: Tensor) -> None:
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # someone replaced .grad: adopt its value, then alias it again
        p.grad = view

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, slot = self._where[p]
        bucket = self.buckets[b]
        if self.as_views:
            self._attach(p, bucket.views[slot])
        elif self.sync_enabled:  # the accumulated gradient, copied into its slot when it will be sent
            bucket.views[slot].copy_(p.grad)
        if self._arrivals is not None:
            self._arrivals.setdefault(p)
        self._used.add(p)
        bucket.pending -= 1
        if self.sync_enabled:
            self._launch_ready(in_backward=True)

    def grad_ready(self, p: nn.Parameter) -> None:
        """A held parameter's gradient of this backward is complete (its owner says so, instead of a hook
        of the reducer's own): counted as the hook counts the others."""
        if self._watching and p in self._where:
            self._on_grad_ready(p)

    def _launch_ready(self, in_backward: bool = False) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending <= 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1
            self.stats.bucket_all_reduces += 1
            self.stats.launched_in_backward += int(in_backward)

    def _launch(self, index: int) -> None:
        """Start the collective of one bucket (a comm hook's, or ``_reduce_bucket``); waited in ``finish_sync``."""
        bucket = self.buckets[index]
        if self.comm_hook is None:
            bucket.work = self._reduce_bucket(bucket)
        else:
            hook_bucket = HookBucket(bucket, index, last=index == len(self.buckets) - 1)
            bucket.future = self.comm_hook(self.comm_state, hook_bucket)

    def _reduce_bucket(self, bucket: _Bucket) -> dist.Work:
        """The one data-parallel gradient collective of every strategy with a dp axis (DDP, tensor
        parallel, pipeline stages): an asynchronous all-reduce of the bucket's flat buffer, divided first
        (torch's ``allreduce_hook``), so ``.grad`` holds the average once it is waited for.

        Optimizer sharding (``distributed.zero.ShardedGradientReducer``) returns a reduce-scatter of the
        buffer into this rank's shard instead; the rest (buckets, hooks, overlap with backward, no_sync,
        the wait in ``finish_sync``) stays as it is."""
        return dist.all_reduce(bucket.buffer.div_(self.world_size), group=self.group, async_op=True)

    def finish_sync(self) -> None:
        """Send what is left, wait once, and leave averaged gradients in ``.grad``."""
        if not self.sync_enabled:
            return
        missing = [p for b in self.buckets for p in b.params if p not in self._used]
        if not self.as_views:  # gradients accumulated on earlier micro-steps still count
            for p in missing:
                if p.grad is not None:
                    b, slot = self._where[p]
                    self.buckets[b].views[slot].copy_(p.grad)
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._names[p] for p in missing)
            raise UnusedParametersError(
                f"These parameters received no gradient in this step: {names}. If that is intended, use "
                "find_unused_parameters=True (e.g. DDPStrategy(find_unused_parameters=True) or "
                "strategy='lp_ddp_find_unused_parameters_true'); otherwise make them take part in the loss."
            )
        for bucket in self.buckets:
            bucket.pending = 0
        self._launch_ready()
        globally_unused = self._globally_unused(missing) if self.find_unused_parameters else []
        for bucket in self.buckets:
            self._wait(bucket)
        for p in globally_unused:  # torch DDP leaves these without a gradient
            p.grad = None
        self.unused_last_sync = set(globally_unused)
        self._used.clear()
        self._synced_once = True
        self.stats.synced_steps += 1

    def _wait(self, bucket: _Bucket) -> None:
        """Wait for the bucket's collective (if not waited yet) and leave its averaged gradients in ``.grad``."""
        if bucket.work is not None:
            bucket.work.wait()
        if bucket.future is not None:
            value = bucket.future.wait()
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value.view_as(bucket.buffer))
        bucket.work = bucket.future = None
        if not self.as_views:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def average_now(self) -> None:
        """Average the gradients now in ``.grad`` at once, outside a backward (a reducer made with
        ``hooks=False``): the async pipeline applies a gradient finished a step earlier, while the
        backwards of the next batch ran into other tensors. Parameters without a gradient on any rank
        keep none (the optimizer skips them)."""
        present = [p for p in self._names if p.grad is not None]
        self.prepare_for_backward()
        self._used.update(present)
        self.finish_sync()

    def _globally_unused(self, locally_unused: list[nn.Parameter]) -> list[nn.Parameter]:
        """All ranks take part (another rank may have unused parameters even if this one has none); with
        ``static_graph`` only on the first synchronised step, whose answer then holds for every step."""
        if self._static_unused is not None:
            return self._static_unused
        used = [p in self._used for p in self._order]
        flags = torch.tensor(used, dtype=torch.int32, device=self.buckets[0].buffer.device)
        self._sum_over_ranks(flags)
        index = {p: i for i, p in enumerate(self._order)}
        counts = flags.tolist()  # one host sync, not one per parameter
        unused = [p for p in locally_unused if counts[index[p]] == 0]
        if self.static_graph:
            self._static_unused = unused
        return unused

    def _sum_over_ranks(self, tensor: Tensor) -> None:
        """``tensor`` summed in place over every rank this reducer averages over."""
        dist.all_reduce(tensor, group=self.group)

    def gradient_tensors(self) -> list[Tensor]:
        """The gradient memory this reducer holds (its buckets), for the memory report."""
        return [b.buffer for b in self.buckets]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._watching = False
