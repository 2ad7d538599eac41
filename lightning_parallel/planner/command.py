"""``python -m lightning_parallel.planner [package.module:MyModule] --devices 8 [--cluster FILE|NAME]
[--memory-gb 80] [--global-batch B] [--kwargs JSON] [--data package.module:DataModule] [--output FILE]``

Measures the module's blocks on this machine (``planner.measure``), predicts every layout of the devices
(``planner.layouts``, ``planner.cost_model``), prints the fastest first (step time, samples/s, bubble,
exposed data-parallel time, peak memory per rank) and why the others were excluded, and prints the
``lp-train`` overrides of the best one (written to ``--output`` too). Without a module it plans the
embedded ``CharGPT`` of ``lp-train``'s default config. Without ``--cluster`` the machine is this one:
``cpu_2core``'s figures with ``--devices`` processes; with a cluster that is not a CPU box, block times
come from a FLOP count at the cluster's rate (``--timing flops``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch
from hydra.utils import get_object
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

from lightning_parallel.memory.expected import optimizer_kind
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.cost_model import ModelCost
from lightning_parallel.planner.layouts import NO_FIT, Plan, plan_layouts
from lightning_parallel.planner.measure import flop_times, measure_model

__all__ = ["main", "format_plan", "EMBEDDED"]

#: the model planned when no module is given: lp-train's default (conf/model/char_gpt.yaml) with 8 blocks
EMBEDDED = ("lightning_parallel.models.gpt:CharGPT", {"n_layer": 8, "n_embd": 128, "block_size": 64})
GIB, MIB = 2**30, 2**20


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer of ``configure_optimizers()``'s return (an optimizer, a list, or a dict)."""
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        configured = configured[0] if isinstance(configured, (list, tuple)) else configured
    return configured["optimizer"] if isinstance(configured, dict) else configured


def _sample_step(
    module: Any, data: Optional[str], batch_size: int
) -> tuple[Callable[[], torch.Tensor], int, int]:
    """A step returning a loss to time, its batch's samples, and tokens per sample: ``training_step`` on a
    batch of ``--data`` (or of random tokens for the embedded GPT), else ``forward`` on the module's
    ``example_input_array`` (its outputs summed)."""
    if data is not None:
        datamodule = get_object(data.replace(":", "."))()
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
    elif hasattr(module, "model") and hasattr(module.model, "block_size") and hasattr(module, "hparams"):
        shape = (batch_size, module.model.block_size)
        batch = (
            torch.randint(module.hparams.vocab_size, shape),
            torch.randint(module.hparams.vocab_size, shape),
        )
    elif getattr(module, "example_input_array", None) is not None:
        example = module.example_input_array
        return lambda: module(example).float().sum(), len(example), 1
    else:
        raise ValueError(
            f"{type(module).__name__}: give --data package.module:DataModule (its first training batch is "
            "timed), or set the module's example_input_array"
        )
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    tokens = first.shape[1] if first.dim() > 1 and not first.is_floating_point() else 1

    def step() -> torch.Tensor:
        loss = module.training_step(batch, 0)
        return loss["loss"] if isinstance(loss, dict) else loss

    return step, len(first), tokens


def model_cost(
    target: str, kwargs: dict, data: Optional[str], batch_size: int, repeats: int = 2
) -> ModelCost:
    """The module built from ``target`` with ``kwargs``, measured on this machine (median of ``repeats``)."""
    module = get_object(target.replace(":", "."))(**kwargs)
    optimizer = _first_optimizer(module.configure_optimizers())
    step, samples, tokens = _sample_step(module, data, batch_size)
    with warnings.catch_warnings():  # self.log outside a Trainer
        warnings.simplefilter("ignore")
        return measure_model(module, step, samples, optimizer, optimizer_kind(optimizer), tokens, repeats)


