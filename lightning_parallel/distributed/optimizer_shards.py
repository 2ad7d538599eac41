"""The user's optimizer made to update only this rank's pieces (ZeRO), and its state in unsharded form.

``ShardedOptimizer`` keeps the user's optimizer object (its LR schedulers hold it), and only swaps what its
``param_groups`` list: the model's parameters outside a step (what Lightning, the checkpoint code and the
user see), this rank's pieces (``zero.Piece``) inside one (``sharded()``), so the optimizer creates and
updates state for the pieces only. An elementwise optimizer (SGD, Adam, AdamW, Adagrad, ...) gives each
element exactly what it gives on one device; an optimizer that mixes elements of a parameter (Adafactor's
factored moments, LBFGS) is refused.

Its ``state_dict()`` is the one an unsharded optimizer of this rank would return, on the rank that writes
it: the pieces' state gathered to the data-parallel group's rank 0 and joined into tensors of each
parameter's shape, numbered as the model's parameters. It is a collective: every rank of the
data-parallel group must call it (Lightning's checkpoint saving does, on every rank); the other ranks send
their pieces and get the parameter groups with an empty ``state``. ``load_state_dict()`` takes the
unsharded form and keeps this rank's pieces. So every checkpoint path (full files, tensor-parallel and
pipeline gathers, sharded directories) sees an ordinary optimizer, and a checkpoint loads under another
data-parallel size or with ZeRO off.

The groups are cut into pieces once: a group added later (``add_param_group``) or a parameter appended to
one is refused at the next step (``sharded()``), since its parameters would not be updated.

The model's parameters hold no gradient under ZeRO (the pieces do), so torch's clipping functions called
on them would clip nothing: ``refuse_raw_clipping`` makes such a call raise, naming
``self.clip_gradients``, which clips the pieces by the whole model's norm.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Generator, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.distributed.zero import Piece

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "ShardedOptimizer",
    "StatePieces",
    "refuse_raw_clipping",
    "sharding_problem",
]

#: torch optimizers whose update of an element reads only that element's gradient and state
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adadelta",
    )
    if hasattr(torch.optim, name)
)


def sharding_problem(optimizer: Any, zero_stage: int) -> Optional[str]:
    """Why ``optimizer`` cannot be sharded elementwise, or None."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return None
    names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
    return (
        f"zero_stage={zero_stage} shards the optimizer state element by element, which is exact only for an "
        f"optimizer that updates each element from its own gradient and state; {type(optimizer).__name__} is "
        f"not one of those known to be: {names}. Use one of them, or zero_stage=0."
    )


@dataclass
class StatePieces:
    """One elementwise state tensor (a moment) of a parameter as this rank holds it: elements
    ``start : start + value.numel()`` of the parameter of ``shape`` flattened, and every data-parallel rank's
    ``(start, stop)`` of it (``spans``: together they cover the parameter). What a sharded checkpoint writes
    for this rank (``checkpointing.sharded``)."""

    value: Tensor
    start: int
    spans: list[tuple[int, int]]
    shape: torch.Size


