"""A layout's set-up at scale without the hardware: each rank's parameter, gradient and optimizer bytes as
the strategies place them, for worlds of hundreds of ranks, in one process.

Each simulated rank runs the strategy's own set-up (``configure_parallelism``: tensor-parallel sharding,
the pipeline partition, the data-parallel gradient path with its ZeRO buckets, then ``shard_optimizers``)
on torch's fake process group (every collective returns at once, nothing is sent) with the LightningModule
built on the meta device, as torchtitan's memory estimation does. On meta the share is never allocated
(``materialize`` leaves it as it is), so a 70B model costs shapes, not bytes. The optimizer then takes one
step on meta gradients, so that it creates its state for the tensors it really holds. The figures are read
from what the set-up left: the module's parameters, the reducer's buckets (ZeRO-2: the received ranges),
the optimizer's state.

A world of ``dp x pp x tp`` ranks is simulated at a few representative ranks (``representative_ranks``):
the ranks of one tensor-parallel group differ only where a layer does not divide evenly, the data-parallel
replicas only in their ZeRO ranges, the pipeline stages in their blocks; ``ranks=`` chooses others.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import lightning_utilities.core.rank_zero as rank_zero_module
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.core.optimizer import _configure_optimizers
from torch import Tensor, nn

from lightning_parallel.compat import fake_store
from lightning_parallel.distributed.mesh import MeshShape, build_mesh
from lightning_parallel.distributed.zero import ShardedGradientReducer
from lightning_parallel.memory.expected import optimizer_kind
from lightning_parallel.module_names import find_block_stack
from lightning_parallel.planner.cost_model import BlockCost, ModelCost

__all__ = [
    "RankState",
    "fake_world",
    "representative_ranks",
    "set_up_rank",
    "set_up_at_scale",
    "parameter_cost",
]


@dataclass(frozen=True)
class RankState:
    """What one rank holds after set-up, in bytes, and the seconds its simulated set-up took."""

    rank: int
    coordinates: tuple[int, int, int]  # (dp, pp, tp)
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    seconds: float

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group, this process as ``rank`` of ``world_size``."""
    if dist.is_initialized():
        raise RuntimeError("set-up at scale needs a process without a process group; one is initialized")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def representative_ranks(shape: MeshShape) -> list[int]:
    """Every pipeline stage at data-parallel and tensor-parallel index 0, and the last rank of the world
    (last dp index: its ZeRO ranges hold the padding; last tp index: a layer that does not divide evenly)."""
    return sorted({shape.rank(0, p, 0) for p in range(shape.pp)} | {shape.world_size - 1})


def _nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct tensors (a tied weight counted once), meta ones as they would be allocated."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _gradient_bytes(strategy: Any, module: nn.Module) -> int:
    """The gradients between steps: the reducer's flat buckets (ZeRO-2: freed, the received ranges kept),
    else autograd's ``.grad`` of each trainable parameter (no data-parallel group, so no reducer)."""
    reducer = getattr(strategy, "reducer", None)
    if reducer is None:
        return _nbytes(p for p in module.parameters() if p.requires_grad)
    held = _nbytes(b.buffer for b in reducer.buckets)
    if isinstance(reducer, ShardedGradientReducer) and reducer.stage == 2:
        dtype = {id(b): b.params[0].dtype for b in reducer.buckets}
        held += sum(
            shard.size * torch.empty((), dtype=dtype[id(bucket)]).element_size()
            for bucket, shard in zip(reducer.buckets, reducer.shards)
            if not shard.whole
        )
    return held


def _optimizer_bytes(strategy: Any, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """One step of each optimizer on zero meta gradients of what it holds (ZeRO: this rank's pieces), then
    the bytes of the state it created."""
    total = 0
    for optimizer in optimizers:
        shards = strategy._optimizer_shards.get(id(optimizer))
        with shards.sharded() if shards is not None else nullcontext():
            held = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            for p in held:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            for p in held:
                p.grad = None
        total += _nbytes(
            v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
        )
    return total


@contextmanager
def _rank_zero_quiet() -> Iterator[None]:
    """Lightning's rank-zero messages held back: every simulated rank is rank 0 to them, and a fake
    all-gather of the stages' report hands back this rank's line for each of the world's ranks."""
    logger = logging.getLogger(rank_zero_module.log.name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _placed(strategy: Any, rank: int, world_size: int) -> Any:
    """``strategy`` as ``rank`` of ``world_size`` processes, its device meta (what the launch would set)."""
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    strategy.parallel_devices = [torch.device("meta")] * world_size  # one node: a layout's errors count all
    return strategy


def set_up_rank(
    build: Callable[[], Any], make_strategy: Callable[[], Any], rank: int, world_size: int
) -> RankState:
    """Set up ``rank`` of ``world_size``: the LightningModule ``build()`` makes on meta, split by the
    strategy ``make_strategy()`` makes (``lp_ddp``, ``lp_parallel`` or a preset), as its set-up would."""
    start = time.perf_counter()
    with fake_world(rank, world_size), _rank_zero_quiet():
        with torch.device("meta"):
            module = build()
        strategy = _placed(make_strategy(), rank, world_size)
        strategy.connect(module)
        shape = strategy.mesh_shape()
        strategy.mesh = build_mesh(shape)
        strategy.configure_parallelism()
        optimizers = _configure_optimizers(module.configure_optimizers())[0]
        strategy.optimizers = optimizers
        strategy.shard_optimizers()
        held = (
            _nbytes(module.parameters()),
            _gradient_bytes(strategy, module),
            _optimizer_bytes(strategy, optimizers),
        )
    return RankState(rank, shape.coordinates(rank), *held, seconds=time.perf_counter() - start)


def set_up_at_scale(
    build: Callable[[], Any],
    make_strategy: Callable[[], Any],
    world_size: int,
    ranks: Optional[Sequence[int]] = None,
) -> list[RankState]:
    """``set_up_rank`` for each of ``ranks`` (default: ``representative_ranks`` of the strategy's layout)."""
    if ranks is None:
        ranks = representative_ranks(_placed(make_strategy(), 0, world_size).mesh_shape())
    return [set_up_rank(build, make_strategy, r, world_size) for r in ranks]


def parameter_cost(build: Callable[[], Any], batch_size: int = 1) -> ModelCost:
    """The parameter side of the ``ModelCost`` of the LightningModule ``build()`` makes on meta: each block's
    parameter bytes, the rest's, the element size and the optimizer of its ``configure_optimizers`` (times
    and activations 0). The cost model's memory side predicts each rank's model states from it, which
    ``set_up_at_scale`` reads from the real set-up (``tests/planner/test_at_scale.py`` compares the two)."""
    with torch.device("meta"):
        module = build()
    _, stack = find_block_stack(module)
    blocks = [
        BlockCost(0.0, 0.0, 0.0, float(_nbytes(p for p in block.parameters())))
        for block in stack
    ]
    whole = _nbytes(module.parameters())
    optimizers = _configure_optimizers(module.configure_optimizers())[0]
    itemsize = next(p for p in module.parameters() if p.is_floating_point()).element_size()
    return ModelCost(
        blocks=blocks,
        other_parameter_bytes=float(whole - sum(b.parameter_bytes for b in blocks)),
        batch_size=batch_size,
        parameter_itemsize=itemsize,
        optimizer=optimizer_kind(optimizers[0]),
        name=type(module).__name__,
    )
