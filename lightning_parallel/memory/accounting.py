"""What one rank holds, in bytes: tensors counted by unique storage, and the process's memory.

Parameters, gradients and optimizer state are summed over distinct storages (by storage identity), so a
view or a tied weight counts once and a meta tensor counts nothing. The process figures come from the OS
on the CPU (resident set: current from ``/proc/self/statm``, peak from ``VmHWM``) and from
the CUDA caching allocator on a GPU.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor

__all__ = [
    "storage_of",
    "storage_id",
    "storage_key",
    "unique_storage_bytes",
    "ModelSize",
    "model_size",
    "floating_dtype",
    "gradients",
    "optimizer_state_tensors",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "cuda_allocated",
]


def _local(t: Tensor) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t


def storage_of(t: Tensor) -> Optional[torch.UntypedStorage]:
    """The storage behind ``t`` (shared by its views; a DTensor's local one), or None for a meta tensor."""
    t = _local(t)
    return None if t.device.type == "meta" else t.untyped_storage()


def storage_id(t: Tensor) -> int:
    """The identity of the storage behind ``t`` (a DTensor's local one) among the live storages: the
    package's one way to tell whether two tensors share their memory (views do). Real, meta and fake
    tensors all have one; it can be reused once the storage is freed."""
    return _local(t).untyped_storage()._cdata


def storage_key(t: Tensor) -> Optional[int]:
    """``storage_id`` of a tensor that holds memory, or None for a meta tensor."""
    return None if storage_of(t) is None else storage_id(t)


def unique_storage_bytes(tensors: Iterable[Optional[Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped): each storage once, meta 0."""
    held = (t for t in tensors if t is not None and storage_of(t) is not None)
    return sum({storage_id(t): storage_of(t).nbytes() for t in held}.values())


@dataclass(frozen=True)
class ModelSize:
    """A model's parameters, read before a strategy splits them: floating-point elements, their bytes
    as built, and the bytes of the rest. Read again in another floating dtype (``bytes_as``), because
    Lightning's precision plugin may convert the model (``64-true``, ``bf16-true``) after it is read."""

    float_elements: int = 0
    float_bytes: int = 0
    other_bytes: int = 0

    def bytes_as(self, dtype: Optional[torch.dtype]) -> int:
        """The bytes with the floating-point elements in ``dtype`` (None: as built)."""
        floats = self.float_bytes if dtype is None else self.float_elements * dtype.itemsize
        return floats + self.other_bytes


def model_size(tensors: Iterable[Tensor]) -> ModelSize:
    """The size of ``tensors`` (a model's parameters) each storage once; a meta tensor counts the size it
    describes (each tensor object once), so a model built on meta is measured too."""
    seen: dict[Any, tuple[bool, int, int]] = {}
    for t in tensors:
        storage = storage_of(t)
        nbytes = t.numel() * t.element_size() if storage is None else storage.nbytes()
        key = ("meta", id(t)) if storage is None else storage_id(t)
        seen[key] = (t.is_floating_point(), nbytes, t.element_size())
    floats = [(n, size) for is_float, n, size in seen.values() if is_float]
    return ModelSize(
        float_elements=sum(n // size for n, size in floats),
        float_bytes=sum(n for n, _ in floats),
        other_bytes=sum(n for is_float, n, _ in seen.values() if not is_float),
    )


def floating_dtype(tensors: Iterable[Tensor]) -> Optional[torch.dtype]:
    """The one floating-point dtype of ``tensors``, or None when they have none or several."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def gradients(parameters: Iterable[Tensor]) -> Iterator[Optional[Tensor]]:
    """The ``.grad`` of each parameter (None where it has none)."""
    return (p.grad for p in parameters)


def optimizer_state_tensors(optimizers: Iterable[Any]) -> Iterator[Tensor]:
    """Every tensor in the state of ``optimizers`` (momentum, Adam's moments and step counts, ...)."""
    for optimizer in optimizers:
        optimizer = _holding_state(getattr(optimizer, "optimizer", optimizer))  # Lightning's wrapper
        for state in optimizer.state.values():
            values = state.values() if isinstance(state, dict) else [state]
            yield from (v for v in values if isinstance(v, Tensor))


def _holding_state(optimizer: Any) -> Any:
    """The optimizer whose ``state`` holds the tensors: torch's ``ZeroRedundancyOptimizer`` keeps this rank's
    in its local optimizer, ``optim``, and leaves its own ``state`` empty.

    Looked up among the imported modules, never imported here: importing
    ``torch.distributed.optim`` once a process group exists stores the default group in a default
    argument (``zero_redundancy_optimizer._broadcast_object(group=dist.group.WORLD)``), which keeps that
    group and its gloo threads alive after ``destroy_process_group``. An optimizer of that class exists
    only if its module was imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def rss_bytes() -> Optional[int]:
    """The process's resident memory now (Linux ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def available_host_bytes() -> Optional[int]:
    """The memory the host can still give without swapping (Linux ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """The process's peak resident memory: Linux's ``VmHWM`` (this program's own; ``ru_maxrss`` would also
    hold the launching process's peak from before ``exec``), else ``ru_maxrss`` (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_peak_rss() -> bool:
    """Lower the process's peak resident memory (``VmHWM``) to its resident memory now (Linux 4.0+:
    ``/proc/self/clear_refs``), so that a peak read later is what came after; False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cuda_allocated(device: torch.device) -> Optional[dict[str, int]]:
    """The CUDA allocator's figures for ``device`` (now and peak, allocated and reserved); None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }
