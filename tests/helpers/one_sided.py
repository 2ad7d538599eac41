"""A user's bug: a collective in ``validation_step`` that only one rank calls. Plain user code."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.helpers.models import MLP

__all__ = ["OneSidedMLP", "SlowToStartMLP", "STUCK_MARKER_ENV"]

#: a file the rank creates just before its one-sided call (tests wait for it before signalling)
STUCK_MARKER_ENV = "LP_TEST_STUCK_MARKER"


class OneSidedMLP(MLP):
    """At validation batch ``at_batch`` of the first validation, global rank ``rank`` alone does
    ``action``: ``"all_gather"`` (``self.all_gather``), ``"strategy_barrier"``
    (``trainer.strategy.barrier()``), ``"dist_barrier"`` (``torch.distributed.barrier()``), or
    ``"optimizer_state_dict"`` (the optimizer's ``state_dict()``, a collective under ZeRO), or
    ``"sleep"`` (``seconds`` without any collective: a slow rank, which is no bug)."""

    def __init__(
        self, action: str = "all_gather", rank: int = 0, at_batch: int = 1, seconds: float = 0.0, **kw
    ):
        super().__init__(**kw)
        self.action, self.rank, self.at_batch, self.seconds = action, rank, at_batch, seconds
        self.done = False

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.global_rank == self.rank and batch_idx == self.at_batch and not self.done:
            self.done = True
            if os.environ.get(STUCK_MARKER_ENV):
                open(os.environ[STUCK_MARKER_ENV], "w").close()
            if self.action == "all_gather":
                self.all_gather(loss)
            elif self.action == "strategy_barrier":
                self.trainer.strategy.barrier()
            elif self.action == "dist_barrier":
                dist.barrier()
            elif self.action == "optimizer_state_dict":
                self.trainer.optimizers[0].state_dict()
            else:
                time.sleep(self.seconds)
        return loss


class SlowToStartMLP(MLP):
    """Global rank ``rank`` spends ``seconds`` building the model (before its ``Trainer`` exists): a
    second run in the same processes whose ranks arrive at different times."""

    def __init__(self, rank: int = 1, seconds: float = 0.0, **kw):
        super().__init__(**kw)
        if int(os.environ.get("RANK", "0")) == rank:
            time.sleep(seconds)
