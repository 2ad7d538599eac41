"""Megatron's patterns found in a traced forward: which projections are column-parallel, which are
their row-parallel partners, which written sizes must be divided, and why everything else stays whole.

Every projection starts as a column-parallel candidate. The sharded values are followed through the
trace (``shard_flow.propagate``); a candidate is dropped when one of its values escapes, when it has no
row-parallel partner, or when it is itself a partner. Repeat until nothing changes: what remains is
correct by construction of the data flow, whatever the names or the nesting of the modules.

A mixture of experts' experts module (``moe.experts``) is one node of the trace: its input must be
whole (a column-parallel value read by it fails like any value read whole), and its output is whole
(``tensor.expert_layer`` sums the partial outputs), so each one called is listed (``TracedPlan.experts``)
for the plan to split by its own layout.

A column's output cut into blocks of unequal widths (a fused q|k|v with fewer key-value heads) is cut per
block, the blocks read from the operations on it (``shard_flow.Parts``); heads fewer than the ranks are
held by several ranks each (``shard_flow.Replicate``), and the flow is followed again with them.

A parameter or buffer that meets the sharded features with their full length (a BatchNorm's weight,
bias and running statistics; a per-feature scale) is cut with them (``TracedPlan.features``): the flow
is followed again with it sharded from its first read, so every use of it, and every value computed
from it, must work on its slice too.

A module applied right to a column-parallel output whose steps cannot run on its slice (a norm taking
statistics over the whole q or k projection) is run on all the features instead (``full_width``: its
input all-gathered, its output cut again, ``tensor.full_width``), and the flow is followed again with its
output split as its input was.

Sizes to divide are found on the module whose ``forward`` wrote them, or on a plain object it holds
(``config.n_head``; ``tensor.attributes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_parallel.moe.experts import is_experts
from lightning_parallel.tensor.attributes import holders
from lightning_parallel.tensor.layers import ShardSpec
from lightning_parallel.tensor.shard_flow import (
    Companion,
    Demand,
    Escape,
    Layout,
    Parts,
    Replicate,
    _split_of,
    entry_layout,
    per_channel,
    propagate,
)
from lightning_parallel.tensor.trace import Call, Node, Trace, is_conv1d, is_projection

__all__ = ["TracedPlan", "find_traced_plan", "out_features"]

# attributes equal to a written size that are never the size to divide
# attributes that may hold a written size: head counts, split sizes, widths; never per-head sizes,
# rotary dimensions, positions or group counts (equal by chance)
DIVIDED = re.compile(r"head|split|embd|embed|hidden|query_groups")
NOT_DIVIDED = re.compile(
    r"head_dim|head_size|layer_idx|layers|(?<!query_)groups|max_|position|vocab|rotary|rope|ndims"
)


def out_features(m: nn.Module) -> int:
    return m.nf if is_conv1d(m) else m.out_features


@dataclass
class TracedPlan:
    columns: dict[str, int] = field(default_factory=dict)  # name -> packed chunks (3 for a fused q|k|v)
    copies: dict[str, int] = field(default_factory=dict)  # name -> ranks holding each head (kv < tp)
    parts: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # fused, unequal blocks
    rows: set[str] = field(default_factory=set)
    gathered: set[str] = field(default_factory=set)  # column-parallel with a gathered output
    attributes: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (owner, attr) -> its columns
    attribute_copies: dict[tuple[str, str], int] = field(default_factory=dict)  # heads held by several
    reasons: dict[str, str] = field(default_factory=dict)
    regions: list[set[str]] = field(default_factory=list)  # columns with their row partners, in call order
    gradient_sums: dict[str, set[str]] = field(default_factory=dict)  # whole parameter -> columns it meets
    unread: list[str] = field(default_factory=list)  # tied aliases held by modules that never read them
    features: dict[str, ShardSpec] = field(default_factory=dict)  # per-feature tensor -> how it is cut
    feature_columns: dict[str, set[str]] = field(default_factory=dict)  # per-feature tensor -> its columns
    full_width: dict[str, set[str]] = field(default_factory=dict)  # module run on all features -> columns
    experts: list[str] = field(default_factory=list)  # experts modules called, in call order


@dataclass
class _Flow:
    failed: dict[str, str] = field(default_factory=dict)
    rows: dict[str, set[str]] = field(default_factory=dict)
    # parameter name -> (columns whose sharded values it meets, [used on whole values too])
    parameter_uses: dict[str, tuple[set[str], list[bool]]] = field(default_factory=dict)
    demands: list[tuple[Demand, frozenset]] = field(default_factory=list)
    companions: list[tuple[Companion, frozenset]] = field(default_factory=list)
    full_width: dict[str, set[str]] = field(default_factory=dict)  # module -> columns it gathers
    widen: set[str] = field(default_factory=set)  # modules to run on all features, found in this run
    # modules of ``full_width`` also called on whole values
    whole_calls: set[str] = field(default_factory=set)
    copies: dict[str, int] = field(default_factory=dict)  # column -> ranks that could hold each head
    # column -> unequal block widths, and the head size where the cut shows it
    parts: dict[str, tuple[tuple[int, ...], Optional[int]]] = field(default_factory=dict)


def _chunks(trace: Trace, key: int, width: int) -> int:
    """A projection output cut at once into k equal parts of the last dimension is k packed blocks."""
    for node in trace.nodes:
        if node.layer is None and node.args and getattr(node.args[0], "key", None) == key:
            if node.name not in ("split", "split_with_sizes"):
                return 1
            sizes = [trace.shapes[o.key][-1] for o in node.outputs if o is not None]
            last = len(trace.shapes[key]) - 1
            dim = node.args[2] if len(node.args) > 2 else 0
            if dim in (-1, last) and len(set(sizes)) == 1 and len(sizes) > 1 and sum(sizes) == width:
                return len(sizes)
            return 1
    return 1


def _widths_read(trace: Trace, key: int, dim: int, width: int) -> tuple[tuple[int, ...], Optional[int]]:
    """The blocks of a column's output (``width`` features, viewed as ``key``) that the operations on
    ``key`` read along ``dim``: slices by where they start, and one-block indexes (``qkv[..., [-2], :]``)
    filling what the slices leave, in the order of the code; () where they do not cover it once. With
    the head size where ``dim`` counts heads (the features of one step along it), else None."""
    shape = trace.shapes[key]
    unit = 1
    for s in shape[dim + 1 :]:
        unit *= s
    if unit * shape[dim] != width:
        return (), None
    starts: dict[int, int] = {}
    picks: list[int] = []
    for node in trace.nodes:
        if node.layer is not None or not node.args or getattr(node.args[0], "key", None) != key:
            continue
        out = trace.shapes[node.outputs[0].key] if node.outputs and node.outputs[0] else None
        if node.name == "slice" and out is not None and node.args[1] % len(shape) == dim:
            start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
            starts[start % shape[dim]] = out[dim]
        elif node.name == "index" and out is not None and len(out) == len(shape):
            picks.append(out[dim])
    blocks, at = [], 0
    while at < shape[dim]:
        size = starts.pop(at, None) or (picks.pop(0) if picks else 0)
        if not size:
            return (), None
        blocks.append(size * unit)
        at += size
    found = at == shape[dim] and not starts and not picks and len(blocks) > 1
    return (tuple(blocks) if found else ()), (unit if unit > 1 else None)


def _blocks(
    trace: Trace, node: Node, widths: tuple[int, ...], tp: int, head: Optional[int]
) -> Optional[tuple[tuple[tuple[int, int], ...], int]]:
    """(width, copies) of each block of a fused q|k|v cut into ``widths``: its heads (of size ``head``, or
    else the size that the next attention reads) split over the ranks, or each held by several ranks
    where there are fewer heads than ranks; None where a block splits neither way."""
    if head is None:
        at = trace.nodes.index(node)
        attention = next((n for n in trace.nodes[at:] if "scaled_dot_product" in n.name), None)
        if attention is None:
            return None
        head = trace.shapes[attention.args[0].key][-1]
    blocks = []
    for width in widths:
        heads = width // head
        if width % head or not (heads % tp == 0 or tp % heads == 0):
            return None
        blocks.append((width, 1 if heads % tp == 0 else tp // heads))
    return tuple(blocks), head


def _seed(
    trace: Trace, node: Node, seeds: dict[str, tuple[Layout, frozenset]], layouts: dict, owners: dict
) -> None:
    """Per-feature tensors found so far are sharded from their first read."""
    for r in node.inputs():
        name = trace.raw.get(r.key)
        if name in seeds and r.key not in layouts:
            layouts[r.key], owners[r.key] = seeds[name]


def _sync_batchnorm(node: Node, module: nn.Module, layouts: dict) -> tuple[Layout, list]:
    """A ``SyncBatchNorm`` call (one trace node): per-channel, like the batch norm operators."""
    operands = [
        (f"{node.layer}.{attr}", tuple(t.shape), None)
        for attr in ("weight", "bias", "running_mean", "running_var")
        if (t := getattr(module, attr, None)) is not None
    ]
    source = layouts[node.inputs()[0].key]
    return source, per_channel(source, operands, node.layer)


def _gathers(call: Call, trace: Trace, layouts: dict) -> bool:
    """``call`` can run on all the features: one tensor in, split on its last dimension in contiguous
    blocks, one tensor out of the same shape, and no other split value read inside."""
    if len(call.inputs) != 1 or len(call.outputs) != 1 or not call.module:
        return False
    x, y = call.inputs[0], call.outputs[0]
    layout = layouts.get(x.key)
    if layout is None or not layout.features_split() or trace.shapes[x.key] != trace.shapes[y.key]:
        return False
    inside = {o.key for n in trace.nodes[call.start : call.end] for o in n.outputs if o is not None}
    return all(
        r.key in inside or r.key == x.key or r.key not in layouts
        for n in trace.nodes[call.start : call.end]
        for r in n.inputs()
    )


def _widened(
    trace: Trace, at: int, layouts: dict, wide: frozenset[str], columns: dict[str, int]
) -> Optional[str]:
    """The innermost module call around step ``at`` that could run on all the features instead: one
    applied right to a column-parallel layer's output (a norm over the whole q or k projection)."""
    outputs = {n.outputs[0].key for n in trace.nodes if n.layer in columns and n.outputs and n.outputs[0]}
    around = [
        c
        for c in trace.calls
        if c.start <= at < c.end and c.module not in wide and c.inputs and c.inputs[0].key in outputs
    ]
    around.sort(key=lambda c: c.end - c.start)
    return next((c.module for c in around if _gathers(c, trace, layouts)), None)


