"""LightningCLI on your own module, with the strategy named in a YAML config by ``class_path``.

    python examples/lightning_cli/own_module.py fit --config examples/lightning_cli/config.yaml

This script never imports lightning_parallel: a ``class_path`` (like Hydra's ``_target_``) imports the
class itself, whereas a strategy *name* (``--trainer.strategy lp_ddp``) exists only once the package is
imported (``main.py`` does that).
"""

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero:
            loss = float(self.trainer.callback_metrics["train_loss"])
            print(
                f"world size {self.trainer.world_size}, {type(self.trainer.strategy).__name__}, loss {loss:.4f}"
            )


class RegressionData(LightningDataModule):
    def __init__(self, n: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 8, generator=g)
        self.data = TensorDataset(x, x @ torch.randn(8, 1, generator=g))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


if __name__ == "__main__":
    LightningCLI(Regressor, RegressionData)
