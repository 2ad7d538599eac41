"""Stop every rank, within a bounded time, when one rank fails, dies, or waits in a collective that a
peer never joins; and end a rank at once when it is signalled while stuck.

Without this, a rank that raises leaves its peers blocked in the next collective or point-to-point
receive until the process-group timeout (30 minutes by default), a rank killed outright may leave
them blocked forever, and a collective that a user's code calls on some ranks only (``self.all_gather``
under ``if self.global_rank == 0``) blocks every rank. Each rank runs one daemon thread that talks to
the rendezvous store (the TCPStore every ``torch.distributed`` job already has):

- every ``interval`` seconds it publishes a heartbeat (``lp/hb/<rank>``) that also says which
  communication call this rank is blocked in, if any, and for how long (``waits.WaitSampler``: read
  from the rank's stack and CPU clock, nothing recorded on the hot path);
- a rank that raises publishes where and why (``lp/failed``) before it unwinds;
- it watches: when ``lp/failed`` appears, or a peer's heartbeat is older than ``timeout``, or the store
  itself has been unreachable for ``timeout``, it prints which rank failed and where, and ends this
  process with exit code 1 (``os._exit``: the main thread may be stuck inside a collective);
- when this rank has been blocked in a collective for ``timeout`` while every peer is blocked too (for
  at least half of it) in a different call, nothing can progress: it publishes the
  call, where it came from and what each peer waits in, and every rank stops. Waiting for a peer
  that computes (validation on one rank, a checkpoint write) is legitimate and never ends a run, and
  ranks that are all in the same call are one slow collective, left to the process-group timeout;
- SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) runs no Python handler while the main thread
  is blocked in C++. The signal is also written to a wake-up socket (``signal.set_wakeup_fd``) that
  this thread reads: if the rank is then blocked in a collective for ``SIGNAL_GRACE_S`` while no peer
  computes, it stops at once, saying so (no checkpoint is written); otherwise the Python handlers
  run as usual (``checkpointing/preemption.py`` saves and stops at the next step).

A rank that finishes normally marks its heartbeat ``done`` so slower peers don't mistake it for dead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_parallel.distributed.waits import Wait, WaitSampler

__all__ = ["FailureWatchdog", "describe_exception", "SIGNAL_GRACE_S"]

FAILED_KEY = "lp/failed"
#: seconds a signalled rank may stay blocked in a collective, with no peer computing, before it stops
SIGNAL_GRACE_S = 3.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    """One per process; ``start`` after the default process group exists, from the thread that runs the
    training (the one whose collectives are watched), and ``stop`` at teardown.

    ``exit_fn(code)`` ends this rank when a peer failed or a collective will never complete; after a
    signal, ``terminate_fn(code)`` follows it (the process was asked to end, whatever ``exit_fn`` did).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 60.0,
        interval: float = 1.0,
        store: Optional[dist.Store] = None,
        exit_fn: Callable[[int], None] = os._exit,
        terminate_fn: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"failure_timeout must be > 0 seconds, got {timeout!r} (default 60).")
        self.rank, self.world_size = rank, world_size
        self.timeout, self.interval = timeout, min(interval, timeout / 4)
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._exit, self._terminate = exit_fn, terminate_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lp-failure-watchdog", daemon=True)
        self._last_seen = {r: time.monotonic() for r in range(world_size)}
        self._last_value: dict[int, bytes] = {}
        self._peers: dict[int, Any] = {}  # each peer's last heartbeat: "done", or {"wait": ...}
        self._sampler: Optional[WaitSampler] = None
        self._wait: Optional[Wait] = None  # what this rank is blocked in, at the last sample
        self._signal: Optional[tuple[int, float]] = None  # (signal number, when it came)
        self._wake: Optional[tuple[socket.socket, socket.socket]] = None  # (read end, write end)
        #: why this watchdog ended the rank (or stopped its peers, in a launching process that stays)
        self.cause: Optional[str] = None

    def start(self) -> "FailureWatchdog":
        self._sampler = WaitSampler()
        self._listen_for_signals()
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread, then mark this rank done. The thread is joined (within a bound): a daemon thread
        still inside a store call when the interpreter exits aborts the process ("terminate called without
        an active exception"), which happened to a rank of the 2-host test after its work was saved."""
        self._stop.set()
        if self._wake is not None:
            try:
                self._wake[1].send(b"\0")
            except OSError:
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(10.0, 2 * self.interval))
        self._stop_listening()
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
        if self.cause is not None:  # this thread decided first (its rank's collective then broke)
            return self.cause
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

    # ------------------------------------------------------------------ signals
    def _listen_for_signals(self) -> None:
        """Have SIGTERM/SIGINT written to a socket this thread reads (only the main thread may set it, and
        only one such socket exists per process: one set by someone else, e.g. an asyncio loop, stays)."""
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            read.close()
            write.close()
            return
        self._wake = (read, write)

    def _stop_listening(self) -> None:
        if self._wake is None or threading.current_thread() is not threading.main_thread():
            return  # the sockets stay open: the C signal handler may still write to the fd
        previous = signal.set_wakeup_fd(-1)
        if previous != self._wake[1].fileno():  # someone else's since: put it back
            signal.set_wakeup_fd(previous)
        for end in self._wake:
            end.close()
        self._wake = None

    def _sleep(self, seconds: float) -> None:
        if self._wake is None:
            self._stop.wait(seconds)
            return
        ready, _, _ = select.select([self._wake[0]], [], [], seconds)
        if not ready:
            return
        try:
            received = self._wake[0].recv(4096)
        except OSError:
            return
        for number in received:
            if number in _SIGNALS and self._signal is None:
                self._signal = (number, time.monotonic())

    # ------------------------------------------------------------------ thread
    def _beat(self) -> None:
        wait = self._wait.to_json() if self._wait is not None else None
        self.store.set(f"lp/hb/{self.rank}", json.dumps({"t": time.time(), "wait": wait}))

    def _run(self) -> None:
        store_lost_since: Optional[float] = None
        while not self._stop.is_set():
            self._sleep(self.interval if self._signal is None else min(self.interval, 0.25))
            if self._stop.is_set():
                return
            outcome: Optional[tuple[str, int]] = None
            try:
                assert self._sampler is not None
                self._wait = self._sampler.sample()
                self._beat()
                outcome = self._check()
                store_lost_since = None
            except Exception as err:  # store unreachable: its host (usually rank 0) may be gone
                store_lost_since = store_lost_since or time.monotonic()
                if time.monotonic() - store_lost_since > self.timeout:
                    outcome = f"lost contact with the rendezvous store for {self.timeout:.0f} s ({err})", 1
            if outcome and not self._stop.is_set():
                reason, code = outcome
                self.cause = reason
                print(
                    f"[lightning_parallel] {reason}; stopping rank {self.rank} (exit {code}).",
                    file=sys.stderr,
                    flush=True,
                )
                self._exit(code)
                if self._signal is not None:
                    self._terminate(code)
                return

    def _check(self) -> Optional[tuple[str, int]]:
        if self.store.check([FAILED_KEY]):
            message = self.store.get(FAILED_KEY).decode()
            if not message.startswith(f"rank {self.rank} "):
                return message, 1
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            value = self.store.get(f"lp/hb/{r}") if self.store.check([f"lp/hb/{r}"]) else b""
            if value == b"done":
                self._last_seen[r] = now
            elif value != self._last_value.get(r):
                self._last_value[r], self._last_seen[r] = value, now
            elif now - self._last_seen[r] > self.timeout:
                return (
                    f"rank {r} stopped responding (no heartbeat for {self.timeout:.0f} s: killed or hung)",
                    1,
                )
            self._peers[r] = "done" if value == b"done" else _parse(value)
        if self._wait is None:
            return None
        if self._signal is not None:
            return self._stuck_when_signalled()
        return self._never_joined()

    def _peer_wait(self, r: int, at_least: float, ending: bool = False) -> Any:
        """Peer ``r``'s wait if it has been blocked ``at_least`` s, else None (it computes, or has only
        just started waiting). A peer that has finished (``"done"``) or has sent no heartbeat for
        ``at_least`` s (``"gone"``) counts as one that will not join only when this rank is ``ending``
        (signalled): otherwise a finished rank may start the process's next run (a second ``fit``), and
        a silent one is the heartbeat rule's to judge."""
        state = self._peers.get(r)
        if state == "done":
            return "done" if ending else None
        if time.monotonic() - self._last_seen[r] >= at_least:
            return "gone" if ending else None
        wait = state.get("wait") if isinstance(state, dict) else None
        return wait if wait is not None and wait.get("for", 0) >= at_least else None

    def _never_joined(self) -> Optional[tuple[str, int]]:
        """This rank has waited ``timeout`` in a collective and so has every peer, in another call, for at
        least half of it: no rank can progress."""
        mine = self._wait
        assert mine is not None
        if mine.seconds() < self.timeout:
            return None
        peers = {r: self._peer_wait(r, self.timeout / 2) for r in range(self.world_size) if r != self.rank}
        if any(p is None for p in peers.values()):
            return None  # a peer computes: it may still join
        if all(isinstance(p, dict) and _key(p) == mine.key for p in peers.values()):
            return None  # every rank is in the same call: one slow collective (the process-group timeout)
        waits = {self.rank: mine.to_json(), **peers}
        # the subject: a wait the user's own code asked for, else the longest; the ranks elsewhere did not join it
        subject = max(
            (r for r, w in waits.items() if isinstance(w, dict)),
            key=lambda r: (bool(waits[r].get("by_user")), waits[r].get("for", 0)),
        )
        key = _key(waits[subject])
        absent = [r for r, w in waits.items() if not (isinstance(w, dict) and _key(w) == key)]
        joined = [r for r in waits if r != subject and r not in absent]
        message = (
            f"a collective that not every rank joined: {_wait_report(subject, waits[subject])}, which "
            f"{_ranks(absent)} did not join"
            + (f" ({_ranks(joined)} did)" if joined else "")
            + f"; {'; '.join(_wait_report(r, waits[r]) for r in absent)}. Every rank of a process group "
            "must make the same collective calls in the same order (a collective under `if "
            "self.global_rank == ...`, or in a hook that runs on some ranks only, blocks)"
        )
        return self._publish(message), 1

    def _stuck_when_signalled(self) -> Optional[tuple[str, int]]:
        """Signalled, and blocked in a collective for ``SIGNAL_GRACE_S`` while no peer computes: stop."""
        mine, (number, _) = self._wait, self._signal  # type: ignore[misc]
        assert mine is not None
        grace = min(SIGNAL_GRACE_S, self.timeout)
        if mine.seconds() < grace:
            return None
        peers = {r: self._peer_wait(r, grace, ending=True) for r in range(self.world_size) if r != self.rank}
        if any(p is None for p in peers.values()):
            return None  # a peer computes: it will join, and the Python handlers save and stop as usual
        name = signal.Signals(number).name
        message = (
            f"rank {self.rank} got {name} while stuck for {mine.seconds():.0f} s in {mine.describe()}"
            + "".join(f"; {_wait_report(r, w)}" for r, w in peers.items())
            + "; no checkpoint was written"
        )
        self._publish(message)
        return message, 128 + number

    def _publish(self, message: str) -> str:
        """Make ``message`` the run's failure unless another was published first; returns the one that won."""
        try:
            return self.store.compare_set(FAILED_KEY, "", message).decode()
        except Exception:
            return message


def _parse(value: bytes) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None


def _key(wait: dict) -> str:
    return f"{wait.get('call')}@{wait.get('at')}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _wait_report(rank: int, wait: Any) -> str:
    if wait == "done":
        return f"rank {rank} has finished"
    if wait == "gone":
        return f"rank {rank} has stopped responding"
    under = f" under {wait['under']}" if wait.get("under") else ""
    return (
        f"rank {rank} has waited {wait.get('for', 0):.0f} s in {wait.get('call')} at {wait.get('at')}{under}"
    )
