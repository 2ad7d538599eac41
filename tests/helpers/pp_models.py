"""Models for pipeline tests: plain user code."""

from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, default_collate

from tests.helpers.models import MLP
from tests.helpers.tp_models import SmallGPT, TokenData


class SequentialNet(MLP):
    """An nn.Sequential called as a whole in forward: the block stack is the Sequential itself."""

    def __init__(self, depth: int = 4, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        layers = [nn.Linear(h.in_dim, h.hidden), nn.Tanh()]
        for _ in range(depth - 2):
            layers += [nn.Linear(h.hidden, h.hidden), nn.Tanh()]
        layers.append(nn.Linear(h.hidden, h.out_dim))
        self.net = nn.Sequential(*layers)


class AsyncRule:
    """Mixin for a LightningModule: one process, plain SGD written out, W(t+1) = W(t) - lr * grad f_t(W(t-1)),
    W(-1) = W(0), with f_t the module's own ``training_step`` loss on batch t. The documented rule of the
    async pipeline schedule, to compare it with. The optimizer must be plain SGD."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.previous = None

    def training_step(self, batch, batch_idx):
        params = list(self.parameters())
        current = [p.detach().clone() for p in params]
        if self.previous is None:
            self.previous = [c.clone() for c in current]
        with torch.no_grad():
            for p, old in zip(params, self.previous):
                p.copy_(old)
        loss = super().training_step(batch, batch_idx)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            for p, now, g in zip(params, current, grads):
                p.copy_(now)
                p.grad = g
        self.optimizers().step()  # plain SGD: W(t) - lr * g
        self.previous = current
        return loss.detach()


class AsyncSteps:
    """Mixin for a LightningModule: the async rule (``AsyncRule``) at the async pipeline's own timing, on one
    process, inside Lightning's loop (automatic optimization, any optimizer, its LR schedulers, callbacks and
    step checkpoints). Each optimizer step is handed the previous batch's gradient, computed at the weights
    before the previous update (the first step gets none and changes nothing); the last batch's gradient
    is applied when training ends. So step t applies batch t-1's gradient at step t's learning rate, and a
    checkpoint at step t holds t-1 updates, as under the pipeline. With a constant learning rate it ends
    where ``AsyncRule`` ends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[nn.Parameter, Optional[torch.Tensor]] = {}

    def on_before_optimizer_step(self, optimizer) -> None:
        for p in self.parameters():  # this batch's gradient waits a step; the previous one is applied
            p.grad, self.pending[p] = self.pending.get(p), p.grad

    def on_train_end(self) -> None:
        for p in self.parameters():
            p.grad = self.pending.pop(p, None)
        for optimizer in self.trainer.optimizers:
            optimizer.step()
            optimizer.zero_grad()


class AsyncRuleEmulation(AsyncRule, SequentialNet):
    """``SequentialNet`` trained by the async rule on one process."""


class FlatSequentialNet(SequentialNet):
    """``SequentialNet`` whose parameters become views into one flat buffer when training starts (as
    apex or DeepSpeed flatten them): each at its own offset, one storage for them all. On a pipeline
    stage that is the stage's own parameters."""

    def on_train_start(self) -> None:
        params = [p for p in self.parameters() if p.device.type != "meta"]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class AsyncRuleFlatEmulation(AsyncRule, FlatSequentialNet):
    """``FlatSequentialNet`` trained by the async rule on one process."""


class _Lift(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.tanh(h)  # the pair travels through the blocks (and between stages)


class _PairBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, pair):
        x, aux = pair
        return torch.tanh(self.lin(x)) + 0.1 * aux, 0.9 * aux


class _Drop(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


class TupleNet(MLP):
    """Blocks of an nn.Sequential that pass a tuple (x, aux) to each other: tuples cross stages."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        self.net = nn.Sequential(
            _Lift(h.in_dim, h.hidden),
            *[_PairBlock(h.hidden) for _ in range(4)],
            _Drop(),
            nn.Linear(h.hidden, h.out_dim),
        )


class _Repeat(nn.Module):
    """One linear layer applied ``times`` times: the same parameters, ``times`` the work."""

    def __init__(self, d: int, times: int) -> None:
        super().__init__()
        self.lin, self.times = nn.Linear(d, d), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.lin(x))
        return x


class UnevenTimeNet(MLP):
    """Blocks 1-3 have equal parameter counts, but block 3 does 20 times the work. Balanced by
    parameters the stages are blocks [0, 1] | [2, 3, 4]; by time, [0, 1, 2] | [3, 4]."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        self.net = nn.Sequential(
            nn.Linear(h.in_dim, h.hidden),
            _Repeat(h.hidden, 1),
            _Repeat(h.hidden, 1),
            _Repeat(h.hidden, 20),
            nn.Linear(h.hidden, h.out_dim),
        )


