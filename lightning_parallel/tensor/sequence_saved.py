"""A region's gathered input kept for backward as this rank's part of the sequence, and gathered again there.

The column-parallel layers of a sequence-parallel region read the whole sequence, so autograd would save
the gathered input (``tp`` times this rank's part) for their weight gradients. As in Megatron-SP, what is
stored is the part instead (a ``memory.saved.SavedHooks`` while the region runs), and backward all-gathers
it again when it unpacks it: the saved activations of a region's input drop by ``tp``, for one more
all-gather per region in backward (q, k and v share it). The hooks stack on those below them: inside a
checkpointed block, torch's checkpoint stores nothing in the forward and the part in its recompute.

Under ``torch.compile`` the hooks are not installed: what a compiled graph saves for its backward is
chosen by its own partitioner, inside the graph, and saved-tensor hooks cannot be entered there. A region
then saves what tensor parallelism alone would (``tensor.sequence`` warns once at set-up).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.compat import in_backward, queue_end_of_backward
from lightning_parallel.distributed.collectives import all_gather_dim
from lightning_parallel.memory.accounting import storage_id
from lightning_parallel.memory.saved import SavedHooks, Stored

__all__ = ["SavedAsPart"]


class SavedAsPart:
    """Saved-tensor hooks for the region calls running now: the gathered input (made from ``part`` along
    ``dim``), or any view of it, is stored as ``part``; ``enter()``/``exit()`` bracket a region's forward."""

    def __init__(self, group: Optional[dist.ProcessGroup], dim: int) -> None:
        self.group, self.dim = group, dim
        self.stack: list[tuple[SavedHooks, int, Tensor]] = []  # (hooks, gathered's storage, part) per region
        self._last: Optional[tuple[tuple, Tensor, Tensor]] = None  # (part's place, part, gathered again)

    def enter(self, gathered: Tensor, part: Tensor) -> None:
        if torch.compiler.is_compiling():  # a compiled graph saves what its partitioner chose (module doc)
            return
        hooks = SavedHooks(self._keep)
        hooks.__enter__()
        self.stack.append((hooks, storage_id(gathered), part))

    def exit(self) -> None:
        if torch.compiler.is_compiling():
            return
        if self.stack:
            self.stack.pop()[0].__exit__(None, None, None)
        self._last = None

    def _keep(self, t: Tensor) -> Stored:
        _, gathered, part = self.stack[-1]
        if not t.numel() or t.device.type == "meta" or storage_id(t) != gathered:
            return Stored(t)
        geometry = (tuple(t.shape), t.stride(), t.storage_offset())
        return Stored(part, lambda kept: self._gathered(kept).as_strided(*geometry))

    def _gathered(self, part: Tensor) -> Tensor:
        """``part`` gathered again; the last one is kept for the next unpack of the same part (q, k and v
        read one input) until the backward ends."""
        key = (storage_id(part), part.storage_offset(), tuple(part.shape))
        if self._last is None or self._last[0] != key:
            self._last = None  # freed before the next one is gathered
            self._last = (key, part, all_gather_dim(part, self.group, self.dim))
            if in_backward():
                queue_end_of_backward(self._forget)
        return self._last[2]

    def _forget(self) -> None:
        self._last = None
