"""Run a handful of local processes to completion, with a hard time limit and nothing left behind.

Used by ``verify`` and by the test harness to start the ranks of a short run (not a training launcher:
training uses Lightning's launchers, torchrun or srun). If one process fails, the others get ``grace``
seconds to notice and exit on their own, then every survivor's process group is killed. With
``rendezvous=True`` the processes are the ranks of one ``torch.distributed`` run, and this process
hosts their rendezvous store (``distributed/rendezvous.py``: no free-port race).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from lightning_parallel.distributed.rendezvous import HostedStore

__all__ = ["ProcessResults", "start_processes", "run_processes", "local_rank_envs"]

#: seconds between looks at the processes: what a caller waits, at most, after the last one exits (a test
#: session makes hundreds of launches)
POLL_S = 0.01


@dataclass
class ProcessResults:
    codes: list[int]  # -9: killed here (time limit, or grace period after a peer failed)
    outputs: list[str]
    seconds: float


def local_rank_envs(world: int, **extra: str) -> list[dict[str, str]]:
    """Each rank's environment for ``world`` processes on this machine, as torchrun sets it (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``), the working directory first on ``PYTHONPATH`` so the
    ranks import what the launcher imports, plus ``extra``."""
    pythonpath = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    return [
        dict(
            os.environ,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            PYTHONPATH=pythonpath,
            **extra,
        )
        for rank in range(world)
    ]


def start_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict],
    timeout: float,
    cwd: Path,
    grace: float = 10.0,
    log_names: Optional[Sequence[str]] = None,
    rendezvous: bool = False,
) -> ProcessResults:
    """Run one process per command until all exit; each one's output goes to ``cwd/<log name>``."""
    if rendezvous:
        with HostedStore(world_size=len(commands)) as store:
            envs = [{**env, **store.env()} for env in envs]
            return start_processes(commands, envs, timeout, cwd, grace, log_names)
    names = list(log_names) if log_names else [f"rank{r}.log" for r in range(len(commands))]
    logs = [Path(cwd) / name for name in names]
    handles = [open(log, "w") for log in logs]
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            list(cmd), env=env, cwd=cwd, stdout=h, stderr=subprocess.STDOUT, start_new_session=True
        )
        for cmd, env, h in zip(commands, envs, handles)
    ]
    deadline, failed_at = start + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:  # each process's whole session: what it started too, also after it exited itself
            _kill_session(p.pid)
            p.wait()
        for h in handles:
            h.close()
    return ProcessResults(
        [p.returncode for p in procs], [log.read_text() for log in logs], time.monotonic() - start
    )


def _kill_session(pid: int) -> None:
    """SIGKILL to every process left in the session that ``pid`` leads (``start_new_session``): the process,
    if it still runs, and what it started, e.g. torchrun's ranks when torchrun itself has exited."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing of it is left
        pass


def run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict],
    timeout: float,
    cwd: Path,
    grace: float = 10.0,
    log_names: Optional[Sequence[str]] = None,
    what: str = "rank",
    rendezvous: bool = False,
) -> list[str]:
    """``start_processes``, raising with every process's output tail unless all exited with 0."""
    result = start_processes(commands, envs, timeout, cwd, grace, log_names, rendezvous)
    if any(c != 0 for c in result.codes):
        tails = "\n".join(
            f"--- {what} {r} (exit {c}) ---\n{o[-3000:]}"
            for r, (c, o) in enumerate(zip(result.codes, result.outputs))
        )
        raise RuntimeError(f"distributed run failed or timed out after {timeout}s:\n{tails}")
    return result.outputs
