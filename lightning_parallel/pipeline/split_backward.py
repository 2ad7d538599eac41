"""TEMPORARY stand-in (replaced by the split-backward branch): I = input gradients, W = a second backward
restricted to the parameters."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["WeightGradients", "backward_input"]


class WeightGradients:
    def __init__(
        self, roots: Sequence[Tensor], grads: Sequence[Optional[Tensor]], parameters: Sequence[Tensor]
    ):
        self.roots, self.grads, self.parameters = list(roots), list(grads), list(parameters)

    def run(self) -> None:
        torch.autograd.backward(self.roots, self.grads, inputs=self.parameters)
        self.roots = self.grads = []


def backward_input(
    roots: Sequence[Tensor],
    grads: Sequence[Optional[Tensor]],
    inputs: Sequence[Tensor],
    parameters: Sequence[Tensor],
) -> WeightGradients:
    if inputs:
        got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
        for t, g in zip(inputs, got):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g
    return WeightGradients(roots, grads, parameters)
