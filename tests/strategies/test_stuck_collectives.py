"""A collective that a rank never joins (a user's bug) ends the run on every rank within failure_timeout
+ 10 s, naming the call and the ranks that did not join; a rank that waits for a slow peer is left
alone; SIGTERM ends a run stuck in a collective within seconds, launcher's children included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_parallel.distributed.rendezvous import HostedStore
from tests.helpers.harness import REPO, distributed_command, process_alive, run_processes, start_processes
from tests.helpers.one_sided import STUCK_MARKER_ENV

FAILURE_TIMEOUT = 5.0
NEVER_JOINED = "a collective that not every rank joined: "


def one_sided_case(
    strategy: str, action: str, rank: int, failure_timeout: float, seconds: float = 0.0
) -> dict:
    name, _, schedule = strategy.partition("-")
    return {
        "name": action,
        "model": "tests.helpers.one_sided:OneSidedMLP",
        "model_kwargs": {"action": action, "rank": rank, "seconds": seconds},
        "data": "tests.helpers.models:RegressionData",
        "strategy": {
            "class": f"lightning_parallel:{name}",
            "kwargs": {"failure_timeout": failure_timeout, **({"schedule": schedule} if schedule else {})},
        },
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 8, "val_check_interval": 4, "limit_val_batches": 3},
    }


def commands_with_marker(case: dict, tmp_path: Path) -> tuple[list, list, Path, Path]:
    commands, envs, out = distributed_command([case], 2, tmp_path)
    marker = out / "stuck"
    return commands, [{**env, STUCK_MARKER_ENV: str(marker)} for env in envs], out, marker


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "strategy,action,rank,call",
    [
        ("DDPStrategy", "all_gather", 0, "all_gather"),
        ("DDPStrategy", "strategy_barrier", 1, "barrier"),
        ("DataParallelStrategy", "all_gather", 0, "all_gather"),
        # the pipeline runs validation_step on the last stage (rank 1): a collective over the whole
        # world there is a bug whatever group the strategy's own collectives use
        ("PipelineParallelStrategy-1f1b", "dist_barrier", 1, "barrier"),
        ("TensorParallelStrategy", "all_gather", 1, "all_gather"),
    ],
)
def test_a_collective_one_rank_never_joins_ends_the_run_naming_it(tmp_path, strategy, action, rank, call):
    case = one_sided_case(strategy, action, rank, FAILURE_TIMEOUT)
    commands, envs, out, marker = commands_with_marker(case, tmp_path)
    # generous limits: the harness must not be the one that ends the ranks
    result = start_processes(commands, envs, timeout=150, cwd=out, grace=120, rendezvous=True)
    ended = time.time()
    assert marker.exists(), f"the one-sided call was never reached:\n{result.outputs[rank][-3000:]}"
    took = ended - marker.stat().st_mtime
    assert result.codes == [1, 1], f"exit codes {result.codes}:\n{result.outputs[0][-3000:]}"
    print(f"ended {took:.1f} s after the one-sided call")
    assert took <= FAILURE_TIMEOUT + 10, f"ended {took:.1f} s after the one-sided call"
    other = 1 - rank
    expected = f"rank {rank} has waited"
    for output in result.outputs:
        line = next((ln for ln in output.splitlines() if NEVER_JOINED in ln), None)
        assert line is not None, output[-3000:]
        assert f"{NEVER_JOINED}{expected}" in line, line
        assert f" s in {call} at validation_step (one_sided.py:" in line, line
        assert f"which rank {other} did not join; rank {other} has waited" in line, line


@pytest.mark.timeout(200)
def test_an_optimizer_state_dict_under_zero_on_one_rank_ends_the_run_naming_it(tmp_path):
    """``optimizer.state_dict()`` is a collective under ZeRO (gathered to the writing rank): called on
    rank 0 alone, every rank ends within failure_timeout + 10 s, naming the call and the user's line."""
    case = one_sided_case("DDPStrategy", "optimizer_state_dict", 0, FAILURE_TIMEOUT)
    case["strategy"]["kwargs"]["zero_stage"] = 1
    commands, envs, out, marker = commands_with_marker(case, tmp_path)
    result = start_processes(commands, envs, timeout=150, cwd=out, grace=120, rendezvous=True)
    ended = time.time()
    assert marker.exists(), f"the one-sided call was never reached:\n{result.outputs[0][-3000:]}"
    assert result.codes == [1, 1], f"exit codes {result.codes}:\n{result.outputs[0][-3000:]}"
    assert ended - marker.stat().st_mtime <= FAILURE_TIMEOUT + 10
    for output in result.outputs:
        line = next((ln for ln in output.splitlines() if NEVER_JOINED in ln), None)
        assert line is not None, output[-3000:]
        assert f"{NEVER_JOINED}rank 0 has waited" in line, line
        assert " at validation_step (one_sided.py:" in line and "which rank 1 did not join" in line, line


