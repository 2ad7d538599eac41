"""Stop every rank, within a bounded time, when one rank fails or dies.

Without this, a rank that raises leaves its peers blocked in the next collective or point-to-point
receive until the process-group timeout (30 minutes by default), and a rank killed outright may leave
them blocked forever. Each rank runs one daemon thread that talks to the rendezvous store (the
TCPStore every ``torch.distributed`` job already has):

- it publishes a heartbeat every ``interval`` seconds (``lp/hb/<rank>``);
- a rank that raises publishes where and why (``lp/failed``) before it unwinds;
- it watches: when ``lp/failed`` appears, or a peer's heartbeat is older than ``timeout``, or the store
  itself has been unreachable for ``timeout``, it prints which rank failed and where, and ends this
  process with exit code 1 (``os._exit``: the main thread may be stuck inside a collective).

A rank that finishes normally marks its heartbeat ``done`` so slower peers don't mistake it for dead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["FailureWatchdog", "describe_exception"]

FAILED_KEY = "lp/failed"


def describe_exception(exc: BaseException) -> str:
    """``"RuntimeError: boom (in training_step, model.py:45)"``: the innermost frame says where."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = (
        f" (in {frames[-1].name}, {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
        if frames
        else ""
    )
    return f"{type(exc).__name__}: {exc}{where}"


def _looks_like_peer_loss(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        s in text for s in ("Connection closed by peer", "Connection reset", "Broken pipe", "timed out")
    )


class FailureWatchdog:
    """One per process; ``start`` after the default process group exists, ``stop`` at teardown."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 60.0,
        interval: float = 1.0,
        store: Optional[dist.Store] = None,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"failure_timeout must be > 0 seconds, got {timeout!r} (default 60).")
        self.rank, self.world_size = rank, world_size
        self.timeout, self.interval = timeout, min(interval, timeout / 4)
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lp-failure-watchdog", daemon=True)
        self._last_seen = {r: time.time() for r in range(world_size)}
        self._last_value: dict[int, bytes] = {}

    def start(self) -> "FailureWatchdog":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread, then mark this rank done. The thread is joined (within a bound): a daemon thread
        still inside a store call when the interpreter exits aborts the process ("terminate called without
        an active exception"), which happened to a rank of the 2-host test after its work was saved."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(10.0, 2 * self.interval))
        try:
            self.store.set(f"lp/hb/{self.rank}", "done")
        except Exception:  # the store may already be gone at the very end of a job
            pass

    def report_failure(self, exc: BaseException, wait: float = 2.0) -> Optional[str]:
        """Called from the strategy's ``on_exception``. Returns the root cause if a peer failed first.

        A rank whose collective broke because a peer died waits briefly for that peer's own report and
        returns it (so the error it shows names the real culprit); otherwise it reports itself. The
        first report wins (compare-and-set), so a cascade never hides the original failure.
        """
        try:
            deadline = time.time() + wait
            while time.time() < deadline:
                if self.store.check([FAILED_KEY]):
                    message = self.store.get(FAILED_KEY).decode()
                    return None if message.startswith(f"rank {self.rank} ") else message
                if not _looks_like_peer_loss(exc):
                    break
                time.sleep(0.1)
            mine = f"rank {self.rank} failed: {describe_exception(exc)}"
            winner = self.store.compare_set(FAILED_KEY, "", mine).decode()
            return None if winner == mine else winner
        except Exception:
            return None

    # ------------------------------------------------------------------ thread
    def _beat(self) -> None:
        self.store.set(f"lp/hb/{self.rank}", str(time.time()))

    def _run(self) -> None:
        store_lost_since: Optional[float] = None
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                reason = self._check()
                store_lost_since = None
            except Exception as err:  # store unreachable: its host (usually rank 0) may be gone
                store_lost_since = store_lost_since or time.time()
                reason = None
                if time.time() - store_lost_since > self.timeout:
                    reason = f"lost contact with the rendezvous store for {self.timeout:.0f} s ({err})"
            if reason and not self._stop.is_set():
                print(
                    f"[lightning_parallel] {reason}; stopping rank {self.rank} (exit 1).",
                    file=sys.stderr,
                    flush=True,
                )
                self._exit(1)
                return

    def _check(self) -> Optional[str]:
        if self.store.check([FAILED_KEY]):
            message = self.store.get(FAILED_KEY).decode()
            if not message.startswith(f"rank {self.rank} "):
                return message
        now = time.time()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            value = self.store.get(f"lp/hb/{r}") if self.store.check([f"lp/hb/{r}"]) else b""
            if value == b"done":
                self._last_seen[r] = now
            elif value != self._last_value.get(r):
                self._last_value[r], self._last_seen[r] = value, now
            elif now - self._last_seen[r] > self.timeout:
                return f"rank {r} stopped responding (no heartbeat for {self.timeout:.0f} s: killed or hung)"
        return None