def _measured(target: str, kwargs: dict, args: argparse.Namespace, threads_of: Optional[int]) -> ModelCost:
    """``model_cost``, timed with the threads Lightning gives each of ``threads_of`` processes (None: as
    now); the thread count and ``OMP_NUM_THREADS`` are put back after."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        if threads_of is not None:
            _set_num_threads_if_needed(num_processes=threads_of)
        return model_cost(target, kwargs, args.data, 8, args.repeats)
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def _bytes(value: float) -> str:
    return f"{value / GIB:.3g} GiB" if value >= GIB else f"{value / MIB:.4g} MiB"


def format_plan(plan: Plan, top: int, tokens_per_sample: int = 1, reasons: int = 12) -> str:
    """The ranked table (``top`` rows) and the excluded layouts, grouped by reason."""
    rate = "tokens/s" if tokens_per_sample > 1 else "samples/s"
    head = ["#", "layout", "step ms", rate, "bubble", "dp exposed ms", "peak/rank", "states", "activations"]
    rows = [head] + [
        [
            str(i + 1),
            p.layout.name(),
            f"{p.step_s * 1e3:.4g}",
            f"{p.samples_per_s * tokens_per_sample:.4g}",
            f"{p.bubble:.1%}",
            f"{p.data_parallel_s * 1e3:.3g}",
            _bytes(p.peak_bytes),
            _bytes(p.states.total),
            _bytes(p.activation_bytes),
        ]
        for i, p in enumerate(plan.ranked[:top])
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        " | ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    out = [f"{len(plan.ranked)} layouts predicted, fastest first (top {min(top, len(plan.ranked))}):", *lines]
    kinds = Counter(e.kind for e in plan.excluded)
    out += ["", f"{len(plan.excluded)} excluded: " + ", ".join(f"{n} {k}" for k, n in kinds.items())]
    by_reason: dict[str, list[str]] = {}  # each layout under its first problem
    for e in plan.excluded:
        key = e.problems[0] if e.kind != NO_FIT else NO_FIT
        by_reason.setdefault(key, []).append(e.layout.name() + (f" ({e.reason})" if e.kind == NO_FIT else ""))
    for reason, names in list(by_reason.items())[:reasons]:
        shown = "; ".join(names[:3]) + (f"; and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"  - {reason}: {shown}")
    if len(by_reason) > reasons:
        out.append(f"  ... and {len(by_reason) - reasons} more reasons")
    return "\n".join(out)


def _arguments(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.planner", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "module", nargs="?", help="package.module:LightningModule (default: the embedded CharGPT)"
    )
    parser.add_argument("--devices", type=int, required=True, help="processes (devices) to plan for")
    parser.add_argument("--cluster", help="a cluster YAML, or a shipped one: cpu_2core, h100_8x, h100_64x8")
    parser.add_argument("--memory-gb", type=float, help="memory per device in GiB (default: the cluster's)")
    parser.add_argument(
        "--global-batch", type=int, help="samples per step over all replicas (default 8 x devices)"
    )
    parser.add_argument("--kwargs", default=None, help="the module's constructor arguments as JSON")
    parser.add_argument(
        "--data", help="package.module:LightningDataModule whose first training batch is timed"
    )
    parser.add_argument(
        "--precision", default="32-true", help="Lightning precision of the states (or 'paper')"
    )
    parser.add_argument(
        "--timing", choices=("measured", "flops"), help="block times: measured here, or FLOPs"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timings per block (the median is kept)")
    parser.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    parser.add_argument("--output", help="write the best layout's lp-train overrides to this file")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = _arguments(argv)
    if args.devices < 1:
        raise SystemExit(f"--devices must be a positive number of devices, got {args.devices}")
    if args.cluster is None:  # this machine: the CPU box's figures, one process per device
        cluster = dataclasses.replace(Cluster.load("cpu_2core"), devices_per_node=args.devices)
    else:
        cluster = Cluster.load(args.cluster)
    target, kwargs = (args.module, {}) if args.module else EMBEDDED
    kwargs = {**kwargs, **json.loads(args.kwargs)} if args.kwargs else kwargs
    global_batch = args.global_batch or 8 * args.devices
    timing = args.timing or ("measured" if cluster.name.startswith("cpu") else "flops")
    cost = _measured(target, kwargs, args, threads_of=args.devices if timing == "measured" else None)
    if timing == "flops":
        cost = flop_times(cost, cluster.flops)
    memory = args.memory_gb * GIB if args.memory_gb else None
    plan = plan_layouts(cost, cluster, args.devices, global_batch, memory, args.precision)
    print(
        f"Planning {cost.name} on {args.devices} of {cluster.name} ({cluster.nodes} x {cluster.devices_per_node}), "
        f"global batch {global_batch}, block times {timing}"
    )
    print(format_plan(plan, args.top, cost.tokens_per_sample))
    if not plan.ranked:
        print("No layout fits: raise --memory-gb, lower --global-batch, or add devices.")
        return 1
    nodes = max(1, args.devices // cluster.devices_per_node)
    line = " ".join(plan.ranked[0].layout.overrides(nodes))
    print(f"\nBest layout: {plan.ranked[0].layout.name()}\n  lp-train {line}")
    if args.output:
        with open(args.output, "w") as f:
            f.write(line + "\n")
        print(f"  (written to {args.output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