def _full_width_call(call: Call, trace: Trace, layouts: dict, owners: dict, flow: _Flow) -> int:
    """A call of a module run on all the features: its output split as its input, its parameters used on
    whole values; returns where its steps end (0 when it is called on whole values: it cannot be)."""
    if not _gathers(call, trace, layouts):
        flow.whole_calls.add(call.module)
        return 0
    x, y = call.inputs[0], call.outputs[0]
    layouts[y.key], owners[y.key] = layouts[x.key], owners[x.key]
    flow.full_width.setdefault(call.module, set()).update(owners[x.key])
    for r in (r for n in trace.nodes[call.start : call.end] for r in n.inputs()):
        if r.key in trace.parameters:
            flow.parameter_uses.setdefault(trace.parameters[r.key], (set(), [False]))[1][0] = True
    return call.end


def _note_blocks(escape: Replicate | Parts, column: str, trace: Trace, flow: _Flow) -> None:
    """Record what a column's escape shows of its heads: held by several ranks each (``Replicate``), or
    cut into blocks of unequal widths (``Parts``, the blocks read from the operations on the cut)."""
    if isinstance(escape, Replicate):
        flow.copies.setdefault(column, escape.copies)
        return
    found = (escape.widths, None)
    if escape.cut is not None:
        found = _widths_read(trace, *escape.cut, out_features(trace.modules[column]))
    if found[0]:
        flow.parts.setdefault(column, found)


