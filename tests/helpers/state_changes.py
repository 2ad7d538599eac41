"""User code that changes a model after the strategy set it up, or that runs modules outside the block
stack: a callback that freezes a block and unfreezes it later (what ``BackboneFinetuning`` does), a GPT
with a tensor tied across blocks, a GPT with a `backbone` for Lightning's BackboneFinetuning, a network
with BatchNorm before and after its block stack, and a param group added during fit (``HeadLaterGPT``,
``AddHeadGroup``)."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from torch import nn

from tests.helpers.models import MLP
from tests.helpers.pp_models import MicroBatchNorm
from tests.helpers.tp_models import SmallGPT


class FreezeThenUnfreeze(Callback):
    """``module`` (a submodule's name) frozen at ``freeze_at`` ("setup": before the strategy's set-up, as
    a model built frozen; "fit_start": after it, as ``BackboneFinetuning`` does) and trainable again from
    training step ``unfreeze_at`` on (the change made in ``on_train_batch_start``)."""

    def __init__(
        self, module: str = "model.blocks.0", freeze_at: str = "setup", unfreeze_at: int = 2
    ) -> None:
        self.module, self.freeze_at, self.unfreeze_at = module, freeze_at, unfreeze_at

    def _set(self, pl_module, trainable: bool) -> None:
        pl_module.get_submodule(self.module).requires_grad_(trainable)

    def setup(self, trainer, pl_module, stage) -> None:
        if self.freeze_at == "setup":
            self._set(pl_module, False)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.freeze_at == "fit_start":
            self._set(pl_module, False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.unfreeze_at:
            self._set(pl_module, True)


class TiedAcrossBlocksGPT(SmallGPT):
    """``SmallGPT`` whose block ``tied``'s first MLP weight is the first block's (one tensor in two blocks;
    by default the last block)."""

    def __init__(self, tied: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        blocks = self.model.blocks
        blocks[tied].mlp.fc.weight = blocks[0].mlp.fc.weight


class InputBatchNormNet(MLP):
    """A BatchNorm before a stack of ``depth`` blocks and one after it, then a linear head: the two
    BatchNorms are outside the block stack, run on every stage."""

    def __init__(self, depth: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        h = self.hparams
        del self.net
        self.norm_in = nn.BatchNorm1d(h.in_dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(h.in_dim, h.in_dim), nn.Tanh()) for _ in range(depth)
        )
        self.norm_out = nn.BatchNorm1d(h.in_dim)
        self.head = nn.Linear(h.in_dim, h.out_dim)

    def forward(self, x):
        x = self.norm_in(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_out(x))


class MicroBatchInputNormNet(MicroBatchNorm, InputBatchNormNet):
    """``InputBatchNormNet`` trained as a pipeline with micro-batches trains it, on one process."""


class BackboneGPT(SmallGPT):
    """``SmallGPT`` whose first half of blocks is the ``backbone`` Lightning's ``BackboneFinetuning`` freezes
    and unfreezes; the optimizer takes the parameters that train when it is made (Lightning's example)."""

    @property
    def backbone(self) -> nn.Module:
        blocks = self.model.blocks
        return blocks[: len(blocks) // 2]

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=self.hparams.lr)


class AddAdapter(Callback):
    """A LoRA-style adapter (a small Linear) added to the first block's MLP in ``on_train_start``, after
    the strategy's set-up."""

    def on_train_start(self, trainer, pl_module) -> None:
        width = pl_module.model.blocks[0].mlp.fc.in_features
        pl_module.model.blocks[0].mlp.adapter = nn.Linear(width, width, bias=False)


class HeadLaterGPT(SmallGPT):
    """``SmallGPT`` whose optimizer first takes every parameter but the output head's (trainable all along);
    ``AddHeadGroup`` gives the head a param group of its own later."""

    def configure_optimizers(self):
        head = set(self.model.head.parameters())
        return torch.optim.SGD([p for p in self.parameters() if p not in head], lr=self.hparams.lr)


class AddHeadGroup(Callback):
    """``optimizer.add_param_group`` with the model's output head at training step ``at``, as a user's
    callback (or ``BackboneFinetuning``) adds a group during fit."""

    def __init__(self, at: int = 2) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.model.head.parameters())})
