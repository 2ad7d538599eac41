"""``lp-train`` under faults: a preempted run says so (summary and exit status) and resumes; two runs started
at once keep to their own folders."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lightning_parallel.cli.train import EXIT_PREEMPTED
from tests.cli.lp import LP_TRAIN, QUICK, _stop_session, assert_no_survivors, env, explain, run, summary

# Hydra's clock stopped at one second, in every process that puts this file's folder first on its path
FROZEN_CLOCK = """
import datetime, hydra.core.utils

class _Stopped(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5)

hydra.core.utils.datetime = _Stopped
"""


def _start(args: list[str], cwd: Path, path_first: str = "") -> subprocess.Popen:
    environ = env(str(cwd))
    if path_first:
        environ["PYTHONPATH"] = os.pathsep.join([path_first, environ["PYTHONPATH"]])
    return subprocess.Popen(
        [*LP_TRAIN, *args],
        cwd=cwd,
        env={**environ, "PYTHONFAULTHANDLER": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop_session(proc)
        pytest.fail(f"lp-train did not end within {timeout} s\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    done = _finish(proc, 30) if proc.poll() is None else _finish(proc, 5)
    pytest.fail(f"{text!r} never appeared in {path}\n{explain(done)}")


def _wait_for_glob(root: Path, pattern: str, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not list(root.glob(pattern)) and proc.poll() is None:
        time.sleep(0.2)
    found = list(root.glob(pattern))
    _wait_for(found[0] if found else root / pattern, text, proc, max(deadline - time.monotonic(), 1))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_preempted_run_reports_it_and_resumes(tmp_path) -> None:
    """SIGTERM to the launching process mid-run: every rank saves ``last.ckpt`` and stops; the summary says
    "preempted", resumable, with the command that resumes, and the exit status is 75, not 0."""
    run_dir = tmp_path / "run"
    args = [*QUICK, "trainer.max_steps=3000", "progress_every_n_steps=5", f"hydra.run.dir={run_dir}"]
    proc = _start(args, tmp_path)
    _wait_for(run_dir / "train.log", "step 10/3000", proc, timeout=120)
    os.kill(proc.pid, signal.SIGTERM)
    done = _finish(proc, 120)
    assert done.returncode == EXIT_PREEMPTED, explain(done)
    s = summary(run_dir)
    assert s["status"] == "preempted" and s["resumable"] is True, s
    assert 10 <= s["global_step"] < 3000
    assert s["checkpoint"] == s["preempted_at"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert (
        torch.load(s["checkpoint"], map_location="cpu", weights_only=False)["global_step"] == s["global_step"]
    )
    assert s["resume"].startswith("lp-train ") and f"ckpt_path={s['checkpoint']}" in s["resume"]
    assert_no_survivors(tmp_path)

    # the resume command given, with fewer steps to go: it continues from the saved step
    resume = [a for a in s["resume"].split()[1:] if not a.startswith("trainer.max_steps=")]
    resumed = run([*resume, f"trainer.max_steps={s['global_step'] + 3}"], tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    r = summary(run_dir)
    assert r["status"] == "completed" and r["global_step"] == s["global_step"] + 3, r
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(200)
def test_two_runs_started_at_once_keep_their_own_folders(tmp_path) -> None:
    """The default output folder is unique per run: two runs started in the same second (Hydra's clock
    stopped for both) write two summaries and two checkpoint folders."""
    clock = tmp_path / "clock"
    clock.mkdir()
    (clock / "sitecustomize.py").write_text(FROZEN_CLOCK)
    procs = [
        _start([*QUICK, "trainer.max_steps=4", "trainer.devices=1", f"seed={i}"], tmp_path, str(clock))
        for i in (1, 2)
    ]
    outs = [_finish(p, 150) for p in procs]
    for out in outs:
        assert out.returncode == 0, explain(out)
    summaries = sorted(tmp_path.glob("outputs/2026-01-02/03-04-05*/summary.json"))
    assert len(summaries) == 2, sorted(tmp_path.glob("outputs/*/*"))
    seeds = set()
    for path in summaries:
        overrides = summary(path.parent)["overrides"]
        seeds |= {o for o in overrides if o.startswith("seed=")}
        assert [p.name for p in (path.parent / "checkpoints").iterdir()] == ["last.ckpt"]
    assert seeds == {"seed=1", "seed=2"}
    assert_no_survivors(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_preempted_sweep_starts_no_further_job_and_exits_75(tmp_path) -> None:
    """SIGTERM during a sweep's first job: it saves and stops, the second job is not started, the sweep
    summary lists both as preempted (the first resumable) and the sweep exits 75."""
    args = ["-m", *QUICK, "trainer.devices=1", "progress_every_n_steps=5", "trainer.max_steps=3000,4"]
    proc = _start(args, tmp_path)
    _wait_for_glob(tmp_path, "multirun/*/*/0/train.log", "step 10/3000", proc, timeout=120)
    os.kill(proc.pid, signal.SIGTERM)
    done = _finish(proc, 120)
    assert done.returncode == EXIT_PREEMPTED, explain(done)
    root = next(tmp_path.glob("multirun/*/*"))
    first, second = summary(root / "0"), summary(root / "1")
    assert first["status"] == "preempted" and first["resumable"] is True and first["global_step"] < 3000
    assert second["status"] == "preempted" and second["resumable"] is False and second["global_step"] == 0
    assert "not started" in second["error"]
    rows = list(csv.DictReader(open(root / "sweep_summary.csv")))
    assert [r["status"] for r in rows] == ["preempted", "preempted"], rows
    assert_no_survivors(tmp_path)