def _run_flow(
    trace: Trace,
    columns: dict[str, int],
    tp: int,
    seeds: dict[str, tuple[Layout, frozenset]],
    copies: dict[str, object],
    wide: frozenset[str] = frozenset(),
) -> _Flow:
    flow = _Flow()
    layouts: dict[int, object] = {}
    owners: dict[int, frozenset] = {}
    tensors = trace.tensors()
    starts = {c.start: c for c in sorted(trace.calls, key=lambda c: c.start - c.end) if c.module in wide}
    skip = 0
    for at, node in enumerate(trace.nodes):
        call = starts.get(at) if at >= skip else None
        if call is not None:
            skip = _full_width_call(call, trace, layouts, owners, flow) or skip
        if at < skip:
            continue
        _seed(trace, node, seeds, layouts, owners)
        labeled = [r for r in node.inputs() if r.key in layouts]
        sources = frozenset().union(*(owners[r.key] for r in labeled)) if labeled else frozenset()
        if node.layer is not None:
            module = trace.modules.get(node.layer)
            if labeled:
                first = node.inputs()[0] if node.inputs() else None
                if (
                    is_projection(module)
                    and len(labeled) == 1
                    and first is labeled[0]
                    and layouts[first.key].features_split()
                ):
                    flow.rows.setdefault(node.layer, set()).update(sources)
                elif isinstance(module, nn.SyncBatchNorm) and first is labeled[0] and node.outputs:
                    try:
                        out, found = _sync_batchnorm(node, module, layouts)
                    except Escape as escape:
                        for s in sources:
                            flow.failed.setdefault(s, f"{escape} (in {node.layer})")
                        continue
                    flow.companions.extend((c, sources) for c in found)
                    layouts[node.outputs[0].key], owners[node.outputs[0].key] = out, sources
                    continue
                else:
                    for s in sources:
                        flow.failed.setdefault(s, f"its sharded output is read whole by {node.layer}")
            if node.layer in columns and node.outputs and node.outputs[0] is not None:
                out = node.outputs[0]
                layouts[out.key] = entry_layout(
                    trace.shapes[out.key], columns[node.layer], copies.get(node.layer, 1)
                )
                owners[out.key] = frozenset([node.layer])
            continue
        _note_parameter_uses(node, trace, labeled, sources, flow, seeds)
        if not labeled:
            continue
        demands: list[Demand] = []
        companions: list[Companion] = []
        try:
            outs = propagate(node, trace.shapes, layouts, tp, demands, trace.parameters, tensors, companions)
        except Escape as escape:
            if isinstance(escape, (Replicate, Parts)) and len(sources) == 1:
                _note_blocks(escape, next(iter(sources)), trace, flow)
            else:
                widened = _widened(trace, at, layouts, wide | flow.widen, columns)
                if widened is not None:  # followed again with that module run on all the features
                    flow.widen.add(widened)
                    continue
            for s in sources:
                flow.failed.setdefault(s, f"{escape} (in {node.owner or 'the root module'})")
            continue
        flow.demands.extend((d, sources) for d in demands)
        flow.companions.extend((c, sources) for c in companions)
        for o, layout in zip(node.outputs, outs):
            if o is not None and layout is not None:
                layouts[o.key], owners[o.key] = layout, sources
    for name, (on_shards, whole) in flow.parameter_uses.items():
        if (
            on_shards and whole[0]
        ):  # part of its gradient from shards, part whole: a sum would count the whole twice
            for c in on_shards:
                flow.failed.setdefault(c, f"the parameter {name!r} is used both on sharded values and whole")
    return flow


