"""The bytes autograd keeps saved for backward (the activations), counted live, with their peak.

Saved-tensor hooks form a stack and only the innermost pair runs, so a counting hook of its own would be
hidden by any hook installed inside it (the pipeline's ``weights_snapshot``). Counting therefore goes
through one module-level function, ``record_saved``, which every pack hook of the package calls with the
tensor autograd is saving; ``SavedTensorCounter.start`` installs a pack hook that only calls it.

A saved storage counts once from when it is first saved until it is freed (``weakref.finalize`` on the
storage object, which torch keeps alive as long as the storage), so views and reused tensors count once.
Storages of parameters and buffers (``ignore``) are not activations and count nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from lightning_parallel.memory.accounting import storage_key, storage_of

__all__ = ["SavedTensorCounter", "record_saved"]

#: the counters counting now; every pack hook of the package reports to them through ``record_saved``
_COUNTING: list["SavedTensorCounter"] = []


def record_saved(t: Tensor) -> None:
    """Report a tensor that autograd is saving to every counter counting now (call it in a pack hook)."""
    for counter in _COUNTING:
        counter.add(t)


def _pack(t: Tensor) -> Tensor:
    record_saved(t)
    return t


def _unpack(t: Tensor) -> Tensor:
    return t


class SavedTensorCounter:
    """Live bytes of the storages autograd saved while counting, and the largest value they reached."""

    def __init__(self) -> None:
        self.live = 0  # bytes saved and not yet freed
        self.peak = 0  # the most that ``live`` reached since counting began
        self._sizes: dict[int, int] = {}  # storage key -> bytes, for the live storages
        self._ignored: set[int] = set()
        self._hooks: Optional[Any] = None

    def ignore(self, tensors: Iterable[Tensor]) -> None:
        """Storages that are not activations (the module's parameters and buffers): saved, they count 0."""
        self._ignored = {k for k in (storage_key(t) for t in tensors) if k is not None}

    def add(self, t: Tensor) -> None:
        """Count the storage behind ``t`` if it is new, not ignored and not on meta; until it is freed."""
        storage = storage_of(t)
        key = None if storage is None else storage._cdata
        if storage is None or key in self._ignored or key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key).atexit = False

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def start(self) -> None:
        """Count from now on: install the counting pack hook (innermost until another is installed)."""
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            self._hooks.__enter__()
            _COUNTING.append(self)

    @property
    def counting(self) -> bool:
        """Whether the counting hook is installed now."""
        return self._hooks is not None

    def stop(self) -> None:
        """Stop counting and remove the hook (storages still live keep counting down as they are freed)."""
        if self._hooks is not None:
            _COUNTING.remove(self)
            self._hooks.__exit__(None, None, None)
            self._hooks = None
