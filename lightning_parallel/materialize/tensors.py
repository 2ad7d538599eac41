"""A module's tensors taken out of it before it is parallelized: every name of each tensor, and where its
values come from (the real tensor of a normally built model, or nothing yet for one built on meta)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

__all__ = ["Captured", "ModuleRecord", "Slot", "capture", "has_meta_tensors", "own_tensors"]


@dataclass
class Slot:
    """One unique tensor: the names that hold it (tied weights: several), its full shape on meta, and its
    real values when the model was built normally (None: its module's initializer makes them)."""

    names: list[str]
    is_param: bool
    requires_grad: bool
    template: Tensor
    source: Optional[Tensor] = None

    @property
    def nbytes(self) -> int:
        return self.template.numel() * self.template.element_size()


@dataclass
class ModuleRecord:
    """A module with the tensors it holds itself (``own``: attribute -> slot) and the slots it is the
    first holder of, in ``named_modules`` order (``first``: the values are produced with this module)."""

    name: str
    module: nn.Module
    own: dict[str, Slot] = field(default_factory=dict)
    first: list[Slot] = field(default_factory=list)


@dataclass
class Captured:
    """Every module of a model, in order, with its tensors; the model itself holds meta tensors now."""

    records: list[ModuleRecord]

    def slots(self) -> Iterator[Slot]:
        for record in self.records:
            yield from record.first

    @property
    def nbytes(self) -> int:
        """The whole model's parameter and buffer bytes (each tied tensor once)."""
        return sum(s.nbytes for s in self.slots())


def own_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """(attribute, tensor, is a parameter) of what ``module`` holds itself in its registry."""
    for attr, t in module._parameters.items():
        if t is not None:
            yield attr, t, True
    for attr, t in module._buffers.items():
        if t is not None:
            yield attr, t, False


def has_meta_tensors(module: nn.Module) -> bool:
    """True when some parameter or buffer of ``module`` is on the meta device (built with deferred init)."""
    return any(t.is_meta for _, m in module.named_modules() for _, t, _ in own_tensors(m))


def _meta_like(t: Tensor, is_param: bool) -> Tensor:
    if t.is_meta:
        return t
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta


def capture(module: nn.Module) -> Captured:
    """Record ``module``'s tensors and put meta tensors in their place (one per unique tensor, so tied
    weights stay tied). A real tensor is kept as its slot's ``source`` until ``materialize`` has used it."""
    slots: dict[int, Slot] = {}  # id of the original tensor, and of the meta one put in its place
    records: dict[int, ModuleRecord] = {}
    alive: list[Tensor] = []  # keeps the ids above from being reused while this runs
    for prefix, m in module.named_modules(remove_duplicate=False):
        record = records.get(id(m))
        new = record is None
        if new:
            record = records[id(m)] = ModuleRecord(prefix, m)
        for attr, t, is_param in list(own_tensors(m)):
            slot = slots.get(id(t))
            if slot is None:
                meta = _meta_like(t, is_param)
                slot = Slot([], is_param, t.requires_grad, meta, None if t.is_meta else t.detach())
                slots[id(t)] = slots[id(meta)] = slot
                alive += [t, meta]
                record.first.append(slot)
            slot.names.append(f"{prefix}.{attr}" if prefix else attr)
            if new:
                record.own[attr] = slot
                (m._parameters if is_param else m._buffers)[attr] = slot.template
    return Captured(list(records.values()))