def _tensor_shape(trace: Trace, name: str) -> tuple[int, ...]:
    owner, _, attr = name.rpartition(".")
    return tuple(getattr(trace.modules[owner], attr).shape)


def _raw_layout(trace: Trace, found: Companion) -> Optional[Layout]:
    """The layout of the parameter or buffer itself, when what met the features was computed from it
    (``weight.view(1, -1)``): the same shape, or a vector as long as the features; else None."""
    shape = _tensor_shape(trace, found.name)
    if shape == found.shape:
        return found.layout
    features = found.layout.dims[found.layout.sharded_dim]
    if len(shape) == 1 and Layout((features,)).shape() == shape:
        return Layout((features,))
    return None


def _spec(layout: Layout, tp: int) -> Optional[ShardSpec]:
    """How a per-feature tensor of ``layout`` is cut: along its sharded dimension, per packed chunk."""
    dim = layout.sharded_dim
    factors = _split_of(layout.dims[dim])
    if factors[-1][0] % tp or factors[-1][1] != 1:
        return None
    chunks = 1
    for size, _ in factors[:-1]:
        chunks *= size
    return ShardSpec(dim, chunks)


def _flow_with_features(
    trace: Trace, columns: dict[str, int], tp: int, copies: dict[str, object]
) -> tuple[_Flow, dict[str, tuple[ShardSpec, frozenset]]]:
    """The flow with every per-feature tensor it finds sharded, followed again until none is new."""
    seeds: dict[str, tuple[Layout, frozenset]] = {}
    wide: frozenset[str] = frozenset()
    while True:
        flow = _run_flow(trace, columns, tp, seeds, copies, wide)
        if flow.widen:
            wide |= flow.widen
            continue
        for module in flow.whole_calls & set(flow.full_width):
            for s in flow.full_width[module]:
                flow.failed.setdefault(
                    s, f"{module} reads all the features in one call, whole values in another"
                )
        grown = dict(seeds)
        for found, sources in flow.companions:
            layout = _raw_layout(trace, found)
            known = grown.get(found.name)
            if layout is None or (known is not None and known[0] != layout):
                why = "is reshaped before it meets the features" if layout is None else "is cut two ways"
                for s in sources | (known[1] if known else frozenset()):
                    flow.failed.setdefault(s, f"the per-feature tensor {found.name!r} {why}")
            else:
                grown[found.name] = (layout, sources | (known[1] if known else frozenset()))
        if grown == seeds:
            break
        seeds = grown
    specs = {}
    for name, (layout, sources) in seeds.items():
        spec = _spec(layout, tp)
        if spec is None:
            for s in sources:
                flow.failed.setdefault(s, f"the per-feature tensor {name!r} does not split over tp={tp}")
        else:
            specs[name] = (spec, sources)
    return flow, specs


