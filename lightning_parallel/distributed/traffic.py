"""The bytes this process hands to ``torch.distributed`` collectives, counted per kind and per step.

A measuring tool for benchmarks and tests (``benchmarks/bench_expert_parallel.py``, the check of the plan
table's all-to-all figure), never used while training otherwise. ``count_collective_bytes`` wraps the
counted functions of ``torch.distributed`` (every caller reaches them as ``dist.<name>``) and adds, per
call, the bytes of the tensor a rank hands over: all-reduce and broadcast the tensor (of which a ring
all-reduce sends 2 (P - 1) / P), all-gather and reduce-scatter the rank's input, all-to-all its input,
split into the rows that go to the other ranks (``sent``) and those that stay on this rank (``kept``).
``lightning_parallel.step_traffic.StepTraffic`` keeps one such count per training step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["COUNTED", "Traffic", "count_collective_bytes"]

#: torch.distributed calls counted, and which positional argument is the tensor a rank hands over
COUNTED = {
    "all_reduce": 0,
    "broadcast": 0,
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
    "all_to_all_single": 1,
}


@dataclass
class Traffic:
    """Bytes by kind: ``sent`` to other ranks (everything but an all-to-all's own rows), ``kept`` (an
    all-to-all's rows for this rank); ``handed`` is both, what the call was given."""

    sent: Counter = field(default_factory=Counter)
    kept: Counter = field(default_factory=Counter)

    def handed(self) -> Counter:
        return self.sent + self.kept

    def clear(self) -> None:
        self.sent.clear()
        self.kept.clear()


def _kept(tensor: torch.Tensor, args: tuple, kwargs: dict) -> int:
    """The bytes of an all-to-all's input that stay on this rank."""
    if not tensor.shape or not tensor.shape[0]:
        return 0
    group = kwargs.get("group", args[4] if len(args) > 4 else None)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    rows = splits[rank] if splits else tensor.shape[0] // size
    return rows * tensor[0].numel() * tensor.element_size()


def _counting(traffic: Traffic, name: str, position: int, original: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        tensor = args[position] if len(args) > position else next(iter(kwargs.values()))
        if isinstance(tensor, torch.Tensor):
            kept = _kept(tensor, args, kwargs) if name == "all_to_all_single" else 0
            traffic.sent[name] += tensor.numel() * tensor.element_size() - kept
            if kept:
                traffic.kept[name] += kept
        return original(*args, **kwargs)

    return call


@contextmanager
def count_collective_bytes() -> Iterator[Traffic]:
    """Within: the counted collectives of this process add their bytes to the yielded ``Traffic``."""
    traffic = Traffic()
    originals = {name: getattr(dist, name) for name in COUNTED}
    for name, position in COUNTED.items():
        setattr(dist, name, _counting(traffic, name, position, originals[name]))
    try:
        yield traffic
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
