"""Sizes written in a module's ``forward`` that each tensor-parallel rank must see divided: an integer
attribute of the module (``attn.n_head``), or of a plain object the module holds and reads in
``forward`` (litgpt's ``attn.config.n_head``: one ``Config`` shared by every layer and by the model).

A held object is never changed: each module whose attribute is divided gets its own shallow copy of
it, with the divided values, so the model, the other layers and the user's object keep the full ones.

A count of heads each held by several ranks (key-value heads fewer than the ranks: ``copies`` ranks
share each) is divided by ``tp // copies`` only (``local_value``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from torch import Tensor, nn

from lightning_parallel.module_names import match_pattern

__all__ = [
    "attribute_targets",
    "divide_attributes",
    "held_objects",
    "holders",
    "local_value",
    "read_attribute",
    "restore_attributes",
]

# (owner module name, attribute path: "n_head" or "config.n_head", value before dividing)
Divided = tuple[str, str, int]


def holders(module: nn.Module) -> dict[str, object]:
    """The plain objects ``module`` holds as public attributes (a config): not modules, tensors, callables
    or builtins; their integer attributes may be written sizes."""
    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_")
        and not isinstance(v, (nn.Module, Tensor, type))
        and not callable(v)
        and hasattr(v, "__dict__")
    }


def attribute_targets(modules: dict[str, nn.Module], pattern: str) -> list[tuple[str, str]]:
    """(module name, attribute path) for each match of ``pattern``: ``owner.attr``, or
    ``owner.holder.attr`` where ``holder`` is a plain object that the matched module holds."""
    owner, _, attr = pattern.rpartition(".")
    hits = [(n, attr) for n in modules if match_pattern(owner, n)] if owner else [("", attr)]
    if hits or "." not in owner:
        return hits
    owner, _, holder = owner.rpartition(".")
    return [
        (n, f"{holder}.{attr}") for n in modules if match_pattern(owner, n) and holder in holders(modules[n])
    ]


def read_attribute(module: nn.Module, path: str) -> Any:
    holder, _, attr = path.rpartition(".")
    return getattr(getattr(module, holder) if holder else module, attr, None)


def local_value(value: int, tp: int, copies: int = 1) -> int:
    """What a divided size holds on each of ``tp`` ranks, each of its heads held by ``copies`` ranks."""
    return value * copies // tp


def divide_attributes(
    module: nn.Module,
    attributes: Iterable[Divided],
    tp: int,
    copies: Optional[Mapping[tuple[str, str], int]] = None,
) -> None:
    """Set each attribute to its value on one of ``tp`` ranks (``local_value``, with ``copies`` keyed by
    (owner, attribute path)); a held object is first copied for its module."""
    copied: set[tuple[str, str]] = set()
    copies = copies or {}
    for owner, path, value in attributes:
        m = module.get_submodule(owner)
        holder, _, attr = path.rpartition(".")
        if holder and (owner, holder) not in copied:
            setattr(m, holder, copy.copy(getattr(m, holder)))
            copied.add((owner, holder))
        setattr(
            getattr(m, holder) if holder else m, attr, local_value(value, tp, copies.get((owner, path), 1))
        )


def held_objects(module: nn.Module, attributes: Iterable[Divided]) -> dict[tuple[str, str], object]:
    """The held objects that ``divide_attributes`` would replace by copies: (owner, holder) -> object."""
    return {
        (owner, path.rpartition(".")[0]): getattr(module.get_submodule(owner), path.rpartition(".")[0])
        for owner, path, _ in attributes
        if "." in path
    }


def restore_attributes(
    module: nn.Module, attributes: Iterable[Divided], held: dict[tuple[str, str], object]
) -> None:
    """Undo ``divide_attributes``: the values as they were, and each module's held object its original."""
    for owner, path, value in attributes:
        if "." not in path:
            setattr(module.get_submodule(owner), path, value)
    for (owner, holder), obj in held.items():
        setattr(module.get_submodule(owner), holder, obj)
