"""Run ``lp-train`` (as ``python -m lightning_parallel.cli.train``) in a scratch folder, and find leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from lightning_parallel.distributed.rendezvous import AGENT_STORE_ENV

REPO = Path(__file__).resolve().parents[2]
LP_TRAIN = [sys.executable, "-m", "lightning_parallel.cli.train"]
# small enough for CI: a one-block model, 20 steps, 2 validation batches
QUICK = ["experiment=quick"]


MARKER = "LP_TEST_MARKER"


def env(marker: str = "") -> dict[str, str]:
    """The test's environment plus a marker that every descendant process inherits."""
    out = dict(os.environ)
    out[MARKER] = marker
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in (
        "LOCAL_RANK",
        "WORLD_SIZE",
        "RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        AGENT_STORE_ENV,
    ):
        out.pop(key, None)  # a fresh shell: nothing left by an earlier in-process run
    return out


def run(
    args: Sequence[str], cwd: Path, timeout: float = 240, command: Sequence[str] = LP_TRAIN
) -> subprocess.CompletedProcess:
    return run_bounded([*command, *args], cwd, env(str(cwd)), timeout)


def run_bounded(
    command: Sequence[str], cwd: Path, environ: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, on a time-out, fails the test saying where it hung and leaves nothing behind.

    The command runs in its own session. On a time-out every process in it gets SIGABRT first, which
    with ``PYTHONFAULTHANDLER=1`` prints each thread's Python stack (rank 0's to the captured stderr,
    the other ranks' to their ``*.out`` files); then SIGKILL. The failure shows those stacks and the
    tail of every log under ``cwd``: a hang in CI must say where it was, and must not leave processes
    running into the next test.
    """
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env={**environ, "PYTHONFAULTHANDLER": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:  # our time-out, or pytest-timeout's (it raises in this thread), or ^C
        stdout, stderr = _stop_session(proc)
        report = (
            f"{' '.join(command)} was stopped ({type(exc).__name__}) after {timeout:.0f} s or less\n"
            f"--- stdout ---\n{stdout[-3000:]}\n--- stderr (with the stacks when it was stopped) ---\n"
            f"{stderr[-8000:]}\n{log_tails(cwd)}"
        )
        if isinstance(exc, subprocess.TimeoutExpired):
            pytest.fail(report, pytrace=False)
        print(report)  # pytest shows a failed test's captured output
        raise
    return subprocess.CompletedProcess(list(command), proc.returncode, stdout, stderr)


def _stop_session(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT (stacks), then SIGKILL, to every process in ``proc``'s session; returns its output."""
    _signal_session(proc.pid, signal.SIGABRT)
    try:
        stdout, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        _signal_session(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    _signal_session(proc.pid, signal.SIGKILL)  # children that outlived the abort
    return stdout or "", stderr or ""


def _signal_session(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session: the session's process group id is the leader's pid
    except ProcessLookupError:
        pass


def log_tails(cwd: Path, lines: int = 25, limit: int = 12000) -> str:
    """The last lines of every ``*.out`` and ``*.log`` under ``cwd``, newest last."""
    logs = sorted(
        (p for pattern in ("*.out", "*.log") for p in cwd.rglob(pattern)), key=lambda p: p.stat().st_mtime
    )
    text = "".join(
        f"--- {p.relative_to(cwd)} ---\n"
        + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        + "\n"
        for p in logs
    )
    return text[-limit:]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def survivors(cwd: Path) -> list[str]:
    """Live processes started (directly or not) by ``run(..., cwd)``: they inherit its marker."""
    needle = f"{MARKER}={cwd}".encode() + b"\0"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
            if needle in environ:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                found.append(f"{pid}: {cmdline}")
        except OSError:
            continue
    return found


def assert_no_survivors(cwd: Path, wait: float = 15.0) -> None:
    deadline = time.monotonic() + wait
    while survivors(cwd) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not survivors(cwd), survivors(cwd)


def sweep_dir(cwd: Path) -> Path:
    """The one sweep folder under ``cwd/multirun`` (fails if there are several)."""
    dirs = [p for p in (cwd / "multirun").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, f"expected one sweep folder, found {dirs}"
    return dirs[0]


def check_sweep(cwd: Path, expected: dict[str, int], proc, root: Path | None = None) -> Path:
    """Every job of the sweep in ``root`` (default: the one sweep folder of ``cwd``): completed, world size as
    asked (``expected``: {its overrides but ``experiment=``: world size}), per-rank logs in its own folder;
    the sweep summary files; no process left."""
    root = root or sweep_dir(cwd)  # a child re-running the sweep would have made a second one
    jobs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == len(expected), explain(proc)
    seen = {}
    for job in jobs:
        s = summary(job)
        assert s["status"] == "completed", s.get("error")
        key = " ".join(o for o in s["overrides"] if not o.startswith("experiment"))
        seen[key] = s["world_size"]
        assert s["world_size"] == s["devices"]  # torch.distributed's own count, inside training
        assert (job / "train.log").exists()
        for rank in range(1, s["world_size"]):
            assert (job / f"train_rank{rank}.log").exists() and (job / f"train_rank{rank}.out").exists()
        assert not (job / "multirun").exists() and not (job / "outputs").exists()
    assert seen == expected, seen
    for suffix in ("csv", "md", "svg"):
        assert (root / f"sweep_summary.{suffix}").is_file()
    assert "Sweep summary" in proc.stdout
    assert_no_survivors(cwd)
    return root
