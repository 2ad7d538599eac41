"""Sharding plans: which layers of a module are split, and how. Parse, validate, apply.

A plan maps module-name patterns to a style; ``*`` matches exactly one dotted segment::

    layers:
      model.tok_emb: vocab
      model.blocks.*.attn.q: colwise
      model.blocks.*.attn.proj: rowwise
      model.head: {style: colwise, gather_output: true}
    attributes:
      model.blocks.*.attn.n_head: divide      # the head count each rank sees

A flat mapping works too (a value ``divide`` marks an attribute). Styles: ``colwise``
(``gather_output``), ``rowwise`` (``input_is_parallel``, default true), ``vocab``, ``attention`` (for
``nn.MultiheadAttention``), ``experts`` (a Hugging Face mixture-of-experts block's experts module: each
expert's MLP split as a column/row pair, ``tensor.expert_layer``), ``per_feature``, ``full_width`` and
``replicate``. Names are those of
``module.named_modules()``; an attribute may be one of a plain object the module holds
(``model.h.*.attn.config.n_head: divide``, ``tensor.attributes``).

``per_feature`` is for a layer between a colwise layer and its rowwise partner that computes each
feature from that feature alone (a BatchNorm, a per-feature scale): its parameters and buffers, vectors
as long as the features, are cut with them (a count such as ``num_batches_tracked`` stays whole). A
BatchNorm between a colwise layer and its rowwise partner in an ``nn.Sequential`` is taken as
``per_feature`` without being named: it could not run on split features otherwise.

``full_width`` is for a module fed a colwise layer's split output that needs all of its features (a norm
over the whole q or k projection, as OLMo-2's): it runs on all of them, with its whole parameters, and
each rank keeps its slice of the output (``tensor.full_width``).

Everything is checked on the unsharded module before anything is changed, and each problem is reported
with the offending name and what would work: ``resolve_plan`` never returns a plan ``apply_plan``
cannot carry out.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn

from lightning_parallel.checkpointing.one_device import keep_skeleton
from lightning_parallel.module_names import match_pattern
from lightning_parallel.moe.experts import ExpertsType
from lightning_parallel.tensor.attributes import (
    attribute_targets,
    divide_attributes,
    local_value,
    read_attribute,
)
from lightning_parallel.tensor.expert_layer import ParallelExperts, split_refusal
from lightning_parallel.tensor.full_width import run_full_width
from lightning_parallel.tensor.gradient_sums import GradientSums, gradient_sums_for
from lightning_parallel.tensor.layers import (
    TP_LAYERS,
    ShardSpec,
    SharedEntry,
    _linear_shape,
    _TPLayer,
    check_parts,
    shard_features,
)
from lightning_parallel.tensor.replicated_blocks import Replicated

__all__ = [
    "PlanError",
    "LayerRule",
    "AttributeRule",
    "Plan",
    "Assignment",
    "ResolvedPlan",
    "parse_plan",
    "check_sequence_section",
    "SEQUENCE_KEYS",
    "resolve_plan",
    "apply_plan",
    "install_gradient_sums",
    "STYLES",
    "KEPT_STYLES",
    "ELEMENTWISE",
    "PER_FEATURE",
    "named_plans",
]

STYLES = ("colwise", "rowwise", "vocab", "attention", "experts", "per_feature", "full_width", "replicate")
# styles whose module stays the user's object (not replaced by a tensor-parallel layer)
KEPT_STYLES = ("replicate", "per_feature", "full_width")
OPTIONS: dict[str, dict[str, Any]] = {
    "colwise": {"gather_output": False, "chunks": 1, "parts": ()},
    "rowwise": {"input_is_parallel": True},
    "vocab": {},
    "attention": {},
    "experts": {},
    "per_feature": {},
    "full_width": {},
    "replicate": {},
}
SEQUENCE_KEYS = ("dim", "enter", "exit")  # a plan's ``sequence`` section (``tensor.sequence_plan``)
ATTRIBUTE_ACTIONS = ("divide",)
# Modules that act on each feature independently: a sharded last dimension passes through them unchanged.
ELEMENTWISE: tuple[type, ...] = (
    nn.ReLU,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Dropout,
    nn.Identity,
)
# Modules whose statistics and parameters are per feature (channel): taken as ``per_feature`` between a
# colwise layer and its rowwise partner in an ``nn.Sequential``.
PER_FEATURE: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm,)
# plan style -> (layer class, the module types it replaces)
LAYERS = {**TP_LAYERS, "experts": (ParallelExperts, (ExpertsType,))}


class PlanError(ValueError):
    """A sharding plan that does not fit the module it is applied to."""


@dataclass(frozen=True)
class LayerRule:
    pattern: str
    style: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AttributeRule:
    pattern: str  # "owner.pattern.attribute"
    action: str = "divide"
    copies: int = 1  # a count of heads each held by this many ranks: divided by tp // copies


@dataclass
class Plan:
    layers: list[LayerRule] = field(default_factory=list)
    attributes: list[AttributeRule] = field(default_factory=list)
    # whole parameters used only on split values (a per-head norm's weight): gradients summed over the group
    gradient_sums: list[str] = field(default_factory=list)
    # names of tied parameters that their module's own code never reads (BERT's cls.predictions.bias, an
    # alias of the decoder's): they may take the shard of the layer they are tied to
    unread: list[str] = field(default_factory=list)
    # parameters and buffers cut with the features they meet (found by ``plan="auto"``): name -> how
    features: dict[str, ShardSpec] = field(default_factory=dict)
    # the ``sequence`` section (where sequence parallelism cuts the sequence), read by tensor.sequence_plan
    sequence: dict[str, Any] = field(default_factory=dict)
    # modules run on all the features of their split input (a norm over a whole q/k projection), found by
    # ``plan="auto"``: listed like a written ``full_width`` module
    full_width: list[str] = field(default_factory=list)


@dataclass
class Assignment:
    """One module of the actual model and what happens to it."""

    name: str
    module: nn.Module
    style: str
    options: dict[str, Any]


@dataclass
class ResolvedPlan:
    assignments: list[Assignment]
    attributes: list[tuple[str, str, int]]  # (owner module name, attribute, value before dividing)
    tp_size: int
    report: list[tuple[str, str]] = field(default_factory=list)  # (name, why it stays replicated), from auto
    gradient_sums: list[str] = field(default_factory=list)  # parameter names, see Plan
    features: dict[str, ShardSpec] = field(default_factory=dict)  # per-feature tensors, see Plan
    sequence: Any = None  # a tensor.sequence.SequencePlan when sequence parallelism is on
    experts: Any = None  # a moe.expert_traffic.ExpertPlacement when the table shows expert parallelism
    copies: dict[tuple[str, str], int] = field(default_factory=dict)  # attributes of heads held by several

    def styles(self) -> dict[str, str]:
        return {a.name: a.style for a in self.assignments}

    @property
    def full_width(self) -> list[str]:
        """The modules run on all the features of their split input (``tensor.full_width``)."""
        return [a.name for a in self.assignments if a.style == "full_width"]

    def local_value(self, owner: str, attr: str, value: int) -> int:
        """What a divided attribute holds on each rank (``tensor.attributes.local_value``)."""
        return local_value(value, self.tp_size, self.copies.get((owner, attr), 1))


# ---------------------------------------------------------------------------------------------- parse
# Where named plans (``plan="char_gpt"``) are looked up: the package's own copy, then the repository's.
PLAN_DIRS = (
    Path(__file__).resolve().parents[1] / "conf" / "plan",
    Path(__file__).resolve().parents[2] / "conf" / "plan",
)


def named_plans() -> list[str]:
    return sorted({p.stem for d in PLAN_DIRS if d.is_dir() for p in d.glob("*.yaml")})


def _load_yaml(path: Path) -> Any:
    import yaml

    if not path.is_file() and path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:
        found = [d / f"{path}.yaml" for d in PLAN_DIRS if (d / f"{path}.yaml").is_file()]
        if found:
            path = found[0]
        else:
            raise PlanError(
                f"plan {str(path)!r} is neither a file nor a named plan; named plans: "
                f"{', '.join(named_plans()) or 'none'}; or give a dict, a YAML file path, or 'auto'"
            )
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist; give a dict, a YAML file path, or 'auto'")
    return yaml.safe_load(path.read_text()) or {}


def _rule(pattern: str, value: Any) -> Union[LayerRule, AttributeRule]:
    if value in ATTRIBUTE_ACTIONS:
        return AttributeRule(pattern, value)
    if isinstance(value, str):
        value = {"style": value}
    if not isinstance(value, Mapping) or "style" not in value:
        raise PlanError(
            f"plan entry {pattern!r}: {value!r} is not a style; use one of {', '.join(STYLES)} "
            f"or a mapping like {{style: colwise, gather_output: true}}"
        )
    options = dict(value)
    style = options.pop("style")
    if style not in STYLES:
        raise PlanError(
            f"plan entry {pattern!r}: unknown style {style!r}; use one of {', '.join(STYLES)} "
            "(or 'divide' for a head-count attribute)"
        )
    unknown = set(options) - set(OPTIONS[style])
    if unknown:
        allowed = ", ".join(OPTIONS[style]) or "none"
        raise PlanError(
            f"plan entry {pattern!r}: option(s) {sorted(unknown)} not valid for style {style!r}; "
            f"allowed: {allowed}"
        )
    return LayerRule(pattern, style, options)


def check_sequence_section(section: Any) -> dict[str, Any]:
    """A plan's ``sequence`` section, checked: {dim: int >= 0, enter: name, exit: name or names}."""
    if not isinstance(section, Mapping):
        raise PlanError(f"plan section 'sequence' must be a mapping such as {{dim: 1}}, got {section!r}")
    unknown = sorted(set(section) - set(SEQUENCE_KEYS))
    if unknown:
        raise PlanError(
            f"plan section 'sequence': unknown key(s) {unknown}; allowed: {', '.join(SEQUENCE_KEYS)}"
        )
    dim = section.get("dim", 1)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise PlanError(
            f"plan section 'sequence': dim={dim!r} must be the sequence dimension of the hidden states, an "
            "integer >= 0 (1 for [batch, sequence, features], 0 for [sequence, batch, features])"
        )
    exits = section.get("exit")
    exits = [exits] if isinstance(exits, str) else exits
    if "enter" in section and not isinstance(section["enter"], str):
        raise PlanError(f"plan section 'sequence': enter={section['enter']!r} must be a module name")
    if exits is not None and not (
        isinstance(exits, list) and exits and all(isinstance(e, str) for e in exits)
    ):
        raise PlanError(
            f"plan section 'sequence': exit={section['exit']!r} must be a module name or a list of them"
        )
    return {"dim": dim, "enter": section.get("enter"), "exit": exits}


