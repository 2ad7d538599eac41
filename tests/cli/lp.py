"""Run ``lp-train`` (as ``python -m lightning_parallel.cli.train``) in a scratch folder, and find leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

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
    out.pop("LOCAL_RANK", None)
    out.pop("WORLD_SIZE", None)
    return out


def run(args: Sequence[str], cwd: Path, timeout: float = 240, command: Sequence[str] = LP_TRAIN
        ) -> subprocess.CompletedProcess:
    proc = subprocess.run([*command, *args], cwd=cwd, env=env(str(cwd)), capture_output=True, text=True,
                          timeout=timeout)
    return proc


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
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
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
