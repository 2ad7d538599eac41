"""Models for pipeline tests: plain user code."""

import torch
from lightning.pytorch import LightningModule
from torch import nn

from tests.helpers.models import MLP


class SequentialNet(MLP):
    """An nn.Sequential called as a whole in forward: the block stack is the Sequential itself."""

    def __init__(self, depth: int = 4, **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        layers = [nn.Linear(h.in_dim, h.hidden), nn.Tanh()]
        for _ in range(depth - 2):
            layers += [nn.Linear(h.hidden, h.hidden), nn.Tanh()]
        layers.append(nn.Linear(h.hidden, h.out_dim))
        self.net = nn.Sequential(*layers)
