"""The bytes autograd keeps saved for backward (the activations), counted live, with their peak, and the
package's one pair of saved-tensor hooks.

Saved-tensor hooks form a stack and only the innermost pair runs. The package's own hooks (the memory
counter's, the async pipeline's weights snapshot, sequence parallelism's saved parts, the recompute's
report) are all ``SavedHooks``, which stack: each says what is stored for a tensor (``keep``) and hands
that to the hooks below it, so a hook installed inside another (a sequence-parallel region inside a
checkpointed block) adds to it instead of hiding it. What is finally stored is counted once, by the
topmost of the package's hooks, through ``record_saved``.

A saved storage counts once from when it is first saved until it is freed (``weakref.finalize`` on the
storage object, which torch keeps alive as long as the storage), so views and reused tensors count once.
Storages of parameters and buffers (``ignore``) are not activations and count nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_parallel.compat import saved_tensors_hooks_readable, top_saved_tensors_hooks
from lightning_parallel.memory.accounting import storage_key, storage_of

__all__ = ["SavedHooks", "SavedTensorCounter", "Stored", "can_stack", "counting", "record_saved"]

#: the counters counting now; every pack hook of the package reports to them through ``record_saved``
_COUNTING: list["SavedTensorCounter"] = []


def record_saved(t: Tensor) -> None:
    """Report a tensor that autograd is saving to every counter counting now (call it in a pack hook)."""
    for counter in _COUNTING:
        counter.add(t)


def counting() -> bool:
    """Whether a counter counts now (a hook that only reports need not be installed otherwise)."""
    return bool(_COUNTING)


def can_stack() -> bool:
    """Whether this torch lets ``SavedHooks`` read the hooks below them (a private function torch 2.13 has
    and 2.5 lacks). Without it they hide the hooks below, as any other hooks do: a hook inside torch's
    checkpoint then stores for real what the checkpoint would have recomputed."""
    return saved_tensors_hooks_readable()


class Stored(NamedTuple):
    """What a ``SavedHooks`` stores for a saved tensor: ``tensor``, given back in backward as
    ``restore(tensor)`` (None: as it is); ``counted`` is what the counters see (a weight copy is stored
    but counted as the parameter it copies, which counts nothing)."""

    tensor: Tensor
    restore: Optional[Callable[[Tensor], Tensor]] = None
    counted: Optional[Tensor] = None


def _as_is(t: Tensor) -> Stored:
    return Stored(t)


class SavedHooks(torch.autograd.graph.saved_tensors_hooks):
    """The package's pair of saved-tensor hooks: ``keep(t)`` says what is stored for each saved tensor
    ``t`` (default: ``t`` itself).

    Stacked: the hooks installed when these are entered (``below``) still apply. The pack hook hands what
    ``keep`` chose to theirs and the unpack hook restores what theirs gave back: inside torch's
    checkpoint, nothing is stored in the forward, and the recompute stores what ``keep`` chose. With no
    hooks below, the tensor is stored here, detached: never the graph's own tensor object, which for an
    output of the node that saves it would hold that node (its ``grad_fn``), a reference cycle that
    ``gc`` cannot free while no backward runs (torch stores such outputs without that reference too).

    Counting: the topmost of the package's hooks reports ``Stored.counted`` when the tensor is stored for
    real: here, in a package hook below (called through ``_keep``, which does not count again), or in
    hooks below that store what they get (``below_stores``: torch's recompute hook)."""

    def __init__(self, keep: Callable[[Tensor], Stored] = _as_is, below_stores: bool = False) -> None:
        super().__init__(self._pack, self._unpack)
        self.keep, self.below_stores = keep, below_stores
        self.below: Optional[tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]] = None

    def __enter__(self) -> None:
        self.below = _innermost_hooks()
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        self.below = None

    # autograd calls the hooks as it saves, also inside a compiled graph's run, where dynamo would trace
    # them as frames of their own: they run eagerly (storage identities, Python bookkeeping)
    @torch.compiler.disable
    def _pack(self, t: Tensor) -> Any:
        stored = self.keep(t)
        if self._stores():
            record_saved(stored.tensor if stored.counted is None else stored.counted)
        return self._hand_down(stored)

    def _keep(self, t: Tensor) -> Any:
        """Pack for a package hook above this one, which has counted already."""
        return self._hand_down(self.keep(t))

    def _hand_down(self, stored: Stored) -> Any:
        if self.below is None:
            return None, stored.tensor.detach(), stored.restore
        pack, unpack = self.below
        package = _package_hooks(pack)
        return (
            unpack,
            (pack(stored.tensor) if package is None else package._keep(stored.tensor)),
            stored.restore,
        )

    @torch.compiler.disable
    def _unpack(self, packed: Any) -> Tensor:
        unpack, inner, restore = packed
        t = inner if unpack is None else unpack(inner)
        return t if restore is None else restore(t)

    def _stores(self) -> bool:
        """Whether what this pack hook hands down is stored for real."""
        if self.below is None or self.below_stores:
            return True
        package = _package_hooks(self.below[0])
        return package is not None and package._stores()


def _innermost_hooks() -> Optional[tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]]:
    """The saved-tensor hooks that run now (the innermost pair), read with a private torch function."""
    return top_saved_tensors_hooks()


def _package_hooks(pack: Callable[[Tensor], Any]) -> Optional[SavedHooks]:
    """The ``SavedHooks`` whose pack hook ``pack`` is, else None (another's: torch's checkpoint hooks)."""
    owner = getattr(pack, "__self__", None)
    return owner if isinstance(owner, SavedHooks) else None


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
        storage, key = storage_of(t), storage_key(t)
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
            self._hooks = SavedHooks()
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
