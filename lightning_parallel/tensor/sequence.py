"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022) on a tensor-parallel module, by hooks.

Between the column/row pairs of a transformer (norms, dropout, residual adds) tensor parallelism keeps
whole copies of the activations on every rank. Sequence parallelism cuts them along the sequence:

    enter   the first block's hidden-state input is split along the sequence (backward: all-gather)
    region  a module holding a column -> row pair (attention, MLP) all-gathers its hidden-state input
            (backward: reduce-scatter); its column-parallel layers then need no "f" operator, and its
            row-parallel layer reduce-scatters along the sequence instead of all-reducing; the gathered
            input is saved for backward as this rank's part (``tensor.sequence_saved``)
    exit    a module that needs the whole sequence again (the LM head) gathers its input: a
            column-parallel head through its entry (backward: reduce-scatter), any other module by an
            all-gather whose backward keeps this rank's part

A replicated parameter used on the sequence shards (a norm's weight, a row-parallel bias) gets a partial
gradient on each rank, summed over the group in backward. Which parameters those are is seen as the
forward runs: those of a module called between ``enter`` and ``exit``, outside the regions (what follows
a region's row-parallel layer is outside). A module called both there and on whole sequences is refused
(its gradient would mix partial and whole contributions).

An ``nn.Dropout`` called on the sequence parts draws the mask one device draws for the whole sequence
(same shape, same random stream) and keeps this rank's part, so a rank's masks are one device's for its
positions (exact where nothing else random runs differently under tensor parallelism: attention dropout
on split heads does). A functional ``F.dropout`` in the blocks would draw on the part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.collectives import (
    gather_from_group,
    gather_sequence,
    group_rank,
    group_size,
    split_to_group,
)
from lightning_parallel.recompute_state import is_recomputing
from lightning_parallel.tensor.gradient_sums import gradient_sums_for
from lightning_parallel.tensor.layers import ColumnParallelLinear, _TPLayer
from lightning_parallel.tensor.sequence_saved import SavedAsPart

__all__ = ["SequencePlan", "SequenceParallel", "apply_sequence_parallel", "first_tensor", "replace_first"]


@dataclass(frozen=True)
class SequencePlan:
    """Where the sequence is cut and gathered, by module name (``tensor.sequence_plan`` finds it)."""

    dim: int  # the sequence dimension of the hidden states ([batch, sequence, features]: 1)
    enter: str  # its first tensor input is split along ``dim``
    regions: tuple[str, ...]  # modules holding a column -> row pair: their first tensor input is gathered
    rows: tuple[str, ...]  # the row-parallel layers that reduce-scatter
    exits: tuple[str, ...]  # modules that need the whole sequence again


def first_tensor(args: tuple, kwargs: dict) -> Optional[Tensor]:
    """The first tensor argument of a call: positional, else keyword in call order (``hidden_states=``)."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)


def replace_first(args: tuple, kwargs: dict, new: Tensor) -> tuple[tuple, dict]:
    """The call's arguments with the first tensor, and every argument that is the same object (the
    key and value of self-attention), replaced by ``new``."""
    old = first_tensor(args, kwargs)
    return (
        tuple(new if a is old else a for a in args),
        {k: new if v is old else v for k, v in kwargs.items()},
    )


class SequenceParallel:
    """The hooks of one ``SequencePlan`` on a sharded module (``remove()`` takes them off again)."""

    def __init__(self, module: nn.Module, plan: SequencePlan, group: Optional[dist.ProcessGroup]) -> None:
        self.plan, self.group = plan, group
        # on the sequence parts now (between enter and exit, outside the pairs): in a forward, and in a
        # recompute (activation checkpointing replays blocks, which start on the parts)
        self._inside = {False: False, True: True}
        self.where: dict[str, set[bool]] = {}  # module name -> where its calls ran
        self.handles: list[RemovableHandle] = []
        self.saved = SavedAsPart(group, plan.dim)
        self.dropped: dict[int, float] = {}  # dropout modules switched off for this call -> their p
        self.row_biases = {
            id(module.get_submodule(r).bias) for r in plan.rows if module.get_submodule(r).bias is not None
        }
        self._wire(module)

    @property
    def inside(self) -> bool:
        return self._inside[is_recomputing()]

    @inside.setter
    def inside(self, value: bool) -> None:
        self._inside[is_recomputing()] = value

    def _hook(self, module: nn.Module, pre: Any = None, post: Any = None) -> None:
        if pre is not None:
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        if post is not None:  # also when the call raises: a recompute stopped early by torch's checkpoint
            self.handles.append(module.register_forward_hook(post, always_call=True))

    def _wire(self, module: nn.Module) -> None:
        plan, dim = self.plan, self.plan.dim
        for name in plan.rows:
            module.get_submodule(name).sequence_dim = dim
            self._hook(module.get_submodule(name), post=self._leave_pair)
        for name, layer in module.named_modules():
            if isinstance(layer, ColumnParallelLinear):
                inside = any(name.startswith(r + ".") for r in plan.regions)
                if inside or name in plan.exits:
                    layer.entry.sequence_dim, layer.entry.gathered = dim, inside
        self._hook(module.get_submodule(plan.enter), pre=self._enter)
        for name in plan.regions:
            self._hook(module.get_submodule(name), pre=self._gather_region, post=self._leave_region)
        for m in module.modules():
            if isinstance(m, nn.Dropout):
                self.handles.append(m.register_forward_pre_hook(self._dropout_off))
                self.handles.append(m.register_forward_hook(self._dropout_part))
        for name in plan.exits:
            self._hook(module.get_submodule(name), pre=self._exit)
        for name, m in module.named_modules():  # after the hooks above: they run first
            if not isinstance(m, _TPLayer) and any(True for _ in m.parameters(recurse=False)):
                self._hook(m, pre=self._recorder(name))

    # ------------------------------------------------------------------ forward
    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = first_tensor(args, kwargs)
        if x is None or x.dim() <= self.plan.dim:
            shape = None if x is None else tuple(x.shape)
            raise ValueError(
                f"sequence parallel: {self.plan.enter!r} is called with no hidden state of at least "
                f"{self.plan.dim + 1} dimensions to split along dimension {self.plan.dim} (first tensor "
                f"argument: {shape}); name the dimension in the plan (sequence: {{dim: ...}}), or set "
                "sequence_parallel=False"
            )
        self.inside = True
        return replace_first(args, kwargs, split_to_group(x, self.group, self.plan.dim))

    def _gather_region(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.inside = False
        x = first_tensor(args, kwargs)
        gathered = gather_sequence(x, self.group, self.plan.dim)
        self.saved.enter(gathered, x)
        return replace_first(args, kwargs, gathered)

    def _leave_pair(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.inside = True  # what follows the row-parallel layer, in its module too, runs on the parts

    def _leave_region(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.saved.exit()

    def _dropout_off(self, m: nn.Dropout, args: tuple) -> None:
        """On the sequence parts, the module's own draw is switched off (``_dropout_part`` draws)."""
        if self.inside and m.training and m.p > 0:
            self.dropped[id(m)], m.p = m.p, 0.0

    def _dropout_part(self, m: nn.Dropout, args: tuple, output: Tensor) -> Optional[Tensor]:
        """This rank's part of the mask one device draws for the whole sequence."""
        p = self.dropped.pop(id(m), None)
        if p is None:
            return None
        m.p, x = p, args[0]
        dim, size = self.plan.dim, group_size(self.group)
        full = [*x.shape[:dim], x.shape[dim] * size, *x.shape[dim + 1 :]]
        # the same draw as one device's F.dropout of the whole sequence (same shape, dtype and device)
        noise = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), p, training=True)
        return x * noise.narrow(dim, group_rank(self.group) * x.shape[dim], x.shape[dim]).clone()

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self.inside = False
        if isinstance(module, ColumnParallelLinear):  # its entry gathers (reduce-scatter backward)
            return None
        x = first_tensor(args, kwargs)
        return replace_first(args, kwargs, gather_from_group(x, self.group, self.plan.dim))

    def _recorder(self, name: str) -> Any:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if is_recomputing():  # seen in the forward already
                return
            seen = self.where.setdefault(name, set())
            seen.add(self.inside)
            if len(seen) > 1:
                raise ValueError(
                    f"sequence parallel: {name!r} runs both on the sequence shards (between "
                    f"{self.plan.enter!r} and {', '.join(self.plan.exits)}) and on whole sequences; its "
                    "parameters' gradients would mix partial and whole parts. Move the exit "
                    "(sequence: {exit: ...} in the plan) or set sequence_parallel=False"
                )

        return record

    # ------------------------------------------------------------------ backward
    def install_gradient_sums(self, module: nn.Module) -> None:
        """Sum over the group the gradients of the replicated parameters used on the sequence shards (as
        seen by the forward that made them), each backward's in one collective (``tensor.gradient_sums``),
        on the parameter objects ``module`` holds now."""
        sums = gradient_sums_for(module, self.group)
        if sums is None:
            return
        owners: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, m in module.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                if id(p) in self.row_biases or not isinstance(m, _TPLayer):
                    owners.setdefault(id(p), (p, []))[1].append(name)
        for key, (p, names) in owners.items():
            self.handles.append(sums.add([p], when=self._on_shards(names, key)))

    def _on_shards(self, names: list[str], key: int) -> Callable[[], bool]:
        """Whether the parameter ``key`` (held by the modules ``names``) ran on the sequence shards."""

        def on_shards() -> bool:
            seen = set().union(*(self.where.get(n, set()) for n in names))
            return key in self.row_biases or seen == {True}

        return on_shards

    def summed(self) -> list[str]:
        """The modules whose parameters' gradients are summed (known after a forward)."""
        return sorted(n for n, seen in self.where.items() if seen == {True})

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def apply_sequence_parallel(
    module: nn.Module,
    plan: SequencePlan,
    group: Optional[dist.ProcessGroup],
    gradient_hooks: bool = True,
    compiled: bool = False,
) -> SequenceParallel:
    """Wire ``plan`` into ``module`` (sharded already, by ``tensor.shard_module``) over ``group``; ``compiled``:
    the module runs (partly) under torch.compile, which set-up says once."""
    if compiled:
        rank_zero_warn(
            "sequence_parallel under torch.compile: each region's gathered input is saved whole for backward, "
            "as under tensor parallelism alone (the saved-tensor hooks that keep this rank's part of it run "
            "eagerly only); the rest of sequence parallelism is compiled"
        )
    sp = SequenceParallel(module, plan, group)
    if gradient_hooks:
        sp.install_gradient_sums(module)
    return sp