class ShardedOptimizer:
    """``optimizer`` updating only ``pieces`` (this rank's; see the module docstring) over ``group``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pieces: list[Piece],
        bucketed: set,
        group: Optional[Any],
        own: frozenset = frozenset(),
        own_group: Optional[Any] = None,
    ) -> None:
        """``bucketed``: every parameter the reducers shard (a rank holds pieces of some of them); the
        optimizer's other parameters are held whole by every rank. ``own``: ids of parameters that differ
        across the group (the experts placed on this rank under expert parallelism): their state is this
        rank's own, kept by ``state_dict`` on every rank rather than taken from rank 0; held whole, or
        (``own_group``: their replicas) sharded over ``own_group`` and joined over it."""
        self.optimizer, self.group, self.own_group = optimizer, group, own_group
        piece_of = {piece.param: piece for piece in pieces}
        self.model_groups = [list(g["params"]) for g in optimizer.param_groups]
        self._group_sizes = [len(params) for params in self.model_groups]  # as made: what sharded() checks
        self.shapes = [p.shape for params in self.model_groups for p in params]
        # what the optimizer holds inside a step, and for each: (model index, its piece or None if whole)
        self.shard_groups: list[list[nn.Parameter]] = []
        self.index: list[tuple[int, Optional[Piece]]] = []
        j = 0
        for params in self.model_groups:
            held = []
            for p in params:
                piece = piece_of.get(p)
                if piece is not None or p not in bucketed:
                    held.append(piece.shard if piece is not None else p)
                    self.index.append((j, piece))
                j += 1
            self.shard_groups.append(held)
        #: what the optimizer steps on this rank, in and out of a step: what clipping measures and scales
        self.held_parameters: list[nn.Parameter] = [p for held in self.shard_groups for p in held]
        self.own_indices = {j for j, p in enumerate(p for g in self.model_groups for p in g) if id(p) in own}
        earlier = type(optimizer).state_dict(optimizer) if optimizer.state else None
        self._swap(self.model_groups)  # the groups hold these lists from now on (sharded() checks them)
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self.load_state_dict  # type: ignore[method-assign]
        if earlier is not None:
            self.load_state_dict(earlier)

    @contextmanager
    def sharded(self) -> Generator[None, None, None]:
        """The optimizer's groups hold this rank's pieces (a step and its hooks run inside). Raises if its
        groups changed since it was made (``add_param_group``, a parameter appended to a group)."""
        self._refuse_changed_groups()
        self._swap(self.shard_groups)
        try:
            yield
        finally:
            self._swap(self.model_groups)

    def _refuse_changed_groups(self) -> None:
        groups = self.optimizer.param_groups
        same = len(groups) == len(self.model_groups) and all(
            g["params"] is params and len(params) == size
            for g, params, size in zip(groups, self.model_groups, self._group_sizes)
        )
        if not same:
            raise ValueError(
                f"zero_stage: the optimizer's parameter groups changed after set-up ({len(self.model_groups)} "
                f"groups then, {len(groups)} now: add_param_group, or a parameter added to a group). ZeRO cut "
                "each group into this rank's pieces once, at set-up, and a parameter added since would not be "
                "updated. Make every group in configure_optimizers (a group's parameters may stay frozen "
                "until you unfreeze them, under zero_stage=0), or use zero_stage=0."
            )

    def _swap(self, groups: list[list[nn.Parameter]]) -> None:
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = params

    # ------------------------------------------------------------------ state in unsharded form
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as an unsharded optimizer of this rank would hold it, on the group's rank 0
        (the rank that writes a checkpoint; the ranks whose tensor-parallel and pipeline gathers reach
        Lightning's writer, global rank 0, are each their group's rank 0). A collective: every rank of the
        group must call it. The other ranks send their pieces and get the parameter groups with only the
        ``own`` parameters' state (every rank's own, not gathered: a later gather over ep joins them)."""
        with self.sharded():
            local = type(self.optimizer).state_dict(self.optimizer)
        mine: list[tuple[int, Any, dict]] = []
        own: list[tuple[int, Any, dict]] = []
        for i, entry in local["state"].items():
            j, piece = self.index[int(i)]
            span = (piece.start, piece.stop) if piece is not None else None
            if j in self.own_indices and self.own_group is None:  # held whole: kept where it is
                own.append((j, span, entry))
                continue
            held = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in entry.items()}
            (own if j in self.own_indices else mine).append((j, span, held))
        parts = _gather_to_first(mine, self.group)
        joined = self._joined(parts) if parts is not None else {}
        own_parts: list[Any] = [own]
        if self.own_group is not None:  # every replica joins them: the gathers over ep that follow need them
            own_parts = [None] * dist.get_world_size(self.own_group)
            dist.all_gather_object(own_parts, own, group=self.own_group)
        own_state = self._joined(own_parts)
        if self.own_group is not None and self.held_parameters:  # back where the rest of the state lives
            device = self.held_parameters[0].device
            own_state = {
                j: {k: v.to(device) if isinstance(v, Tensor) and v.dim() else v for k, v in entry.items()}
                for j, entry in own_state.items()
            }
        return {
            "state": dict(sorted((joined | own_state).items())),
            "param_groups": _numbered(local["param_groups"], self.model_groups),
        }

    def local_state_dict(self) -> dict[str, Any]:
        """As ``state_dict``, but each moment of a piece stays this rank's, as ``StatePieces`` (the state's own
        memory, nothing gathered): for a sharded checkpoint, where each rank writes its own pieces. Exchanges
        only the spans over the group (a collective)."""
        with self.sharded():
            local = type(self.optimizer).state_dict(self.optimizer)
        mine = [(j, piece.start, piece.stop) for j, piece in self.index if piece is not None]
        parts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, mine, group=self.group)
        spans: dict[int, list[tuple[int, int]]] = {}
        for part in parts:
            for j, start, stop in part:
                spans.setdefault(j, []).append((start, stop))
        state = {}
        for i, entry in local["state"].items():
            j, piece = self.index[int(i)]
            if piece is None:  # held whole by every rank
                state[j] = entry
                continue
            span = (piece.start, piece.stop)
            state[j] = {
                k: StatePieces(v.detach(), piece.start, sorted(spans[j]), self.shapes[j])
                if _elementwise(v, span)
                else v
                for k, v in entry.items()
            }
        return {"state": state, "param_groups": _numbered(local["param_groups"], self.model_groups)}

    def _joined(self, parts: list[list[tuple[int, Any, dict]]]) -> dict[int, dict[str, Any]]:
        """Each parameter's state from its pieces on every rank: tensors of a piece's shape concatenated in
        element order into the parameter's shape, the rest (a step count) taken from the first piece."""
        spans: dict[int, list[tuple[Any, dict]]] = {}
        for part in parts:
            for j, span, entry in part:
                spans.setdefault(j, []).append((span, entry))
        state = {}
        for j, entries in sorted(spans.items()):
            if entries[0][0] is None:  # held whole by every rank
                state[j] = entries[0][1]
                continue
            entries.sort(key=lambda e: e[0][0])
            shape, first = self.shapes[j], entries[0][1]
            state[j] = {
                k: torch.cat([e[k] for _, e in entries]).view(shape) if _elementwise(v, entries[0][0]) else v
                for k, v in first.items()
            }
            numel = sum(stop - start for (start, stop), _ in entries)
            if numel != shape.numel():
                raise RuntimeError(
                    f"optimizer state of parameter {j} covers {numel} of {shape.numel()} elements"
                )
        return state

    def load_state_dict(self, full: Mapping[str, Any]) -> None:
        """Load an unsharded optimizer state (this rank's parameters numbered as ``state_dict`` would give
        them): each piece takes its elements."""
        saved = {int(j): entry for j, entry in full["state"].items()}
        state = {}
        for i, (j, piece) in enumerate(self.index):
            entry = saved.get(j)
            if entry is None:
                continue
            if piece is None:
                state[i] = entry
                continue
            shape = self.shapes[j]
            state[i] = {
                k: v.reshape(-1)[piece.start : piece.stop].clone() if _of_shape(v, shape) else v
                for k, v in entry.items()
            }
        if len(full["param_groups"]) != len(self.shard_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(full['param_groups'])} parameter groups, this one "
                f"{len(self.shard_groups)}; it was saved for another optimizer configuration"
            )
        groups = _numbered(full["param_groups"], self.shard_groups)
        with self.sharded():
            type(self.optimizer).load_state_dict(self.optimizer, {"state": state, "param_groups": groups})


