"""Synchronised BatchNorm that also works on CPU (gloo), where ``torch.nn.SyncBatchNorm`` refuses to run.

In training mode, as torch's SyncBatchNorm does, each rank's per-channel count, mean and sum of squared
deviations (in float32, or the input's dtype when wider) are gathered over the data-parallel group and
combined without cancellation, so normalisation uses the statistics of the global batch; in backward
the two per-channel sums of the input's gradient are all-reduced: the same result as BatchNorm on one
device with the whole batch. Counts stay tensors (no host sync). On CUDA, torch's own fused
implementation is used. The gathering is a collective inside the user's forward, so it runs only in the
forwards every rank joins (the strategy's training step and backward, while autograd records:
``every_rank.every_rank_forward``); a forward in training mode elsewhere (a hook or callback on rank 0
alone) normalizes with its own input's statistics, as a BatchNorm on one device does with that input.

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
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel.compat import is_fake
from lightning_parallel.every_rank import every_rank_forward

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
        if self.training and not every_rank_forward():  # a forward some ranks may run alone (every_rank.py)
            return self._local(input)
        if input.device.type != "cpu":
            return super().forward(input)
        syncing = self.training and dist.is_available() and dist.is_initialized()
        if not syncing or dist.get_world_size(self.process_group) == 1:
            return self._local(input)
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        out, mean, var, count = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, group)
        if self.track_running_stats:
            self._update_running_stats(mean, var, count)
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

    def _update_running_stats(self, mean: Tensor, var: Tensor, count: Tensor) -> None:
        """Blend in the batch's ``mean`` and biased ``var`` over ``count`` values per channel (the group's,
        a tensor: no host sync)."""
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        with torch.no_grad():
            unbiased = var * (count / (count - 1).clamp(min=1))
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

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


def _statistics_dtype(input: Tensor) -> torch.dtype:
    """float32 for half-precision inputs (E[x^2] - mean^2 cancels in bf16, a sum of squares overflows
    fp16), the input's own dtype when wider."""
    return torch.promote_types(input.dtype, torch.float32)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over the group's batch, as torch's SyncBatchNorm computes it: each rank's
    count, mean and sum of squared deviations (float32 or wider) gathered and combined without
    cancellation; in backward, the two per-channel sums of the input gradient all-reduced. Returns the
    output (the input's dtype) and the group's mean, biased variance and count (no gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        eps: float,
        group: dist.ProcessGroup,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dtype = _statistics_dtype(input)
        x = input.to(dtype)
        c, dims = input.shape[1], [0] + list(range(2, input.dim()))
        shape = [1, c] + [1] * (input.dim() - 2)
        local_count = input.numel() // c
        if local_count:
            local_var, local_mean = torch.var_mean(x, dims, correction=0)
        else:  # an empty part weighs nothing in the combination
            local_var = local_mean = x.new_zeros(c)
        count_row = torch.full((1,), local_count, dtype=dtype, device=input.device)
        local = torch.cat([count_row, local_mean, local_var * local_count])
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, local, group=group)
        table = torch.stack(rows)
        counts, means, deviations = table[:, :1], table[:, 1 : c + 1], table[:, c + 1 :]
        count = counts.sum()
        mean = (counts * means).sum(0) / count
        var = (deviations + counts * (means - mean) ** 2).sum(0) / count
        invstd = torch.rsqrt(var + eps)
        out = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(dtype).view(shape)
        if bias is not None:
            out = out + bias.to(dtype).view(shape)
        ctx.save_for_backward(input, weight, mean, invstd, count)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, var, count)
        return out.to(input.dtype), mean, var, count

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        input, weight, mean, invstd, count = ctx.saved_tensors
        dtype = mean.dtype
        c, dims = input.shape[1], [0] + list(range(2, input.dim()))
        shape = [1, c] + [1] * (input.dim() - 2)
        dy = grad_out.to(dtype)
        xmu = input.to(dtype) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, group=ctx.group)
            mean_dy, mean_dy_xmu = (sums / count).split(c)
            scale = invstd if weight is None else invstd * weight.to(dtype)
            correction = xmu * (invstd * invstd * mean_dy_xmu).view(shape)
            grad_input = ((dy - mean_dy.view(shape) - correction) * scale.view(shape)).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None


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
