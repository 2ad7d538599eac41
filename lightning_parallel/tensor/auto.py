"""``plan="auto"``: find a sharding plan, from the data flow when a forward can be run.

With a sample forward (``run``: the strategy passes the user's ``training_step`` on the first batch, the
plan table ``example_input_array``), ``traced_plan.find_traced_plan`` reads the operator-level trace
(``tensor.trace``, run on fake tensors: no weights or activations are allocated, and the module may be on
the meta device) and keeps every column-parallel choice whose sharded values the model's own code handles
correctly up to a row-parallel partner (``tensor.shard_flow``): MLP pairs in a submodule or inline, gated
products (SwiGLU), attention through ``scaled_dot_product_attention`` or matmul-softmax, fused q/k/v
split per chunk or per block of unequal widths (multi-query and grouped-query layouts), key-value heads
fewer than the ranks held by the ranks that read them, grouped-query attention, ``Conv1D``, the experts
of a Hugging Face mixture of experts (each expert's MLP split as a pair: ``moe.experts``, called with
whole inputs); sizes written in ``forward`` (a head count, a split size) are divided through the
attribute they are read from (the module's, or that of a config object it holds: each sharded module
then holds its own copy, ``tensor.attributes``). A large layer whose output is needed whole (the output
head) is column-parallel with a gathered output; tied weights are sharded alike or not at all.
Per-feature layers inside a pair (a BatchNorm, a per-feature scale) have their parameters and buffers
cut with the features; a norm right on a column-parallel output whose statistics span all its features
(OLMo-2's q/k norms) runs on all of them (``tensor.full_width``). ``nn.MultiheadAttention`` and
``nn.Embedding`` are decided by type. The plan is tried on one simulated rank (``dry_run``), and where a
model declares its own plan (Hugging Face's ``_tp_plan``) every disagreement with it is reported
(``declared``).

Without a forward, the structural rules below apply, and the evidence required is:
- ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``/``DecoderLayer``): heads split;
- attention written by hand: a module with an integer head-count attribute (``n_head``, ``num_heads``,
  ...), three q/k/v-named ``nn.Linear`` of equal width and one output projection: q/k/v colwise, the
  projection rowwise, the head count divided;
- MLP pairs (Linear, element-wise ops, Linear): in an ``nn.Sequential`` from the order of its children
  (a BatchNorm between the two is cut with the features);
  in the feed-forward of ``nn.TransformerEncoderLayer``/``DecoderLayer`` (``linear1``/``linear2``); in
  any other small module from a ``torch.fx`` trace that shows the second Linear reads only the first one's
  output through element-wise operations;
- ``nn.Embedding``: vocabulary-parallel;
- a Hugging Face experts module (``moe.experts``: the flags and 3-D weights its decorator gives it):
  each expert's MLP split, unless its layout cannot be (``split_refusal`` says why).

Everything else stays replicated, and the reason is reported.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from lightning_parallel.moe.experts import is_experts
from lightning_parallel.tensor.declared import disagreements
from lightning_parallel.tensor.dry_run import DryRunFailure, dry_run
from lightning_parallel.tensor.expert_layer import split_refusal
from lightning_parallel.tensor.layers import ShardSpec
from lightning_parallel.tensor.plan import (
    ELEMENTWISE,
    PER_FEATURE,
    AttributeRule,
    LayerRule,
    Plan,
    PlanError,
    ResolvedPlan,
    resolve_plan,
    tied_parameters,
)
from lightning_parallel.tensor.trace import is_projection, trace_dataflow
from lightning_parallel.tensor.traced_plan import TracedPlan, find_traced_plan, out_features

__all__ = ["auto_plan", "resolve_auto"]

HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead", "heads")
QKV_NAMES = (("q", "k", "v"), ("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"))
OUT_NAMES = ("proj", "out_proj", "o_proj", "o", "out", "c_proj", "wo", "dense")
ELEMENTWISE_FUNCTIONS = {
    F.relu,
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    F.dropout,
    F.leaky_relu,
    F.elu,
    F.mish,
    F.softplus,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    torch.nn.functional.relu6,
    operator.mul,
    torch.mul,
}
ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid", "contiguous"}
TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class _Finder:
    def __init__(self, module: nn.Module, tp: int) -> None:
        self.module, self.tp = module, tp
        self.layers: dict[str, LayerRule] = {}
        self.attributes: list[AttributeRule] = []
        self.report: dict[str, str] = {}
        self.features: dict[str, ShardSpec] = {}
        self.full_width: dict[str, set[str]] = {}

    def take(self, name: str, style: str, **options: object) -> None:
        self.layers[name] = LayerRule(name, style, dict(options))

    def pair(self, first: str, second: str, between: tuple[str, ...] = ()) -> None:
        """``first`` colwise, ``second`` rowwise; the per-feature modules ``between`` them cut alike."""
        a = self.module.get_submodule(first)
        if a.out_features % self.tp:
            self.report[first] = (
                f"MLP pair with {second}: width {a.out_features} not divisible by tp={self.tp}"
            )
            return
        self.take(first, "colwise")
        self.take(second, "rowwise")
        for name in between:
            self.take(name, "per_feature")

    def run(self) -> None:
        for name, m in self.module.named_modules():
            if name in self.layers or any(name.startswith(n + ".") for n in self.layers):
                continue
            if isinstance(m, nn.MultiheadAttention):
                self.mha(name, m)
            elif isinstance(m, TRANSFORMER_LAYERS):
                self.pair(f"{name}.linear1", f"{name}.linear2")
            elif isinstance(m, nn.Sequential):
                self.sequential(name, m)
            elif isinstance(m, nn.Embedding):
                self.embedding(name, m)
            elif is_experts(m):
                self.experts(name, m)
            elif self.attention(name, m):
                pass
            elif any(isinstance(c, nn.Linear) for c in m.children()):
                self.traced_pairs(name, m)
        for name, m in self.module.named_modules():
            if (
                isinstance(m, (nn.Linear, nn.Embedding))
                and name not in self.layers
                and not self._inside_taken(name)
            ):
                self.report.setdefault(name, "no row-parallel partner found (replicated)")

    def _inside_taken(self, name: str) -> bool:
        return any(name.startswith(n + ".") for n in self.layers)

    def _join(self, prefix: str, child: str) -> str:
        return f"{prefix}.{child}" if prefix else child

    def mha(self, name: str, m: nn.MultiheadAttention) -> None:
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            self.report[name] = "MultiheadAttention with kdim/vdim, add_bias_kv or add_zero_attn"
        elif m.num_heads % self.tp:
            self.report[name] = f"num_heads={m.num_heads} not divisible by tp={self.tp}"
        else:
            self.take(name, "attention")

    def embedding(self, name: str, m: nn.Embedding) -> None:
        if type(m).forward is not nn.Embedding.forward:
            self.report[name] = (
                f"{type(m).__name__} has a forward of its own (the vocabulary-parallel layer would replace it)"
            )
        elif m.num_embeddings % self.tp:
            self.report[name] = f"num_embeddings={m.num_embeddings} not divisible by tp={self.tp}"
        elif m.max_norm is not None or m.sparse or m.scale_grad_by_freq:
            self.report[name] = "embedding with max_norm, sparse or scale_grad_by_freq"
        else:
            self.take(name, "vocab")

    def experts(self, name: str, m: nn.Module) -> None:
        why = split_refusal(m, self.tp)
        if why is None:
            self.take(name, "experts")
        else:
            self.report[name] = f"experts stay whole: {why}"

    def attention(self, name: str, m: nn.Module) -> bool:
        heads = next((a for a in HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        if heads is None:
            return False
        children = dict(m.named_children())
        qkv = next(
            (names for names in QKV_NAMES if all(isinstance(children.get(n), nn.Linear) for n in names)), None
        )
        out = next((n for n in OUT_NAMES if isinstance(children.get(n), nn.Linear)), None)
        if qkv is None or out is None:
            return False
        h = getattr(m, heads)
        widths = {children[n].out_features for n in qkv}
        if (
            len(widths) != 1
            or h % self.tp
            or next(iter(widths)) % h
            or children[out].in_features != next(iter(widths))
        ):
            self.report[name] = (
                f"attention-like module, but {heads}={h} and q/k/v widths {sorted(widths)} "
                f"do not split over tp={self.tp}"
            )
            return True
        for n in qkv:
            self.take(self._join(name, n), "colwise")
        self.take(self._join(name, out), "rowwise")
        self.attributes.append(AttributeRule(self._join(name, heads), "divide"))
        return True

    def sequential(self, name: str, m: nn.Sequential) -> None:
        items = list(m.named_children())
        i = 0
        while i < len(items):
            if isinstance(items[i][1], nn.Linear):
                j = i + 1
                width = items[i][1].out_features
                while j < len(items) and (
                    isinstance(items[j][1], ELEMENTWISE)
                    or (isinstance(items[j][1], PER_FEATURE) and items[j][1].num_features == width)
                ):
                    j += 1
                if (
                    j < len(items)
                    and isinstance(items[j][1], nn.Linear)
                    and items[j][1].in_features == items[i][1].out_features
                ):
                    between = tuple(
                        self._join(name, n) for n, c in items[i + 1 : j] if isinstance(c, PER_FEATURE)
                    )
                    self.pair(self._join(name, items[i][0]), self._join(name, items[j][0]), between)
                    i = j + 1
                    continue
            i += 1

    def traced_pairs(self, name: str, m: nn.Module) -> None:
        """Pairs proven by a ``torch.fx`` trace of ``m`` (only small modules made of Linears and
        element-wise children are traced)."""
        if not all(isinstance(c, (nn.Linear,) + ELEMENTWISE) for c in m.children()):
            return
        try:
            graph = torch.fx.symbolic_trace(m).graph
        except Exception as err:  # noqa: BLE001  (any tracing failure means "not proven")
            self.report[name] = f"could not trace to find MLP pairs ({type(err).__name__})"
            return
        linear = {
            n: n.target
            for n in graph.nodes
            if n.op == "call_module" and isinstance(m.get_submodule(n.target), nn.Linear)
        }

        def elementwise(node: torch.fx.Node) -> bool:
            if node.op == "call_module":
                return isinstance(m.get_submodule(node.target), ELEMENTWISE)
            if node.op == "call_function":
                return node.target in ELEMENTWISE_FUNCTIONS
            return node.op == "call_method" and node.target in ELEMENTWISE_METHODS

        for node, target in linear.items():
            src: Optional[torch.fx.Node] = node.args[0] if node.args else None
            while (
                isinstance(src, torch.fx.Node)
                and src not in linear
                and elementwise(src)
                and len(src.users) == 1
            ):
                tensor_args = [a for a in src.args if isinstance(a, torch.fx.Node)]
                src = tensor_args[0] if len(tensor_args) == 1 else None
            if isinstance(src, torch.fx.Node) and src in linear and len(src.users) == 1 and src is not node:
                first, second = linear[src], target
                full_first, full_second = self._join(name, first), self._join(name, second)
                if full_first not in self.layers and full_second not in self.layers:
                    self.pair(full_first, full_second)


def _untie(finder: _Finder) -> None:
    """Layers holding a tied weight stay replicated, with the partner of their pair."""
    tied = {n.rpartition(".")[0] for names in tied_parameters(finder.module).values() for n in names}
    for name in [n for n in finder.layers if n in tied]:
        finder.layers.pop(name, None)
        finder.report[name] = "holds a tied weight (shared with another layer)"
        parent = name.rpartition(".")[0]
        for other in [n for n in finder.layers if n.rpartition(".")[0] == parent]:
            finder.layers.pop(other)
            finder.report[other] = f"its partner {name} holds a tied weight"
        finder.attributes = [a for a in finder.attributes if a.pattern.rpartition(".")[0] != parent]


def _traced(
    module: nn.Module, tp_size: int, run: Callable[[], Any], fake: bool
) -> tuple[_Finder, TracedPlan]:
    """The plan proven by a trace of ``run``; MultiheadAttention and embeddings decided by type."""
    finder = _Finder(module, tp_size)
    for name, m in module.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            finder.mha(name, m)
        elif isinstance(m, nn.Embedding):
            finder.embedding(name, m)
    trace = trace_dataflow(module, run, fake)
    found = find_traced_plan(trace, tp_size)
    for name, chunks in found.columns.items():
        if name in found.parts:  # a fused q|k|v of unequal widths, cut per block
            finder.take(name, "colwise", parts=found.parts[name])
        elif name in found.copies:  # one block, each of its heads held by several ranks
            finder.take(
                name, "colwise", parts=((out_features(module.get_submodule(name)), found.copies[name]),)
            )
        else:
            finder.take(name, "colwise", **({"chunks": chunks} if chunks > 1 else {}))
    for name in found.rows:
        finder.take(name, "rowwise")
    for name in found.gathered:
        finder.take(name, "colwise", gather_output=True)
    for name in found.experts:
        finder.experts(name, module.get_submodule(name))
    finder.features = dict(found.features)
    finder.full_width = {m: set(cols) for m, cols in found.full_width.items()}
    finder.attributes = [
        AttributeRule(
            f"{owner}.{attr}" if owner else attr, "divide", found.attribute_copies.get((owner, attr), 1)
        )
        for owner, attr in sorted(found.attributes)
    ]
    for name, m in module.named_modules():
        if is_projection(m) and name not in finder.layers and not finder._inside_taken(name):
            finder.report.setdefault(name, found.reasons.get(name, "not called in the traced forward"))
    return finder, found


def _repeated(name: str) -> str:
    """``blocks.3.attn.q`` -> ``blocks.*.attn.q``: the same layer in every repeated block."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _drop_failing_region(finder: _Finder, found: TracedPlan, failure: DryRunFailure) -> bool:
    """Replicate the first region in call order that the failing module holds or sits in, and the same
    region in every repeated block; False when no region is to blame."""
    where = failure.module
    experts = [
        n for n, r in finder.layers.items() if r.style == "experts" and (where + ".").startswith(n + ".")
    ]
    if experts:  # the same experts in every repeated block stay whole
        for name in [n for n in finder.layers if _repeated(n) == _repeated(experts[0])]:
            finder.layers.pop(name)
            finder.report[name] = f"sharded, the forward fails on a rank in {where!r} ({failure})"
        return True
    inside = [
        r
        for r in found.regions
        if any(n == where or n.startswith(where + ".") or where.startswith(n + ".") or not where for n in r)
    ]
    if not inside:
        return False
    patterns = {_repeated(n) for n in inside[0]}
    dropped = [r for r in found.regions if {_repeated(n) for n in r} == patterns]
    names = set().union(*dropped)
    for r in dropped:
        found.regions.remove(r)
    for tensor in [t for t, cols in found.feature_columns.items() if cols <= names]:
        finder.features.pop(tensor, None)
    for module in [m for m, cols in finder.full_width.items() if cols <= names]:
        finder.full_width.pop(module)
    for name in names:
        finder.layers.pop(name, None)
        finder.report[name] = (
            f"sharded, the forward fails on a rank in {where or 'the root module'!r} ({failure})"
        )
    stale = {
        f"{owner}.{attr}" if owner else attr
        for (owner, attr), cols in found.attributes.items()
        if cols <= names
    }
    finder.attributes = [a for a in finder.attributes if a.pattern not in stale]
    return True


