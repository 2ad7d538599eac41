"""A user's own LightningModule and DataModule; nothing here knows about lightning_parallel or Hydra."""

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SineRegressor(LightningModule):
    def __init__(self, width: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(1, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class SineData(LightningDataModule):
    def __init__(self, n: int = 2048, batch_size: int = 64) -> None:
        super().__init__()
        x = torch.linspace(-3, 3, n).unsqueeze(1)
        y = torch.sin(2 * x)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        cut = n * 7 // 8
        self.train_set = TensorDataset(x[perm[:cut]], y[perm[:cut]])
        self.val_set = TensorDataset(x[perm[cut:]], y[perm[cut:]])
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
