"""Small LightningModules and data for equivalence tests. Plain user code: nothing here knows about
lightning_parallel, which is the point (strategies must work on unmodified modules)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["RegressionData", "MLP", "MLPWithUnusedBranch", "BatchNormNet"]


class RegressionData(LightningDataModule):
    """A fixed random regression problem; the same on every process (seeded generator)."""

    def __init__(
        self,
        batch_size: int = 8,
        n: int = 256,
        in_dim: int = 16,
        out_dim: int = 4,
        seed: int = 1,
        dtype: str = "float64",
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, in_dim, generator=g, dtype=torch.float64)
        w = torch.randn(in_dim, out_dim, generator=g, dtype=torch.float64)
        self.dataset = TensorDataset(
            x, torch.tanh(x @ w) + 0.1 * torch.randn(n, out_dim, generator=g, dtype=torch.float64)
        )
        self.dataset = TensorDataset(*(t.to(getattr(torch, dtype)) for t in self.dataset.tensors))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


class MLP(LightningModule):
    def __init__(
        self,
        in_dim: int = 16,
        hidden: int = 32,
        out_dim: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class MLPWithUnusedBranch(MLP):
    """Has a layer that never takes part in the loss (a common source of DDP hangs)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.unused = nn.Linear(self.hparams.hidden, self.hparams.hidden)


class BatchNormNet(MLP):
    """BatchNorm between layers: its statistics depend on the batch, so replicas must agree on them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        self.net = nn.Sequential(
            nn.Linear(h.in_dim, h.hidden), nn.BatchNorm1d(h.hidden), nn.Tanh(), nn.Linear(h.hidden, h.out_dim)
        )


class FailingMLP(MLP):
    """Fails on one rank at one step: raises, or kills its own process (as the OOM killer would)."""

    def __init__(self, fail_rank: int = 1, fail_step: int = 2, mode: str = "raise", **kwargs):
        super().__init__(**kwargs)
        self.fail_rank, self.fail_step, self.mode = fail_rank, fail_step, mode

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            if self.mode == "kill":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


class ManualOptimizationMLP(MLP):
    """Manual optimization: the user calls manual_backward and step themselves."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


class CountingMLP(MLP):
    """Counts training samples with a torchmetrics SumMetric: replicas that hold the same batch (model
    parallel peers) must not be counted twice when the metric syncs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import torchmetrics

        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.seen.update(torch.tensor(float(len(batch[0]))))
        return super().training_step(batch, batch_idx)


class NaNLossMLP(MLP):
    """Returns a NaN loss at one global step, on one rank (or on every rank: ``nan_rank=None``)."""

    def __init__(self, nan_step: int = 2, nan_rank=None, **kwargs):
        super().__init__(**kwargs)
        self.nan_step, self.nan_rank = nan_step, nan_rank

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.nan_step and self.nan_rank in (None, self.global_rank):
            loss = loss * float("nan")
        return loss
