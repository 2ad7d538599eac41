"""Where sequence parallelism cuts and gathers the sequence: from a written plan's ``sequence`` section, or
found for ``plan="auto"`` and checked on the traced step before anything changes.

The regions are the modules that hold a column -> row pair (an attention, an MLP); the sequence is cut
at the first block of the block stack and gathered again where a column-parallel layer outside the
blocks reads it (the LM head), or else the last Linear outside the blocks. A written plan may name them::

    sequence:
      dim: 1                  # hidden states [batch, sequence, features]; the default
      enter: model.blocks.0   # default: the first block of the block stack
      exit: model.head        # default: the column-parallel layers outside the regions, else the last
                              # Linear after the blocks (a list is fine)

For ``plan="auto"`` the step runs once on fake tensors (``tensor.fake``) with every ATen operation between
the cut and the gather checked to treat the positions of the sequence apart (``_Positions``); the dimension
is the one of the first block's hidden state that is neither the batch nor the features. Then the plan is
tried on one simulated rank (``tensor.dry_run``). Where any of that fails, the run goes on without
sequence parallelism and rank 0 says why.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_parallel.compat import TorchDispatchMode, tree_flatten
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.tensor.dry_run import dry_run
from lightning_parallel.tensor.fake import fake_step
from lightning_parallel.tensor.plan import PlanError, ResolvedPlan, _no_match, check_sequence_section
from lightning_parallel.tensor.sample import SampleStep
from lightning_parallel.tensor.sequence import SequencePlan, first_tensor
from lightning_parallel.tensor.trace import is_projection

__all__ = [
    "sequence_plan",
    "auto_sequence_plan",
    "resolve_sequence",
]

# operations that keep positions apart when their other operands do not run along the sequence
_ELEMENTWISE = frozenset(
    {
        "native_dropout",
        "dropout",
        "clone",
        "detach",
        "alias",
        "_to_copy",
        "copy_",
        "copy",
        "masked_fill",
        "where",
    }
)
_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "slice"})
_REDUCTIONS = frozenset(
    {"mean", "sum", "var", "std", "amax", "amin", "var_mean", "linalg_vector_norm", "norm"}
)
_LAST_DIM = frozenset({"_softmax", "_log_softmax", "softmax", "log_softmax"})
_LIKE = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})
_NORMS = frozenset({"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"})


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _inside(name: str, outer: str) -> bool:
    return name.startswith(outer + ".")


def sequence_plan(
    module: nn.Module, resolved: ResolvedPlan, section: Optional[Mapping] = None
) -> SequencePlan:
    """The ``SequencePlan`` of ``resolved`` on ``module`` (unsharded), or a ``PlanError`` naming what does
    not fit and what would."""
    section = check_sequence_section(section or {})
    modules = dict(module.named_modules())
    attention = [a.name for a in resolved.assignments if a.style == "attention"]
    if attention:
        raise PlanError(
            f"sequence parallel does not cover nn.MultiheadAttention layers ({', '.join(attention[:3])}); "
            "write their q/k/v and out projections as colwise/rowwise Linears, or set sequence_parallel=False"
        )
    experts = [a.name for a in resolved.assignments if a.style == "experts"]
    if experts:
        raise PlanError(
            f"sequence parallel does not cover the experts of a mixture of experts ({', '.join(experts[:3])}); "
            "set sequence_parallel=False"
        )
    rows = [a.name for a in resolved.assignments if a.style == "rowwise" and a.options["input_is_parallel"]]
    if not rows:
        raise PlanError("sequence parallel needs column -> row pairs, and the plan has no rowwise layer")
    try:
        stack = find_block_stack(module)[0]
    except ValueError as err:
        if section["enter"] is None:
            raise PlanError(f"sequence parallel: {err}; or name the first block: sequence: {{enter: ...}}")
        stack = _parent(section["enter"])
    enter = section["enter"] or f"{stack}.0"
    regions = sorted({_parent(r) for r in rows})
    doubled = sorted({_parent(r) for r in rows if sum(_parent(o) == _parent(r) for o in rows) > 1})
    if doubled:
        raise PlanError(
            f"sequence parallel: {doubled[0]!r} holds more than one row-parallel layer; each pair needs a "
            "module of its own (its input gathered, its row-parallel output cut), or sequence_parallel=False"
        )
    for region in regions:
        if not region or _parent(region) == stack or enter == region or _inside(enter, region):
            raise PlanError(
                f"sequence parallel: the column -> row pair of {region or 'the root module'!r} sits beside the "
                "block's norms and residual adds, not in a module of its own that takes the hidden state; "
                "sequence_parallel=False, or put the pair in its own module (an MLP)"
            )
    columns = [a.name for a in resolved.assignments if a.style == "colwise"]
    outside = [c for c in columns if not any(_inside(c, r) for r in regions)]
    heads = [n for n, m in modules.items() if is_projection(m) and not _inside(n, stack)]
    exits = section["exit"] or outside or heads[-1:]
    if not exits:
        raise PlanError(
            "sequence parallel: no column-parallel layer reads the last hidden state after the blocks; name "
            "the module that needs the whole sequence again in the plan: sequence: {exit: model.head}"
        )
    for name in (enter, *exits):
        if name not in modules:
            raise _no_match(name, [n for n in modules if n])
    stray = [c for c in outside if c not in exits]
    if stray:
        raise PlanError(
            f"sequence parallel: colwise layer(s) {stray[:3]} are in no module with a row-parallel partner "
            "and are not an exit; name them in sequence: {exit: [...]}, or set sequence_parallel=False"
        )
    return SequencePlan(section["dim"], enter, tuple(regions), tuple(sorted(rows)), tuple(exits))


class _Positions(TorchDispatchMode):
    """Checks, on a fake step of the unsharded module, that every operation on the hidden states between
    ``enter`` and the exits (outside the regions) keeps the positions of the sequence apart. Each value
    that holds the sequence is known with the dimension it holds it in (a transpose moves it)."""

    def __init__(self, plan: SequencePlan, batch: Optional[int], detect: bool = True) -> None:
        super().__init__()
        self.plan, self.batch, self.detect = plan, batch, detect
        self.dim = plan.dim
        self.length: Optional[int] = None
        self.active = False
        self.values: dict[int, tuple[Tensor, int]] = {}  # id -> (value, its sequence dimension), kept alive
        self.problem: Optional[str] = None
        self.reached_exit = False
        self.owner = [""]
        self.modules: list[nn.Module] = []  # the modules whose forward is running, innermost last
        self.names: dict[int, str] = {}

    def mark(self, out: Any, dim: int) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.dim() > dim and t.shape[dim] == self.length:
                self.values[id(t)] = (t, dim)

    def fail(self, why: str) -> None:
        self.problem = self.problem or why

    def _check_whole(self, x: Optional[Tensor], where: str) -> None:
        """``x`` enters a region or an exit: it must be a hidden state, with the sequence where it started."""
        held = self.values.get(id(x))
        if held is None:
            self.fail(f"the input of {where!r} is not the hidden state of the blocks")
        elif held[1] != self.dim:
            self.fail(f"the input of {where!r} holds the sequence in dimension {held[1]}, not {self.dim}")

    # ---------------------------------------------------------------- module hooks
    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = first_tensor(args, kwargs)
        if x is None or x.dim() < (3 if self.detect else self.dim + 1):
            shape = None if x is None else tuple(x.shape)
            return self.fail(
                f"the hidden state entering {self.plan.enter!r} has shape {shape}: no sequence dimension "
                "beside the batch and the features"
            )
        if self.detect and self.batch is not None and x.shape[0] != self.batch and x.shape[1] == self.batch:
            self.dim = 0  # [sequence, batch, features]
        self.length = x.shape[self.dim]
        self.active = True
        self.mark(x, self.dim)

    def region_in(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active:
            self._check_whole(first_tensor(args, kwargs), self.names.get(id(module), "?"))
        self.active = False

    def row_out(self, module: nn.Module, args: tuple, output: Any) -> None:
        """What follows a region's row-parallel layer runs on the sequence parts (its dropout too)."""
        self.active = self.length is not None
        self.mark(output, self.dim)

    def exit(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active:
            self._check_whole(first_tensor(args, kwargs), self.names.get(id(module), "?"))
        self.active, self.reached_exit = False, self.reached_exit or self.active

    def push(self, module: nn.Module, args: tuple) -> None:
        self.owner.append(self.names.get(id(module), "?"))
        self.modules.append(module)

    def pop(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.owner.pop()
        self.modules.pop()

    # ---------------------------------------------------------------- operations
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        first = next((t for t in tree_flatten(out)[0] if isinstance(t, Tensor)), None)  # None: a question
        src = next((self.values[id(a)] for a in inputs if id(a) in self.values), None)
        if self.active and first is not None and self.problem is None and src is not None:
            in_dropout = bool(self.modules) and isinstance(
                self.modules[-1], nn.Dropout
            )  # drawn as one device
            why, dim = (None, src[1]) if in_dropout else self._mixes(func, args, kwargs, inputs, src, first)
            if why:
                name = func.overloadpacket.__name__
                self.fail(f"{name} in {self.owner[-1] or 'the root module'!r} {why}")
            else:
                self.mark(out, dim)
        return out

    def _mixes(
        self, func: Any, args: tuple, kwargs: dict, inputs: list[Tensor], src: tuple[Tensor, int], out: Tensor
    ) -> tuple[Optional[str], int]:
        """Why ``func`` would read positions of the sequence together (None: it keeps them apart), and the
        dimension that holds the sequence in its output."""
        name, (x, dim) = func.overloadpacket.__name__, src
        if name.startswith("bernoulli"):
            return (
                "draws random numbers on the sequence (a functional dropout: an nn.Dropout draws as one device)",
                dim,
            )
        if name in _LIKE:
            return None, dim
        if torch.Tag.pointwise in func.tags or name in _ELEMENTWISE:
            at = dim + out.dim() - x.dim()
            for t in inputs:
                d = at - (out.dim() - t.dim())
                if id(t) not in self.values and 0 <= d < t.dim() and t.shape[d] != 1:
                    return f"combines the sequence with a tensor of shape {tuple(t.shape)} along it", at
            return None, at
        if name in ("transpose", "permute", "t"):
            order = list(range(x.dim()))
            if name == "permute":
                order = [d % x.dim() for d in args[1]]
            else:
                a, b = (0, 1) if name == "t" else (args[1] % x.dim(), args[2] % x.dim())
                order[a], order[b] = order[b], order[a]
            return None, order.index(dim)
        if name in _VIEWS:
            keeps = out.dim() > dim and tuple(out.shape[: dim + 1]) == tuple(x.shape[: dim + 1])
            return (None if keeps else f"reshapes the sequence ({tuple(x.shape)} -> {tuple(out.shape)})"), dim
        if name in _REDUCTIONS or name in _LAST_DIM:
            dims = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("dim")
            dims = list(range(x.dim())) if dims is None else dims
            dims = [d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)] or list(range(x.dim()))
            if dim in dims:
                return f"reduces over the sequence (dimension {dim})", dim
            keep = name in _LAST_DIM or (args[2] if len(args) > 2 else kwargs.get("keepdim", False))
            return None, dim if keep else dim - sum(d < dim for d in dims)
        if name in _NORMS:
            inside = dim < x.dim() - len(args[1])
            return (None if inside else "normalizes over the sequence"), dim
        if "batch_norm" in name:
            return "normalizes over the batch and the sequence (a BatchNorm)", dim
        return "is not known to keep the positions of the sequence apart", dim


def _batch_size(run: Any) -> Optional[int]:
    inputs = run.inputs if isinstance(run, SampleStep) else None
    first = next((t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor) and t.dim()), None)
    return None if first is None else first.shape[0]


