"""The checks of strategy options: each returns the problem as a sentence naming the value and the fix, or None.

Constructors raise the problems they find (``require``); ``lp-train`` reports every problem of a composed
config before any process starts (``config.validate``). Both call these functions, with ``prefix``
``"strategy."`` on the command line, so a check and its message exist once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["layout", "layout_sizes", "one_of", "positive_int", "positive_number", "require", "shard_size"]


def require(problems: Iterable[str | None], prefix: str = "") -> None:
    """Raise ``ValueError`` with every problem found (None entries are checks that passed)."""
    found = [p for p in problems if p]
    if found:
        raise ValueError(prefix + "; ".join(found))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, allow_none: bool = False) -> str | None:
    """A size: an integer of at least 1 (or None where None means "all devices")."""
    if (value is None and allow_none) or (_is_int(value) and value >= 1):
        return None
    none = " or None (all devices)" if allow_none else ""
    return f"{name} must be a positive integer{none}, got {value!r}"


def positive_number(name: str, value: Any, unit: str, default: Any) -> str | None:
    """A positive int or float, e.g. seconds or megabytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return None
    return f"{name} must be a positive number of {unit}, got {value!r} (default {default})."


def one_of(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> str | None:
    """A value from a fixed list."""
    if value in choices:
        return None
    return f"{name}={value!r} is not supported; use one of {', '.join(repr(c) for c in choices)}{hint}."


def layout(world: int, where: str, sizes: Mapping[str, int | None], prefix: str = "") -> str | None:
    """The sizes named in ``sizes`` (option name -> size, in the order a message lists them; the first is
    ``data_parallel_size``) must multiply to the ``world`` (``where`` says how it is counted); one of them
    may be None, which takes what the others leave."""
    named = {f"{prefix}{name}": size for name, size in sizes.items()}
    unset = [name for name, size in named.items() if size is None]
    if len(unset) > 1:
        return f"at most one of {', '.join(unset)} may be null (inferred from the {where}); set the others"
    first = next(iter(named))
    for name, size in named.items():
        if name != first and size is not None and size > world:
            return (
                f"{name}={size} is more than the {where}; each part needs its own process: use {name}={world} "
                f"or less, or {size} or more devices (a multiple of {size})"
            )
        if name != first and size is not None and world % size:
            return (
                f"{where} is not divisible by {name}={size}; use a device count that is a multiple of {size}, "
                f"or {name}=null to use all {world}"
            )
    if named[first] is not None and world % named[first]:
        return f"{where} is not divisible by {first}={named[first]}; use {first}=1 or a divisor of {world}"
    given = math.prod(size for size in named.values() if size is not None)
    if world % given:
        product = " x ".join(f"{n}={s}" for n, s in named.items() if s is not None)
        return f"{product} = {given} does not divide the {where}"
    if unset or given == world:
        return None
    others = given // named[first]
    hint = f"; use {first}={world // others}" if world % others == 0 else ""
    return f"{' x '.join(f'{n}={s}' for n, s in named.items())} = {given} must equal the {where}{hint}"


def layout_sizes(world: int, sizes: Mapping[str, int | None]) -> dict[str, int]:
    """``sizes`` with the one None (if any) replaced by what the others leave of ``world``; assumes
    ``layout`` found no problem."""
    given = math.prod(size for size in sizes.values() if size is not None)
    return {name: world // given if size is None else size for name, size in sizes.items()}


def shard_size(name: str, shard: int | None, dp: int, where: str) -> str | None:
    """HSDP's shard size (``data_parallel_shard_size``) against the data-parallel size ``dp`` (``where``
    says how it is counted): None (all of dp), or a divisor of ``dp`` of at least 2."""
    if shard is None or (shard > 1 and dp % shard == 0):
        return None
    divisors = [d for d in range(2, dp + 1) if dp % d == 0]
    fits = f"use one of {divisors} (the devices per node on a multi-node run), or " if divisors else "use "
    return (
        f"{name}={shard} must divide the data-parallel size {dp} ({where}) into shard groups of at least 2 "
        f"ranks; {fits}null to shard over all {dp}"
    )
