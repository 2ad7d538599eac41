"""Synchronised BatchNorm that also works on CPU (gloo), where ``torch.nn.SyncBatchNorm`` refuses to run.

In training mode the per-channel count, sum and sum of squares are all-reduced over the data-parallel
group with a differentiable all-reduce, so normalisation uses the statistics of the global batch and
gradients flow back through them to every rank: the same result as BatchNorm on one device with the
whole batch. On CUDA, torch's own fused implementation is used.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.nn import functional as F

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "SyncBatchNormPlugin"]


class SyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` with a CPU path."""

    def forward(self, input: Tensor) -> Tensor:
        if input.device.type != "cpu":
            return super().forward(input)
        syncing = self.training and dist.is_available() and dist.is_initialized()
        if not syncing or dist.get_world_size(self.process_group) == 1:
            return self._local(input)
        self._check_input_dim(input)
        dims = [0] + list(range(2, input.dim()))
        count = torch.full((1,), input.numel() // input.shape[1], dtype=input.dtype)
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
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        with torch.no_grad():
            self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(var * n / max(n - 1, 1), alpha=momentum)


def convert_sync_batchnorm(module: nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``module`` by :class:`SyncBatchNorm`, keeping its tensors."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """What ``Trainer(sync_batchnorm=True)`` becomes under our strategies: sync over the dp group."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model, self.process_group)
