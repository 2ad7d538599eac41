"""One row of figures per rank, the table rank 0 prints, and the dictionary ``summary.json`` holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.memory.accounting import (
    ModelSize,
    cuda_allocated,
    floating_dtype,
    gradients,
    optimizer_state_tensors,
    peak_rss_bytes,
    rss_bytes,
    storage_id,
    unique_storage_bytes,
)

__all__ = [
    "RankMemory",
    "SetupFigures",
    "measure_rank",
    "parameter_bytes",
    "format_table",
    "as_dicts",
    "headline",
]

MIB = 2**20


@dataclass(frozen=True)
class SetupFigures:
    """The set-up's memory, read at the first training batch, before its forward.

    ``peak``: the process's peak resident memory so far (CPU, ``ru_maxrss``) or the allocator's peak
    allocated bytes (GPU). ``growth``: ``peak`` minus the same reading's current value at the start of
    ``setup``; ``growth_since_created``: minus the value when the report object was created (often before
    the model was built)."""

    peak: int
    growth: int
    growth_since_created: int


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes (None: not measured on this device)."""

    rank: int
    device: str
    model_parameters: int  # the whole model's parameters on one device (read before the strategy splits
    # it, in the floating dtype this rank's parameters have)
    parameters: int  # this rank's parameters (unique storages, meta 0)
    gradients: int  # their ``.grad`` (a bucket that holds gradients as views counts whole)
    optimizer_state: int  # the tensors in the optimizers' state
    activations: int  # the peak of the bytes autograd kept saved for backward during a training step
    setup_peak: int
    setup_growth: int
    setup_growth_since_created: int
    peak_rss: int  # the process's lifetime peak resident memory
    rss: Optional[int]  # the process's resident memory now
    cuda_max_allocated: Optional[int] = None
    cuda_max_reserved: Optional[int] = None
    expected_states: Optional[int] = None  # parameters + gradients + optimizer state by the ZeRO paper's
    # formulas (memory.expected) for this rank's share and layout; None where the layout is not known


def measure_rank(
    rank: int,
    module: nn.Module,
    optimizers: Iterable[Any],
    model: ModelSize,
    activations: int,
    setup: SetupFigures,
    device: torch.device,
    held_gradients: Iterable[Tensor] = (),
    held_parameters: Iterable[Tensor] = (),
    expected_states: Optional[int] = None,
    released_parameters: Iterable[Tensor] = (),
) -> RankMemory:
    """This rank's row, measured now: the tensors it holds, and the process's memory. ``held_gradients``:
    gradient memory the strategy holds beside the ``.grad`` of the parameters (its buckets, ZeRO's shards);
    ``held_parameters``: parameter memory beside the module's (ZeRO-3's shards); ``expected_states``: what
    the formulas expect of the parameters, gradients and optimizer state together; ``released_parameters``:
    storages whose pages the strategy handed back (ZeRO-3's freed units on the CPU), not counted."""
    params = list(module.parameters())
    cuda = cuda_allocated(device) or {}
    return RankMemory(
        rank=rank,
        device=str(device),
        model_parameters=model.bytes_as(floating_dtype(params)),
        parameters=parameter_bytes(params, held_parameters, released_parameters),
        gradients=unique_storage_bytes([*gradients(params), *held_gradients]),
        optimizer_state=unique_storage_bytes(optimizer_state_tensors(optimizers)),
        activations=activations,
        setup_peak=setup.peak,
        setup_growth=setup.growth,
        setup_growth_since_created=setup.growth_since_created,
        peak_rss=peak_rss_bytes(),
        rss=rss_bytes(),
        cuda_max_allocated=cuda.get("max_allocated"),
        cuda_max_reserved=cuda.get("max_reserved"),
        expected_states=expected_states,
    )


def parameter_bytes(
    params: Iterable[Tensor], held: Iterable[Tensor] = (), released: Iterable[Tensor] = ()
) -> int:
    """Bytes of the distinct storages of ``params`` and ``held``, leaving out those of ``released``."""
    gone = {storage_id(t) for t in released}
    return unique_storage_bytes([t for t in [*params, *held] if storage_id(t) not in gone])


#: the table's columns: field -> heading
COLUMNS = {
    "rank": "rank",
    "device": "device",
    "model_parameters": "model params",
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "optimizer",
    "expected_states": "expected p+g+o",
    "activations": "activations",
    "setup_peak": "set-up peak",
    "setup_growth": "set-up growth",
    "peak_rss": "peak RSS",
    "rss": "RSS",
    "cuda_max_allocated": "CUDA max alloc",
    "cuda_max_reserved": "CUDA max reserved",
}


_UNITS = ("B", "KiB", "MiB", "GiB")


def _cell(value: Any) -> str:
    """Bytes in B, KiB, MiB or GiB; text as it is; "-" where not measured."""
    if value is None:
        return "-"
    if not isinstance(value, int):
        return str(value)
    power = 0
    while power < len(_UNITS) - 1 and abs(value) >= 1024 ** (power + 1):
        power += 1
    return f"{value / 1024**power:.4g} {_UNITS[power]}"


def format_table(rows: list[RankMemory], when: str) -> str:
    """The table (MiB) of every rank, leaving out columns no rank measured (CUDA ones on the CPU)."""
    shown = [name for name in COLUMNS if any(getattr(r, name) is not None for r in rows)]
    cells = [[COLUMNS[n] for n in shown]] + [
        [str(r.rank)] + [_cell(getattr(r, n)) for n in shown[1:]] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(shown))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return f"Memory per rank, {when} (docs/memory.md):\n" + "\n".join(lines)


def as_dicts(rows: list[RankMemory]) -> list[dict[str, Any]]:
    """The rows as plain dictionaries (bytes), for JSON."""
    return [asdict(r) for r in rows]


def headline(rows: list[RankMemory]) -> dict[str, Optional[float]]:
    """A few figures of the run for a sweep table: the largest rank's value of each column, in MiB."""
    names = ("parameters", "gradients", "optimizer_state", "activations", "peak_rss", "cuda_max_allocated")
    found = {n: [getattr(r, n) for r in rows if getattr(r, n) is not None] for n in names}
    return {f"memory_{n}_mib": round(max(v) / MIB, 3) if v else None for n, v in found.items()}
