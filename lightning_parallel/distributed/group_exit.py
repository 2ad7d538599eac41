"""Process groups end while the interpreter is still whole: destroyed at exit if nothing did it before, and
let go by the torch functions that keep one as a default argument.

A gloo group's threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) run until the last reference to the group
goes; ``destroy_process_group`` only unregisters it. A group still referenced when the interpreter exits is
torn down during finalization, where a gloo thread can abort a rank that finished its work (SIGABRT,
"terminate called without an active exception"), which a launcher reports as a failed run.

Some torch modules bind ``dist.group.WORLD`` as a default argument when they are imported
(``torch.distributed.optim.zero_redundancy_optimizer._broadcast_object``, the collectives of
``torch.distributed.nn.functional``): imported once the default group exists, such a module holds that
group for good. Once every group is destroyed, those defaults become None, which means the default group,
looked up at call time.
"""

from __future__ import annotations

import atexit
import sys
import types

import torch.distributed as dist

__all__ = ["destroy_process_groups_at_exit", "release_destroyed_default_groups"]

_DESTROY_REGISTERED = False


def destroy_process_groups_at_exit() -> None:
    """At interpreter exit, destroy every process group if nothing did before, then let go of the groups
    torch's functions hold as default arguments, so that their gloo threads end before finalization.
    Registered once per process."""
    global _DESTROY_REGISTERED
    if not _DESTROY_REGISTERED:
        atexit.register(_end_process_groups)
        _DESTROY_REGISTERED = True


def _end_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release_destroyed_default_groups()


def release_destroyed_default_groups() -> int:
    """With no process group left (after ``destroy_process_group()``), replace every process group held as a
    default argument by a function of an imported ``torch.distributed`` module with None; returns how many
    were replaced. Does nothing while a default group exists: it may be the one they hold."""
    if not dist.is_available() or dist.is_initialized():
        return 0
    released = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        for value in list(vars(module).values()):
            # type(), not isinstance(): some module attributes warn when their __class__ is read
            if type(value) is types.FunctionType and value.__module__ == name:
                released += _release_defaults(value)
    return released


def _release_defaults(function: types.FunctionType) -> int:
    """Replace the process groups among ``function``'s default arguments by None; how many there were."""
    defaults = function.__defaults__ or ()
    keyword = function.__kwdefaults__ or {}
    held = sum(_is_group(v) for v in (*defaults, *keyword.values()))
    if held:
        function.__defaults__ = tuple(None if _is_group(v) else v for v in defaults) or None
        if keyword:
            function.__kwdefaults__ = {k: None if _is_group(v) else v for k, v in keyword.items()}
    return held


def _is_group(value: object) -> bool:
    """A process group, found by its type alone (reading ``__class__`` of some objects warns)."""
    return issubclass(type(value), dist.ProcessGroup)
