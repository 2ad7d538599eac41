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
import json
import sys
from collections import Counter
from typing import Optional

from lightning_parallel.planner.layouts import NO_FIT, Plan, plan_layouts
from lightning_parallel.planner.measure import flop_times
from lightning_parallel.planner.planning import (
    cluster_for,
    is_this_machine,
    model_cost,
    tensor_parallel_sizes,
    threads_of,
)

__all__ = ["main", "format_plan", "EMBEDDED"]

#: the model planned when no module is given: lp-train's default (conf/model/char_gpt.yaml) with 8 blocks
EMBEDDED = ("lightning_parallel.models.gpt:CharGPT", {"n_layer": 8, "n_embd": 128, "block_size": 64})
GIB, MIB = 2**30, 2**20


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
    parser.add_argument(
        "--cluster",
        help="a cluster YAML (a calibration's: planner.calibration_run), or a shipped one: cpu_2core, "
        "h100_8x, h100_64x8",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate this machine over --devices processes first and plan on its figures",
    )
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
    try:
        cluster = cluster_for(args.cluster, args.devices, args.calibrate)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    target, kwargs = (args.module, {}) if args.module else EMBEDDED
    kwargs = {**kwargs, **json.loads(args.kwargs)} if args.kwargs else kwargs
    global_batch = args.global_batch or 8 * args.devices
    timing = args.timing or ("measured" if is_this_machine(cluster) else "flops")
    measured = timing == "measured"
    with threads_of(args.devices if measured else None):
        sizes = tensor_parallel_sizes(args.devices) if measured else ()
        cost = model_cost(target, kwargs, args.data, 8, args.repeats, sizes)
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
