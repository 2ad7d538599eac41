"""Tensor parallelism's part of a step (``TensorParallel``, an axis: ``axes.py``): the sharded layers'
shared entries let go of the step's activations after each backward, and at teardown the gradient sums
over tp stop reporting to this fit's reducer (the split module keeps them for the next stage)."""

from __future__ import annotations

from typing import Any

from lightning_parallel.strategies.axes import Axis
from lightning_parallel.tensor.gradient_sums import installed_gradient_sums

__all__ = ["TensorParallel"]


class TensorParallel(Axis):
    """Reads the strategy's ``_entries`` (the sharded layers' shared entries) and its module."""

    name = "tensor"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def post_backward(self) -> None:
        for entry in self.strategy._entries:
            entry.clear()  # do not keep the step's activations alive

    def teardown(self) -> None:
        self.strategy._entries = []
        module = self.strategy.lightning_module
        sums = installed_gradient_sums(module) if module is not None else None
        if sums is not None:
            sums.report_to(None)
