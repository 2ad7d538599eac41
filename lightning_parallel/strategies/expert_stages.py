"""ExpertParallel (mixin of ParallelStrategy): what ``expert_parallel_size`` adds to the strategy; its step
hooks are the ``Experts`` axis (``axes.py``).

The checks of the option against the others, the ep axis of the mesh (it divides dp), the placement of
this rank's experts inside ``set_up_share`` (``moe.expert_parallel.apply_expert_parallel``, composed with the
tensor-parallel cut), the experts' gradients divided by ep and averaged over their replicas by a second
reducer over the ``edp`` group (none where each expert has one replica), driven beside the dp reducer in
every backward and under gradient accumulation. Under pipeline stages the ep and edp groups are those of
the rank's (pp, tp) coordinate: the ep ranks of a stage run the same schedule, so their all-to-alls pair
up micro-batch by micro-batch, and the experts' reducer averages once after the schedule (no hooks), as the
dp reducer does for the schedules that do not overlap it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.distributed.reducer import GradientReducer
from lightning_parallel.distributed.zero import ShardedGradientReducer
from lightning_parallel.distributed.zero3 import FullyShardedGradientReducer
from lightning_parallel.moe.expert_parallel import (
    apply_expert_parallel,
    describe_expert_parallel,
    expert_parallel_problem,
    scale_expert_gradients,
)
from lightning_parallel.strategies.checks import positive_int, require
from lightning_parallel.strategies.data_parallel_axes import DataParallel
from lightning_parallel.tensor.full_state import cut_experts, expert_pieces

__all__ = ["ExpertParallel", "Experts", "EP_REFUSED"]

Cut = Callable[[str, torch.Tensor], torch.Tensor]

#: the options expert parallelism does not compose with yet: name -> (its value that is off, what it is)
EP_REFUSED = {
    "save_distributed": (False, "sharded checkpoints"),
    "data_parallel_shard_size": (None, "HSDP (ZeRO within groups of the data-parallel ranks)"),
    "sequence_parallel": (
        False,
        "sequence parallelism (each tp rank would route its own part of the sequence)",
    ),
}


class ExpertParallel:
    """Expert parallelism over the ``ep`` axis of the mesh; ``expert_parallel_size`` is declared by
    ``ParallelStrategy``'s constructor."""

    expert_parallel_size: int
    expert_reducer: Optional[GradientReducer]

    @classmethod
    def expert_problems(cls, values: Mapping[str, Any], prefix: str = "") -> list[Optional[str]]:
        """The checks of ``expert_parallel_size`` against the other options."""
        ep, dp = values["expert_parallel_size"], values["data_parallel_size"]
        size = positive_int(f"{prefix}expert_parallel_size", ep)
        if size or ep == 1:
            return [size]
        refused = [name for name, (off, _) in EP_REFUSED.items() if values.get(name, off) != off]
        pp = values.get("pipeline_parallel_size", 1)
        return [
            None
            if dp is None or dp % ep == 0
            else f"{prefix}expert_parallel_size={ep} does not divide {prefix}data_parallel_size={dp}: the ranks "
            f"of an expert-parallel group are data-parallel ranks; use a divisor of {dp}, or "
            f"data_parallel_size={ep * max(1, dp // ep)}",
            *(
                f"{prefix}expert_parallel_size={ep} with {prefix}{name}={values[name]!r}: expert parallelism is "
                f"not composed with {EP_REFUSED[name][1]} yet; use expert_parallel_size=1 or {name}="
                f"{EP_REFUSED[name][0]!r}"
                for name in refused
            ),
            None
            if "pp" not in getattr(cls, "always_applied", ())
            else f"{prefix}expert_parallel_size={ep}: the pipeline presets do not declare expert parallelism; use "
            f"lp_parallel (ParallelStrategy) with pipeline_parallel_size and expert_parallel_size={ep}",
            None
            if values.get("schedule") != "async" or pp == 1
            else f"{prefix}expert_parallel_size={ep} with {prefix}schedule='async': the async pipeline's resume "
            "state (a gradient finished a step earlier) is not gathered over the experts' ranks; use another "
            "schedule ('1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1', 'zbv') or expert_parallel_size=1",
        ]

    def mesh_shape(self) -> MeshShape:
        """The (dp, pp, tp) layout, with ``expert_parallel_size`` dividing dp (checked before any process
        group exists)."""
        shape = super().mesh_shape()
        ep = self.expert_parallel_size
        if shape.dp % ep:
            raise ValueError(
                f"{type(self).__name__}: expert_parallel_size={ep} does not divide the data-parallel size "
                f"{shape.dp} of this run: the ranks of an expert-parallel group are data-parallel ranks; use "
                f"a divisor of {shape.dp}, or {ep * max(1, shape.dp // ep) * shape.pp * shape.tp} processes"
            )
        return replace(shape, ep=ep)

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("ep") if self.mesh is not None else None

    def _has_experts_split(self) -> bool:
        return self.lightning_module is not None and bool(expert_pieces(self.lightning_module))

    # ----------------------------------------------------------------- set-up
    def check_experts(self, module: nn.Module) -> None:
        """Before the module is taken apart: refuse a model whose experts cannot be placed on ep ranks."""
        if self.expert_parallel_size > 1:
            require([expert_parallel_problem(module, self.expert_parallel_size)])

    def place_experts(self, module: nn.Module, cut: Optional[Cut]) -> Optional[Cut]:
        """Inside ``parallelize``: this rank's experts placed; returns set-up's cut (``cut``, then the
        experts')."""
        if self.expert_parallel_size == 1:
            return cut
        placed = apply_expert_parallel(module, self.ep_group, self.expert_parallel_size, self.mesh.ep_rank)
        rank_zero_info(describe_expert_parallel(placed, self.mesh.shape.size("edp")))
        if self.compiles(module):
            rank_zero_warn(
                f"expert parallelism under torch.compile: the {len(placed)} experts modules ({', '.join(placed)}) "
                "run eagerly, their token dispatch sized by the routing; the rest of the model is compiled"
            )
        return partial(_then_experts, cut, expert_pieces(module))

    def split_expert_gradients(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """On the final parameters: the experts' gradients divided by ep and, with replicas, averaged over
        them by ``expert_reducer`` (``zero_stage=3``: the experts sharded over their replicas in units of their
        own, a pipeline stage's gathered for its schedule as its other units are, reduce-scattered per unit);
        returns the other parameters, for the dp reducer."""
        experts = {id(t) for t, _, _ in expert_pieces(module).values()}
        scale_expert_gradients(module)
        self.expert_reducer = None
        if experts and self.mesh.shape.size("edp") > 1:
            named = [(n, p) for n, p in module.named_parameters() if id(p) in experts]
            group, hooks = self.mesh.group("edp"), not self.pipelined
            others = [p for p in module.parameters() if id(p) not in experts]
            stage = {"blocks": self.partition.held_blocks(), "kept": True} if self.pipelined else {}
            shards = self.shard_parameters(self.block_stack, leave_out=others, axis="edp", **stage)
            if shards is not None:
                self.expert_reducer = FullyShardedGradientReducer(named, group, shards, hooks=hooks)
            else:
                self.expert_reducer = self.reducer_class(named, group=group, hooks=hooks)
        return [(n, p) for n, p in module.named_parameters() if id(p) not in experts]

    def sharded_reducers(self) -> list[ShardedGradientReducer]:
        """As the base's, and the experts' reducer where it shards them over their replicas."""
        extra = [self.expert_reducer] if isinstance(self.expert_reducer, ShardedGradientReducer) else []
        return [*super().sharded_reducers(), *extra]

    def own_parameters(self) -> frozenset:
        """The experts placed on this rank: under ZeRO they stay out of the dp reducer's shards (their
        gradients take the edp path), each rank's optimizer holding their whole state (``zero_stage=3``: their
        pieces, sharded over their replicas by the experts' reducer)."""
        module = self.lightning_module
        return (
            frozenset(id(t) for t, _, _ in expert_pieces(module).values())
            if module is not None
            else frozenset()
        )


class Experts(DataParallel):
    """The experts' gradients averaged over their replicas (the ``edp`` group) by ``expert_reducer``, as
    ``DataParallel`` averages the other parameters' over dp; under pipeline stages once after the schedule
    (the experts' reducer has no hooks there). Where ``zero_stage=3`` shards the experts over their
    replicas, each of their pieces then takes its gradient, and the pieces' are dropped after the step (as
    the ``Zero`` axis does for the others)."""

    name = "experts"

    def __init__(self, strategy: Any, after_schedule: bool = False) -> None:
        super().__init__(strategy, after_schedule, overlapped=False)

    def reducer(self) -> Optional[GradientReducer]:
        return self.strategy.expert_reducer

    def post_backward(self) -> None:
        super().post_backward()
        reducer = self.reducer()
        if isinstance(reducer, ShardedGradientReducer) and reducer.sync_enabled:
            reducer.shard_gradients()

    @contextmanager
    def optimizer_step(self, optimizer: Any) -> Iterator[None]:
        yield
        reducer = self.reducer()
        if isinstance(reducer, ShardedGradientReducer):
            reducer.gather_parameters()


def _then_experts(
    cut: Optional[Cut], pieces: Mapping[str, Any], name: str, full: torch.Tensor
) -> torch.Tensor:
    """Set-up's cut of a full tensor: the tensor-parallel one (if any), then this rank's experts."""
    return cut_experts(name, full if cut is None else cut(name, full), pieces)
