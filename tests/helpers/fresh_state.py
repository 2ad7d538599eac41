"""A rank forked by ``tests/helpers/forkserver.py`` made the process a fresh ``python -m`` would be, or refused.

The server's imports computed some state from the server's environment. A forked rank has the server's
copy, so each piece is computed again from the rank's own environment, as a fresh interpreter computes it
on import (``Preloaded.become``): the environment itself, with what the imports add to it; the temporary
directory; the warning filters (``PYTHONWARNINGS``); ``rank_zero_only.rank`` (Lightning's from ``RANK`` and
its fallbacks, torchmetrics' from ``LOCAL_RANK``); the global random generators that seed themselves from
the OS on import (numpy's, torch's where torch does; Python's ``random`` reseeds itself after a fork);
torch's distributed debug level (``TORCH_DISTRIBUTED_DEBUG``) and thread count (``OMP_NUM_THREADS``).

What an interpreter or a preloaded library reads once at start and a fork cannot change (the hash seed
``PYTHONHASHSEED``, the allocator, the locale, torch's logging, ...) is honoured by starting a fresh
interpreter for a rank whose value differs from the server's (``Preloaded.fresh_start_reason``). The hash
seed also differs between fresh interpreters when nobody sets it: ``forkserver.py`` gives each rank index its
own server for that.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

__all__ = ["Preloaded", "FIXED_AT_START", "FIXED_AT_START_PREFIXES", "FOLLOWED"]

#: variables read once when an interpreter or a preloaded library starts (Python's own, the C runtime's,
#: OpenMP's and BLAS's, torch's logging and JIT switches): a rank that asks for a value other than the
#: server's starts a fresh interpreter
FIXED_AT_START_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_",
    "PYTORCH_",
)
FIXED_AT_START = ("LANG", "TZ", "POSSIBLE_USER_WARNINGS")
#: of those, the ones a forked rank follows (``Preloaded.become``, or read where they are used)
FOLLOWED = (
    "PYTHONPATH",
    "PYTHONWARNINGS",
    "PYTHONUNBUFFERED",
    "PYTHONBREAKPOINT",
    "TORCH_DISTRIBUTED_DEBUG",
    "OMP_NUM_THREADS",
)


def _threads(value: Optional[str]) -> Optional[int]:
    """``OMP_NUM_THREADS`` as the thread count a fresh torch takes from it; None where that is not a positive
    integer (OpenMP reads lists and defaults at start: only a fresh interpreter has them)."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _fixed_at_start(name: str) -> bool:
    return name in FIXED_AT_START or (name.startswith(FIXED_AT_START_PREFIXES) and name not in FOLLOWED)


def _lightning_rank(module, env: Mapping[str, str]) -> None:
    module.rank_zero_only.rank = module._get_rank() or 0  # the expression Lightning evaluates on import


def _torchmetrics_rank(module, env: Mapping[str, str]) -> None:
    module.rank_zero_only.rank = int(
        env.get("LOCAL_RANK", 0)
    )  # the expression torchmetrics evaluates on import


def _numpy_seed(module, env: Mapping[str, str]) -> None:
    module.seed()  # no argument: from the OS, as the global RandomState is created on import


def _torch_state(module, env: Mapping[str, str]) -> None:
    if module.initial_seed() != TORCH_FIXED_SEED:  # this torch seeds itself from the OS on import
        module.seed()
    threads = _threads(env.get("OMP_NUM_THREADS"))
    if threads is not None and threads != module.get_num_threads():
        module.set_num_threads(threads)


def _debug_level(module, env: Mapping[str, str]) -> None:
    if module.is_available():
        module.set_debug_level_from_env()  # what ``import torch.distributed`` runs


def _inductor_cache_dir(module, env: Mapping[str, str]) -> None:
    module.cache_dir()  # what an import runs: TORCHINDUCTOR_CACHE_DIR from the rank's TMPDIR and user


#: torch's default seed where torch does not seed itself from the OS on import (torch's own constant)
TORCH_FIXED_SEED = 67280421310721

