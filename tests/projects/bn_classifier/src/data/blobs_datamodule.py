"""Gaussian blobs, one per class, made in memory (no download); the global batch is split over the
data-parallel replicas."""

from typing import Optional

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset


def data_parallel_replicas(trainer) -> int:
    """How many replicas share the global batch: the distributed sampler's count (not the process count,
    which also counts the tensor-parallel peers and the pipeline stages of one replica)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


class BlobsDataModule(LightningDataModule):
    def __init__(
        self,
        n_train: int = 128,
        n_val: int = 64,
        n_test: int = 64,
        n_features: int = 16,
        n_classes: int = 4,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train: Optional[TensorDataset] = None
        self.batch_size_per_device = batch_size

    def setup(self, stage: Optional[str] = None) -> None:
        if self.trainer is not None:
            replicas = data_parallel_replicas(self.trainer)
            if self.hparams.batch_size % replicas != 0:
                raise RuntimeError(
                    f"batch size ({self.hparams.batch_size}) is not divisible by the {replicas} data-parallel replicas"
                )
            self.batch_size_per_device = self.hparams.batch_size // replicas
        if self.data_train is None:
            hp = self.hparams
            g = torch.Generator().manual_seed(hp.seed)
            centers = 2.0 * torch.randn(hp.n_classes, hp.n_features, generator=g)
            n = hp.n_train + hp.n_val + hp.n_test
            y = torch.randint(0, hp.n_classes, (n,), generator=g)
            x = centers[y] + torch.randn(n, hp.n_features, generator=g)
            a, b = hp.n_train, hp.n_train + hp.n_val
            self.data_train = TensorDataset(x[:a], y[:a])
            self.data_val = TensorDataset(x[a:b], y[a:b])
            self.data_test = TensorDataset(x[b:], y[b:])

    def train_dataloader(self):
        return DataLoader(self.data_train, batch_size=self.batch_size_per_device, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data_val, batch_size=self.batch_size_per_device)

    def test_dataloader(self):
        return DataLoader(self.data_test, batch_size=self.batch_size_per_device)
