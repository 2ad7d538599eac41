"""What the benchmarks share: launching a worker under torchrun, timing steps, summarising runs."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the benchmarks import the package from this checkout
    sys.path.insert(0, str(REPO))

from lightning_parallel.quiet_trainer import QUIET_TRAINER  # noqa: E402 - a timed run writes and prints nothing

__all__ = [
    "REPO",
    "QUIET_TRAINER",
    "benchmark_parser",
    "torchrun",
    "end_worker",
    "step_timer",
    "worker_args",
    "interleaved",
    "append_record",
    "read_records",
    "median_of",
    "median_ratio",
    "llama_lm",
]


def benchmark_parser(doc: str, rounds: int, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: the hidden ones of a worker run (``--worker``, ``--out``) and
    how many rounds, steps and warm-up steps to time; a benchmark adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    return parser


def torchrun(script: str, nprocs: int, args: list[str], timeout: float = 600) -> None:
    """Run ``script --worker ARGS`` on ``nprocs`` processes (one thread each) and wait for it."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        "--standalone",
        script,
        "--worker",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, text=True
    )
    if done.returncode:
        raise RuntimeError(f"benchmark worker failed:\n{done.stderr[-3000:]}")


def end_worker() -> NoReturn:
    """End a worker rank once its work is done (records written): destroy the process group and leave with
    ``os._exit(0)``, after flushing stdout and stderr, without interpreter finalization.

    A process group that something still references outlives ``destroy_process_group``, and its gloo threads
    with it: Lightning's ``ModelParallelStrategy`` leaves its ``DeviceMesh`` (two groups) in torch's DTensor
    caches (sharding propagation, the redistribute planner), which nothing here can release. Torn down
    during finalization, such a group can abort the finished rank (SIGABRT, "terminate called without an
    active exception"), which torchrun reports as a failed run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def step_timer():
    """A Lightning callback that records the wall time (``times``), the process's CPU time (``cpu_times``,
    all its threads) and its minor page faults (``faults``) of every training step: on a shared machine the
    CPU time is the steadier measure of the work a step does, and the faults show memory handed back to the
    system and faulted in again within a step."""
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.faults: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start, self.start_cpu = time.perf_counter(), time.process_time()
            self.start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.start_cpu)
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.start_faults)

    return StepTimer()


def worker_args(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """``--out``, ``--steps``, ``--warmup`` and the options ``names`` (attribute names) of ``args``, as a
    worker's command line."""
    line = ["--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for name in names:
        line += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return line


def interleaved(rounds: int, variants: list[str]):
    """``(round, variant)`` for every variant of every round, in reverse order every other round, so that
    a slow spell of a shared machine does not always hit the same variant first."""
    for round_ in range(rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            yield round_, variant


def append_record(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def median_of(records: list[dict], key: str, **match) -> float:
    values = [r[key] for r in records if all(r.get(k) == v for k, v in match.items())]
    return statistics.median(values) if values else float("nan")


def median_ratio(records: list[dict], key: str, numerator: dict, denominator: dict) -> float:
    """The median over rounds of ``numerator[key] / denominator[key]``, pairing records by their "round".
    Each round runs both back to back, so a slow spell of a shared machine hits both sides of a ratio."""

    def by_round(match: dict) -> dict:
        return {r["round"]: r[key] for r in records if all(r.get(k) == v for k, v in match.items())}

    top, bottom = by_round(numerator), by_round(denominator)
    ratios = [top[r] / bottom[r] for r in top if r in bottom]
    return statistics.median(ratios) if ratios else float("nan")


def llama_lm(config):
    """A LightningModule around an unmodified ``LlamaForCausalLM`` built from ``config`` (no download): the
    causal-LM loss of a batch of token ids, AdamW (fused on CUDA)."""
    import torch
    from lightning.pytorch import LightningModule
    from transformers import LlamaForCausalLM

    class LlamaLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            fused = {"fused": True} if self.device.type == "cuda" else {}
            return torch.optim.AdamW(self.parameters(), lr=1e-4, **fused)

    return LlamaLM()
