"""What a forward running now is: a recompute of a checkpointed module, or under a weights snapshot.

A leaf (it imports nothing of the package), so that the modules that act on this state and those that
read it know only this one: ``recompute`` marks its recomputes (``recomputing``) and reads the
snapshot in use, the pipeline's executor enters snapshots (``using_snapshot``), and the pipeline's
deferred BatchNorm and tensor parallelism's sequence hooks ask ``is_recomputing``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from torch import Tensor

__all__ = [
    "SnapshotView",
    "is_recomputing",
    "recomputing",
    "recomputes_started",
    "snapshot_in_use",
    "using_snapshot",
]

#: a snapshot's lookup: a tensor -> the same view of the snapshot's copy (None: no parameter's)
SnapshotView = Callable[[Tensor], Optional[Tensor]]

_recomputes = 0  # > 0 while a checkpointed forward is being recomputed
_started = [0, 0]  # recomputes started so far (only grows): all, selective ones
_snapshots: list[SnapshotView] = []  # the lookups of the snapshots entered now, innermost last


def is_recomputing() -> bool:
    """Whether a checkpointed forward is being recomputed now (in backward)."""
    return _recomputes > 0


def recomputes_started(selective: bool = False) -> int:
    """How many recomputes (with ``selective``: of selective checkpoints only) have started so far. A split
    backward (``pipeline.split_backward``) compares them around its input part: torch recomputes once per
    backward call, and a selective checkpoint once only."""
    return _started[selective]


@contextmanager
def recomputing(selective: bool = False) -> Iterator[None]:
    """Mark the block as a recompute (``is_recomputing`` is True inside it); ``selective``: of a selective
    checkpoint (counted apart by ``recomputes_started``)."""
    global _recomputes
    _recomputes += 1
    _started[False] += 1
    _started[True] += selective
    try:
        yield
    finally:
        _recomputes -= 1


def snapshot_in_use() -> Optional[SnapshotView]:
    """The innermost weights snapshot in use now (None outside any): a recomputed forward reads the
    parameters through it, so it uses the weights the forward used."""
    return _snapshots[-1] if _snapshots else None


@contextmanager
def using_snapshot(view: SnapshotView) -> Iterator[None]:
    """Make ``view`` the snapshot in use within the block."""
    _snapshots.append(view)
    try:
        yield
    finally:
        _snapshots.remove(view)
