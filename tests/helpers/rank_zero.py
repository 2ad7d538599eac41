"""A callback that runs the model on rank 0 alone between training steps, as a user's sample or probe does."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

__all__ = ["RankZeroForward"]


class RankZeroForward(Callback):
    """After every training batch, under ``if trainer.global_rank == 0``: the LightningModule's forward on a
    fixed input of ``shape`` (gradients on, the module in training mode, as the hook finds it)."""

    def __init__(self, shape: tuple[int, ...] = (4, 16)) -> None:
        self.shape = tuple(shape)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            n = torch.Size(self.shape).numel()
            x = torch.linspace(-2.0, 3.0, n, dtype=pl_module.dtype, device=pl_module.device).view(self.shape)
            pl_module(x.sin() * torch.arange(n, device=x.device).view(self.shape).remainder(5))
