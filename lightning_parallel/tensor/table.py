"""The plan as a table: each planned module, its style, local weight shape, parameters per rank and the
communication it adds, with totals. Computed from the unsharded module and a resolved plan, so it can be
printed before any process exists (``python -m lightning_parallel.cli.plan_table``).

Communication is per call of the module in one forward+backward, in elements per token (the batch and
sequence sizes multiply it). Column-parallel layers that share a parent share one backward all-reduce of
their input (q, k and v), as the layers do at run time. Attention is counted as self-attention: used
for cross-attention it adds one backward all-reduce (for the gradient of the keys' and values' source).
A mixture of experts' experts module adds one all-reduce forward (after the weighted combine) and one
backward (the hidden states' and the routing weights' gradients together).
With sequence parallelism (``resolved.sequence``) the rows say where the sequence is cut and gathered: each
pair's module gathers its input (all-gather forward, reduce-scatter backward, and an all-gather of the part
it saved for backward) in place of its column-parallel layers' all-reduce, and its row-parallel layer
reduce-scatters; the totals then count those.
With expert parallelism (``resolved.experts``, a ``moe.expert_traffic.ExpertPlacement``; ``expert_placement``
traces its experts' calls) each experts module's row holds its ``num_experts / ep`` whole experts and its
all-to-alls (the counts, the dispatch and the combine forward, the two row exchanges backward), and the
lines below the table give their bytes per step from the traced batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.moe.expert_traffic import ExpertCall, ExpertPlacement, recorded_calls
from lightning_parallel.moe.experts import experts_layout, find_hf_experts
from lightning_parallel.tensor.expert_layer import experts_shards
from lightning_parallel.tensor.fake import fake_step
from lightning_parallel.tensor.layers import _linear_shape
from lightning_parallel.tensor.plan import ResolvedPlan

__all__ = [
    "PlanRow",
    "expert_placement",
    "plan_rows",
    "params_per_rank",
    "collectives_per_step",
    "format_table",
    "feature_tensors",
]


@dataclass
class PlanRow:
    name: str
    style: str
    local_shape: str
    params_per_rank: int
    forward: str
    backward: str


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _local(a, tp: int) -> tuple[str, int, str, str]:
    m, style, opts = a.module, a.style, a.options
    if style in ("colwise", "rowwise"):
        n_in, n_out, transposed = _linear_shape(m)
        # a column's blocks held by several ranks each (parts) keep more than 1/tp of its outputs
        cols = sum(w * c // tp for w, c in opts.get("parts", ())) or n_out // tp
        local = [cols, n_in] if style == "colwise" else [n_out, n_in // tp]
        shape = str(local[::-1] if transposed else local)
    if style == "colwise":
        bias = 0 if m.bias is None else cols
        fwd = f"all-gather {n_out}/tok" if opts.get("gather_output") else "-"
        return shape, cols * n_in + bias, fwd, f"all-reduce {n_in}/tok"
    if style == "rowwise":
        bias = 0 if m.bias is None else n_out
        bwd = "-" if opts.get("input_is_parallel", True) else f"all-gather {n_in}/tok"
        return shape, m.weight.numel() // tp + bias, f"all-reduce {n_out}/tok", bwd
    if style == "vocab":
        return (
            f"[{m.num_embeddings // tp}, {m.embedding_dim}]",
            m.weight.numel() // tp,
            f"all-reduce {m.embedding_dim}/tok",
            "-",
        )
    if style == "attention":
        e = m.embed_dim
        n = (
            m.in_proj_weight.numel()
            + (m.in_proj_bias.numel() if m.in_proj_bias is not None else 0)
            + m.out_proj.weight.numel()
        ) // tp + (m.out_proj.bias.numel() if m.out_proj.bias is not None else 0)
        return f"[{3 * e // tp}, {e}]+[{e}, {e // tp}]", n, f"all-reduce {e}/tok", f"all-reduce {e}/tok"
    if style == "experts":
        return _experts_row(m, tp)
    return "(full)", _numel(m), "-", "-"


def _width(m: nn.Module) -> str:
    """The features a ``full_width`` module reads: its weight's length (a norm), else "features"."""
    vectors = [p.shape[0] for p in m.parameters() if p.dim() == 1]
    return str(max(vectors)) if vectors else "features"