def _note_parameter_uses(
    node: Node, trace: Trace, labeled: list, sources: frozenset, flow: _Flow, seeds: dict
) -> None:
    """Record which columns' sharded values each whole parameter meets, and whether it is also used on
    whole values (a use that only computes from parameters, ``1 + weight``, is not a use; per-feature
    tensors, ``seeds``, are sharded, not whole)."""
    inputs = node.inputs()
    params = {trace.parameters[r.key] for r in inputs if r.key in trace.parameters} - set(seeds)
    if not params or all(r.key in trace.parameters for r in inputs):
        return
    for name in params:
        on_shards, whole = flow.parameter_uses.setdefault(name, (set(), [False]))
        if labeled:
            on_shards.update(sources)
        else:
            whole[0] = True


def _unread_aliases(trace: Trace) -> list[str]:
    """Names of tied parameters whose holder is no layer and whose tensor no recorded operation read: the
    holder keeps an alias of a layer's parameter (BERT's ``cls.predictions.bias``)."""
    root = trace.modules[""]
    read = set(trace.parameters.values())
    canonical = {id(p): n for n, p in root.named_parameters()}
    names: dict[int, list[str]] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    unread = []
    for pid, aliases in names.items():
        if len(aliases) < 2 or canonical[pid] in read:
            continue
        for n in aliases:
            holder = trace.modules[n.rpartition(".")[0]]
            if not (is_projection(holder) or isinstance(holder, nn.Embedding)):
                unread.append(n)
    return unread


def _regions(rows: dict[str, set[str]], order: list[str]) -> list[set[str]]:
    """Columns joined by a shared row partner (q, k, v and their output projection), with the partners."""
    regions: list[set[str]] = []
    for row, columns in rows.items():
        members = {row} | columns
        touching = [r for r in regions if r & members]
        for r in touching:
            regions.remove(r)
            members |= r
        regions.append(members)
    first = {name: i for i, name in enumerate(order)}
    return sorted(regions, key=lambda r: min(first.get(n, len(first)) for n in r))


def _divisible_attributes(module: nn.Module, value: int) -> list[str]:
    """Integer attributes of ``module``, or of a plain object it holds (``config.n_head``), equal to a
    written size ``value`` and named like a size that splits with the heads."""

    def sizes(obj: object) -> list[str]:
        return [
            k
            for k, v in vars(obj).items()
            if isinstance(v, int)
            and not isinstance(v, bool)
            and v == value
            and not k.startswith("_")
            and DIVIDED.search(k)
            and not NOT_DIVIDED.search(k)
        ]

    own = sizes(module)
    return own or [f"{h}.{k}" for h, obj in holders(module).items() for k in sizes(obj)]


