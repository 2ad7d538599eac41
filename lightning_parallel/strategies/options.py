"""A strategy's options are its constructor's keyword arguments: this reads them for every other consumer.

The constructors along a strategy's lightning_parallel ancestry are the one declaration (name, type hint,
default, and the ``Args`` docstring beside them). The Hydra schemas (``config.schema``), the pre-launch
validation (``config.validate``, through ``option_problems``) and the tests of the README's table read
them from here.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TRAINER_SUPPLIED", "Option", "defaults", "given", "level_problems", "option_problems", "options"]

#: constructor arguments that are objects the Trainer (or the user's code) passes, not configuration
TRAINER_SUPPLIED = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)


@dataclass(frozen=True)
class Option:
    """One keyword argument of a strategy constructor."""

    name: str
    hint: Any  # the evaluated type hint (Any where it has none)
    default: Any
    owner: type  # the class whose ``__init__`` declares it


def _own_options(klass: type) -> list[Option]:
    hints = typing.get_type_hints(klass.__init__)
    params = inspect.signature(klass.__init__).parameters.values()
    return [
        Option(p.name, hints.get(p.name, Any), p.default, klass)
        for p in params
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    ]


@functools.lru_cache(maxsize=None)
def _all_options(cls: type) -> dict[str, Option]:
    """Every option of ``cls``'s lightning_parallel constructors, read once per class (the planner checks
    thousands of layouts); callers copy, never change, the dictionary."""
    found: dict[str, Option] = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning_parallel") and "__init__" in vars(klass):
            for option in _own_options(klass):
                found.setdefault(option.name, option)
    return found


def options(cls: type, configurable: bool = True) -> list[Option]:
    """Every keyword option of ``cls``, the subclass's first, without those a preset fixes (its
    ``hidden_options``); ``configurable`` leaves out ``TRAINER_SUPPLIED``."""
    hidden = set(getattr(cls, "hidden_options", ()))
    return [
        o
        for o in _all_options(cls).values()
        if o.name not in hidden and not (configurable and o.name in TRAINER_SUPPLIED)
    ]


def defaults(cls: type) -> dict[str, Any]:
    """Option name -> the constructor's default, for every configurable option of ``cls``."""
    return {o.name: o.default for o in options(cls)}


def given(values: Mapping[str, Any], name: str, default: Any) -> Any:
    """A base class's option as a subclass's own checks see it: in ``values`` (``option_problems`` merges every
    option), or in the ``kwargs`` a subclass constructor passes up (its ``locals()``), else ``default``."""
    return values[name] if name in values else values.get("kwargs", {}).get(name, default)


def level_problems(level: type, cls: type, values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The problems found by the checks that ``level`` states for its own arguments (its classmethod
    ``own_option_problems``, bound to ``cls``); none where it states none."""
    check = vars(level).get("own_option_problems")
    return [] if check is None else [p for p in check.__get__(None, cls)(values, prefix) if p]


def option_problems(cls: type, values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every problem of ``values`` (absent options at their defaults) that the constructors of ``cls`` check,
    each naming the option as ``prefix + name``."""
    merged = {**{o.name: o.default for o in _all_options(cls).values()}, **values}
    return [p for level in reversed(cls.__mro__) for p in level_problems(level, cls, merged, prefix)]
