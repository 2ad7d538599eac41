"""Version shims: every call that differs between torch, Lightning and transformers versions, each with the
version that changed it. Callers ask here instead of testing versions themselves, so that a guard added for
one caller holds for all."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

__all__ = ["reduce_scatter_single", "all_gather_single"]


def reduce_scatter_single() -> Callable[..., object]:
    """``(output, input, op=SUM, group=None, async_op=False)``: the sum of ``input`` over the group, this
    rank's equal part of it in ``output``. torch 2.13 added ``dist.reduce_scatter_single``; before it the
    same call is ``dist.reduce_scatter_tensor`` (torch >= 1.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single() -> Callable[..., object]:
    """``(output, input, group=None, async_op=False)``: every rank's ``input`` concatenated in ``output``
    (``input`` may be this rank's part of ``output``: in place). torch 2.13 added ``dist.all_gather_single``;
    before it the same call is ``dist.all_gather_into_tensor`` (torch >= 1.13)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
