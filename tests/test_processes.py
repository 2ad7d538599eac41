"""``lightning_parallel.processes``: what a process started is gone when ``start_processes`` returns."""

from __future__ import annotations

import os
import time

import pytest

from lightning_parallel.processes import start_processes
from tests.helpers.harness import process_alive


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 3])
def test_a_process_that_exited_leaves_nothing_it_started(tmp_path, code):
    """The process starts a child in its session and exits (as torchrun may, its ranks still running):
    the child is killed too, whether the process succeeded or failed."""
    command = ["bash", "-c", f"sleep 120 & echo $! > child.pid; exit {code}"]
    result = start_processes([command], [dict(os.environ)], timeout=30, cwd=tmp_path, grace=0.5)
    assert result.codes == [code]
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child), f"the child {child} of the exited process still runs"