@pytest.mark.timeout(200)
def test_waiting_for_a_slow_rank_is_not_a_hang(tmp_path):
    """Rank 1 spends 3 x failure_timeout in validation_step (a slow rank, no collective): rank 0 waits for
    it in its next collective all that time, and the run finishes."""
    timeout = 3.0
    case = one_sided_case("DDPStrategy", "sleep", 1, timeout, seconds=3 * timeout)
    commands, envs, out, marker = commands_with_marker(case, tmp_path)
    outputs = run_processes(commands, envs, timeout=150, cwd=out, rendezvous=True)
    assert marker.exists()
    assert not any(NEVER_JOINED in o for o in outputs)


@pytest.mark.timeout(200)
def test_a_rank_that_finished_a_run_may_start_the_next_one_late(tmp_path):
    """Two fits in the same processes: rank 1 finishes the first, then spends 3 x failure_timeout before
    the second, while rank 0 waits for it in the second's first collective. Not a hang."""
    timeout = 3.0
    first = one_sided_case("DDPStrategy", "sleep", 1, timeout)
    second = {**first, "name": "second", "model": "tests.helpers.one_sided:SlowToStartMLP"}
    second["model_kwargs"] = {"rank": 1, "seconds": 3 * timeout}
    commands, envs, out = distributed_command([first, second], 2, tmp_path)
    outputs = run_processes(commands, envs, timeout=150, cwd=out, rendezvous=True)
    assert not any(NEVER_JOINED in o for o in outputs)


def _wait_for(path: Path, procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.1)


@pytest.mark.timeout(200)
def test_sigterm_ends_a_run_stuck_in_a_collective(tmp_path):
    """SIGTERM to rank 0 alone, stuck in a one-sided all_gather (failure_timeout far away): it stops at
    once, saying so, and its peer follows."""
    case = one_sided_case("DDPStrategy", "all_gather", 0, failure_timeout=120.0)
    commands, envs, out, marker = commands_with_marker(case, tmp_path)
    logs = [open(out / f"rank{r}.log", "w") for r in range(2)]
    with HostedStore(world_size=2) as store:
        procs = [
            subprocess.Popen(
                cmd,
                env={**env, **store.env()},
                cwd=out,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for cmd, env, log in zip(commands, envs, logs)
        ]
        try:
            _wait_for(marker, procs, 120)
            time.sleep(5)  # both ranks are now blocked: rank 0 in all_gather, rank 1 in its next collective
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            signalled = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=30)
            took = time.monotonic() - signalled
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for log in logs:
                log.close()
    outputs = [(out / f"rank{r}.log").read_text() for r in range(2)]
    print(f"ended {took:.1f} s after SIGTERM")
    assert took < 8, f"took {took:.1f} s after SIGTERM"
    assert procs[0].returncode == 128 + signal.SIGTERM, outputs[0][-3000:]
    assert procs[1].returncode == 1, outputs[1][-3000:]
    for output in outputs:
        assert "rank 0 got SIGTERM while stuck for " in output, output[-3000:]
        assert " s in all_gather at validation_step (one_sided.py:" in output
        assert "no checkpoint was written" in output


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ending", ["never_joined", "sigterm"])
def test_under_lightnings_launcher_the_launching_process_and_its_children_end(tmp_path, ending):
    """Lightning's launcher (ours, popen): rank 1 is a child of the process the user started (rank 0).
    A one-sided collective ends both within failure_timeout + 10 s, the launching process with an
    exception that names it; with a far failure_timeout, SIGTERM to the launching process while both
    are stuck ends both within seconds."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    script = str(REPO / "tests" / "helpers" / "scripts" / "stuck_fit.py")
    failure_timeout = FAILURE_TIMEOUT if ending == "never_joined" else 120.0
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, script, str(tmp_path), str(failure_timeout)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pids: list[int] = []
    try:
        _wait_for(tmp_path / "stuck", [proc], 120)
        stuck = time.monotonic()
        _wait_for(tmp_path / "1.pid", [proc], 30)
        pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
        assert pids[0] == proc.pid
        if ending == "sigterm":
            time.sleep(5)
            stuck = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        while process_alive(pids[1]) and time.monotonic() - stuck < 60:
            time.sleep(0.1)
        took = time.monotonic() - stuck
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids[1:]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    output = (tmp_path / "launcher.log").read_text()
    assert not process_alive(pids[1]), "rank 1 outlived the launching process"
    print(f"ended {took:.1f} s after the {'signal' if ending == 'sigterm' else 'one-sided call'}")
    if ending == "sigterm":
        assert took < 8, f"took {took:.1f} s after SIGTERM"
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "rank 0 got SIGTERM while stuck for " in output, output[-3000:]
    else:
        assert took <= FAILURE_TIMEOUT + 10, f"ended {took:.1f} s after the one-sided call"
        assert proc.returncode == 1, output[-3000:]
        raised = output[output.rindex("Traceback") :]  # the exception the user's script died of
        assert f"{NEVER_JOINED}rank 0 has waited" in raised, raised[-3000:]
        assert "in all_gather at validation_step (one_sided.py:" in raised