class MetricNet(SequentialNet):
    """Logs torchmetrics objects (not numbers) from training_step and validation_step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import torchmetrics

        self.train_mse = torchmetrics.MeanSquaredError()
        self.train_worst = torchmetrics.MaxMetric()  # not an average of micro-batch values
        self.val_mae = torchmetrics.MeanAbsoluteError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.train_mse(out, y)
        self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
        self.train_worst((out - y).abs())
        self.log("train_worst", self.train_worst, on_step=True, on_epoch=False)
        return nn.functional.mse_loss(out, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mae(self(x), y)
        self.log("val_mae", self.val_mae)


class TokenDataWithValidation(TokenData):
    """``TokenData`` whose validation set is its first 32 windows, in order."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Subset(self.dataset, range(32)), batch_size=self.batch_size)


class VariableLengthTokens(TokenData):
    """Token windows cut, batch by batch, to a length read from the batch itself (``block_size`` - 3 to
    ``block_size`` tokens), so the activations crossing the stages change shape between steps. The same
    batch gets the same cut in every run; ``lengths`` keeps the cuts made."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lengths: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=self._cut
        )

    def _cut(self, samples: list) -> tuple:
        x, y = default_collate(samples)
        length = x.shape[1] - int(x[0, 0]) % 4
        self.lengths.append(length)
        return x[:, :length], y[:, :length]


class BatchNormStack(MLP):
    """A dense network with ``BatchNorm1d`` between its Linears, one ``nn.Sequential`` the partitioner
    cuts; ``bn_history`` holds its BatchNorm buffers (this stage's) after every training batch."""

    def __init__(self, bn_momentum: Optional[float] = 0.1, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        self.net = nn.Sequential(
            nn.Linear(h.in_dim, h.hidden),
            nn.BatchNorm1d(h.hidden, momentum=bn_momentum),
            nn.Tanh(),
            nn.Linear(h.hidden, h.hidden),
            nn.BatchNorm1d(h.hidden, momentum=bn_momentum),
            nn.Tanh(),
            nn.Linear(h.hidden, h.out_dim),
        )
        self.bn_history: list[dict] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.bn_history.append({k: v.detach().clone() for k, v in self.named_buffers()})


class MicroBatchNorm:
    """Mixin for a LightningModule with BatchNorm and a batch ``(x, y)``: one process, written with torch
    alone, what a pipeline with ``num_microbatches`` does. The loss is the size-weighted sum of the
    micro-batches' losses, each micro-batch normalised with its own statistics (no running update), and
    then each layer is called once on its inputs of all micro-batches together, which updates its
    running statistics once per batch, over the whole batch."""

    def __init__(self, *args, num_microbatches: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_microbatches = num_microbatches

    def training_step(self, batch, batch_idx):
        layers = [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        inputs = {layer: [] for layer in layers}
        hooks = [
            layer.register_forward_pre_hook(lambda m, args: inputs[m].append(args[0].detach()))
            for layer in layers
        ]
        for layer in layers:
            layer.track_running_stats = False  # training mode: batch statistics, running ones untouched
        try:
            parts = list(zip(*(torch.tensor_split(t, self.num_microbatches) for t in batch)))
            size = len(batch[0])
            loss = 0.0
            for part in parts:
                loss = loss + len(part[0]) / size * super().training_step(part, batch_idx)
        finally:
            for hook in hooks:
                hook.remove()
            for layer in layers:
                layer.track_running_stats = True
        with torch.no_grad():
            for layer in layers:
                layer(torch.cat(inputs[layer]))
        return loss


class MicroBatchNormStack(MicroBatchNorm, BatchNormStack):
    """``BatchNormStack`` trained as a pipeline with micro-batches trains it, on one process."""


class AsyncMicroBatchNormStack(AsyncRule, MicroBatchNorm, BatchNormStack):
    """``BatchNormStack`` trained as the async pipeline with micro-batches trains it, on one process."""


class AsyncRuleGPT(AsyncRule, SmallGPT):
    """``SmallGPT`` (plain SGD) trained by the async rule on one process."""
