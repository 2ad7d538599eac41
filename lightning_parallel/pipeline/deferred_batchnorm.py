"""BatchNorm running statistics updated once per mini-batch, over the whole mini-batch, in a pipeline.

A pipeline stage runs each BatchNorm once per micro-batch. Left alone, each call would update the
running statistics with that micro-batch's: ``num_microbatches`` updates per step, each over a part of
the batch. One device makes one update per batch, over the whole batch. As torchgpipe's deferred batch
norm does, each call's statistics are recorded and, when the stage has run all of a mini-batch's
forwards, one update is made from them combined, with the layer's momentum (or the cumulative average
for ``momentum=None``) and the unbiased variance of the whole batch, as ``_BatchNorm`` does.

The layer computes a call's statistics itself, at no extra cost: during the call its buffers are
zeroed scratch tensors and its momentum is 1, so its own update leaves in them exactly the mean and
unbiased variance it normalised with (a ``SyncBatchNorm``'s: over its group). The count is the
input's, summed over the group for a ``SyncBatchNorm``. The layers stay the user's objects with
their own ``forward``; the hooks live for one mini-batch, so ``state_dict`` names and pickling are
untouched, and autograd only ever saves the scratch tensors. In training mode a layer still
normalises each micro-batch with that micro-batch's statistics (the outputs and gradients differ
from one device's unless ``num_microbatches=1``); ``batchnorm_warning`` says so. Evaluation is
untouched.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from lightning_parallel.recompute_state import is_recomputing

__all__ = ["DeferredBatchNorm", "batchnorm_warning"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

Count = Union[float, Tensor]
Record = tuple[Count, Tensor, Tensor]  # one call: count per channel, mean, unbiased variance


def batchnorm_warning(module: nn.Module, num_microbatches: int, shown: int = 10) -> Optional[str]:
    """What to tell the user about ``module``'s BatchNorm layers under ``num_microbatches`` (None: exact)."""
    names = [n for n, m in module.named_modules() if isinstance(m, _BatchNorm)]
    if num_microbatches == 1 or not names:
        return None
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    return (
        f"BatchNorm layers {listed} normalise each of the {num_microbatches} micro-batches with that "
        "micro-batch's statistics in training mode, so the model's outputs and gradients differ from one "
        "device's on the whole batch. Their running statistics are still updated once per batch, over the "
        "whole batch, as on one device. Exact training needs num_microbatches=1, or a normalisation "
        "without batch statistics (nn.LayerNorm, nn.GroupNorm)."
    )


def _combine(records: Sequence[Record]) -> tuple[Tensor, Tensor]:
    """The mean and unbiased variance of the union of the records' samples (Chan et al.: sums of squared
    deviations, no cancellation)."""
    count = sum(n for n, _, _ in records)
    mean = sum(n * m for n, m, _ in records) / count
    deviations = sum(v * (n - 1) + n * (m - mean) ** 2 for n, m, v in records)
    return mean, deviations / max(count - 1, 1)


def _statistics_group(layer: _BatchNorm) -> Optional[dist.ProcessGroup]:
    """The group a SyncBatchNorm reduces its training statistics over (None: the layer does not sync),
    by torch's own rule: its ``process_group``, or the whole world."""
    if not isinstance(layer, nn.SyncBatchNorm) or not (dist.is_available() and dist.is_initialized()):
        return None
    group = layer.process_group or dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _tracked(module: nn.Module) -> list[_BatchNorm]:
    """The layers whose running statistics live on this stage (other stages' are meta, unregistered)."""
    return [
        m
        for m in module.modules()
        if isinstance(m, _BatchNorm)
        and m.track_running_stats
        and isinstance(m._buffers.get("running_mean"), Tensor)
        and m.running_mean.device.type != "meta"
    ]


