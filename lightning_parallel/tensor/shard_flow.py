"""Which values of a traced forward would be split over the tensor-parallel ranks, given the layers
that are made column-parallel, and whether the model's own code still computes the right thing on them.

A value's ``Layout`` describes each dimension as a list of factors (outer to inner); one factor, the
sharded one, is split into ``tp`` contiguous blocks. ``view`` and ``reshape`` regroup factors (heads
split out of the feature dimension, and merged back), ``split`` along a dimension made of chunks
(fused q|k|v) cuts it per chunk, element-wise operations keep the layout when every other operand
broadcasts over the sharded dimension, attention and batched matmuls keep a sharded batch or head
dimension. A sharded factor with fewer parts (heads) than the ranks may be held by several ranks each
(``Replicate``: key-value heads), and a dimension of unequal blocks (a fused q|k|v with fewer key-value
heads) is cut per block by ``split_with_sizes``, slices and one-head indexes (``Parts``). Any other use
of a sharded value is an ``Escape``: the rank would compute on part of the
features something that needs all of them. A projection layer fed a value sharded on its input
features, and only there, is a row-parallel partner.

A parameter or buffer that meets a sharded value with its full length along the sharded features (a
per-feature scale in ``x * self.scale``; a batch norm's weight, bias and running statistics, its input
split by channels) is a ``Companion``: it can be cut with the features, so each rank holds its slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_parallel.tensor.fused_blocks import (
    _blocks_at,
    _heads_of_blocks,
    _held_by_all,
    _index,
    _parts_of_dimension,
    _slice_blocks,
)
from lightning_parallel.tensor.layout import (
    Companion,
    Demand,
    Escape,
    Factor,
    Layout,
    Parts,
    Replicate,
    _dim,
    _plain,
    _split_of,
    entry_layout,
)
from lightning_parallel.tensor.trace import Node

__all__ = [
    "BATCH_NORMS",
    "Companion",
    "Demand",
    "Escape",
    "Parts",
    "Replicate",
    "Layout",
    "entry_layout",
    "per_channel",
    "propagate",
]


def _regroup(layout: Layout, out_shape: Sequence[int], node: Node) -> Layout:
    """Re-split the flat list of factors into dimensions of ``out_shape`` (a view). A sharded factor of
    size 1 (one head, held by every rank) goes to the first dimension of size 1 at its place."""
    factors = [list(f) for fs in layout.dims for f in fs if f[0] != 1 or f[1]]
    dims: list[tuple[Factor, ...]] = []
    i = 0
    for size in out_shape:
        group: list[Factor] = []
        need = size
        if size == 1 and i < len(factors) and factors[i][0] == 1:
            group.append(tuple(factors[i]))
            i += 1
        while need > 1:
            if i < len(factors) and factors[i][0] == 1:  # a one-head factor inside a larger dimension
                raise Escape(
                    f"{node.name}: merges a key-value head held by every rank into {tuple(out_shape)}"
                )
            if i >= len(factors):
                raise Escape(
                    f"{node.name}: cannot follow the sharded dimension into shape {tuple(out_shape)}"
                )
            fsize, sharded = factors[i]
            if isinstance(sharded, tuple) and fsize != need:
                group.append(_heads_of_blocks(fsize, sharded, need, node))
                factors[i] = [fsize // need, False]
                need = 1
                continue
            if fsize <= need and need % fsize == 0:
                group.append((fsize, sharded))
                need //= fsize
                i += 1
            elif fsize % need == 0:  # split this factor: the outer part goes here
                if sharded:
                    group.append((need, sharded))
                    factors[i] = [fsize // need, False]
                else:
                    group.append((need, False))
                    factors[i] = [fsize // need, False]
                need = 1
            else:
                raise Escape(f"{node.name}: shape {tuple(out_shape)} cuts across the sharded dimension")
        dims.append(tuple(group) or ((1, False),))
    return Layout(tuple(dims))


def _check_split_factor(layout: Layout, tp: int, node: Node) -> None:
    for fs in layout.dims:
        for size, copies in fs:
            if isinstance(copies, tuple):
                if any(w % (tp // c) for w, c in copies):
                    raise Escape(f"{node.name}: a block of the fused dimension does not split over tp={tp}")
                continue
            if copies and size % (tp // copies):
                why = f"{node.name}: the sharded factor has {size} parts, not divisible by tp={tp}"
                if copies == 1 and tp % size == 0:
                    raise Replicate(why, tp // size)
                raise Escape(why)


def _pointwise(
    node: Node, shapes: list, layouts: dict, out_ndim: int, tensors: dict, companions: list
) -> Layout:
    """All sharded operands agree; every other tensor operand broadcasts over the sharded dimension, or
    is a parameter or buffer (``tensors``) as long as the features: a ``Companion``."""
    sharded = [(r, layouts[r.key]) for r in node.inputs() if r.key in layouts]
    first = sharded[0][1]
    pos = first.sharded_dim - len(first.dims)  # from the right, as broadcasting aligns
    for _, lay in sharded:
        same = _split_of(lay.dims[lay.sharded_dim]) == _split_of(first.dims[first.sharded_dim])
        if lay.sharded_dim - len(lay.dims) != pos or not same:
            raise Escape(f"{node.name}: operands sharded differently")
    features = first.dims[first.sharded_dim]
    for r in node.inputs():
        if r.key not in layouts:
            shape = tuple(shapes[r.key])
            if len(shape) >= -pos and shape[pos] != 1:
                if r.key not in tensors or shape[pos] != first.shape()[first.sharded_dim]:
                    raise Escape(f"{node.name}: combines a sharded value with a whole one ({shape})")
                dims = list(_plain(shape))
                dims[len(shape) + pos] = features
                companions.append(Companion(tensors[r.key], shape, Layout(tuple(dims))))
    dims = list(_plain(shapes[node.outputs[0].key]))
    dims[out_ndim + pos] = first.dims[first.sharded_dim]
    return Layout(tuple(dims))


VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
SAME = {"clone", "_to_copy", "detach", "alias", "contiguous", "lift_fresh", "to", "type_as"}
REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "logsumexp",
    "norm",
    "linalg_vector_norm",
}
SOFTMAX = {"_softmax", "_safe_softmax", "softmax", "_log_softmax", "log_softmax"}
# (input, weight, bias, running_mean, running_var, ...): statistics per channel (dimension 1)
BATCH_NORMS = {
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",
    "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
    "cudnn_batch_norm",
    "miopen_batch_norm",
}


def per_channel(
    source: Layout, operands: Sequence[tuple[str | None, tuple, Layout | None]], what: str
) -> list[Companion]:
    """A batch norm of ``source`` (statistics per channel, dimension 1) with per-channel ``operands``
    (name of the parameter or buffer or None, shape, layout when already sharded): runs on each rank's
    channels when they are split and every operand is cut alike; the operands still whole are returned."""
    if source.sharded_dim != 1 or len(source.dims) < 2:
        raise Escape(f"{what} normalizes over the sharded dimension (its channels are not the split ones)")
    channels, found = source.dims[1], []
    for name, shape, layout in operands:
        if layout is not None:
            if len(layout.dims) != 1 or _split_of(layout.dims[0]) != _split_of(channels):
                raise Escape(f"{what}: a per-channel operand is sharded differently from the channels")
        elif name is None or tuple(shape) != (source.shape()[1],):
            raise Escape(f"{what}: a whole per-channel operand {tuple(shape)} that is no parameter or buffer")
        else:
            found.append(Companion(name, tuple(shape), Layout((channels,))))
    return found


def _batch_norm(node: Node, shapes: list, layouts: dict, tensors: dict, companions: list) -> list:
    source = layouts.get(node.args[0].key) if hasattr(node.args[0], "key") else None
    if source is None:
        raise Escape(f"{node.name}: sharded statistics of a whole input")
    operands = [
        (tensors.get(r.key), shapes[r.key], layouts.get(r.key)) for r in node.args[1:5] if hasattr(r, "key")
    ]
    companions.extend(per_channel(source, operands, node.name))
    width = source.shape()[1]
    return [source] + [
        Layout((source.dims[1],)) if o is not None and tuple(shapes[o.key]) == (width,) else None
        for o in node.outputs[1:]
    ]


def propagate(
    node: Node,
    shapes: list,
    layouts: dict,
    tp: int,
    demands: list[Demand],
    parameters: dict[int, str],
    tensors: dict[int, str] | None = None,
    companions: list[Companion] | None = None,
) -> list[Layout | None]:
    """The layouts of ``node``'s outputs given its inputs' (``layouts``: key -> Layout for sharded values).
    Raises ``Escape`` when the node cannot run on shards, or when a whole parameter (``parameters``) meets
    sharded values other than element-wise (broadcast over the split dimension, it gets part of its
    gradient on each rank: ``traced_plan`` sums those over the group) or per feature. Appends sizes that
    must be divided to ``demands``, and parameters or buffers (``tensors``, key -> name) that meet the
    sharded features with their full length to ``companions``."""
    tensors = tensors if tensors is not None else {}
    companions = companions if companions is not None else []
    ins = node.inputs()
    if not any(r.key in layouts for r in ins):
        return [None] * len(node.outputs)
    if node.name in BATCH_NORMS:
        return _batch_norm(node, shapes, layouts, tensors, companions)
    whole = [r for r in ins if r.key in parameters and r.key not in layouts]
    if whole and not _is_pointwise(node):
        raise Escape(f"{node.name}: the whole parameter {parameters[whole[0].key]!r} meets sharded values")
    name = node.name
    a = node.args
    src = layouts.get(a[0].key) if a and hasattr(a[0], "key") else None
    out_shapes = [shapes[o.key] if o is not None else None for o in node.outputs]
    if name in VIEWS and src is not None:
        out = _regroup(src, out_shapes[0], node)
        try:
            _check_split_factor(out, tp, node)
        except Replicate:
            raise
        except Escape as escape:  # more heads than ranks, not a multiple: perhaps unequal blocks of heads
            _parts_of_dimension(node, out, out.sharded_dim, node.outputs[0].key, str(escape))
            raise
        # sizes as written (-1 stays -1). A size that splits heads out of the features must shrink on each
        # rank; one that merges sharded dimensions is taken to be computed from the input's shape
        size = a[1][out.sharded_dim]
        copies = _split_of(out.dims[out.sharded_dim])[-1][1]
        if isinstance(copies, tuple):  # a fused dimension in heads: each split block's head count shrinks
            demands.extend(Demand(node.owner, w) for w, c in copies if c == 1 and size != -1)
        elif name == "view" and size != -1 and size < src.shape()[src.sharded_dim]:
            demands.append(Demand(node.owner, size, copies))
        return [out]
    if name == "expand" and src is not None:
        d = src.sharded_dim + len(out_shapes[0]) - len(src.dims)
        dims = list(_plain(out_shapes[0]))
        dims[d] = src.dims[src.sharded_dim]
        if _held_by_all(src, tp) and src.shape()[src.sharded_dim] == 1 and out_shapes[0][d] > 1:
            # one key-value head, every rank's, repeated for the query heads: as many as the rank's
            dims[d] = ((out_shapes[0][d], 1),)
            demands.append(Demand(node.owner, out_shapes[0][d]))
        return [Layout(tuple(dims))]
    if name == "index" and src is not None:
        return [_index(node, src, out_shapes[0], tp)]
    if (
        name == "slice"
        and src is not None
        and _blocks_at(src, _dim(a[1] if len(a) > 1 else 0, len(src.dims)))
    ):
        return [_slice_blocks(node, src, out_shapes[0], demands, tp)]
    if (
        name in ("transpose", "t", "permute", "unsqueeze", "squeeze", "select", "slice", "narrow")
        and src is not None
    ):
        return [_rearrange(node, src, out_shapes[0])]
    if name in ("split", "split_with_sizes", "unbind", "chunk") and src is not None:
        return _split(node, src, out_shapes, demands)
    if name == "cat":
        return [_cat(node, layouts, out_shapes[0], shapes)]
    if name in SOFTMAX and src is not None:
        if _dim(a[1], len(src.dims)) == src.sharded_dim:
            raise Escape(f"{name} over the sharded dimension")
        return [src]
    if name in REDUCTIONS and src is not None:
        return [_reduce(node, src, out_shapes[0])]
    if name in ("bmm", "baddbmm"):
        return [_bmm(node, layouts, shapes, out_shapes[0])]
    if name == "stack":
        return [_stack(node, layouts, out_shapes[0])]
    if "scaled_dot_product" in name:
        return _attention(node, layouts, out_shapes, shapes, tp)
    if _is_pointwise(node):
        out = _pointwise(node, shapes, layouts, len(out_shapes[0]), tensors, companions)
        return [out if s is not None and len(s) == len(out.dims) else None for s in out_shapes]
    raise Escape(f"{name} reads the sharded features")


def _is_pointwise(node: Node) -> bool:
    pointwise = node.func is not None and torch.Tag.pointwise in node.func.tags
    return (
        pointwise
        or node.name in SAME
        or node.name in ("native_dropout", "masked_fill", "where", "dropout", "copy_", "copy")
    )


def _rearrange(node: Node, src: Layout, out_shape: Sequence[int]) -> Layout:
    name, a, n = node.name, node.args, len(src.dims)
    dims = list(src.dims)
    if name in ("transpose", "t"):
        d0, d1 = (0, 1) if name == "t" else (_dim(a[1], n), _dim(a[2], n))
        dims[d0], dims[d1] = dims[d1], dims[d0]
    elif name == "permute":
        dims = [dims[_dim(d, n)] for d in a[1]]
    elif name == "unsqueeze":
        dims.insert(_dim(a[1], n + 1), ((1, False),))
    elif name == "squeeze":
        drop = (
            [_dim(d, n) for d in (a[1] if isinstance(a[1], (list, tuple)) else [a[1]])]
            if len(a) > 1
            else [i for i, fs in enumerate(dims) if all(s == 1 for s, _ in fs)]
        )
        dims = [fs for i, fs in enumerate(dims) if i not in drop or any(s != 1 for s, _ in fs)]
    else:  # select / slice / narrow: fine on any dimension but the sharded one
        d = _dim(a[1] if len(a) > 1 else 0, n)
        if d == src.sharded_dim:
            _parts_of_dimension(node, src, d)
            raise Escape(f"{name} along the sharded dimension")
        if name == "select":
            dims.pop(d)
        else:
            dims[d] = ((out_shape[d], False),)
    return Layout(tuple(dims))


def _split(node: Node, src: Layout, out_shapes: list, demands: list[Demand]) -> list[Layout | None]:
    a, n = node.args, len(src.dims)
    d = (
        _dim(a[2] if len(a) > 2 else (a[1] if node.name == "unbind" and len(a) > 1 else 0), n)
        if node.name != "unbind"
        else _dim(a[1] if len(a) > 1 else 0, n)
    )
    if d != src.sharded_dim:
        out = []
        for s in out_shapes:
            if s is None:
                out.append(None)
                continue
            dims = list(src.dims)
            if node.name == "unbind":
                dims.pop(d)
            else:
                dims[d] = ((s[d], False),)
            out.append(Layout(tuple(dims)))
        return out
    factors = [f for f in src.dims[d] if f[0] != 1]
    sizes = {s[d] for s in out_shapes if s is not None}
    widths = tuple(s[d] for s in out_shapes if s is not None)
    if len(factors) == 1 and isinstance(factors[0][1], tuple):  # a fused dimension cut into its blocks
        blocks = factors[0][1]
        if widths != tuple(w for w, _ in blocks) or len(widths) != len(out_shapes):
            raise Escape(f"{node.name} cuts a fused dimension of unequal blocks elsewhere than between them")
        if node.name == "split_with_sizes":  # sizes as written: a block split over all ranks shrinks
            demands.extend(Demand(node.owner, w) for w, copies in blocks if copies == 1)
        return [Layout(src.dims[:d] + (((w, copies),),) + src.dims[d + 1 :]) for w, copies in blocks]
    if (
        factors == [(factors[0][0], 1)]
        and node.name == "split_with_sizes"
        and len(set(widths)) > 1
        and len(widths) == len(out_shapes)
    ):
        raise Parts(f"{node.name} cuts the sharded dimension into unequal blocks {list(widths)}", widths)
    if len(factors) == 2 and not factors[0][1] and factors[1][1] and sizes == {factors[1][0]}:
        if node.name == "split":  # split(size): a written size of one chunk
            demands.append(Demand(node.owner, a[1]))
        dims = list(src.dims)
        dims[d] = (factors[1],)
        return [Layout(tuple(dims)) for _ in out_shapes]
    raise Escape(f"{node.name} cuts the sharded dimension (not along packed chunks)")


def _cat(node: Node, layouts: dict, out_shape: Sequence[int], shapes: list) -> Layout:
    tensors = [
        t for t in node.args[0] if 0 not in shapes[t.key]
    ]  # empty parts (a fresh KV cache) add nothing
    d = _dim(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
    lays = [layouts.get(t.key) for t in tensors]
    if (
        any(lay is None for lay in lays)
        or len({(lay.sharded_dim, _split_of(lay.dims[lay.sharded_dim])) for lay in lays}) != 1
    ):
        raise Escape("cat of sharded and whole values")
    if lays[0].sharded_dim == d:
        raise Escape("cat along the sharded dimension")
    dims = list(lays[0].dims)
    dims[d] = ((out_shape[d], False),)
    return Layout(tuple(dims))


def _reduce(node: Node, src: Layout, out_shape: Sequence[int]) -> Layout:
    a, n = node.args, len(src.dims)
    dims_arg = a[1] if len(a) > 1 and a[1] is not None else list(range(n))
    reduced = {_dim(d, n) for d in (dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg])}
    if src.sharded_dim in reduced:
        raise Escape(f"{node.name} over the sharded dimension")
    if len(out_shape) == n:
        return Layout(tuple(((1, False),) if i in reduced else fs for i, fs in enumerate(src.dims)))
    return Layout(tuple(fs for i, fs in enumerate(src.dims) if i not in reduced))


def _bmm(node: Node, layouts: dict, shapes: list, out_shape: Sequence[int]) -> Layout:
    """Batched matmuls keep a sharded batch (heads) dimension; ``baddbmm``'s added input must be sharded
    alike or broadcast over it (an ALiBi bias of every head is not)."""
    refs = [r for r in node.args if hasattr(r, "key")]
    lays = [layouts.get(r.key) for r in refs[-2:]]
    if any(lay is None or lay.sharded_dim != 0 for lay in lays) or _split_of(lays[0].dims[0]) != _split_of(
        lays[1].dims[0]
    ):
        raise Escape(f"{node.name} contracts or mixes the sharded dimension")
    if len(refs) == 3:
        added = layouts.get(refs[0].key)
        if (added is None and shapes[refs[0].key][0] != 1) or (added is not None and added.sharded_dim != 0):
            raise Escape(f"{node.name} adds a value with a whole head dimension")
    return Layout((lays[0].dims[0],) + _plain(out_shape[1:]))


def _stack(node: Node, layouts: dict, out_shape: Sequence[int]) -> Layout:
    """``stack`` of values sharded alike along a new dimension (rotary embeddings interleaved by hand)."""
    lays = [layouts.get(t.key) for t in node.args[0]]
    if any(lay is None for lay in lays) or len({_split_of(lay.dims[lay.sharded_dim]) for lay in lays}) != 1:
        raise Escape("stack of sharded and whole values")
    d = _dim(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
    dims = list(lays[0].dims)
    dims.insert(d, ((out_shape[d], False),))
    return Layout(tuple(dims))


def _attention(node: Node, layouts: dict, out_shapes: list, shapes: list, tp: int) -> list[Layout | None]:
    q, k, v = node.args[:3]
    lays = [layouts.get(t.key) for t in (q, k, v)]
    if all(lay is not None for lay in lays) and _held_by_all(lays[1], tp) and _held_by_all(lays[2], tp):
        # one key-value head, held whole by every rank (multi-query): each rank's query heads read it
        lays = lays[:1]
    if any(lay is None or lay.sharded_dim != 1 or not lay.dims[1][0][1] for lay in lays):
        raise Escape("attention over values not all sharded by heads")
    if lays[0].dims[1][0][1] != 1:
        raise Escape("attention with query heads fewer than the ranks")
    # each rank's query heads read only its own key-value heads: as many, or a whole number of query heads
    # per key-value head on each rank (grouped-query attention)
    heads = [_split_of(lay.dims[1])[-1] for lay in lays]
    if len(heads) == 3 and (heads[1] != heads[2] or heads[0][0] % (heads[1][0] * heads[1][1])):
        raise Escape("attention over query and key-value heads cut differently")
    mask = node.kwargs.get(
        "attn_mask", node.args[3] if len(node.args) > 3 and hasattr(node.args[3], "key") else None
    )
    if hasattr(mask, "key") and (
        mask.key in layouts or (len(shapes[mask.key]) == 4 and shapes[mask.key][1] != 1)
    ):
        raise Escape("attention mask with a whole head dimension")
    heads = shapes[q.key][1]
    return [
        Layout(tuple(((s, i == 1),) for i, s in enumerate(shape)))
        if shape is not None and len(shape) >= 2 and shape[1] == heads
        else None
        for shape in out_shapes
    ]