def find_traced_plan(trace: Trace, tp: int) -> TracedPlan:
    """Column/row pairs, gathered heads and divided attributes proven by ``trace`` for ``tp`` ranks."""
    plan = TracedPlan()
    calls = {
        n.layer: n for n in trace.nodes if n.layer is not None and is_projection(trace.modules.get(n.layer))
    }
    candidates: dict[str, int] = {}
    for name, node in calls.items():
        width = out_features(trace.modules[name])
        k = _chunks(trace, node.outputs[0].key, width) if node.outputs and node.outputs[0] else 1
        if width % (k * tp) == 0:
            candidates[name] = k
        else:
            plan.reasons[name] = f"output width {width} is not divisible by tp={tp}" + (
                f" x {k} chunks" if k > 1 else ""
            )
    copies: dict[str, object] = {}  # column -> ranks holding each head, or its blocks (width, copies)
    head_sizes: dict[str, int] = {}  # a column cut in blocks -> the size of its heads
    while True:
        flow, features = _flow_with_features(trace, candidates, tp, copies)
        wanted: dict[str, object] = {c: n for c, n in flow.copies.items() if candidates.get(c) == 1}
        for c, (widths, head) in flow.parts.items():
            blocks = _blocks(trace, calls[c], widths, tp, head) if candidates.get(c) == 1 else None
            if blocks is not None:
                wanted[c], head_sizes[c] = blocks
            else:
                flow.failed.setdefault(
                    c, f"its output is cut into blocks {list(widths)} that do not split over tp={tp}"
                )
        wanted = {c: n for c, n in wanted.items() if c not in copies}
        if wanted:  # heads fewer than the ranks, or blocks of unequal widths: the flow followed again
            copies.update(wanted)
            continue
        bad = dict(flow.failed)
        partnered = set().union(*flow.rows.values()) if flow.rows else set()
        for name in candidates:
            if name not in partnered:
                bad.setdefault(name, "no row-parallel partner: its output is not reduced by a projection")
        for row, columns in flow.rows.items():  # a partner of columns that all fail is a candidate still
            if row in candidates and not columns <= set(bad):
                bad.setdefault(row, "row-parallel partner of " + ", ".join(sorted(columns)))
        # a written size with no attribute to divide may be computed from a split tensor's shape: kept,
        # and the dry run (tensor.dry_run) drops the region if it was not
        attributes: dict[tuple[str, str], set[str]] = {}
        attribute_copies: dict[tuple[str, str], int] = {}
        for demand, sources in flow.demands:
            for a in _divisible_attributes(trace.modules.get(demand.owner, nn.Module()), demand.value):
                attributes.setdefault((demand.owner, a), set()).update(sources)
                if attribute_copies.setdefault((demand.owner, a), demand.copies) != demand.copies:
                    for s in sources:
                        bad.setdefault(s, f"{demand.owner}.{a} is a size of heads cut two ways")
        for column, size in head_sizes.items():  # the head count of each block that shrinks on a rank
            if column not in candidates:
                continue
            owner = column.rpartition(".")[0]
            for width, held in (b for b in copies[column] if b[1] < tp):
                for a in _divisible_attributes(trace.modules[owner], width // size):
                    attributes.setdefault((owner, a), set()).add(column)
                    if attribute_copies.setdefault((owner, a), held) != held:
                        bad.setdefault(column, f"{owner}.{a} is a size of heads cut two ways")
        if not bad:
            break
        for name, why in bad.items():
            candidates.pop(name, None)
            plan.reasons[name] = why
    plan.columns = candidates
    plan.copies = {c: n for c, n in copies.items() if c in candidates and isinstance(n, int)}
    plan.parts = {c: n for c, n in copies.items() if c in candidates and isinstance(n, tuple)}
    plan.rows = set(flow.rows)
    plan.attributes = attributes
    plan.attribute_copies = {k: c for k, c in attribute_copies.items() if c > 1}
    plan.regions = _regions(flow.rows, list(calls))
    plan.gradient_sums = {
        n: set(cols) for n, (cols, _) in flow.parameter_uses.items() if cols and n not in features
    }
    plan.features = {n: spec for n, (spec, _) in features.items()}
    plan.feature_columns = {n: set(cols) for n, (_, cols) in features.items()}
    plan.full_width = {m: set(cols) for m, cols in flow.full_width.items() if m not in flow.whole_calls}
    plan.unread = _unread_aliases(trace)
    called = (n.layer for n in trace.nodes if n.layer is not None)
    plan.experts = list(dict.fromkeys(n for n in called if is_experts(trace.modules.get(n, nn.Module()))))
    for name in calls:
        plan.reasons.pop(name, None) if name in plan.columns or name in plan.rows else None
    embeddings = [m for m in trace.modules.values() if isinstance(m, nn.Embedding)]
    heads = [n for n in calls if n in plan.reasons and _is_output_head(trace.modules[n], tp, embeddings)]
    for name in heads:  # tied to an embedding, or the last projection onto a vocabulary
        if _tied(trace.modules[name], embeddings) or name == heads[-1]:
            plan.gathered.add(name)
            plan.reasons.pop(name)
    return plan


def _tied(module: nn.Module, embeddings: list[nn.Embedding]) -> bool:
    return any(e.weight is module.weight for e in embeddings)


def _is_output_head(module: Optional[nn.Module], tp: int, embeddings: list[nn.Embedding]) -> bool:
    """A Linear onto a vocabulary (tied to its embedding, or as wide): worth splitting whatever its share of
    the model (1 B parameters of a 70 B model), though its output must be gathered for the loss."""
    if not isinstance(module, nn.Linear) or module.out_features % tp:
        return False
    return _tied(module, embeddings) or any(e.num_embeddings == module.out_features for e in embeddings)
