"""Which communication call a thread is blocked in, read from another thread at no cost to it.

The failure watchdog (``watchdog.py``) needs to tell a rank that waits in a collective from one that
computes: only the first can be part of a deadlock, and a long computation on one rank (a checkpoint
write, validation) is a legitimate reason for its peers to wait. Nothing is recorded on the hot path:
the watchdog thread samples the watched thread's innermost Python frame (``sys._current_frames``) and
its CPU clock. A thread is *blocked* when two samples find it inside ``torch.distributed`` (or this
package's ``distributed/``) at the same instruction with no CPU time spent in between: a thread
waiting for a gloo collective sleeps in C++, while one that keeps issuing collectives spends CPU
time between them.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

__all__ = ["Wait", "WaitSampler"]

# where a blocked thread's innermost frame must be for it to count as waiting on its peers
_COMMUNICATION = ("torch.distributed.", "lightning_parallel.distributed.")
_NOT_COMMUNICATION = ("torch.distributed.checkpoint.", "lightning_parallel.distributed.watchdog")
# frames between a collective and the code that asked for it: skipped when saying where a call came from
_PLUMBING = (
    "torch.",
    "lightning_utilities.",
    "lightning.fabric.utilities.",
    "lightning.fabric.strategies.",
    "lightning.pytorch.strategies.",
    "lightning.pytorch.core.module",
    "lightning.pytorch.trainer.connectors.logger_connector.",
    "lightning.pytorch.trainer.call",
    "lightning_parallel.strategies.",
    "lightning_parallel.distributed.",
    "torchmetrics.",
)
_LIBRARIES = {"torch", "lightning", "lightning_utilities", "lightning_parallel", "torchmetrics", "hydra"}
_STDLIB = sysconfig.get_paths()["stdlib"]
# CPU seconds a blocked thread may spend between two samples (a signal handled in C, a spurious wake-up)
_IDLE_CPU_S = 1e-3


@dataclass(frozen=True)
class Wait:
    """A blocked communication call: ``call`` (the torch.distributed function, e.g. ``all_gather``),
    ``at`` (the code that asked for it), ``under`` (the user's frame below that, if different),
    ``since`` (``time.monotonic()`` of the first sample that found it) and ``by_user`` (``at`` is the
    user's code, not a library's)."""

    call: str
    at: str
    under: Optional[str]
    since: float
    by_user: bool = False

    def seconds(self, now: Optional[float] = None) -> float:
        return (time.monotonic() if now is None else now) - self.since

    @property
    def key(self) -> str:
        """Equal on every rank that waits in the same collective (same call, asked for by the same line)."""
        return f"{self.call}@{self.at}"

    def describe(self) -> str:
        return f"{self.call} at {self.at}" + (f" under {self.under}" if self.under else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "at": self.at,
            "under": self.under,
            "for": round(self.seconds(), 1),
            "by_user": self.by_user,
        }


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _is_communication(frame: FrameType) -> bool:
    name = _module(frame) + "."
    return name.startswith(_COMMUNICATION) and not name.startswith(_NOT_COMMUNICATION)


def _is_user(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith(("<", _STDLIB)) and "site-packages" not in filename:
        return False
    return _module(frame).split(".")[0] not in _LIBRARIES


def _where(frame: FrameType) -> str:
    """``validation_step (model.py:42)`` for the user's code; the module's path for a library's."""
    path = (
        os.path.basename(frame.f_code.co_filename)
        if _is_user(frame)
        else _module(frame).replace(".", "/") + ".py"
    )
    return f"{frame.f_code.co_name} ({path}:{frame.f_lineno})"


def _describe(innermost: FrameType, since: float) -> Wait:
    frame: Optional[FrameType] = innermost
    call, at, under = innermost.f_code.co_name, None, None
    while frame is not None:
        if at is None and not (_module(frame) + ".").startswith(_PLUMBING):
            at = _where(frame)
        if _is_user(frame):
            under = _where(frame)
            break
        frame = frame.f_back
    if at is None:
        at = _where(innermost)
    return Wait(call, at, None if under == at else under, since, by_user=under == at)


class WaitSampler:
    """Samples one thread (the caller of ``__init__`` by default): ``sample()`` returns the ``Wait`` it
    has been blocked in since an earlier sample, or None. Call it from another thread, periodically."""

    def __init__(self, thread_id: Optional[int] = None) -> None:
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        try:
            self._clock: Optional[int] = time.pthread_getcpuclockid(self.thread_id)
        except (AttributeError, OSError):  # no per-thread CPU clock (macOS): the stack alone decides
            self._clock = None
        # (position, CPU time at the last sample, when the thread was first seen there)
        self._last: Optional[tuple[Any, Optional[float], float]] = None
        self._wait: Optional[Wait] = None

    def _cpu(self) -> Optional[float]:
        if self._clock is None:
            return None
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread has ended
            return None

    def sample(self) -> Optional[Wait]:
        now, cpu = time.monotonic(), self._cpu()
        frame = sys._current_frames().get(self.thread_id)
        try:
            if frame is None or not _is_communication(frame):
                self._last, self._wait = None, None
                return None
            position = (frame.f_code, frame.f_lasti)
            last = self._last
            unchanged = (
                last is not None
                and last[0] == position
                and (cpu is None or last[1] is None or cpu - last[1] < _IDLE_CPU_S)
            )
            if not unchanged:
                self._last, self._wait = (position, cpu, now), None
                return None
            assert last is not None
            self._last = (position, cpu, last[2])
            if self._wait is None:
                self._wait = _describe(frame, since=last[2])
            return self._wait
        finally:
            del frame  # a frame kept here would keep the watched thread's locals (tensors) alive
