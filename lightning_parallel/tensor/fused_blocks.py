"""Values of a fused q|k|v whose blocks differ in width or in how many ranks hold each (``shard_flow``):
a dimension of unequal blocks viewed as heads, sliced or indexed one block at a time, and a key-value
head that every rank holds whole."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_parallel.tensor.layout import Demand, Escape, Factor, Layout, Parts, _dim, _split_of
from lightning_parallel.tensor.trace import Node

__all__: list[str] = []


def _heads_of_blocks(width: int, blocks: tuple, heads: int, node: Node) -> Factor:
    """A fused dimension of unequal blocks viewed as ``heads`` heads: the blocks counted in heads."""
    size = width // heads
    if width % heads or any(w % size for w, _ in blocks):
        raise Escape(f"{node.name}: cuts a fused dimension of unequal blocks inside a block")
    return (heads, tuple((w // size, copies) for w, copies in blocks))


def _parts_of_dimension(node: Node, src: Layout, d: int, key: int | None = None, why: str = "") -> None:
    """A part of a dimension split over all ranks read alone (or, ``why``, a dimension that does not
    split, value ``key``): it may be a block of a fused q|k|v, read from the operations on the value."""
    if [f for f in src.dims[d] if f[0] != 1] == [(src.shape()[d], 1)]:
        why = why or f"{node.name} reads one part of the sharded dimension"
        raise Parts(why, (), (node.args[0].key if key is None else key, d))


def _blocks_at(src: Layout, d: int) -> tuple:
    """The blocks ((width, copies), ...) of a fused dimension ``d`` of unequal blocks, else ()."""
    factors = [f for f in src.dims[d] if f[0] != 1]
    return factors[0][1] if len(factors) == 1 and isinstance(factors[0][1], tuple) else ()


def _slice_blocks(
    node: Node, src: Layout, out_shape: Sequence[int], demands: list[Demand], tp: int
) -> Layout:
    """``slice`` of one whole block of a fused dimension (``qkv[..., :q_size]``). A bound written from the
    start moves on each rank unless every block before it is split over all ranks (it is then divided);
    one written from the end, unless every block after it is held whole by every rank."""
    a, n = node.args, len(src.dims)
    d = _dim(a[1], n)
    blocks = _blocks_at(src, d)
    full = sum(w for w, _ in blocks)
    offsets = [sum(w for w, _ in blocks[:i]) for i in range(len(blocks))]
    start = a[2] if len(a) > 2 and a[2] is not None else 0
    first = start + full if start < 0 else start
    hit = [i for i, (w, _) in enumerate(blocks) if offsets[i] == first and w == out_shape[d]]
    if not hit:
        raise Escape(f"{node.name} cuts a fused dimension of unequal blocks elsewhere than between them")
    i = hit[0]
    end = a[3] if len(a) > 3 and a[3] is not None else full
    for bound, at in ((start, i), (end, i + 1)):
        if 0 < bound < full:
            if any(c != 1 for _, c in blocks[:at]):
                raise Escape(f"{node.name}: a bound {bound} follows blocks held by several ranks")
            demands.append(Demand(node.owner, bound))
        elif bound < 0 and any(c != tp for _, c in blocks[at:]):
            raise Escape(f"{node.name}: a bound {bound} from the end precedes blocks split over the ranks")
    dims = list(src.dims)
    dims[d] = (blocks[i],)
    return Layout(tuple(dims))


def _index(node: Node, src: Layout, out_shape: Sequence[int], tp: int) -> Layout:
    """``x[..., [i], ...]``: one index tensor; along a whole dimension it keeps the layout, along a fused
    dimension it may pick a block that every rank holds whole, at the end of it (``qkv[..., [-2], :]``:
    the same place on every rank, counted from the end)."""
    indices = node.args[1]
    at = [j for j, t in enumerate(indices) if t is not None]
    if len(at) != 1 or len(out_shape) != len(src.dims):
        raise Escape(f"{node.name} reads the sharded features")
    d = at[0]
    dims = list(src.dims)
    if d != src.sharded_dim:
        dims[d] = ((out_shape[d], 0),)
        return Layout(tuple(dims))
    blocks = _blocks_at(src, d)
    if not blocks:
        _parts_of_dimension(node, src, d)
    held = []
    for w, c in reversed(blocks):  # the blocks every rank holds whole, from the end
        if c != tp:
            break
        held.append((w, c))
    if not held or len({w for w, _ in held}) != 1 or held[0][0] != out_shape[d]:
        raise Escape(f"{node.name} reads the sharded features")
    dims[d] = (held[0],)
    return Layout(tuple(dims))


def _held_by_all(layout: Layout, tp: int) -> bool:
    """Sharded into one block that every rank holds: whole on each rank, its gradient partial."""
    return _split_of(layout.dims[layout.sharded_dim])[-1][1] == tp
