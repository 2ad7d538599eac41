"""An ordinary Lightning script; the only lightning_parallel changes are the import and ``strategy=``.

python examples/drop_in/train.py                      # lp_ddp on 2 CPU processes
python examples/drop_in/train.py --strategy lp_dp
python examples/drop_in/train.py --strategy ddp       # Lightning's own, for comparison
"""

import argparse

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_parallel  # noqa: F401  <- change 1 of 2: registers "lp_ddp", "lp_dp", ...


class Classifier(LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(-1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Blobs(LightningDataModule):
    """Four Gaussian blobs in 20 dimensions."""

    def __init__(self, n: int = 2048, batch_size: int = 32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        centers = 2 * torch.randn(4, 20, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        x = centers[y] + torch.randn(n, 20, generator=g)
        self.train_set, self.val_set = TensorDataset(x[:1792], y[:1792]), TensorDataset(x[1792:], y[1792:])
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="lp_ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=2)
    args = parser.parse_args()
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,  # <- change 2 of 2 (was "ddp"); lightning_parallel.DDPStrategy(...) works too
        max_epochs=args.max_epochs,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    model = Classifier()
    trainer.fit(model, datamodule=Blobs())
    if trainer.is_global_zero:
        print(f"world size {trainer.world_size}, val_acc {float(trainer.callback_metrics['val_acc']):.3f}")