def parse_plan(spec: Any) -> Plan:
    """A ``Plan`` from a dict (flat, or with ``layers``/``attributes``), a YAML path, or a ``Plan``."""
    if isinstance(spec, Plan):
        return spec
    if isinstance(spec, (str, Path)):
        spec = _load_yaml(Path(spec))
    try:  # a Hydra/OmegaConf node
        from omegaconf import DictConfig, OmegaConf

        if isinstance(spec, DictConfig):
            spec = OmegaConf.to_container(spec, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(spec, Mapping):
        raise PlanError(
            f"a plan must be a mapping of module-name patterns to styles, got {type(spec).__name__}"
        )
    plan = Plan()
    sections = {"layers", "attributes", "sequence"}
    flat = {k: v for k, v in spec.items() if k not in sections}
    entries = list(flat.items()) + list((spec.get("layers") or {}).items())
    for pattern, value in entries:
        rule = _rule(str(pattern), value)
        (plan.attributes if isinstance(rule, AttributeRule) else plan.layers).append(rule)
    for pattern, action in (spec.get("attributes") or {}).items():
        if action not in ATTRIBUTE_ACTIONS:
            raise PlanError(
                f"attribute {pattern!r}: unknown action {action!r}; use one of {ATTRIBUTE_ACTIONS}"
            )
        plan.attributes.append(AttributeRule(str(pattern), action))
    if "sequence" in spec:
        check_sequence_section(spec["sequence"])
        plan.sequence = dict(spec["sequence"])
    return plan


# ---------------------------------------------------------------------------------------------- resolve
def _no_match(pattern: str, names: list[str], what: str = "module") -> PlanError:
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
    hint = (
        f"closest module names: {', '.join(close)}"
        if close
        else f"module names look like: {', '.join(names[:5])}"
    )
    return PlanError(f"plan pattern {pattern!r} matches no {what} of the model; {hint}")


def _type_error(name: str, module: nn.Module, style: str) -> PlanError:
    expected = " or ".join(t.__name__ for t in LAYERS[style][1])
    suggest = {
        nn.Embedding: "vocab",
        nn.MultiheadAttention: "attention",
        nn.Linear: "colwise or rowwise",
        TP_LAYERS["colwise"][1][1]: "colwise or rowwise",
        ExpertsType: "experts",
    }
    alt = next((s for t, s in suggest.items() if isinstance(module, t)), "replicate")
    return PlanError(
        f"style {style!r} applies to {expected}, but {name!r} is a {type(module).__name__}; "
        f"use {alt!r} for it (or leave it out of the plan to replicate it)"
    )


def _divisible(name: str, what: str, size: int, tp: int, style: str) -> None:
    if size % tp:
        raise PlanError(
            f"{name!r} ({style}): {what}={size} is not divisible by the tensor-parallel size {tp}; "
            f"use a tensor-parallel size that divides {size}, or replicate {name!r}"
        )


def feature_vectors(module: nn.Module) -> dict[str, int]:
    """A module's own parameters and buffers with at least one dimension: local name -> length, for
    those that are vectors (``per_feature`` needs all of them to be, of one length)."""
    tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    return {n: (t.shape[0] if t.dim() == 1 else -1) for n, t in tensors.items() if t is not None and t.dim()}


def _check_per_feature(a: Assignment, tp: int) -> None:
    vectors = feature_vectors(a.module)
    lengths = set(vectors.values())
    if not vectors or len(lengths) != 1 or -1 in lengths:
        held = ", ".join(f"{n} {tuple(getattr(a.module, n).shape)}" for n in vectors) or "no tensors"
        raise PlanError(
            f"style 'per_feature' applies to a module whose parameters and buffers are vectors of one "
            f"length (a BatchNorm, a per-feature scale), but {a.name!r} ({type(a.module).__name__}) holds "
            f"{held}; replicate it, or keep it out of the split region"
        )
    _divisible(a.name, "features", lengths.pop(), tp, "per_feature")


def _check_layer(a: Assignment, tp: int) -> None:
    m, style = a.module, a.style
    if style == "replicate":
        return
    if style == "per_feature":
        return _check_per_feature(a, tp)
    if style == "full_width":
        return
    if not isinstance(m, LAYERS[style][1]):
        raise _type_error(a.name, m, style)
    if style == "colwise":
        chunks = a.options.get("chunks", 1)
        if not isinstance(chunks, int) or chunks < 1:
            raise PlanError(
                f"{a.name!r} (colwise): chunks={chunks!r} must be a positive integer (3 for a fused q|k|v)"
            )
        parts = a.options.get("parts", ())
        if (chunks > 1 or parts) and a.options.get("gather_output"):
            raise PlanError(f"{a.name!r} (colwise): gather_output needs chunks=1 and no parts")
        if parts:
            try:
                check_parts(tuple(tuple(p) for p in parts), _linear_shape(m)[1], tp)
            except (TypeError, ValueError) as err:
                raise PlanError(
                    f"{a.name!r} (colwise): parts={parts!r} must be [width, copies] pairs: {err}"
                ) from err
        else:
            _divisible(a.name, "out_features", _linear_shape(m)[1], tp * chunks, style)
    elif style == "rowwise":
        _divisible(a.name, "in_features", _linear_shape(m)[0], tp, style)
    elif style == "vocab":
        _divisible(a.name, "num_embeddings", m.num_embeddings, tp, style)
        if m.max_norm is not None or m.sparse or m.scale_grad_by_freq:
            raise PlanError(
                f"{a.name!r} (vocab): max_norm, sparse and scale_grad_by_freq are not supported by "
                "the vocabulary-parallel embedding; replicate it"
            )
    elif style == "attention":
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            raise PlanError(
                f"{a.name!r} (attention): needs kdim == vdim == embed_dim, no add_bias_kv and no "
                "add_zero_attn; replicate it"
            )
        _divisible(a.name, "num_heads", m.num_heads, tp, style)
    elif style == "experts" and (why := split_refusal(m, tp)) is not None:
        raise PlanError(f"{a.name!r} (experts): {why}; replicate it")


def _split_name(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


def _check_dataflow(assignments: list[Assignment], modules: dict[str, nn.Module]) -> None:
    """A row-parallel layer needs a sharded input, and a column-parallel output left sharded needs a
    row-parallel consumer, and a per-feature module a sharded input. In an ``nn.Sequential`` the
    neighbours are known (only element-wise and per-feature modules may sit between the two); elsewhere
    the pair must at least be siblings."""
    style = {a.name: a for a in assignments}

    def sharded_producer(a: Assignment) -> bool:
        return a.style == "colwise" and not a.options.get("gather_output", False)

    for a in assignments:
        parent_name, child = _split_name(a.name)
        parent = modules[parent_name]
        siblings = [f"{parent_name}.{c}" if parent_name else c for c in parent._modules]
        if isinstance(parent, nn.Sequential):
            i = siblings.index(a.name)
            step = -1 if a.style in ("rowwise", "per_feature", "full_width") else 1
            j = i + step
            while 0 <= j < len(siblings) and _passes_features(siblings[j], modules, style):
                j += step
            neighbour = style.get(siblings[j]) if 0 <= j < len(siblings) else None
            candidates = [neighbour] if neighbour is not None else []
        else:
            candidates = [style[s] for s in siblings if s in style and s != a.name]
        if a.style in ("per_feature", "full_width"):
            if not any(sharded_producer(c) for c in candidates):
                raise PlanError(
                    f"{a.style} module {a.name!r} is fed no split features: no colwise layer (without "
                    f"gather_output) before it in {parent_name or 'the root module'!r}. Mark its producer "
                    "'colwise' and the consumer 'rowwise', or leave it out of the plan"
                )
            continue
        if a.style == "rowwise" and a.options.get("input_is_parallel", True):
            if not any(sharded_producer(c) for c in candidates):
                raise PlanError(
                    f"rowwise layer {a.name!r} would be fed a replicated input: no colwise layer (without "
                    f"gather_output) feeds it in {parent_name or 'the root module'!r}. Mark its producer 'colwise', "
                    f"or give it {{style: rowwise, input_is_parallel: false}} to split its input"
                )
        if sharded_producer(a) and not any(c.style == "rowwise" for c in candidates):
            raise PlanError(
                f"colwise layer {a.name!r} leaves its output sharded, but no rowwise layer consumes it in "
                f"{parent_name or 'the root module'!r}. Mark the consumer 'rowwise', or use "
                f"{{style: colwise, gather_output: true}}"
            )


def _passes_features(name: str, modules: dict[str, nn.Module], style: dict[str, Assignment]) -> bool:
    """A split value goes through this module unchanged in layout (element-wise, or per feature)."""
    own = style.get(name)
    if own is not None:
        return own.style in ("per_feature", "full_width")
    return isinstance(modules[name], ELEMENTWISE + PER_FEATURE)


def _infer_per_feature(assignments: list[Assignment], modules: dict[str, nn.Module]) -> list[Assignment]:
    """BatchNorms between a colwise layer (output left split) and its rowwise partner in an
    ``nn.Sequential``, not named by the plan: ``per_feature``."""
    style = {a.name: a for a in assignments}
    found = []
    for a in assignments:
        parent_name, _ = _split_name(a.name)
        parent = modules[parent_name]
        if a.style != "colwise" or a.options.get("gather_output") or not isinstance(parent, nn.Sequential):
            continue
        siblings = [f"{parent_name}.{c}" if parent_name else c for c in parent._modules]
        between = []
        for name in siblings[siblings.index(a.name) + 1 :]:
            if name in style and style[name].style == "rowwise":
                found += [Assignment(n, modules[n], "per_feature", {}) for n in between]
                break
            if not _passes_features(name, modules, style):
                break
            if name not in style and isinstance(modules[name], PER_FEATURE):
                between.append(name)
    return found


def _features(
    assignments: list[Assignment], plan: "Plan", module: nn.Module, tp: int
) -> dict[str, ShardSpec]:
    """Every per-feature tensor of the plan (those of ``per_feature`` modules, and ``plan.features``),
    checked: an existing parameter or buffer, untied, its cut dimension divisible."""
    specs = {
        f"{a.name}.{n}" if a.name else n: ShardSpec(0)
        for a in assignments
        if a.style == "per_feature"
        for n in feature_vectors(a.module)
    }
    specs.update(plan.features)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    tied = {n for names in tied_parameters(module).values() for n in names}
    for name, spec in specs.items():
        if name not in tensors:
            raise _no_match(name, list(tensors), "parameter or buffer")
        if name in tied:
            raise PlanError(f"per-feature tensor {name!r} is tied to another parameter; replicate its module")
        size = tensors[name].shape[spec.dim]
        _divisible(name, f"size along dimension {spec.dim}", size, tp * spec.chunks, "per_feature")
    return specs


def tied_parameters(module: nn.Module) -> dict[int, list[str]]:
    """id of every parameter registered under more than one name -> those names."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {k: v for k, v in names.items() if len(v) > 1}


def _shard_dim(a: Assignment) -> int:
    """The dimension along which ``a``'s weight is cut (vocab rows and Linear outputs alike: 0)."""
    if a.style == "colwise":
        return 1 if _linear_shape(a.module)[2] else 0
    if a.style == "rowwise":
        return 0 if _linear_shape(a.module)[2] else 1
    return 0


def _check_tied(module: nn.Module, sharded: list[Assignment], unused: frozenset = frozenset()) -> None:
    """A tied weight (an output head sharing the embedding's) may be sharded only where every holder cuts
    it the same way (vocab embedding rows = column-parallel head rows, output not left sharded); a holder
    that is no planned layer may share the shard only if its own code never reads it (``unused``)."""
    tied = tied_parameters(module)
    holders = {a.name: a for a in sharded}
    for a in sharded:
        for local, p in a.module.named_parameters(remove_duplicate=False):
            others = [n for n in tied.get(id(p), []) if not n.startswith(a.name + ".")]
            for other in others:
                b = holders.get(other.rpartition(".")[0])
                if b is None and other in unused:
                    continue
                if (
                    b is None
                    or _shard_dim(b) != _shard_dim(a)
                    or b.options.get("chunks", 1) != 1
                    or a.options.get("chunks", 1) != 1
                ):
                    raise PlanError(
                        f"'{a.name}.{local}' is the same tensor as {other!r} (tied weights), and the plan does not "
                        "shard both alike; shard both (the embedding as 'vocab', the head as "
                        "{style: colwise, gather_output: true}), or replicate both"
                    )


def resolve_plan(module: nn.Module, plan: Any, tp_size: int, check_dataflow: bool = True) -> ResolvedPlan:
    """Match ``plan`` against ``module``'s names and validate everything, without changing the module.
    ``check_dataflow=False`` skips the neighbour check of column/row pairs (a traced plan proved them)."""
    plan = parse_plan(plan)
    modules = dict(module.named_modules())
    names = [n for n in modules if n]
    owner: dict[str, str] = {}
    assignments: list[Assignment] = []
    for rule in plan.layers:
        hits = [n for n in names if match_pattern(rule.pattern, n)]
        if not hits:
            raise _no_match(rule.pattern, names)
        for n in hits:
            if n in owner:
                raise PlanError(
                    f"module {n!r} is matched by two plan patterns, {owner[n]!r} and {rule.pattern!r}; "
                    "keep one"
                )
            owner[n] = rule.pattern
            a = Assignment(n, modules[n], rule.style, {**OPTIONS[rule.style], **rule.options})
            _check_layer(a, tp_size)
            assignments.append(a)
    if check_dataflow:
        assignments += _infer_per_feature(assignments, modules)
    sharded = [a for a in assignments if a.style != "replicate"]
    for a in sharded:
        for b in sharded:
            if a is not b and b.name.startswith(a.name + ".") and a.style != "per_feature":
                raise PlanError(
                    f"{b.name!r} is inside {a.name!r}, which is sharded as a whole ({a.style}); "
                    f"remove one of the two"
                )
    _check_tied(module, [a for a in sharded if a.style != "per_feature"], frozenset(plan.unread))
    if check_dataflow:
        _check_dataflow(sharded, modules)
    features = _features(assignments, plan, module, tp_size)
    named = {a.name for a in assignments}
    for owner in dict.fromkeys(name.rpartition(".")[0] for name in plan.features):
        if owner not in named:  # found by the automatic plan: listed like a written per_feature module
            assignments.append(Assignment(owner, modules[owner], "per_feature", {}))
    for name in plan.full_width:
        if name not in modules:
            raise _no_match(name, names)
        if name not in named:
            assignments.append(Assignment(name, modules[name], "full_width", {}))
    attributes: list[tuple[str, str, int]] = []
    copies: dict[tuple[str, str], int] = {}
    for rule in plan.attributes:
        hits = attribute_targets(modules, rule.pattern)
        if not hits:
            raise _no_match(
                rule.pattern,
                [
                    f"{n}.{k}"
                    for n in names
                    for k, v in vars(modules[n]).items()
                    if isinstance(v, int) and not k.startswith("_")
                ],
                "attribute",
            )
        for n, attr in hits:
            value = read_attribute(modules[n], attr)
            if not isinstance(value, int) or isinstance(value, bool):
                raise PlanError(
                    f"attribute {attr!r} of {n or 'the root module'!r} is {value!r}; 'divide' needs an "
                    "integer attribute such as a head count"
                )
            if value % (tp_size // rule.copies) or tp_size % rule.copies:
                raise PlanError(
                    f"head count {n + '.' if n else ''}{attr}={value} is not divisible by the "
                    f"tensor-parallel size {tp_size}; use a tensor-parallel size that divides {value}"
                )
            attributes.append((n, attr, value))
            if rule.copies > 1:
                copies[(n, attr)] = rule.copies
    parameters = dict(module.named_parameters())
    for name in plan.gradient_sums:
        if name not in parameters:
            raise _no_match(name, list(parameters), "parameter")
    return ResolvedPlan(
        assignments,
        attributes,
        tp_size,
        gradient_sums=list(plan.gradient_sums),
        features=features,
        copies=copies,
    )


# ---------------------------------------------------------------------------------------------- apply
def apply_plan(
    module: nn.Module,
    resolved: ResolvedPlan,
    group: Optional[dist.ProcessGroup],
    tp_rank: int,
    gradient_hooks: bool = True,
) -> list[SharedEntry]:
    """Replace the planned layers of ``module`` in place by their sharded versions, cut its per-feature
    tensors (``resolved.features``) to this rank's features, run ``resolved.full_width`` on all the
    features (``tensor.full_width``), and (with ``gradient_hooks``) sum the
    gradients of ``resolved.gradient_sums`` over the group in each backward (``install_gradient_sums``);
    returns the shared entry operators (the strategy clears their caches after each step)."""
    tp = resolved.tp_size
    entries: dict[str, SharedEntry] = {}
    tied = {n: names for names in tied_parameters(module).values() for n in names}
    shared: dict[str, nn.Parameter] = {}  # a tied full weight's name -> the sharded parameter made for it
    for a in resolved.assignments:
        if a.style in KEPT_STYLES:
            continue
        parent_name, child = _split_name(a.name)
        parent = module.get_submodule(parent_name)
        cls = LAYERS[a.style][0]
        kwargs = dict(a.options)
        if a.style in ("colwise", "attention"):
            kwargs["entry"] = entries.setdefault(parent_name, SharedEntry(group))
        new = cls(a.module, group, tp, tp_rank, **kwargs)
        new.train(a.module.training)
        keep_skeleton(new, a.module)
        for local, _ in list(new.named_parameters(recurse=False)):
            for full in tied.get(f"{a.name}.{local}", []):
                if full in shared:  # tied: every holder holds one sharded parameter
                    setattr(new, local, shared[full])
                else:
                    shared[full] = getattr(new, local)
        setattr(parent, child, new)
    for parent_name, entry in entries.items():
        module.get_submodule(parent_name).register_forward_hook(entry.release)
    shard_features(module, resolved.features, tp, tp_rank)
    planned = {a.name for a in resolved.assignments if a.style not in KEPT_STYLES}
    for full, param in shared.items():  # holders that are not planned layers take the shard too
        owner, _, attr = full.rpartition(".")
        if owner not in planned and not any(owner.startswith(n + ".") for n in planned):
            setattr(module.get_submodule(owner), attr, param)
    divide_attributes(module, resolved.attributes, tp, resolved.copies)
    for name in resolved.full_width:
        run_full_width(module.get_submodule(name), group)
    if gradient_hooks:
        install_gradient_sums(module, resolved, group)
    return list(entries.values())


def install_gradient_sums(
    module: nn.Module, resolved: ResolvedPlan, group: Optional[dist.ProcessGroup]
) -> Optional[GradientSums]:
    """Sum the gradients of ``resolved.gradient_sums`` (whole parameters used on split values) over the
    group, each backward's in one collective (``tensor.gradient_sums``), on the parameter objects ``module``
    holds now (a pipeline stage holds only its own). Nothing where the group has one process."""
    sums = gradient_sums_for(module, group)
    if sums is not None:
        held = dict(module.named_parameters(remove_duplicate=False))
        sums.add(held[name] for name in resolved.gradient_sums if name in held)
        sums.add_blocks(replicated_blocks(module))
    return sums


def replicated_blocks(module: nn.Module) -> dict[nn.Parameter, Replicated]:
    """The sharded parameters of ``module`` with blocks held whole by several ranks (key-value heads
    fewer than the ranks), and how each was cut."""
    return {
        getattr(layer, name): Replicated(spec, layer.tp_size, layer.tp_rank)
        for layer in module.modules()
        if isinstance(layer, _TPLayer)
        for name, spec in layer.SHARDS.items()
        if spec.replicated() and name in layer._parameters and getattr(layer, name) is not None
    }