class DeferredBatchNorm:
    """Defers the running-statistics updates of ``module``'s BatchNorm layers to the end of each
    mini-batch (``with deferred.mini_batch(num_microbatches): <the stage's forwards>``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._records: dict[_BatchNorm, list[Record]] = {}
        self._own: dict[_BatchNorm, tuple[dict, Optional[float]]] = {}  # set aside during a call
        self._repeating: Callable[[], bool] = lambda: False

    @contextmanager
    def mini_batch(
        self, num_microbatches: int, repeating: Callable[[], bool] = lambda: False
    ) -> Iterator[None]:
        """Within the block, each training-mode call of a layer records its statistics and leaves the
        running statistics as they were; on leaving it without an error, one update per layer (per call
        site, for a layer called k times per micro-batch). A call made while ``repeating()`` records
        nothing: it repeats one already recorded (a later chunk's forward running the modules before
        the stack again, ``StagePartition.running``)."""
        self._repeating = repeating
        layers = _tracked(self.module)
        handles: list[RemovableHandle] = []
        for layer in layers:
            # after the layer's other pre-hooks (a LazyBatchNorm materialises its buffers in one)
            handles.append(layer.register_forward_pre_hook(self._before))
            # first of the forward hooks: a stage boundary's hook raises after this layer's output
            handles.append(layer.register_forward_hook(self._after, prepend=True))
        self._records = {layer: [] for layer in layers}
        try:
            yield
            self._commit(num_microbatches)
        finally:
            for handle in handles:
                handle.remove()
            for layer in list(self._own):
                self._restore(layer)
            self._records = {}

    def _before(self, layer: _BatchNorm, args: tuple) -> None:
        """The call updates zeroed scratch buffers with momentum 1: they end up holding its statistics.
        A recompute of the forward (activation checkpointing) or a repeat records nothing: its call was
        recorded."""
        if not layer.training or is_recomputing() or self._repeating():
            return
        own = {name: layer._buffers[name] for name in _BUFFERS}
        self._own[layer] = own, layer.momentum
        for name, tensor in own.items():
            if tensor is not None:
                layer._buffers[name] = torch.zeros_like(tensor)
        layer.momentum = 1.0

    def _after(self, layer: _BatchNorm, args: tuple, output: Tensor) -> None:
        if layer not in self._own:
            return
        mean, var = layer._buffers["running_mean"], layer._buffers["running_var"]
        self._restore(layer)
        count = output.numel() // output.shape[1]  # the output has the input's shape
        self._records[layer].append((float(count), mean, var))

    def _restore(self, layer: _BatchNorm) -> None:
        own, layer.momentum = self._own.pop(layer)
        layer._buffers.update(own)

    @torch.no_grad()
    def _commit(self, num_microbatches: int) -> None:
        """One update per layer and call site, from every micro-batch's statistics of that call."""
        self._count_over_groups()
        for layer, records in self._records.items():
            if not records:
                continue
            calls = len(records) // num_microbatches if len(records) % num_microbatches == 0 else 1
            for k in range(calls):  # records are in call order: micro-batch 0's calls, then 1's, ...
                _update(layer, *_combine(records[k::calls]))

    def _count_over_groups(self) -> None:
        """A SyncBatchNorm's statistics cover its group: so must its counts (one all-reduce per group)."""
        by_group: dict[object, list[_BatchNorm]] = {}
        for layer, records in self._records.items():
            group = _statistics_group(layer) if records else None
            if group is not None:
                by_group.setdefault(group, []).append(layer)
        for group, layers in by_group.items():
            device = layers[0].running_mean.device
            counts = torch.tensor(
                [n for layer in layers for n, _, _ in self._records[layer]],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(counts, group=group)
            summed = iter(counts.tolist())
            for layer in layers:
                self._records[layer] = [(next(summed), m, v) for _, m, v in self._records[layer]]


def _update(layer: _BatchNorm, mean: Tensor, var: Tensor) -> None:
    """``_BatchNorm``'s update of its running statistics by one batch (``var``: unbiased)."""
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        if layer.momentum is None:
            factor = 1.0 / float(layer.num_batches_tracked)
    layer.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
    layer.running_var.mul_(1 - factor).add_(var, alpha=factor)
