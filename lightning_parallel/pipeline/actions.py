"""The unit of a pipeline schedule: one piece of work of one rank (``schedules.py`` lists them,
``clock.py`` simulates them, ``executor.py`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Action"]


@dataclass(frozen=True)
class Action:
    """One piece of work of one rank: ``kind`` of ``microbatch`` on the rank's local ``chunk``.

    ``F`` forward; ``B`` full backward (input and weight gradients); ``I`` the input-gradient part
    alone, whose result is sent upstream at once; ``W`` the weight-gradient part of an earlier ``I`` of
    the same micro-batch and chunk. Printed ``F3`` (chunk 0), ``F3.1`` (chunk 1), ``B3'`` (batch -1).
    """

    kind: Literal["F", "B", "I", "W"]
    microbatch: int
    batch: int = 0  # 0: this step's batch; -1: the previous batch (async carries its cool-down over)
    chunk: int = 0  # this rank's local chunk, 0..virtual_stages-1 (placement.py: which piece it holds)

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}" + ("'" if self.batch == -1 else "")