def _experts_row(m: nn.Module, tp: int) -> tuple[str, int, str, str]:
    """Every expert's weights with their intermediate features cut; the partial outputs summed after the
    weighted combine, and backward the gradients of the hidden states and of the top-k routing weights
    summed in one all-reduce (per token: hidden + top-k elements)."""
    lay, cut = experts_layout(m), experts_shards(m)
    local = {lay.up: lay.parts * lay.intermediate // tp, "down_proj": lay.intermediate // tp}
    shapes = []
    for name, spec in cut.items():
        shape = list(getattr(m, name).shape)
        shape[spec.dim] = local[name]
        shapes.append(str(shape))
    top_k = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
    routing = f"+{top_k}" if isinstance(top_k, int) else "+top-k"
    n = sum(p.numel() // tp if name in cut else p.numel() for name, p in m.named_parameters())
    return "+".join(shapes), n, f"all-reduce {lay.hidden}/tok", f"all-reduce {lay.hidden}{routing}/tok"


def feature_tensors(resolved: ResolvedPlan, owner: str) -> list[str]:
    """The local names of ``owner``'s tensors that the plan cuts with the features."""
    return [n.rpartition(".")[2] for n in resolved.features if n.rpartition(".")[0] == owner]


def _per_feature(a, resolved: ResolvedPlan) -> tuple[str, int, set[int]]:
    """A per-feature module's row: its cut tensors with their local shapes, parameters per rank, and the
    ids of the parameters it covers (a module may hold others that stay whole)."""
    tp, shapes, n, ids = resolved.tp_size, [], 0, set()
    for local in feature_tensors(resolved, a.name):
        t = getattr(a.module, local)
        shape = list(t.shape)
        shape[resolved.features[f"{a.name}.{local}" if a.name else local].dim] //= tp
        shapes.append(f"{local} {shape}")
        if isinstance(t, nn.Parameter):
            n, ids = n + t.numel() // tp, ids | {id(t)}
    return ", ".join(shapes), n, ids


def _sequence_rows(module: nn.Module, resolved: ResolvedPlan, rows: list[PlanRow]) -> list[PlanRow]:
    """``rows`` as sequence parallelism changes them, with a row for each place the sequence is cut or
    gathered (per call, elements per token of the whole sequence)."""
    seq, styles = resolved.sequence, {a.name: a for a in resolved.assignments}
    width = {r.rpartition(".")[0]: _linear_shape(styles[r].module)[1] for r in seq.rows}
    hidden = next(iter(width.values()))
    changed = []
    for r in rows:
        if r.name in seq.rows:
            n = width[r.name.rpartition(".")[0]]
            r = PlanRow(
                r.name,
                r.style,
                r.local_shape,
                r.params_per_rank,
                f"reduce-scatter {n}/tok",
                f"all-gather {n}/tok",
            )
        elif r.style == "colwise" and r.name.rpartition(".")[0] in seq.regions:
            r = PlanRow(r.name, r.style, r.local_shape, r.params_per_rank, r.forward, "-")
        elif r.name in seq.exits and r.style == "colwise":
            gather = f"all-gather {_linear_shape(styles[r.name].module)[0]}/tok"
            forward = gather if r.forward == "-" else f"{gather}, {r.forward}"
            back = gather.replace("all-gather", "reduce-scatter")
            r = PlanRow(r.name, r.style, r.local_shape, r.params_per_rank, forward, back)
        changed.append(r)
    extra = [PlanRow(seq.enter, "sequence cut", "-", 0, "-", f"all-gather {hidden}/tok")]
    extra += [
        PlanRow(
            g, "sequence gather", "-", 0, f"all-gather {w}/tok", f"reduce-scatter {w}/tok, all-gather {w}/tok"
        )
        for g, w in ((g, width[g]) for g in seq.regions)
    ]
    extra += [
        PlanRow(e, "sequence gather", "-", 0, f"all-gather {hidden}/tok", "-")
        for e in seq.exits
        if e not in styles or styles[e].style != "colwise"
    ]
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    last = changed.pop()  # everything left replicated
    return sorted(changed + extra, key=lambda r: order.get(r.name, len(order))) + [last]


def plan_rows(module: nn.Module, resolved: ResolvedPlan, sequence: bool = True) -> list[PlanRow]:
    """One row per planned module, in the model's order, then one for everything left replicated; with
    the places sequence parallelism cuts and gathers the sequence when the plan has them (``sequence``)."""
    tp = resolved.tp_size
    rows, seen_entry, covered = [], set(), set()
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    placed = find_hf_experts(module) if resolved.experts is not None else {}
    for name, m in placed.items():  # whole experts on the ep ranks, reached by all-to-all
        fwd, bwd = resolved.experts.comm(m, name)
        shape, n = resolved.experts.local_shape(m), resolved.experts.params_per_rank(m)
        rows.append(PlanRow(name, f"experts ep={resolved.experts.ep}", shape, n, fwd, bwd))
        covered.update(id(p) for p in m.parameters())
    split = resolved.assignments if tp > 1 else []  # at tp=1 the strategies split nothing
    for a in sorted(split, key=lambda a: order.get(a.name, len(order))):
        if a.name in placed:
            continue
        if a.style == "per_feature":  # cut with the features of its pair: no communication
            shape, n, ids = _per_feature(a, resolved)
            rows.append(PlanRow(a.name or "(root)", a.style, shape, n, "-", "-"))
            covered.update(ids)
            continue
        if a.style == "full_width":  # run on all the features: whole parameters, gathered input
            gather = f"all-gather {_width(a.module)}/tok"
            rows.append(PlanRow(a.name, a.style, "(full)", _numel(a.module), gather, gather))
            covered.update(id(p) for p in a.module.parameters())
            continue
        shape, n, fwd, bwd = _local(a, tp)
        if a.style == "colwise":  # one shared backward all-reduce per parent (q, k, v)
            parent = a.name.rpartition(".")[0]
            if parent in seen_entry:
                bwd = "(shared)"
            seen_entry.add(parent)
        if a.style != "replicate":  # a weight tied to one already counted (embedding and head) is held once
            n -= sum(p.numel() // tp for p in a.module.parameters() if id(p) in covered)
        rows.append(PlanRow(a.name, a.style, shape, n, fwd, bwd))
        covered.update(id(p) for p in a.module.parameters())
    if placed:
        rows.sort(key=lambda r: order.get(r.name, len(order)))
    rest = sum(p.numel() for p in module.parameters() if id(p) not in covered)
    rows.append(PlanRow("(all other parameters)", "replicate", "(full)", rest, "-", "-"))
    return _sequence_rows(module, resolved, rows) if sequence and resolved.sequence is not None else rows


def params_per_rank(module: nn.Module, resolved: ResolvedPlan) -> int:
    return sum(r.params_per_rank for r in plan_rows(module, resolved))


def collectives_per_step(rows: list[PlanRow]) -> tuple[int, int]:
    """(forward, backward) collectives, counting each module call once."""
    fwd = sum(r.forward.count(",") + 1 for r in rows if r.forward != "-")
    bwd = sum(r.backward.count(",") + 1 for r in rows if r.backward not in ("-", "(shared)"))
    return fwd, bwd


def format_table(module: nn.Module, resolved: ResolvedPlan) -> str:
    rows = plan_rows(module, resolved)
    total = _numel(module)
    header = ("module", "style", "local weight", "params/rank", "forward comm", "backward comm")
    table = [header] + [
        (r.name, r.style, r.local_shape, f"{r.params_per_rank:,}", r.forward, r.backward) for r in rows
    ]
    per_rank = sum(r.params_per_rank for r in rows)
    fwd, bwd = collectives_per_step(rows)
    layout = f"tp={resolved.tp_size}" + (f" ep={resolved.experts.ep}" if resolved.experts is not None else "")
    table.append(("TOTAL", layout, "", f"{per_rank:,}", f"{fwd} collectives", f"{bwd} collectives"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    lines.append(
        f"parameters: {total:,} in the model, {per_rank:,} per rank ({per_rank / max(total, 1):.0%})"
    )
    for owner, attr, value in resolved.attributes:
        lines.append(
            f"attribute {owner}.{attr}: {value} -> {resolved.local_value(owner, attr, value)} per rank"
        )
    for name, why in resolved.report:
        lines.append(f"replicated {name}: {why}")
    if resolved.experts is not None:
        lines += resolved.experts.summary(module)
    if resolved.sequence is not None:
        seq = resolved.sequence
        plain = collectives_per_step(plan_rows(module, resolved, sequence=False))
        lines.append(
            f"sequence parallel: dimension {seq.dim} cut at {seq.enter}, gathered at {', '.join(seq.exits)}; "
            f"collectives per step {fwd} forward + {bwd} backward, without it {plain[0]} + {plain[1]}"
        )
    return "\n".join(lines)


def expert_placement(module: nn.Module, ep: int, run: Optional[Any]) -> ExpertPlacement:
    """The placement of ``module``'s experts on ``ep`` ranks, with their calls in the step ``run`` (a
    ``SampleStep``) traced on fake tensors; none where ``run`` is None or the step cannot run on fake
    tensors (as ``plan="auto"`` then decides without a trace; the table says it was not traced)."""
    calls: dict[str, list[ExpertCall]] = {}
    if run is not None and find_hf_experts(module):
        try:
            with recorded_calls(module) as calls, fake_step(module, run) as step, torch.no_grad():
                step()
        except Exception:  # noqa: BLE001  (a step that cannot run on fakes: not traced)
            calls = {}
    return ExpertPlacement(ep, calls)
