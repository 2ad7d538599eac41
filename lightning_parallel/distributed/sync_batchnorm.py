"""Synchronised BatchNorm that also works on CPU (gloo), where ``torch.nn.SyncBatchNorm`` refuses to run.

In training mode the per-channel count, sum and sum of squares are all-reduced over the data-parallel
group with a differentiable all-reduce, so normalisation uses the statistics of the global batch and
gradients flow back through them to every rank: the same result as BatchNorm on one device with the
whole batch. On CUDA, torch's own fused implementation is used.

Conversion is in place: each ``BatchNorm*d`` object changes class and keeps its identity, tensors,
hooks and attributes, so whatever holds it (a pipeline stage's hooks, the module pickled into a
LightningModule's hyperparameters) still holds the layer that runs. ``revert_sync_batchnorm`` gives the
objects their own class back. A process group belongs to the processes of one run, so a pickled
converted layer is the BatchNorm it was converted from (``Trainer(sync_batchnorm=True)`` converts it
again in the next run); a deep copy shares the group and keeps synchronising.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel.compat import is_fake

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm", "SyncBatchNormPlugin"]


class SyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` with a CPU path.

    Running statistics are updated once per forward, from the group's mean and unbiased variance
    (``_update_running_stats``), as one device's BatchNorm does from the whole batch.
    """

    #: the class a converted layer had (None: built as a SyncBatchNorm); pickles as that class
    _converted_from: Optional[type] = None

    def forward(self, input: Tensor) -> Tensor:
        if is_fake(input):  # plan="auto" reading the step's data flow: no values to share, shapes as local
            return self._local(input)
        if input.device.type != "cpu":
            return super().forward(input)
        syncing = self.training and dist.is_available() and dist.is_initialized()
        if not syncing or dist.get_world_size(self.process_group) == 1:
            return self._local(input)
        self._check_input_dim(input)
        dims = [0] + list(range(2, input.dim()))
        count = torch.full((1,), input.numel() // input.shape[1], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        stats = differentiable_all_reduce(stats, group=self.process_group or dist.group.WORLD)
        c = input.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(n))
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _local(self, input: Tensor) -> Tensor:
        """Plain BatchNorm (eval mode, or a single process)."""
        momentum = self.momentum or 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        return F.batch_norm(
            input,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            use_batch_stats,
            momentum,
            self.eps,
        )

    def _update_running_stats(self, mean: Tensor, var: Tensor, n: float) -> None:
        """Blend in the batch's ``mean`` and biased ``var`` over ``n`` values per channel (the group's)."""
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        with torch.no_grad():
            self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(var * n / max(n - 1, 1), alpha=momentum)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickled without the process group: as the converted class, or with the default group."""
        state = self.__getstate__()
        state.pop("process_group", None)
        cls = state.pop("_converted_from", None) or type(self)
        if issubclass(cls, nn.SyncBatchNorm):
            state["process_group"] = None
        return object.__new__, (cls,), state

    def __deepcopy__(self, memo: dict) -> "SyncBatchNorm":
        """A copy that synchronises over the same group (a group cannot be copied)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        state = self.__getstate__()
        clone.__setstate__(
            {k: v if k == "process_group" else copy.deepcopy(v, memo) for k, v in state.items()}
        )
        return clone


def convert_sync_batchnorm(module: nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Make every ``BatchNorm*d`` in ``module`` a :class:`SyncBatchNorm` over ``process_group``, in place
    (same objects); a layer converted before synchronises over ``process_group`` from now on."""
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, SyncBatchNorm):
            layer._converted_from = type(layer)
            layer.__class__ = SyncBatchNorm
        if isinstance(layer, SyncBatchNorm):
            layer.process_group = process_group
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Give the layers ``convert_sync_batchnorm`` converted their own class back, in place."""
    for layer in module.modules():
        cls = layer.__dict__.get("_converted_from")
        if isinstance(layer, SyncBatchNorm) and cls is not None:
            del layer._converted_from
            layer.__class__ = cls
            if issubclass(cls, nn.SyncBatchNorm):
                layer.process_group = None
            else:
                del layer.process_group
    return module


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """What ``Trainer(sync_batchnorm=True)`` becomes under our strategies: sync over the dp group,
    converting and reverting in place."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model, self.process_group)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
