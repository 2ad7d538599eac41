"""A user's own LightningModule and DataModule, written without any knowledge of lightning_parallel.

``lp-train model._target_=tests.helpers.user_project.Regressor
data._target_=tests.helpers.user_project.RandomRegressionData`` must run them unmodified. ``fail_on_rank``
makes one rank raise mid-training (or in ``__init__`` with ``fail_at_step=-1``), to test that a failing sweep
job is reported and the sweep goes on.
"""

import os
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(LightningModule):
    def __init__(
        self, hidden: int = 16, lr: float = 0.05, fail_on_rank: Optional[int] = None, fail_at_step: int = 3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if fail_at_step < 0 and str(fail_on_rank) == os.environ.get("LOCAL_RANK", "0"):
            raise RuntimeError(f"deliberate failure in __init__ on local rank {fail_on_rank}")
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        if self.hparams.fail_on_rank == self.global_rank and self.global_step >= self.hparams.fail_at_step:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank} at step {self.global_step}")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RandomRegressionData(LightningDataModule):
    def __init__(self, n: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
        self.train_set, self.val_set = (
            TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]),
            TensorDataset(x[n * 3 // 4 :], y[n * 3 // 4 :]),
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
