"""Mixture-of-experts models for the expert-parallel tests: one whose router only ever picks experts 0 and 1
(of 4): under expert parallelism at ep=2 the rank holding experts 2 and 3 receives no token, yet takes part
in every all-to-all, forward and backward; and the zoo's families with another experts kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn

from tests.helpers.zoo import ZooLM

__all__ = ["FirstExpertsMoE", "RankZeroSample", "ZooMoE"]


class FirstExpertsMoE(LightningModule):
    """Embedding -> Hugging Face Mixtral experts (4, routed to experts 0 and 1 only, weights from a
    learned router) added to the residual -> head; next-token loss, plain SGD."""

    def __init__(self, width: int = 16, vocab: int = 32, lr: float = 0.5) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        self.save_hyperparameters()
        config = MixtralConfig(
            hidden_size=width,
            intermediate_size=2 * width,
            num_local_experts=4,
            experts_implementation="eager",
        )
        self.embed = nn.Embedding(vocab, width)
        self.router = nn.Linear(width, 2, bias=False)
        self.experts = MixtralExperts(config)
        nn.init.normal_(self.experts.gate_up_proj, std=0.3)
        nn.init.normal_(self.experts.down_proj, std=0.3)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.embed(idx).flatten(0, 1)
        chosen = torch.tensor([0, 1], device=h.device).expand(h.shape[0], 2)
        out = self.experts(h, chosen, self.router(h).softmax(-1))
        return self.head(h + out).view(*idx.shape, -1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ZooMoE(ZooLM):
    """``ZooLM`` on a mixture-of-experts family whose experts run by ``experts_implementation`` (Hugging
    Face's eager loop, ``batched_mm`` or ``grouped_mm``)."""

    def __init__(
        self, arch: str = "mixtral", experts_implementation: str = "eager", **kwargs: object
    ) -> None:
        super().__init__(arch=arch, **kwargs)
        self.model.config._experts_implementation = experts_implementation


class RankZeroSample(Callback):
    """What users run on rank 0 alone beside training a mixture of experts: a forward with gradients on in
    ``on_train_batch_end`` and a greedy ``generate`` in ``on_train_epoch_end`` (``if global_rank == 0``);
    the parameters stay as they were."""

    def __init__(self) -> None:
        self.samples: list[list[int]] = []

    @staticmethod
    def _prompt(pl_module: LightningModule) -> Tensor:
        return torch.arange(4, device=pl_module.device).view(1, 4)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            pl_module.model(input_ids=self._prompt(pl_module))  # the router's loss included

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            out = pl_module.model.generate(
                self._prompt(pl_module), max_new_tokens=2, do_sample=False, pad_token_id=0
            )
            self.samples.append(out[0].tolist())
