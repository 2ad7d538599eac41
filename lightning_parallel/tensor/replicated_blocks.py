"""Gradients of the blocks of a sharded tensor held whole by several ranks (``ShardSpec.parts`` with
``copies`` > 1: key-value heads fewer than the tensor-parallel ranks).

Each rank that holds such a block uses it only for its own query heads, so its gradient there is
partial, and one device's gradient is the sum over the ranks that hold the block. The sum runs in the
tensor-parallel group's one collective of a backward (``tensor.gradient_sums``): each rank places its
slice of every replicated block at the slice's place in a zero tensor as wide as the full block, the
all-reduce adds the ranks that hold the same slice, and each rank takes its slice back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_parallel.tensor.layers import ShardSpec

__all__ = ["Replicated", "norm_weight", "placed", "taken_back"]


class Replicated:
    """How a parameter was cut (``spec``) on rank ``rank`` of ``size``: what its gradient sum needs."""

    def __init__(self, spec: ShardSpec, size: int, rank: int) -> None:
        self.spec, self.size, self.rank = spec, size, rank

    def _pieces(self, local: Tensor) -> tuple[list[Tensor], list[tuple[int, int]]]:
        dim = self.spec.dim
        full = self.spec.full_size(local.shape[dim], self.size)
        blocks = self.spec.blocks(full, self.size)
        return list(local.split([w * c // self.size for w, c in blocks], dim=dim)), blocks


def norm_weight(local: Tensor, how: Replicated) -> Tensor:
    """Scales for ``local``'s gradient in the model's norm, summed over the group: 1 on the rows of a split
    block, 1 / sqrt(copies) on those of a block ``copies`` ranks hold, so each row's square counts once.
    Shaped to broadcast over ``local``."""
    pieces, blocks = how._pieces(local)
    dim = how.spec.dim
    scale = torch.cat(
        [
            torch.full((p.shape[dim],), c**-0.5, dtype=local.dtype, device=local.device)
            for p, (_, c) in zip(pieces, blocks)
        ]
    )
    shape = [1] * local.dim()
    shape[dim] = -1
    return scale.view(shape)


def placed(local: Tensor, how: Replicated) -> Tensor:
    """The replicated blocks of ``local``, each at this rank's slice of a zero tensor as wide as the
    block, concatenated along the sharded dimension."""
    pieces, blocks = how._pieces(local)
    dim, out = how.spec.dim, []
    for piece, (width, copies) in zip(pieces, blocks):
        if copies > 1:
            shape = list(piece.shape)
            shape[dim] = width
            zero = piece.new_zeros(shape)
            zero.narrow(dim, how.rank // copies * piece.shape[dim], piece.shape[dim]).copy_(piece)
            out.append(zero)
    return torch.cat(out, dim=dim)


def taken_back(local: Tensor, summed: Tensor, how: Replicated) -> Tensor:
    """``local`` with each replicated block replaced by this rank's slice of ``summed`` (``placed``'s
    layout, summed over the group)."""
    pieces, blocks = how._pieces(local)
    dim = how.spec.dim
    sums = iter(summed.split([w for w, c in blocks if c > 1], dim=dim))
    out = [
        next(sums).narrow(dim, how.rank // copies * piece.shape[dim], piece.shape[dim])
        if copies > 1
        else piece
        for piece, (_, copies) in zip(pieces, blocks)
    ]
    return torch.cat(out, dim=dim)
