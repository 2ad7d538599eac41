"""Ranks laid out as a (data, pipeline, tensor) grid, and the process groups along each axis.

    rank = (dp_index * pp_size + pp_index) * tp_size + tp_index

Tensor-parallel peers are neighbours (same node when devices per node is a multiple of tp, so their
frequent all-reduces stay on the fast links); pipeline stages come next; data-parallel replicas are
farthest apart, since they talk once per step.

Expert parallelism divides the data-parallel axis (as Megatron's and torchtitan's do): ``ep`` neighbouring
dp indices form an expert-parallel group (``"ep"``, which exchanges tokens), and the dp indices holding
the same experts form the expert-replica group (``"edp"``, ``dp / ep`` ranks, which average the experts'
gradients). ``"ep_model"`` is an ep group's ranks with all their pp x tp ranks: together they hold one
whole model once.

HSDP (``dp_shard``, which divides ``dp``) splits the data-parallel axis the same way for ZeRO: ``dp_shard``
neighbouring dp indices form a shard group (``"dp_shard"``, over which ZeRO shards and gathers; one node's
ranks when ``dp_shard`` is the devices per node), and the dp indices at the same place of every shard group
form a replica group (``"dp_replicate"``, ``dp / dp_shard`` ranks, which all-reduce each shard's gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

__all__ = ["HSDP_AXES", "MeshShape", "Mesh", "build_mesh", "new_axis_group"]

#: the groups of HSDP (``MeshShape.dp_shard``): where ZeRO shards, and across which it replicates
HSDP_AXES = ("dp_shard", "dp_replicate")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the three axes (their product is the world size), and ``ep`` and ``dp_shard`` (None: all
    of ``dp``), which divide ``dp``."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    dp_shard: Optional[int] = None

    @property
    def replicates_shards(self) -> bool:
        """HSDP: ZeRO shards over part of the data-parallel axis and replicates across those parts."""
        return self.size("dp_shard") < self.dp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a global rank."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def size(self, axis: str) -> int:
        """The size of ``axis``: ``"dp"``, ``"pp"``, ``"tp"``, ``"ep"``, ``"model"`` (pp x tp: the ranks of
        one replica of the model, which together hold all of it), ``"edp"`` (dp / ep: the replicas of one
        expert), ``"ep_model"`` (ep x pp x tp), ``"dp_shard"`` (what ZeRO shards over) or
        ``"dp_replicate"`` (dp / dp_shard: the replicas of one shard)."""
        shard = self.dp if self.dp_shard is None else self.dp_shard
        derived = {
            "model": self.pp * self.tp,
            "edp": self.dp // self.ep,
            "ep_model": self.ep * self.pp * self.tp,
            "dp_shard": shard,
            "dp_replicate": self.dp // shard,
        }
        return derived[axis] if axis in derived else getattr(self, axis)

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks that share every coordinate of ``rank`` except ``axis`` (``"model"``: except
        pp and tp)."""
        d, p, t = self.coordinates(rank)
        size = self.size(axis)
        if axis == "model":
            return [self.rank(d, 0, 0) + i for i in range(size)]
        if axis in ("ep", "dp_shard"):  # neighbouring dp indices
            return [self.rank(d - d % size + i, p, t) for i in range(size)]
        if axis in ("edp", "dp_replicate"):  # the same place in every group of neighbours
            every = self.dp // size
            return [self.rank(d % every + i * every, p, t) for i in range(size)]
        if axis == "ep_model":
            return [self.rank(d - d % self.ep, 0, 0) + i for i in range(size)]
        if axis == "dp":
            return [self.rank(i, p, t) for i in range(size)]
        if axis == "pp":
            return [self.rank(d, i, t) for i in range(size)]
        return [self.rank(d, p, i) for i in range(size)]

    def all_axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, each once, in a fixed order (new_group must be called alike)."""
        groups: list[list[int]] = []
        for r in range(self.world_size):
            ranks = self.axis_ranks(axis, r)
            if ranks not in groups:
                groups.append(ranks)
        return groups


@dataclass
class Mesh:
    """This rank's place in the grid and the groups it belongs to (None means the whole world)."""

    shape: MeshShape
    rank: int
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    @property
    def dp_rank(self) -> int:
        return self.shape.coordinates(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.shape.coordinates(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.shape.coordinates(self.rank)[2]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (which experts it holds)."""
        return self.dp_rank % self.shape.ep

    def group(self, axis: str) -> Optional[dist.ProcessGroup]:
        return self.groups.get(axis)

    def ranks(self, axis: str) -> list[int]:
        return self.shape.axis_ranks(axis, self.rank)


def build_mesh(shape: MeshShape) -> Mesh:
    """Create the process groups of ``shape``; every rank must call this, in the same order.

    An axis that spans the whole world uses the default group (None) rather than a copy of it; a
    size-1 axis still gets a real (single-rank) group, so None never silently means "everyone". The
    expert axes get groups only where ``shape.ep > 1``, the HSDP axes only where ``replicates_shards``.
    """
    world = dist.get_world_size()
    if shape.world_size != world:
        raise ValueError(
            f"The parallel layout dp={shape.dp} x pp={shape.pp} x tp={shape.tp} needs "
            f"{shape.world_size} processes, but the run has {world} (devices x num_nodes)."
        )
    rank = dist.get_rank()
    mesh = Mesh(shape=shape, rank=rank)
    experts = ("ep", "edp", "ep_model") if shape.ep > 1 else ()
    for axis in ("dp", "pp", "tp", "model", *experts, *(HSDP_AXES if shape.replicates_shards else ())):
        mesh.groups[axis] = None if shape.size(axis) == world else new_axis_group(shape, axis, rank)
    return mesh


def new_axis_group(shape: MeshShape, axis: str, rank: int) -> dist.ProcessGroup:
    """A new process group along ``axis`` holding ``rank`` (every rank calls this alike: each group of
    the axis is created on every rank, in one order, as ``new_group`` requires)."""
    mine = None
    for ranks in shape.all_axis_groups(axis):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