def _checked_positions(
    module: nn.Module, plan: SequencePlan, run: Callable[[], Any], detect: bool = True
) -> _Positions:
    """The sample step run on fake tensors with ``plan``'s positions checked (``detect``: the sequence
    dimension found from the hidden state, else ``plan.dim``)."""
    check = _Positions(plan, _batch_size(run), detect)
    check.names = {id(m): n for n, m in module.named_modules()}
    handles = [module.get_submodule(plan.enter).register_forward_pre_hook(check.enter, with_kwargs=True)]
    for r in plan.regions:
        handles.append(module.get_submodule(r).register_forward_pre_hook(check.region_in, with_kwargs=True))
    for r in plan.rows:
        handles.append(module.get_submodule(r).register_forward_hook(check.row_out))
    for e in plan.exits:
        handles.append(module.get_submodule(e).register_forward_pre_hook(check.exit, with_kwargs=True))
    handles.append(nn.modules.module.register_module_forward_pre_hook(check.push))
    handles.append(nn.modules.module.register_module_forward_hook(check.pop))
    try:
        with fake_step(module, run) as step, torch.no_grad(), check:
            step()
    finally:
        for h in handles:
            h.remove()
    return check


def auto_sequence_plan(
    module: nn.Module, resolved: ResolvedPlan, run: Optional[Callable[[], Any]]
) -> tuple[Optional[SequencePlan], str]:
    """The sequence plan of an automatic tensor-parallel plan and what was found, or None and why not."""
    if run is None:
        return None, "there is no batch or example_input_array to trace the sequence from"
    try:
        plan = sequence_plan(module, resolved)
        check = _checked_positions(module, plan, run)
    except PlanError as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001  (the user's step on fake tensors)
        return None, f"the step could not be traced ({type(err).__name__}: {err})"
    if check.problem is None and not check.reached_exit:
        check.problem = f"the traced step never reaches {', '.join(plan.exits)} from {plan.enter!r}"
    if check.problem is None and check.length % resolved.tp_size:
        check.problem = (
            f"the sequence length {check.length} is not divisible by tensor_parallel_size={resolved.tp_size}"
        )
    if check.problem is not None:
        return None, check.problem
    plan = SequencePlan(check.dim, plan.enter, plan.regions, plan.rows, plan.exits)
    resolved.sequence = plan
    failure = dry_run(module, resolved, run)
    resolved.sequence = None
    if failure is not None:
        return (
            None,
            f"sharded, the forward fails on a rank in {failure.module or 'the root module'!r} ({failure})",
        )
    return (
        plan,
        f"sequence dimension {plan.dim} (length {check.length}), cut at {plan.enter!r}, "
        f"gathered at {', '.join(plan.exits)}",
    )


def resolve_sequence(
    module: nn.Module, resolved: ResolvedPlan, plan: Any, run: Optional[Callable[[], Any]]
) -> Optional[SequencePlan]:
    """``sequence_parallel=True``: a written plan's sequence plan (a ``PlanError`` when it does not fit), or
    for ``plan="auto"`` the one found, else None with rank 0 saying why."""
    if not (isinstance(plan, str) and plan == "auto"):
        found = sequence_plan(module, resolved, plan.sequence)
        _check_written(module, found, resolved.tp_size, run)
        return found
    found, why = auto_sequence_plan(module, resolved, run)
    if found is None:
        rank_zero_warn(f"lp_tensor_parallel: sequence parallel is off: {why}")
    else:
        rank_zero_info(f"lp_tensor_parallel: sequence parallel: {why}")
    return found


def _check_written(module: nn.Module, plan: SequencePlan, tp: int, run: Optional[Callable[[], Any]]) -> None:
    """A written sequence plan tried on the sample step (fake tensors) before training: the hidden state at
    ``enter`` must have the plan's dimension, of a length tp divides (a ``PlanError``); an operation that
    looks like it mixes positions is a warning (the plan says where the sequence is). A step that does not
    run on fake tensors is not checked here."""
    if run is None:
        return
    try:
        check = _checked_positions(module, plan, run, detect=False)
    except Exception:  # noqa: BLE001  (the user's step on fake tensors)
        return
    if check.length is None and check.problem is not None:
        raise PlanError(f"sequence parallel: {check.problem}; name the dimension: sequence: {{dim: ...}}")
    if check.length is not None and check.length % tp:
        raise PlanError(
            f"sequence parallel: the sequence length {check.length} (dimension {plan.dim} of the hidden state "
            f"entering {plan.enter!r}) is not divisible by tensor_parallel_size={tp}; use a length that "
            f"{tp} divides, or sequence_parallel=False"
        )
    if check.problem is not None:
        rank_zero_warn(f"lp_tensor_parallel: sequence parallel as the plan says, although {check.problem}")