def _gather_to_first(obj: Any, group: Optional[Any]) -> Optional[list[Any]]:
    """Every rank's ``obj`` on rank 0 of ``group``, in group-rank order; None on the other ranks."""
    first = dist.get_rank(group) == 0
    parts: Optional[list[Any]] = [None] * dist.get_world_size(group) if first else None
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    dist.gather_object(obj, parts, dst=dst, group=group)
    return parts


def _numbered(hypers: list[Mapping[str, Any]], params: list[list[Any]]) -> list[dict[str, Any]]:
    """``hypers`` (parameter groups' settings) with each group's ``params`` numbered 0.. across groups."""
    out, start = [], 0
    for hyper, held in zip(hypers, params):
        out.append(
            {k: v for k, v in hyper.items() if k != "params"}
            | {"params": list(range(start, start + len(held)))}
        )
        start += len(held)
    return out


def _elementwise(value: Any, span: tuple[int, int]) -> bool:
    """A piece's state tensor of the piece's own shape (a moment), not a count."""
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == span[1] - span[0]


def _of_shape(value: Any, shape: torch.Size) -> bool:
    return isinstance(value, Tensor) and value.shape == shape


# ---------------------------------------------------------------------- torch's clipping of the model's parameters
#: id of a model parameter whose gradient lives in this rank's pieces -> the error a raw clipping call raises
_REFUSED: dict[int, str] = {}
#: torch's clipping functions replaced while anything is refused: (module, name) -> the original
_ORIGINALS: dict[tuple[ModuleType, str], Callable[..., Any]] = {}


def _clipping_entry_points() -> list[tuple[ModuleType, str]]:
    """Where a user's clipping call reaches torch. From torch 2.6 ``clip_grad_norm_`` hands its parameters to
    ``clip_grad._clip_grads_with_norm_``, looked up at every call, so a ``clip_grad_norm_`` imported by name
    before set-up is caught there too; on torch 2.5 only the module attributes are."""
    from torch.nn.utils import clip_grad

    names = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")
    points = [(m, n) for m in (torch.nn.utils, clip_grad) for n in names if hasattr(m, n)]
    if hasattr(clip_grad, "_clip_grads_with_norm_"):  # torch >= 2.6
        points.append((clip_grad, "_clip_grads_with_norm_"))
    return points


def _refusing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        for p in params:
            if id(p) in _REFUSED:
                raise RuntimeError(_REFUSED[id(p)])
        return original(params, *args, **kwargs)

    return clip


def refuse_raw_clipping(params: Iterable[Tensor], message: str) -> Callable[[], None]:
    """Until the returned function is called, torch's ``clip_grad_norm_`` / ``clip_grad_value_`` (and
    ``clip_grads_with_norm_``) called on any of ``params`` raise ``RuntimeError(message)`` instead of
    clipping nothing: under ZeRO these parameters hold no gradient, their pieces do."""
    ids = {id(p) for p in params}
    _REFUSED.update(dict.fromkeys(ids, message))
    if not _ORIGINALS:
        for module, name in _clipping_entry_points():
            _ORIGINALS[(module, name)] = getattr(module, name)
            setattr(module, name, _refusing(getattr(module, name)))

    def release() -> None:
        for i in ids:
            _REFUSED.pop(i, None)
        if not _REFUSED:
            for (module, name), original in _ORIGINALS.items():
                setattr(module, name, original)
            _ORIGINALS.clear()

    return release
