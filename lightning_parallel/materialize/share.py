"""Fill a parallelized meta module with this rank's share: allocated on the device, written one module at a
time from full values made on the host, which no rank ever holds all of at once."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.materialize.initializers import initialized_copy
from lightning_parallel.materialize.tensors import Captured, Slot, own_tensors

__all__ = ["Cut", "Place", "describe_loaded", "materialize", "release_freed_host_memory", "shared_rng_state"]

#: (full name, full tensor) -> what this rank keeps of it
Cut = Callable[[str, Tensor], Tensor]
#: (full name, full tensor) -> whether it wrote what this rank keeps of a tensor it placed itself
Place = Callable[[str, Tensor], bool]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shared_rng_state(state: Optional[Tensor] = None) -> Tensor:
    """Global rank 0's CPU random state (``state``, default the current one), on every rank: initial
    values made from it agree everywhere."""
    state = torch.get_rng_state() if state is None else state.clone()
    if _distributed():
        carrier = state.cuda() if dist.get_backend() == "nccl" else state  # NCCL moves CUDA tensors only
        dist.broadcast(carrier, src=0)
        state = carrier.cpu()
    return state


def describe_loaded(captured: Captured, weights: Mapping[str, Tensor], source: object) -> str:
    """What set-up will read from ``weights`` and what the initializers make (said before set-up)."""
    names = {n for slot in captured.slots() for n in slot.names}
    found = [s for s in captured.slots() if any(n in weights for n in s.names)]
    left = [s.names[0] for s in captured.slots() if not any(n in weights for n in s.names)]
    unused = [k for k in weights if k not in names]
    text = f"initial weights: {len(found)} tensors from {source}"
    if left:
        text += f"; {len(left)} from the model's initializers ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})"
    if unused:
        text += f"; {len(unused)} in the file match no tensor of the model ({', '.join(unused[:4])})"
    return text


def _agreed(source: Tensor, device: torch.device) -> Tensor:
    """Rank 0's values of a tensor every rank built (ranks of an unseeded run may differ)."""
    if not _distributed():
        return source
    moved = source.to(device) if dist.get_backend() == "nccl" else source.contiguous()
    dist.broadcast(moved, src=0)
    return moved


def full_values(
    root: nn.Module,
    captured: Captured,
    rng_state: Tensor,
    device: torch.device,
    checkpoint: Optional[Mapping[str, Tensor]] = None,
) -> Iterator[tuple[Slot, Tensor]]:
    """Each unique tensor's full value, in module order, one module at a time: from ``checkpoint`` (by any
    of its names), else the real tensor (rank 0's), else the module's initializer on the host, run from
    ``rng_state`` (the global random state is left as it was). A real tensor is released once given."""
    checkpoint = checkpoint or {}

    def stored(slot: Slot) -> Optional[Tensor]:
        return next((checkpoint[n] for n in slot.names if n in checkpoint), None)

    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        for record in captured.records:
            needed = [
                attr for attr, slot in record.own.items() if slot.source is None and stored(slot) is None
            ]
            fresh = initialized_copy(root, record, needed) if needed else None
            for slot in record.first:
                value = stored(slot)
                if value is not None and tuple(value.shape) != tuple(slot.template.shape):
                    raise ValueError(
                        f"the stored tensor for {slot.names[0]!r} has shape {tuple(value.shape)}, but the model's "
                        f"is {tuple(slot.template.shape)}: the weights are for another configuration"
                    )
                if value is None and slot.source is not None:
                    value, slot.source = _agreed(slot.source, device), None
                if value is None:
                    attr = next(a for a, s in record.own.items() if s is slot)
                    value = fresh._parameters.get(attr, fresh._buffers.get(attr))
                yield slot, value.detach()


def _allocate(module: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """Replace each meta tensor in ``module``'s registries by an empty one on ``device``, one per unique
    tensor (ties kept), all at once (freed host values then leave no holes between them); returns every
    name of a new tensor -> it."""
    new: dict[int, Tensor] = {}
    names: dict[str, Tensor] = {}
    old: list[Tensor] = []  # keeps ids from being reused while this runs
    for prefix, m in module.named_modules(remove_duplicate=False):
        for attr, t, is_param in list(own_tensors(m)):
            if not t.is_meta:
                continue
            if id(t) not in new:
                empty = torch.empty_like(t, device=device)
                new[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
                old.append(t)
            (m._parameters if is_param else m._buffers)[attr] = new[id(t)]
            names[f"{prefix}.{attr}" if prefix else attr] = new[id(t)]
    return names


def release_freed_host_memory() -> None:
    """Hand the heap memory that freed full tensors leave behind back to the system (glibc keeps it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def materialize(
    module: nn.Module,
    captured: Captured,
    device: torch.device,
    rng_state: Tensor,
    cut: Optional[Cut] = None,
    checkpoint: Optional[Mapping[str, Tensor]] = None,
    place: Optional[Place] = None,
) -> None:
    """Allocate on ``device`` every meta tensor that ``module`` (parallelized after ``capture``) still
    registers, and write each from its full value (``full_values``) through ``cut`` (default: whole); a
    tensor that parallelizing already put on the device (ZeRO-3's sharded parameters) is handed to
    ``place`` by its names instead. Raises if an allocated tensor gets no value. On the meta device the
    share stays as it is, unfilled: the set-up run for its placement alone (``planner/at_scale.py``) reads
    shapes, not values."""
    if device.type == "meta":
        return
    local = _allocate(module, device)
    pending = {id(t): t for t in local.values()}
    had_sources = any(slot.source is not None for slot in captured.slots())
    with torch.no_grad():
        for slot, full in full_values(module, captured, rng_state, device, checkpoint):
            for name in slot.names:
                target = local.get(name)
                if target is not None and pending.pop(id(target), None) is not None:
                    value = cut(name, full) if cut is not None else full
                    target.copy_(value.to(dtype=target.dtype).reshape(target.shape))
                elif target is None and place is not None and place(name, full):
                    break
            del full
    if pending:
        missing = [n for n, t in local.items() if id(t) in pending]
        raise RuntimeError(
            f"set-up gave no values to {missing[:5]} (of {len(missing)}): a bug, please report it"
        )
    if had_sources:
        release_freed_host_memory()
