"""The failure watchdog's own thread: ``stop`` leaves no thread behind, even one caught inside a slow
store call (its failure detection across real processes is tested in tests/strategies/test_failures.py)."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_parallel.distributed.watchdog import FailureWatchdog


class SlowStore:
    """A store whose reads take ``delay`` seconds, like a rendezvous store on another host."""

    def __init__(self, delay: float) -> None:
        self.delay, self.values = delay, {}
        self.reading = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list[str]) -> bool:
        self.reading.set()
        time.sleep(self.delay)
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


@pytest.mark.timeout(30)
def test_stop_waits_for_the_thread_inside_a_store_call_and_marks_the_rank_done():
    store = SlowStore(delay=0.5)
    watchdog = FailureWatchdog(
        rank=0,
        world_size=2,
        timeout=60.0,
        interval=0.05,
        store=store,
        exit_fn=lambda code: pytest.fail(f"the watchdog tried to exit with {code}"),
    )
    watchdog.start()
    assert store.reading.wait(5), "the watchdog never read the store"
    watchdog.stop()  # called while the thread sleeps inside check()
    assert not watchdog._thread.is_alive()
    assert store.values["lp/hb/0"] == b"done"


@pytest.mark.timeout(30)
def test_the_signal_socket_is_handed_back_at_stop():
    """The watchdog hears SIGTERM through ``signal.set_wakeup_fd`` (a rank stuck in C++ runs no Python
    handler); ``stop`` gives the process's one wake-up fd back, and one held by someone else is left alone."""
    import signal
    import socket

    def watchdog():
        return FailureWatchdog(
            0, 2, timeout=60.0, interval=0.05, store=SlowStore(delay=0.0), exit_fn=pytest.fail
        )

    assert signal.set_wakeup_fd(-1) == -1
    first = watchdog().start()
    assert first._wake is not None and signal.set_wakeup_fd(-1) == first._wake[1].fileno()
    signal.set_wakeup_fd(first._wake[1].fileno())
    first.stop()
    assert first._wake is None and signal.set_wakeup_fd(-1) == -1

    theirs, other = socket.socketpair()
    theirs.setblocking(False)
    signal.set_wakeup_fd(theirs.fileno())
    try:
        second = watchdog().start()
        assert second._wake is None
        second.stop()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
    finally:
        theirs.close()
        other.close()


@pytest.mark.timeout(30)
def test_the_thread_hears_sigterm_without_the_main_thread():
    """A real SIGTERM reaches the watchdog's thread through the socket (the main thread here is busy in
    ``time.sleep``, as it would be stuck in a collective); a rank not blocked in a collective goes on."""
    import os
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    watchdog = FailureWatchdog(
        0,
        2,
        timeout=60.0,
        interval=0.05,
        store=SlowStore(delay=0.0),
        exit_fn=pytest.fail,
        terminate_fn=pytest.fail,
    ).start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while watchdog._signal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watchdog._signal is not None and watchdog._signal[0] == signal.SIGTERM
        time.sleep(0.5)  # several checks after the signal: not in a collective, so nothing ends
        assert watchdog._thread.is_alive()
    finally:
        watchdog.stop()
        signal.signal(signal.SIGTERM, previous)
