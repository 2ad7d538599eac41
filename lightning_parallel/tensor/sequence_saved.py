"""A region's gathered input kept for backward as this rank's part of the sequence, and gathered again there.

The column-parallel layers of a sequence-parallel region read the whole sequence, so autograd would save
the gathered input (``tp`` times this rank's part) for their weight gradients. As in Megatron-SP, the
saved copy is the part instead (a pack hook while the region runs), and backward all-gathers it again
when it unpacks it: the saved activations of a region's input drop by ``tp``, for one more all-gather per
saved use in backward. What is saved is reported to ``memory.saved.record_saved`` (only the innermost
pack hook runs, and the memory report counts through it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.distributed.collectives import all_gather_dim
from lightning_parallel.memory.saved import record_saved

__all__ = ["SavedAsPart"]


class SavedAsPart:
    """Pack hooks for one region call: ``gathered`` (made from ``part`` along ``dim``), or any view of it,
    is saved as ``part``; ``enter()``/``exit()`` bracket the region's forward."""

    def __init__(self, group: Optional[dist.ProcessGroup], dim: int) -> None:
        self.group, self.dim = group, dim
        self.stack: list[tuple[Any, Tensor, Tensor]] = []  # (hooks, gathered, part) of the running regions
        self._last: Optional[tuple[Tensor, Tensor]] = None  # (part, gathered again): q, k and v share one

    def enter(self, gathered: Tensor, part: Tensor) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self.stack.append((hooks, gathered, part))

    def exit(self) -> None:
        if self.stack:
            self.stack.pop()[0].__exit__(None, None, None)
        self._last = None

    def _pack(self, t: Tensor) -> Any:
        _, gathered, part = self.stack[-1]
        same = t.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr() and t.numel()
        if not same or t.device.type == "meta":
            record_saved(t)
            return t
        record_saved(part)
        return (part, tuple(t.shape), t.stride(), t.storage_offset())

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        part, shape, stride, offset = packed
        if self._last is None or self._last[0] is not part:
            self._last = (part, all_gather_dim(part, self.group, self.dim))
        return self._last[1].as_strided(shape, stride, offset)
