"""``lp-train``'s progress: Lightning's progress bar with the loss and samples/s on a terminal (here a
pseudo-terminal), a line every N steps elsewhere (every other test's captured output)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time

import pytest

from tests.cli.lp import LP_TRAIN, QUICK, _stop_session, assert_no_survivors, env


def _run_on_a_terminal(args: list[str], cwd, timeout: float) -> tuple[int, str]:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # tqdm sizes its bar to it
    proc = subprocess.Popen(
        [*LP_TRAIN, *args],
        cwd=cwd,
        env=env(str(cwd)),
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed: every process holding it ended
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    else:
        _stop_session(proc)
        pytest.fail(f"lp-train did not end within {timeout} s:\n{out.decode(errors='replace')[-3000:]}")
    os.close(leader)
    return proc.wait(), out.decode(errors="replace")


@pytest.mark.timeout(200)
def test_a_terminal_gets_a_progress_bar_with_loss_and_samples_per_second(tmp_path) -> None:
    code, out = _run_on_a_terminal(
        [*QUICK, "trainer.max_steps=6", "trainer.devices=1", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        180,
    )
    assert code == 0, out[-4000:]
    assert "Epoch 0: 100%" in out and "train_loss=" in out and "samples/s=" in out, out[-4000:]
    assert "step 5/6 |" not in out  # the line log is for output that is not a terminal
    assert_no_survivors(tmp_path)
