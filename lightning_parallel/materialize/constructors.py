"""Each module built on meta remembers how it was constructed, so that its constructor can run again on the host.

Some values come only from a constructor: ``torch.ones(hidden)`` for a norm's weight, a rotary embedding's
frequencies, a bias set to zeros. Under deferred initialization they are made on meta (no values), and a
module's initializer may not set them again (transformers 4.x's ``_init_weights`` leaves norm weights alone).
While a model is built under the strategy's ``tensor_init_context``, ``recording_constructors`` keeps every
module's constructor arguments (read from the constructor's frame when ``nn.Module.__init__`` runs);
``constructed_again`` later builds one such module again on the host, which gives exactly the values its
constructor gives.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["constructed_again", "recording_constructors"]

#: module -> (its class, the positional and keyword arguments it was constructed with, the default dtype then)
_CALLS: "weakref.WeakKeyDictionary[nn.Module, tuple[type, tuple, dict, torch.dtype]]" = (
    weakref.WeakKeyDictionary()
)
_module_init = nn.Module.__init__
_depth = 0  # > 0 while recording (contexts may nest)


def _outermost_init(module: nn.Module, frame: Optional[FrameType]) -> Optional[FrameType]:
    """The frame of the ``__init__`` that the class call ran (the most derived one) for ``module``, found
    from inside ``nn.Module.__init__`` through the chain of ``super().__init__`` calls."""
    found = None
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_code.co_argcount:
        if frame.f_locals.get(frame.f_code.co_varnames[0]) is not module:
            break
        found, frame = frame, frame.f_back
    return found


def _arguments(frame: FrameType) -> tuple[tuple, dict]:
    """The arguments of ``frame``'s call (after ``self``), as they are now: positional, ``*args``,
    keyword-only and ``**kwargs``."""
    code, values = frame.f_code, frame.f_locals
    names = code.co_varnames
    positional, keyword_only = code.co_argcount, code.co_kwonlyargcount
    args = tuple(values[n] for n in names[1:positional])
    kwargs = {n: values[n] for n in names[positional : positional + keyword_only]}
    extra = positional + keyword_only
    if code.co_flags & inspect.CO_VARARGS:
        args += tuple(values[names[extra]])
        extra += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(values[names[extra]])
    return args, kwargs


def _recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    frame = _outermost_init(self, sys._getframe(1))
    if frame is not None and self not in _CALLS:
        _CALLS[self] = (type(self), *_arguments(frame), torch.get_default_dtype())
    _module_init(self, *args, **kwargs)


@contextmanager
def recording_constructors() -> Iterator[None]:
    """While inside: every ``nn.Module`` constructed remembers its class and the arguments of its
    constructor call (for as long as it lives), read when ``nn.Module.__init__`` runs (the arguments as
    they are then: normally unchanged, ``super().__init__()`` comes first). Copies (``copy.deepcopy``) run
    no constructor and are not recorded."""
    global _depth
    if _depth == 0:
        nn.Module.__init__ = _recording_init  # type: ignore[method-assign]
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            nn.Module.__init__ = _module_init  # type: ignore[method-assign]


def constructed_again(module: nn.Module) -> Optional[nn.Module]:
    """A new copy of ``module`` built by its constructor on the host from the arguments it was built with,
    or None when they were not recorded (built outside ``recording_constructors``). It runs with the
    default dtype the module was built with, fills what it leaves empty with NaN and leaves the random
    state as it was; its submodules are built
    too, so this costs the size of ``module`` with its children once."""
    call = _CALLS.get(module)
    if call is None:
        return None
    cls, args, kwargs, dtype = call
    with _as_built(dtype), torch.random.fork_rng(devices=[]), torch.device("cpu"):
        return cls(*args, **kwargs)


@contextmanager
def _as_built(dtype: torch.dtype) -> Iterator[None]:
    """The default dtype the module was built with, and ``torch.empty`` filled with NaN (deterministic
    mode's ``fill_uninitialized_memory``), so that a tensor the constructor leaves empty is found unset."""
    before = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_default_dtype(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=warn_only)