def _untie_inconsistent(finder: _Finder, unread: frozenset = frozenset()) -> None:
    """A tied weight is sharded on every holder alike, or on none (repeated: replicating one holder can
    make another tie inconsistent); a holder whose code never reads it (``unread``) follows the others."""
    changed = True
    while changed:
        changed = False
        for names in tied_parameters(finder.module).values():
            holders = {n.rpartition(".")[0] for n in names if n not in unread}
            rules = [finder.layers.get(h) for h in holders]
            if all(r is None for r in rules) or all(
                r is not None and (r.style == "vocab" or r.options.get("gather_output")) for r in rules
            ):
                continue
            changed = True
            for h in holders:
                finder.layers.pop(h, None)
                finder.report[h] = "holds a tied weight that another of its holders cannot shard alike"


def auto_plan(
    module: nn.Module, tp_size: int, run: Optional[Callable[[], Any]] = None, fake: bool = True
) -> tuple[Plan, list[tuple[str, str]]]:
    """A plan for ``module`` and the list of (name, reason) of what stays replicated; from a trace of
    ``run()`` (a forward of ``module``, on fake tensors; ``fake=False`` runs it on the real ones, for the
    tests' comparison) when given, tried on one simulated rank, else from the module's structure. A step
    that cannot run on fake tensors (its work depends on values) leaves the structural rules to decide."""
    if run is None:
        finder = _Finder(module, tp_size)
        finder.run()
        _untie(finder)
        return Plan(list(finder.layers.values()), finder.attributes), sorted(finder.report.items())
    try:
        finder, found = _traced(module, tp_size, run, fake)
    except Exception as error:  # noqa: BLE001  (the user's step would not run outside the fit loop)
        plan, report = auto_plan(module, tp_size)
        why = (
            f"the sample step could not be traced ({type(error).__name__}: {error}); structural rules decided"
        )
        return plan, [("(whole model)", why), *report]
    unread = frozenset(found.unread)
    while True:
        _untie_inconsistent(finder, unread)
        kept = {n for n, rule in finder.layers.items() if rule.style != "replicate"}
        sums = sorted(n for n, cols in found.gradient_sums.items() if cols & kept)
        finder.features = {t: s for t, s in finder.features.items() if found.feature_columns[t] & kept}
        wide = sorted(m for m, cols in finder.full_width.items() if cols & kept)
        plan = Plan(
            list(finder.layers.values()),
            finder.attributes,
            sums,
            sorted(unread),
            finder.features,
            full_width=wide,
        )
        failure = dry_run(module, _checked(module, plan, tp_size, traced=True), run, fake)
        if failure is None:
            styles = {name: rule.style for name, rule in finder.layers.items()}
            styles.update({name.rpartition(".")[0]: "gradient_sum" for name in sums})
            for name, declared in disagreements(module, styles).items():
                finder.report[name] = f"{finder.report.get(name, 'not split')}; {declared}"
            return plan, sorted(finder.report.items())
        if not _drop_failing_region(finder, found, failure):
            raise PlanError(
                f"the automatic plan fails on a rank in {failure.module or 'the root module'!r} ({failure}) and no "
                "sharded region is to blame; write a plan (docs/tensor_parallel.md)"
            )


def _checked(module: nn.Module, plan: Plan, tp_size: int, traced: bool) -> ResolvedPlan:
    try:
        return resolve_plan(module, plan, tp_size, check_dataflow=not traced)
    except PlanError as err:  # a bug in the finder, not in the user's input
        raise PlanError(f"the automatic plan is inconsistent ({err}); write a plan instead") from err


def resolve_auto(
    module: nn.Module, tp_size: int, run: Optional[Callable[[], Any]] = None, fake: bool = True
) -> ResolvedPlan:
    """``auto_plan`` resolved and validated like a written plan."""
    plan, report = auto_plan(module, tp_size, run, fake)
    resolved = _checked(module, plan, tp_size, traced=run is not None)
    resolved.report = report
    return resolved
