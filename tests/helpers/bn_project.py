"""A project written the way the Lightning + Hydra templates write one: a dense network with BatchNorm
between its Linear layers, built outside the LightningModule, passed into it and saved in its
hyperparameters; torchmetrics; train/val/test/predict loaders. Plain user code: nothing here knows
about lightning_parallel. The probes look inside a run for the tests."""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "DenseNet",
    "Classifier",
    "ManualClassifier",
    "ClassificationData",
    "bn_classifier",
    "validation_record",
    "evaluate_after_fit",
]

IN_DIM, HIDDEN, CLASSES = 16, 32, 4


class DenseNet(nn.Module):
    def __init__(self, in_dim: int = IN_DIM, hidden: int = HIDDEN, n_classes: int = CLASSES) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Classifier(LightningModule):
    def __init__(self, net: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_losses: list[float] = []  # this rank's, every validation batch (the probe reads them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.val_losses.append(float(loss))
        self.val_acc(logits, y)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ManualClassifier(Classifier):
    def __init__(self, net: nn.Module, lr: float = 0.1) -> None:
        super().__init__(net, lr)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def bn_classifier(lr: float = 0.1, manual: bool = False) -> Classifier:
    """The template's composition: the network is built first and handed to the LightningModule."""
    return (ManualClassifier if manual else Classifier)(DenseNet(), lr=lr)


class ClassificationData(LightningDataModule):
    """A fixed random 4-class problem, the same on every process; 128 training and 64 held-out samples."""

    def __init__(self, batch_size: int = 8, seed: int = 1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(192, IN_DIM, generator=g, dtype=torch.float64) * 2 + 0.5
        y = (x @ torch.randn(IN_DIM, CLASSES, generator=g, dtype=torch.float64)).argmax(-1)
        self.train_set, self.held_out = TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out, batch_size=self.batch_size)

    test_dataloader = predict_dataloader = val_dataloader


# ----------------------------------------------------------------- probes (worker: "probe")
def validation_record(trainer: Any) -> dict:
    """This rank's validation losses during fit, and its BatchNorm buffers after fit."""
    module = trainer.lightning_module
    return {
        "val_losses": list(module.val_losses),
        "buffers": {k: v.clone() for k, v in module.named_buffers()},
    }


def evaluate_after_fit(trainer: Any) -> dict:
    """After ``fit``: what the checkpoints hold, then ``test`` (of the model as fit left it, and of the
    best checkpoint), ``validate`` and ``predict`` in the same trainer; and each checkpoint's model
    evaluated on one process, which the strategy's tests must equal."""
    module, data = trainer.lightning_module, trainer.datamodule
    callback = trainer.checkpoint_callback
    best = torch.load(callback.best_model_path, map_location="cpu", weights_only=False)
    last = torch.load(callback.last_model_path, map_location="cpu", weights_only=False)
    pickled = best["hyper_parameters"]["net"]
    return {
        "layers_after_fit": [type(m).__name__ for m in module.modules() if isinstance(m, _BatchNorm)],
        "layers_in_checkpoint": [
            f"{type(m).__module__}.{type(m).__name__}" for m in pickled.modules() if isinstance(m, _BatchNorm)
        ],
        "test": trainer.test(module, datamodule=data, verbose=False),
        # the hyperparameters hold an nn.Module: Lightning's documented weights_only=False
        "test_best": trainer.test(
            module, datamodule=data, ckpt_path=callback.best_model_path, verbose=False, weights_only=False
        ),
        "validate": trainer.validate(module, datamodule=data, verbose=False),
        "predict": trainer.predict(module, datamodule=data),
        "one_process": {"test": _evaluate(last, data), "test_best": _evaluate(best, data)},
        "last_state_dict": last["state_dict"],  # full, whatever the strategy holds per rank
    }


def _evaluate(checkpoint: dict, data: ClassificationData) -> dict:
    """The checkpoint's model on one process, in eval mode, on the whole held-out set."""
    model = bn_classifier().double()
    model.load_state_dict(checkpoint["state_dict"])
    x, y = data.held_out.tensors
    with torch.no_grad():
        logits = model.eval()(x)
    return {
        "test/loss": float(nn.functional.cross_entropy(logits, y)),
        "test/acc": float((logits.argmax(-1) == y).double().mean()),
    }
