"""Run a LightningModule on 1 process with the global batch and on N real processes, then compare.

``run_distributed`` starts one ``tests.helpers.worker`` per rank (gloo on CPU, one thread each), with
a hard time limit. If a rank fails, the others get a short grace period and are then killed, so a
crash never turns into a hang, and no process outlives the call.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterable, Mapping

import torch

from lightning_parallel.checkpointing.trust import FIT_TAKES_WEIGHTS_ONLY
from lightning_parallel.processes import run_processes, start_processes
from tests.helpers.forkserver import rank_commands
from tests.helpers.worker import run_case

__all__ = [
    "free_port",
    "process_alive",
    "run_single",
    "run_single_once",
    "training_key",
    "run_distributed",
    "start_processes",
    "distributed_command",
    "forked_commands",
    "run_program",
    "run_processes",
    "gloo_threads_left",
    "max_param_diff",
    "assert_params_close",
    "assert_given_back_whole",
    "saved_checkpoint",
    "REPO",
    "UNTRUSTED",
]

REPO = Path(__file__).resolve().parents[2]
#: what a resume case adds to load its checkpoint as an untrusted one (``fit(weights_only=True)``, Lightning
#: >= 2.6): every checkpoint the package writes loads that way
UNTRUSTED = {"weights_only": True} if FIT_TAKES_WEIGHTS_ONLY else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_single(case: dict, tmp_path: Path) -> dict:
    """The reference: the same case, one process, the whole global batch."""
    out = tmp_path / "single" / case["name"]
    out.mkdir(parents=True, exist_ok=True)
    return run_case({**case, "dp_size": 1}, world_size=1, out_dir=out)


def training_key(case: dict) -> str:
    """What decides what a case computes: the whole case but its name (which only names its folder)."""
    return json.dumps({k: v for k, v in case.items() if k != "name"}, sort_keys=True)


#: the one-device results of this test session, by what decides the training (the case less its name)
_ONE_DEVICE: dict[str, dict] = {}


def run_single_once(case: dict, tmp_path: Path) -> dict:
    """``run_single``, once per test session for each training: a case that differs from an earlier one only
    in its name gets a copy of that one's result (the same seed, model, data and float64 steps: the same
    numbers), where several tests compare with the same reference. A case whose files are read back (a
    checkpoint it saves, its callbacks' or logger's files) runs each time."""
    if case.get("save_checkpoint") or case.get("callbacks") or case.get("csv_logger"):
        return run_single(case, tmp_path)
    key = training_key(case)
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = run_single(case, tmp_path)
    return copy.deepcopy(_ONE_DEVICE[key])


def worker_env(rank: int, world_size: int, local_world_size: int | None = None) -> dict:
    """A rank's environment; ``run_processes(..., rendezvous=True)`` adds where the rendezvous store is."""
    local = local_world_size or world_size
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % local),
        NODE_RANK=str(rank // local),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    return env


def forked_commands(command: list[str], world_size: int) -> list[list[str]]:
    """``world_size`` ranks running ``command`` (``python -m ...``) as forks of a process that has already
    imported torch and Lightning (``tests/helpers/forkserver.py``): real processes, without a start-up
    of several seconds each. Where a GPU is present each rank starts its own interpreter instead: CUDA
    does not survive a fork once a parent has touched the driver, and the GPU tests are few."""
    if torch.cuda.is_available():
        return [command] * world_size
    server_env = {
        k: v
        for k, v in worker_env(0, 1).items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    }
    return rank_commands(command, world_size, server_env)


def run_program(command: list[str], cwd: Path, timeout: float, world_size: int = 2) -> list[str]:
    """A hand-written rank program (``python -m module args``) on ``world_size`` forked ranks; raises unless
    every rank exits with 0."""
    envs = [worker_env(r, world_size) for r in range(world_size)]
    return run_processes(forked_commands(command, world_size), envs, timeout, cwd, rendezvous=True)


def distributed_command(
    cases: Iterable[dict], world_size: int, tmp_path: Path, threads_after_destroy: bool = False
) -> tuple[list[list[str]], list[dict], Path]:
    """Commands and environments of ``world_size`` worker processes that run ``cases``; with
    ``threads_after_destroy``, each rank then destroys the process group and records the threads it has
    left (``gloo_threads_left``)."""
    cases = list(cases)
    out = tmp_path / f"dist{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(
        json.dumps({"cases": cases, "out": str(out), "threads_after_destroy": threads_after_destroy})
    )
    cmd = [sys.executable, "-m", "tests.helpers.worker", str(spec)]
    return forked_commands(cmd, world_size), [worker_env(r, world_size) for r in range(world_size)], out


def run_distributed(
    cases: Iterable[dict],
    world_size: int,
    tmp_path: Path,
    timeout: float = 240.0,
    threads_after_destroy: bool = False,
) -> dict[str, list[dict]]:
    """Run ``cases`` on ``world_size`` processes; returns {case name: [rank 0 result, rank 1 result, ...]}."""
    cases = list(cases)
    commands, envs, out = distributed_command(cases, world_size, tmp_path, threads_after_destroy)
    run_processes(commands, envs, timeout, out, rendezvous=True)
    return {
        c["name"]: [
            torch.load(out / c["name"] / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]
        for c in cases
    }


def gloo_threads_left(tmp_path: Path, world_size: int) -> list[list[str]]:
    """Each rank's gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) still running after its run of
    ``run_distributed(..., threads_after_destroy=True)`` destroyed the process group and collected garbage:
    a process group something still holds, which would live on into interpreter exit."""
    out = tmp_path / f"dist{world_size}"
    ranks = [json.loads((out / f"threads_rank{r}.json").read_text()) for r in range(world_size)]
    return [[name for name in names if "gloo" in name] for names in ranks]


def max_param_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"different parameter names: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


def saved_checkpoint(tmp_path: Path, world_size: int, name: str) -> dict:
    """The ``last.ckpt`` that case ``name`` saved in a ``run_distributed`` run of ``world_size`` processes."""
    return torch.load(tmp_path / f"dist{world_size}" / name / "last.ckpt", weights_only=False)


def assert_params_close(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], atol: float) -> None:
    diff = max_param_diff(a, b)
    assert diff <= atol, f"largest parameter difference {diff:.3e} exceeds {atol:.0e}"


def assert_given_back_whole(ranks: list[dict], full: Mapping[str, torch.Tensor], reference: dict) -> None:
    """After fit every rank's module is whole again: its ``state_dict()`` has one device's names in one
    device's order (``reference``: the single-process run) and the full checkpoint's values, and rank 0's
    forward (case option ``forward_after_fit``) gives one device's output."""
    for rank in ranks:
        assert list(rank["state_dict"]) == list(reference["state_dict"])
        shapes = {k: (tuple(v.shape), tuple(full[k].shape)) for k, v in rank["state_dict"].items()}
        assert all(a == b for a, b in shapes.values()), f"a rank's shapes differ from the whole's: {shapes}"
        assert max_param_diff(rank["state_dict"], full) == 0
    diff = (ranks[0]["forward"].double() - reference["forward"].double()).abs().max().item()
    assert diff <= 1e-10, f"rank 0's forward after fit differs from one device's by {diff:.3e}"
