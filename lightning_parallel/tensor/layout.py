"""The data model of ``shard_flow``: how a value of a traced forward is split over the tensor-parallel
ranks (``Layout``, a list of factors per dimension), and what the flow reports (``Escape`` and its kinds,
``Demand``, ``Companion``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

__all__ = ["Companion", "Demand", "Escape", "Factor", "Layout", "Parts", "Replicate", "entry_layout"]

# (size, copies): 0 (False) for a whole factor; else the sharded one, cut into tp // copies contiguous
# blocks each held by ``copies`` ranks (1, True: split over all ranks; more: key-value heads fewer than
# the ranks, each replicated over the ranks whose query heads read it). A fused q|k|v of unequal widths
# has ``copies`` = its blocks ((width, copies), ...) until it is split into them.
Factor = tuple[int, Union[int, tuple[tuple[int, int], ...]]]


class Escape(Exception):
    """A sharded value reaches an operation that cannot run on a shard."""


class Parts(Escape):
    """A column's output is split into blocks of unequal ``widths`` (a fused q|k|v with fewer key-value
    heads): the column may be cut per block. Where one operation shows only one block (a ``slice``, an
    index), ``cut`` = (value, dimension): the blocks are read from every operation on that value."""

    def __init__(self, message: str, widths: tuple[int, ...], cut: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.widths, self.cut = widths, cut


class Replicate(Escape):
    """The sharded factor has fewer parts (heads) than the ranks, and ``copies`` ranks could hold each:
    the column-parallel layer it comes from may hold each of its heads on that many ranks."""

    def __init__(self, message: str, copies: int) -> None:
        super().__init__(message)
        self.copies = copies


@dataclass(frozen=True)
class Demand:
    """A size written into the model's code (``view(B, T, self.n_head, -1)``, ``split(self.split_size)``)
    that must be divided by tp on each rank; found on the module whose ``forward`` issued it."""

    owner: str
    value: int
    copies: int = 1  # ranks holding each head of the value: the size is divided by tp // copies


@dataclass(frozen=True)
class Companion:
    """A parameter or buffer (``name``; or a value computed from it alone, of shape ``shape``) that meets
    sharded values element-wise along the features: sharded as ``layout`` says, it lets them stay split."""

    name: str
    shape: tuple[int, ...]
    layout: "Layout"


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[Factor, ...], ...]

    @property
    def sharded_dim(self) -> int:
        return next(i for i, fs in enumerate(self.dims) if any(s for _, s in fs))

    def shape(self) -> tuple[int, ...]:
        out = []
        for fs in self.dims:
            n = 1
            for size, _ in fs:
                n *= size
            out.append(n)
        return tuple(out)

    def features_split(self) -> bool:
        """Sharded only on the last dimension, as its outermost factor, over all ranks: a row-parallel
        input."""
        last = [f for f in self.dims[-1] if f[0] != 1]
        return self.sharded_dim == len(self.dims) - 1 and bool(last) and last[0][1] == 1


def entry_layout(shape: Sequence[int], chunks: int = 1, copies: Union[int, tuple] = 1) -> Layout:
    """The output of a column-parallel layer: its last dimension (``chunks`` packed blocks) sharded, each
    block held by ``copies`` ranks (or blocks of unequal widths: ``copies`` = ((width, copies), ...))."""
    n = shape[-1]
    last: tuple[Factor, ...] = ((chunks, 0), (n // chunks, copies)) if chunks > 1 else ((n, copies),)
    return Layout(tuple(((s, False),) for s in shape[:-1]) + (last,))


def _split_of(factors: tuple[Factor, ...]) -> tuple[Factor, ...]:
    """What a rank holds of a dimension, whatever its factoring: the sharded factor and every factor inside
    it form one factor cut into contiguous blocks (4 heads, or 2 kv heads each repeated twice, alike)."""
    real = [f for f in factors if f[0] != 1 or f[1]]
    at = next((i for i, (_, sharded) in enumerate(real) if sharded), None)
    if at is None:
        return tuple(real)
    inner = 1
    for size, _ in real[at:]:
        inner *= size
    return (*real[:at], (inner, real[at][1]))


def _plain(shape: Sequence[int]) -> tuple[tuple[Factor, ...], ...]:
    return tuple(((s, False),) for s in shape)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d
