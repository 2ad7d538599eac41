"""A model and a callback for running Lightning's own callbacks under every strategy (plain user code).

``CallbackGPT`` is the package's small GPT written the way Lightning's callbacks ask: a ``backbone`` (its first
block) for ``BackboneFinetuning``, an optimizer over the parameters that require grad when it is built, and
a learning rate that halves every epoch (a scheduler for ``LearningRateMonitor`` and
``StochasticWeightAveraging`` to read or replace); ``AsyncCallbackGPT`` is it trained on one process by the
async pipeline's rule at the pipeline's timing (``pp_models.AsyncSteps``). ``RankZeroSample`` is what users
write to look at the model during training: a forward on rank 0 alone at each epoch's end; ``GatheredSample`` is
it inside ``strategy.parameters_gathered()``, entered on every rank, as written for ``zero_stage=3``.
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.pp_models import AsyncSteps
from tests.helpers.tp_models import SmallGPT, TokenData

__all__ = [
    "AsyncCallbackGPT",
    "CallbackGPT",
    "ValidatedTokens",
    "RankZeroSample",
    "GatheredSample",
    "accumulate_from_epoch_1",
    "samples",
    "callback_report",
]


class CallbackGPT(SmallGPT):
    @property
    def backbone(self) -> nn.Module:
        return self.model.blocks[0]

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
        }


class AsyncCallbackGPT(AsyncSteps, CallbackGPT):
    """``CallbackGPT`` trained by the async pipeline's rule on one process, to compare the async pipeline with."""


class ValidatedTokens(TokenData):
    """``TokenData`` with a validation loader (its windows in order), for ``EarlyStopping`` to monitor."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class RankZeroSample(Callback):
    """Greedy next tokens for a fixed prompt, at each epoch's end, on rank 0 only."""

    def __init__(self) -> None:
        self.samples: list[list[int]] = []

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        prompt = torch.arange(8).remainder(pl_module.hparams.vocab_size).unsqueeze(0)
        with torch.no_grad():
            self.samples.append(pl_module(prompt).argmax(-1).squeeze(0).tolist())


def accumulate_from_epoch_1() -> GradientAccumulationScheduler:
    """Lightning's scheduler with integer epochs (a case's JSON keys are strings): 2 batches per step from
    epoch 1."""
    return GradientAccumulationScheduler(scheduling={1: 2})


def samples(trainer) -> list:
    """Probe: what ``RankZeroSample`` produced on this rank."""
    return [c.samples for c in trainer.callbacks if isinstance(c, RankZeroSample)]


def callback_report(trainer) -> dict:
    """Probe: what the callbacks saw and did on this rank, and the model's single-device state dict (gathered
    without the optimizer's: a collective, every rank runs it)."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    return {
        "full_state": {
            k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()
        },
        "samples": samples(trainer),
        "lrs": [c.lrs for c in trainer.callbacks if isinstance(c, LearningRateMonitor)],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "param_groups": [len(o.param_groups) for o in trainer.optimizers],
    }


class GatheredSample(RankZeroSample):
    """``RankZeroSample`` as a user writes it under ``zero_stage=3``: every rank enters the strategy's
    ``parameters_gathered()`` (a collective), and inside it rank 0 alone runs the model. On a strategy
    without it (one device) the sample runs as it is."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        gathered = getattr(trainer.strategy, "parameters_gathered", contextlib.nullcontext)
        with gathered():
            super().on_train_epoch_end(trainer, pl_module)
