"""A user's plain module and data for resume tests: dropout (RNG), momentum (optimizer state), a
step LR schedule, and shuffled data (sampler epoch). Nothing here knows about lightning_parallel."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["ShuffledData", "DropoutMLP"]


class ShuffledData(LightningDataModule):
    def __init__(self, batch_size: int = 4, n: int = 48, dim: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        x = torch.randn(n, dim, generator=g, dtype=torch.float64)
        self.dataset = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class DropoutMLP(LightningModule):
    def __init__(self, dim: int = 8, hidden: int = 16, dropout: float = 0.2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.7), "interval": "step"},
        }
