"""The test MLP with one more layer, and the MLP that loads leniently: checkpoints whose keys differ."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.models import MLP

__all__ = ["MLPWithExtraLayer", "LenientMLP"]


class MLPWithExtraLayer(MLP):
    """``MLP`` with ``extra`` (a layer after ``net``): its checkpoints hold two keys ``MLP`` lacks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.extra = nn.Linear(self.hparams.out_dim, self.hparams.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.net(x))


class LenientMLP(MLP):
    """``MLP`` with Lightning's ``strict_loading = False``: keys it lacks in a checkpoint are ignored."""

    strict_loading = False
