"""How a module built on the meta device gets its initial values: its own initializer, run on a host copy.

The initializer of a module is, in this order: the ``_init_weights`` of the outermost Hugging Face
``PreTrainedModel`` that holds it (what ``from_config`` runs), its ``reset_parameters()`` (torch's layers,
Lightning's and torch FSDP's convention), or its ``_reset_parameters()`` (``nn.MultiheadAttention``). It
runs on a shallow copy of the module whose own tensors are fresh host tensors, so the live module, its
children and the device are never touched. Floating-point tensors start as NaN: one that the initializer
leaves unset is found, not trained from empty memory. Such a tensor gets what the module's constructor gives
it, the constructor run again on the host with the arguments recorded when the module was built
(``constructors.constructed_again``: a norm's weight of ones, a rotary embedding's frequencies); one that is
still unknown raises ``UninitializedTensorError``.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Collection, Optional

import torch
from torch import nn

from lightning_parallel.materialize.constructors import constructed_again
from lightning_parallel.materialize.tensors import ModuleRecord

__all__ = ["UninitializedTensorError", "initialized_copy", "initializer_for"]

Initializer = Callable[[nn.Module], None]


class UninitializedTensorError(RuntimeError):
    """A tensor built on the meta device that no initializer (and no checkpoint) gives values to."""


def _is_hf_model(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__) and hasattr(
        module, "_init_weights"
    )


def initializer_for(root: nn.Module, record: ModuleRecord) -> Optional[Initializer]:
    """The initializer of ``record``'s module inside ``root`` (None when it has none)."""
    parts = record.name.split(".") if record.name else []
    for depth in range(len(parts) + 1):  # the outermost Hugging Face model holding the module
        holder = root.get_submodule(".".join(parts[:depth]))
        if _is_hf_model(holder):
            return holder._init_weights
    module = record.module
    for method in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, method, None)):
            return lambda m, method=method: getattr(m, method)()
    return None


def _fresh(record: ModuleRecord) -> nn.Module:
    """A shallow copy of the module whose own tensors are new host tensors (NaN where floating point)."""
    module = record.module
    fresh = copy.copy(module)
    fresh._parameters = {k: None for k, v in module._parameters.items() if v is None}  # bias=False
    fresh._buffers = {k: None for k, v in module._buffers.items() if v is None}
    fresh._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for attr, slot in record.own.items():
        fresh.__dict__.pop(attr, None)  # a pipeline stage may hold a freed tensor as a plain attribute
        t = torch.empty_like(slot.template, device="cpu")
        t.fill_(math.nan if t.is_floating_point() or t.is_complex() else 0)
        if slot.is_param:
            fresh._parameters[attr] = nn.Parameter(t, requires_grad=slot.requires_grad)
        else:
            fresh._buffers[attr] = t
    return fresh


def initialized_copy(root: nn.Module, record: ModuleRecord, needed: Collection[str]) -> nn.Module:
    """A host copy of ``record``'s module with its own tensors set by its initializer; raises
    ``UninitializedTensorError`` naming the attributes in ``needed`` that stay unset."""
    fresh = _fresh(record)
    init = initializer_for(root, record)
    if init is not None:
        with torch.no_grad():
            init(fresh)
    unset = [attr for attr in needed if _is_unset(_own(fresh, attr))]
    if unset:
        unset = _from_constructor(record, fresh, unset)
    if unset:
        kind = type(record.module).__name__
        how = f"its initializer ({getattr(init, '__qualname__', init)})" if init else "no initializer"
        raise UninitializedTensorError(
            f"{record.name or '(root)'} ({kind}) was built on the meta device (deferred initialization) and "
            f"{how} sets {unset}, nor does its constructor run again (or it was built outside "
            f"init_module / configure_model): give {kind} a reset_parameters() that initializes them, load "
            "a checkpoint (fit(ckpt_path=...)), or build the model without init_module(empty_init=True)."
        )
    return fresh


def _own(module: nn.Module, attr: str) -> Optional[torch.Tensor]:
    return module._parameters.get(attr, module._buffers.get(attr))


def _from_constructor(record: ModuleRecord, fresh: nn.Module, unset: list[str]) -> list[str]:
    """Set ``fresh``'s ``unset`` tensors from the module's constructor run again (those of the same shape);
    returns the attributes still unset."""
    again = constructed_again(record.module)
    if again is None:
        return unset
    left = []
    for attr in unset:
        target, value = _own(fresh, attr), _own(again, attr)
        if value is None or value.is_meta or value.shape != target.shape or _is_unset(value):
            left.append(attr)
            continue
        with torch.no_grad():
            target.copy_(value)
    return left


def _is_unset(t: Optional[torch.Tensor]) -> bool:
    return t is None or ((t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()))