#: state a preloaded module computed on import from the environment: computed again in the rank (in this
#: order), for each of these modules the server imported
ON_IMPORT: dict[str, Callable] = {
    "lightning.fabric.utilities.rank_zero": _lightning_rank,  # also lightning_utilities' rank_zero_only
    "torchmetrics.utilities.prints": _torchmetrics_rank,
    "numpy.random": _numpy_seed,
    "torch": _torch_state,
    "torch.distributed": _debug_level,
}

#: variables the imports set from the environment, and the module function that sets them
DERIVED_BY_IMPORTS = {
    "TORCHINDUCTOR_CACHE_DIR": ("torch._inductor.runtime.cache_dir_utils", _inductor_cache_dir)
}


def _derivation(name: str) -> Optional[Callable[[Mapping[str, str]], None]]:
    """How a rank computes variable ``name`` as its imports would; None where the server did not import the
    module that does it (the variable is then kept as the server's imports left it)."""
    module, derive = DERIVED_BY_IMPORTS.get(name, (None, None))
    if module not in sys.modules:
        return None
    return lambda env: derive(sys.modules[module], env)


@dataclass
class Preloaded:
    """What the server's interpreter and imports derived from the server's environment."""

    environ: dict[str, str]  # the server's environment before the imports
    set_by_imports: dict[str, Optional[str]]  # what the imports changed in it (None: removed)
    default_filters: list  # the warning filters before the imports (with the server's own options)
    library_filters: list  # the filters the imports added
    tempdir_cached: bool  # an import called tempfile.gettempdir(), which keeps its answer

    @classmethod
    def load(cls, modules: tuple[str, ...]) -> "Preloaded":
        environ, default_filters, tempdir = dict(os.environ), list(warnings.filters), tempfile.tempdir
        for name in modules:
            __import__(name)
        changed = set(environ) | set(os.environ)
        return cls(
            environ=environ,
            set_by_imports={k: os.environ.get(k) for k in changed if os.environ.get(k) != environ.get(k)},
            default_filters=default_filters,
            library_filters=[f for f in warnings.filters if f not in default_filters],
            tempdir_cached=tempdir is None and tempfile.tempdir is not None,
        )

    def fresh_start_reason(self, env: Mapping[str, str]) -> Optional[str]:
        """Why a rank with environment ``env`` must start a fresh interpreter; None when a fork is the same."""
        for name in sorted(set(env) | set(self.environ)):
            value, own = env.get(name), self.environ.get(name)
            if value == own:
                continue
            if name == "OMP_NUM_THREADS" and _threads(value) is not None:
                continue
            if name in self.set_by_imports and _derivation(name) is None:
                return f"{name}={value!r}: the preloaded imports set it from the server's {own!r}"
            if _fixed_at_start(name) or name == "OMP_NUM_THREADS":
                return f"{name}={value!r} is read at interpreter start (the server has {own!r})"
        return None

    def become(self, env: Mapping[str, str]) -> None:
        """In a forked rank: what a fresh interpreter started with ``env`` would have after the imports."""
        os.environ.clear()
        os.environ.update(env)
        if self.tempdir_cached:
            tempfile.tempdir = None
            tempfile.gettempdir()
        for name, value in self.set_by_imports.items():
            derive = _derivation(name)
            if derive is not None:
                derive(env)
            elif value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._apply_warning_options(env)
        for name, derive in ON_IMPORT.items():
            if name in sys.modules:
                derive(sys.modules[name], env)

    def _apply_warning_options(self, env: Mapping[str, str]) -> None:
        """The filters a fresh interpreter would have under ``env``: its ``PYTHONWARNINGS`` options (applied at
        start-up, after the defaults) under the filters the preloaded libraries added on import."""
        options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
        sys.warnoptions[:] = options
        warnings.filters[:] = self.default_filters
        warnings._processoptions(options)  # type: ignore[attr-defined]  # what the interpreter runs at start-up
        warnings.filters[:0] = self.library_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
