"""Tensor parallel as a transform of a module: a resolved plan applied over a tp group, and the cut that
tells set-up which slice of each full tensor this rank keeps."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.tensor.full_state import sharded_parameters
from lightning_parallel.tensor.layers import SharedEntry, shard_slice
from lightning_parallel.tensor.plan import ResolvedPlan, apply_plan

__all__ = ["shard_module"]

Cut = Callable[[str, torch.Tensor], torch.Tensor]


def shard_module(
    module: nn.Module, resolved: ResolvedPlan, group: Optional[dist.ProcessGroup], tp_rank: int
) -> tuple[list[SharedEntry], Cut]:
    """Replace the planned layers of ``module`` (real or meta) by their shards for ``tp_rank`` of ``group``;
    returns the shared entry operators (cleared after each step) and how this rank cuts a full tensor
    named by its state-dict key (others are kept whole). The gradient sums the plan asks for are
    installed later, on the final parameter objects (``install_gradient_sums``)."""
    entries = apply_plan(module, resolved, group, tp_rank, gradient_hooks=False)
    cuts = {key: (spec, layer) for key, (_, spec, layer) in sharded_parameters(module).items()}

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        if name not in cuts:
            return full
        spec, layer = cuts[name]
        return shard_slice(full, spec, layer.tp_size, layer.tp_rank)

    return entries, cut
