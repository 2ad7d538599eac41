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
