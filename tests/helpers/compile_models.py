"""Test models for ``trainer.fit(torch.compile(model))``: their training steps do not call ``self.log``.

Lightning compiles ``training_step`` as well as ``forward``; with torch 2.13 and Lightning 2.6, dynamo fails
inside ``self.log`` ("'method' object has no attribute '__dict__'", from Lightning's signature check of
the compiled ``training_step``) under every strategy, Lightning's own ``ddp`` included. That is not the
package's code, so these models leave logging out to count what the strategies do to the graph.
"""

from __future__ import annotations

from torch import nn

from tests.helpers.models import MLP
from tests.helpers.pp_models import SequentialNet
from tests.helpers.tp_models import SmallGPT
from tests.helpers.zoo import ZooLM

__all__ = ["UnloggedMLP", "UnloggedGPT", "UnloggedSequentialNet", "UnloggedZooLM"]


class UnloggedMLP(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class UnloggedSequentialNet(SequentialNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class UnloggedGPT(SmallGPT):
    def training_step(self, batch, batch_idx):
        return self._loss(batch)


class UnloggedZooLM(ZooLM):
    def training_step(self, batch, batch_idx):
        return self.loss(batch)
