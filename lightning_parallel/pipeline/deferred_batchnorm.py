"""BatchNorm running statistics updated once per mini-batch, over the whole mini-batch, in a pipeline.

A pipeline stage runs each BatchNorm once per micro-batch. Left alone, each call would update the
running statistics with that micro-batch's: ``num_microbatches`` updates per step, each over a part of
the batch. One device makes one update per batch, over the whole batch. As torchgpipe's deferred batch
norm does, each micro-batch's per-channel count, mean and sum of squared deviations are recorded here
(the layer's own update goes to scratch tensors), and when the stage has run all of a mini-batch's
forwards one update is made from the combined statistics, with the layer's momentum (or cumulative
average for ``momentum=None``) and the unbiased variance of the whole batch, as ``_BatchNorm`` does.
A ``SyncBatchNorm`` that synchronises over a group gets the statistics of every rank of it.

The layers stay the user's objects with their own ``forward``: hooks are installed for one mini-batch
and removed after it, so ``state_dict`` names and pickling are untouched. In training mode a layer
still normalises each micro-batch with that micro-batch's statistics (the model's outputs and
gradients differ from one device's unless ``num_microbatches=1``); ``batchnorm_warning`` says so.
Evaluation (running statistics) is untouched.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

__all__ = ["DeferredBatchNorm", "batchnorm_warning"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

Stats = tuple[Tensor, Tensor, Tensor]  # per channel: count, mean, sum of squared deviations from the mean


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


def _combine(parts: Sequence[Stats]) -> Stats:
    """The count, mean and sum of squared deviations of the union of ``parts`` (Chan et al.: no
    cancellation, unlike a sum of squares minus the squared sum)."""
    count = sum(p[0] for p in parts)
    mean = sum(p[0] * p[1] for p in parts) / count
    deviations = sum(p[2] + p[0] * (p[1] - mean) ** 2 for p in parts)
    return count, mean, deviations


def _statistics(x: Tensor, dtype: torch.dtype) -> Stats:
    """Per channel (dim 1) of one micro-batch's input: count, mean, sum of squared deviations."""
    x = x.detach().to(torch.promote_types(x.dtype, dtype))
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    count = torch.full_like(mean, x.numel() // x.shape[1])
    return count, mean, var * count


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
        self._records: dict[_BatchNorm, list[Stats]] = {}
        self._own: dict[_BatchNorm, dict[str, Optional[Tensor]]] = {}  # buffers set aside during a call

    @contextmanager
    def mini_batch(self, num_microbatches: int) -> Iterator[None]:
        """Within the block, each training-mode call of a layer records its input's statistics and leaves
        the running statistics as they were; on leaving it without an error, one update per layer (per
        call site, for a layer called k times per micro-batch)."""
        layers = _tracked(self.module)
        handles: list[RemovableHandle] = []
        for layer in layers:
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
        """The layer's own update of this call goes to scratch copies of its buffers."""
        if not layer.training:
            return
        own = {name: layer._buffers[name] for name in _BUFFERS}
        self._own[layer] = own
        for name, tensor in own.items():
            if tensor is not None:
                layer._buffers[name] = tensor.clone()

    def _after(self, layer: _BatchNorm, args: tuple, output: object) -> None:
        if layer not in self._own:
            return
        self._restore(layer)
        self._records[layer].append(_statistics(args[0], layer.running_mean.dtype))

    def _restore(self, layer: _BatchNorm) -> None:
        for name, tensor in self._own.pop(layer).items():
            layer._buffers[name] = tensor

    @torch.no_grad()
    def _commit(self, num_microbatches: int) -> None:
        """One update per layer and call site, from every micro-batch's statistics of that call."""
        updates: list[tuple[_BatchNorm, Stats]] = []
        for layer, records in self._records.items():
            if not records:
                continue
            calls = len(records) // num_microbatches if len(records) % num_microbatches == 0 else 1
            for k in range(calls):  # records are in call order: micro-batch 0's calls, then 1's, ...
                updates.append((layer, _combine(records[k::calls])))
        updates = self._over_groups(updates)
        for layer, (count, mean, deviations) in updates:
            _update(layer, mean, deviations / (count - 1).clamp(min=1))

    @staticmethod
    def _over_groups(updates: list[tuple[_BatchNorm, Stats]]) -> list[tuple[_BatchNorm, Stats]]:
        """SyncBatchNorm layers: the statistics of every rank of the layer's group, combined in rank order
        (the same result on every rank). One all-gather per group."""
        by_group: dict[object, list[int]] = {}
        for i, (layer, _) in enumerate(updates):
            group = _statistics_group(layer)
            if group is not None:
                by_group.setdefault(group, []).append(i)
        updates = list(updates)
        for group, indices in by_group.items():
            local = torch.cat([torch.cat(updates[i][1]) for i in indices])
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            offset = 0
            for i in indices:
                layer, stats = updates[i]
                width = stats[1].numel()
                parts = [
                    tuple(g[offset + j * width : offset + (j + 1) * width] for j in range(3))
                    for g in gathered
                ]
                updates[i] = (layer, _combine(parts))
                offset += 3 * width
        return updates


def _update(layer: _BatchNorm, mean: Tensor, var: Tensor) -> None:
    """``_BatchNorm``'s update of its running statistics by one batch (``var``: unbiased)."""
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        if layer.momentum is None:
            factor = 1.0 / float(layer.num_batches_tracked)
    layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    layer.running_var.mul_(1 - factor).add_(var.to(layer.running_var.dtype), alpha=factor)
