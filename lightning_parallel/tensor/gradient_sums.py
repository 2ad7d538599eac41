"""Gradients summed over the tensor-parallel group: one collective per backward, not one per parameter.

A whole parameter used on split values (a per-head norm's weight on split heads: the plan's
``gradient_sums``; a norm's weight or a row-parallel bias on sequence shards: ``tensor.sequence``) gets a
partial gradient on each rank of the group, and one device's gradient is their sum; so do the blocks of a
sharded parameter that several ranks hold whole (``add_blocks``: key-value heads fewer than the ranks,
``tensor.replicated_blocks``), summed in the same collective. In a backward:

    tensor hook      a parameter summed in this backward keeps its fresh gradient aside and passes zero on
                     to ``.grad``, which so holds what earlier backwards left
    end of backward  the fresh gradients, flat, are all-reduced at once (one collective per dtype), each
                     sum is added to its ``.grad``, and ``ready`` hears that the parameter's gradient is
                     complete

(``torch.autograd.grad``, which accumulates nothing, gets each sum at once, from a collective of its own.)

Each backward sums its own fresh part, so gradient accumulation, several ``manual_backward`` per step and a
pipeline's micro-batch backwards accumulate sums, as one device accumulates gradients. The data-parallel
reducer reads ``.grad`` during backward, so it watches no hook of its own on these parameters
(``GradientReducer(held=...)``) and hears of each through ``ready``: after its sum, or, for one not summed
in this backward, as soon as its gradient is accumulated.

Every rank of the group computes the same parameters' gradients in a backward (the ranks run the same
model on the same batch), so every rank issues the same collectives.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from functools import partial
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from lightning_parallel.compat import accumulates_grad, graph_task_id, queue_end_of_backward
from lightning_parallel.distributed.collectives import all_reduce_sum, group_size
from lightning_parallel.tensor.replicated_blocks import Replicated, placed, taken_back

__all__ = ["GradientSums", "gradient_sums_for", "installed_gradient_sums", "remove_gradient_sums"]

#: whether a parameter's gradient is summed in the backward running now (None: always)
When = Optional[Callable[[], bool]]
Ready = Callable[[nn.Parameter], None]

_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, GradientSums]" = weakref.WeakKeyDictionary()


class GradientSums:
    """The gradient sums of one module's parameters over ``group`` (``add`` names them)."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self._when: dict[nn.Parameter, When] = {}  # in the order of the flat collective
        self._hooks: dict[nn.Parameter, RemovableHandle] = {}
        self._accumulators: dict[nn.Parameter, object] = {}  # each parameter's AccumulateGrad node
        self._ready_hooks: list[RemovableHandle] = []
        self._fresh: dict[nn.Parameter, Tensor] = {}  # this backward's gradients, not yet summed
        self._blocks: dict[nn.Parameter, Replicated] = {}  # only these blocks summed (replicated_blocks)
        self._queued_for: Optional[int] = None  # the backward whose end sums them
        self.ready: Optional[Ready] = None

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter whose gradient may be summed (a reducer must hold them: ``report_to``)."""
        return list(self._when)

    def add_blocks(self, blocks: dict[nn.Parameter, Replicated]) -> "_Added":
        """Sum, in every backward, the gradients of the blocks of each parameter that several ranks hold
        whole (``tensor.replicated_blocks``); its other blocks keep their own gradient."""
        self._blocks.update({p: how for p, how in blocks.items() if p.requires_grad})
        return self.add(blocks)

    def add(self, params: Iterable[nn.Parameter], when: When = None) -> "_Added":
        """Sum the gradients of ``params`` in every backward, or in those where ``when()`` is true. A
        parameter named twice is summed once, where either says so; frozen ones are left out."""
        added = []
        for p in params:
            if not p.requires_grad:
                continue
            if p in self._when:
                earlier = self._when[p]
                self._when[p] = None if earlier is None or when is None else _either(earlier, when)
                continue
            self._when[p] = when
            self._accumulators[p] = get_gradient_edge(p).node
            self._hooks[p] = p.register_hook(partial(self._keep, p))
            added.append(p)
        if self.ready is not None:
            self.report_to(self.ready)
        return _Added(self, added)

    def discard(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            self._when.pop(p, None)
            self._blocks.pop(p, None)
            self._accumulators.pop(p, None)
            handle = self._hooks.pop(p, None)
            if handle is not None:
                handle.remove()
        if self.ready is not None:
            self.report_to(self.ready)

    def report_to(self, ready: Optional[Ready]) -> None:
        """Tell ``ready(p)`` (a data-parallel reducer's ``grad_ready``) when each parameter's gradient of a
        backward is complete; None tells nobody."""
        for handle in self._ready_hooks:
            handle.remove()
        self.ready = ready
        passing = [p for p, when in self._when.items() if when is not None]  # not summed in every backward
        self._ready_hooks = (
            [p.register_post_accumulate_grad_hook(self._accumulated) for p in passing] if ready else []
        )

    # ------------------------------------------------------------------ backward
    def _keep(self, p: nn.Parameter, grad: Tensor) -> Optional[Tensor]:
        when = self._when.get(p)
        if when is not None and not when():
            return None
        if not accumulates_grad(self._accumulators[p]):  # torch.autograd.grad: the sum is its answer
            return all_reduce_sum(grad.clone(), self.group)
        task = graph_task_id()
        if task != self._queued_for:
            queue_end_of_backward(self._sum)
            self._queued_for = task
        earlier = self._fresh.get(p)
        self._fresh[p] = grad if earlier is None else earlier + grad
        return grad.new_zeros(()).expand_as(grad)

    def _accumulated(self, p: nn.Parameter) -> None:
        if p not in self._fresh and self.ready is not None:
            self.ready(p)

    def _sum(self) -> None:
        """At the end of a backward: the fresh gradients summed over the group, into ``.grad``."""
        self._queued_for = None
        fresh, self._fresh = self._fresh, {}
        order = [p for p in self._when if p in fresh]  # the same on every rank
        kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = defaultdict(list)
        for p in order:
            kinds[(fresh[p].dtype, fresh[p].device)].append(p)
        for same in kinds.values():
            sent = [placed(fresh[p], self._blocks[p]) if p in self._blocks else fresh[p] for p in same]
            flat = all_reduce_sum(torch.cat([t.reshape(-1) for t in sent]), self.group)
            for p, t, total in zip(same, sent, flat.split([t.numel() for t in sent])):
                total = total.view(t.shape)
                if p in self._blocks:
                    total = taken_back(fresh[p], total, self._blocks[p])
                if p.grad is None:
                    p.grad = total.view(p.shape).clone()
                else:
                    p.grad.add_(total.view(p.grad.shape))
        if self.ready is not None:
            for p in order:
                self.ready(p)


class _Added:
    """The parameters one ``add`` named; ``remove()`` takes them off again."""

    def __init__(self, sums: GradientSums, params: list[nn.Parameter]) -> None:
        self.sums, self.params = sums, params

    def remove(self) -> None:
        self.sums.discard(self.params)


def _either(a: Callable[[], bool], b: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: a() or b()


def gradient_sums_for(module: nn.Module, group: Optional[dist.ProcessGroup]) -> Optional[GradientSums]:
    """The gradient sums of ``module`` over ``group``, made at the first call; None where the group has one
    process (nothing to sum)."""
    if group_size(group) == 1:
        return None
    sums = _INSTALLED.get(module)
    if sums is None:
        sums = _INSTALLED[module] = GradientSums(group)
    return sums


def installed_gradient_sums(module: nn.Module) -> Optional[GradientSums]:
    """The gradient sums installed on ``module`` (``gradient_sums_for``), or None."""
    return _INSTALLED.get(module)


def remove_gradient_sums(module: nn.Module) -> None:
    """Forget the gradient sums of ``module`` (its hooks removed): the module is whole again."""
    sums = _INSTALLED.pop(module, None)
    if sums is not None:
        sums.report_to(None)
        sums.discard(list(sums.params))
