"""The checks of strategy options: each returns the problem as a sentence naming the value and the fix, or None.

Constructors raise the problems they find (``require``); ``lp-train`` reports every problem of a composed
config before any process starts (``config.validate``). Both call these functions, with ``prefix``
``"strategy."`` on the command line, so a check and its message exist once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["layout", "one_of", "positive_int", "positive_number", "require"]


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


def layout(world: int, where: str, dp: int, size: int | None, size_name: str, prefix: str = "") -> str | None:
    """``data_parallel_size`` x ``size_name`` must equal the ``world`` (``where`` says how it is counted);
    a size of None takes ``world // dp``."""
    s, d = f"{prefix}{size_name}", f"{prefix}data_parallel_size"
    if size is not None and size > world:
        return (
            f"{s}={size} is more than the {where}; each part needs its own process: use at most {world} "
            "or more devices"
        )
    if size is not None and world % size:
        return (
            f"{where} is not divisible by {s}={size}; use a device count that is a multiple of {size}, "
            f"or {s}=null to use all {world}"
        )
    if world % dp:
        return f"{where} is not divisible by {d}={dp}; use {d}=1 or a divisor of {world}"
    if size is not None and size * dp != world:
        return f"{d}={dp} x {s}={size} = {dp * size} must equal the {where}; use {d}={world // size}"
    return None
