"""``StepTraffic``: a Lightning callback that keeps, per training step, the bytes this process hands to
``torch.distributed`` collectives (``distributed.traffic``: sent to other ranks, and an all-to-all's rows
kept on this rank). For benchmarks and tests; counting wraps the collectives while fit runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lightning.pytorch import Callback

from lightning_parallel.distributed.traffic import Traffic, count_collective_bytes

__all__ = ["StepTraffic"]


class StepTraffic(Callback):
    """The bytes of each training step (``steps``: one ``Traffic`` per batch, in order), counted from
    ``setup`` to ``teardown`` of fit."""

    def __init__(self) -> None:
        self.steps: list[Traffic] = []
        self._counting: Any = None
        self._traffic = Traffic()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._counting is None:
            self._counting = count_collective_bytes()
            self._traffic = self._counting.__enter__()

    def on_train_batch_start(self, *args: Any) -> None:
        self._traffic.clear()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(Traffic(Counter(self._traffic.sent), Counter(self._traffic.kept)))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None
