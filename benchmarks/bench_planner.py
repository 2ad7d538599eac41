"""The layout planner's accuracy: its predicted step time and peak memory per rank beside a real run's.

    python benchmarks/bench_planner.py                 # 17 layouts of 2 to 8 processes, CharGPT 8 x 128
    python benchmarks/bench_planner.py --tiny          # 2 layouts of 2 processes, a 2-block model: seconds
    python benchmarks/bench_planner.py --layouts "dp2 tp1 pp1" "dp1 tp1 pp2 1f1b m4"   # a subset, by name
    python benchmarks/bench_planner.py --steps 20 --warmup 5 --json out.json
    python benchmarks/bench_planner.py --records runs.jsonl --cost cost.json   # re-predict saved runs
    python benchmarks/bench_planner.py --calibrate box.yaml   # predicted on this box calibrated now

For each layout (``LAYOUTS``: DDP, ZeRO 1, 2 and 3, tensor parallelism with and without sequence
parallelism, each pipeline schedule, 2-D and 3-D, full recompute), the benchmark puts beside each other:

- **predicted**: ``planner.cost_model.predict`` of the layout on this machine (``cpu_2core``'s cluster
  file, or with ``--calibrate`` the box calibrated at the start; one process per device, the devices
  sharing its cores), from a ``ModelCost`` measured in this process the way the planner's command
  measures it (``planner.command.model_cost``: each block timed alone on its captured inputs in CPU time,
  on the batch and a quarter of it, and on tp2's shard, its saved activations counted; one thread, as
  each worker has): made again just before each layout runs and kept in its record (``--profile each``,
  the default, as ``lp-train strategy=auto`` profiles and then trains), or the one made at the start
  (``--profile once``), or read with ``--cost``. The ranking always uses the one made at the start;
- **measured**: a real ``Trainer.fit`` of the same ``CharGPT`` on the embedded corpus under torchrun (gloo,
  one thread per process), ``lp_ddp`` for the layouts without model parallelism (ZeRO 3 is lp_ddp's),
  ``lp_parallel`` (``Layout.strategy_options``) for the others.

**Step time** is the median of a run's steps after ``--warmup`` steps, on rank 0, from the start of a
training batch to its end (``common.step_timer``: forward, backward, the data-parallel collectives and
the optimizer step; under pipeline stages the whole schedule, which every stage runs in step).

**Peak memory per rank** is the memory report's (``lightning_parallel.MemoryReport``, at the end of
``fit``): a rank's parameters + gradients + optimizer state (unique storages, the strategy's buckets and
shards included) + its peak of the activations autograd kept saved in a step, and of the ranks the
largest. The cost model's figure is the same sum: ``memory.expected``'s model states of the busiest rank
plus its activations (``Prediction.states.total + Prediction.activation_bytes``; its ``peak_bytes`` adds
ZeRO-3's gathered parameters of a unit and the one prefetched, which the report does not see: its
parameters column reads the shards between steps). Neither counts the process's interpreter, libraries
or allocator slack (the report's RSS columns), so the memory side does not depend on the machine's load.

The table prints the absolute % errors and their medians, and the layout ranked first by prediction
against the fastest measured one (how much slower it measured). After the runs the blocks are timed again
(``drift``): how far the machine's speed moved between the profile the predictions used and the runs' end.
On a machine shared with other jobs the step times measure the load, not the model; the memory does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET_TRAINER, append_record, end_worker, read_records, step_timer, torchrun  # noqa: E402

from lightning_parallel.planner.layout import Layout  # noqa: E402

MIB = 2**20

#: the model planned and run: CharGPT (lp-train's default model) at 8 blocks of width 128, block size 64
MODEL = {"n_layer": 8, "n_embd": 128, "n_head": 4, "block_size": 64}
TINY_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16}
GLOBAL_BATCH, TINY_BATCH = 16, 8


def _layout(dp: int, tp: int, pp: int, **options: Any) -> Layout:
    return Layout(dp, tp, pp, GLOBAL_BATCH, **options)


def _pipe(schedule: str, dp: int = 1, tp: int = 1, pp: int = 2, m: int = 4, **options: Any) -> Layout:
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    return _layout(dp, tp, pp, schedule=schedule, num_microbatches=m, virtual_stages=v, **options)


#: the measured layouts: every axis, schedule, ZeRO stage and recompute, 2 to 8 processes
LAYOUTS = [
    _layout(2, 1, 1),
    _layout(2, 1, 1, zero_stage=1),
    _layout(2, 1, 1, zero_stage=2),
    _layout(2, 1, 1, zero_stage=3),
    _layout(2, 1, 1, recompute=True),
    _layout(4, 1, 1),
    _layout(1, 2, 1),
    _layout(1, 2, 1, sequence_parallel=True),
    _pipe("1f1b"),
    _pipe("gpipe"),
    _pipe("zb_h1"),
    _pipe("interleaved_1f1b"),
    _pipe("zbv"),
    _pipe("1f1b", recompute=True),
    _layout(2, 2, 1),
    _pipe("1f1b", dp=2),
    _pipe("1f1b", dp=2, tp=2),
]
TINY_LAYOUTS = [
    Layout(2, 1, 1, TINY_BATCH),
    Layout(1, 1, 2, TINY_BATCH, schedule="1f1b", num_microbatches=2),
]


def build_strategy(layout: Layout) -> Any:
    """``lp_ddp`` (ZeRO 0-3, recompute) where the layout has no model parallelism, else ``lp_parallel``."""
    import lightning_parallel as lp

    options = layout.strategy_options()
    if layout.tp == layout.pp == 1:
        return lp.DDPStrategy(
            zero_stage=layout.zero_stage, activation_checkpointing=layout.recompute, failure_timeout=300
        )
    return lp.ParallelStrategy(**options, failure_timeout=300)


def worker(args: argparse.Namespace) -> None:
    """One layout's ``Trainer.fit``; rank 0 appends its step times and every rank's memory row."""
    import torch
    from lightning.pytorch import Trainer, seed_everything

    import lightning_parallel as lp
    from lightning_parallel.data import CharCorpusData
    from lightning_parallel.models.gpt import CharGPT

    torch.set_num_threads(1)
    seed_everything(0)
    layout = Layout(**json.loads(args.layout))
    shape = json.loads(args.model)
    timer, report = step_timer(), lp.MemoryReport()
    trainer = Trainer(
        accelerator="cpu",
        devices=layout.devices,
        strategy=build_strategy(layout),
        max_steps=args.warmup + args.steps,
        callbacks=[timer, report],
        **QUIET_TRAINER,
    )
    data = CharCorpusData(
        batch_size=layout.global_batch // layout.dp, block_size=shape["block_size"], max_chars=200_000
    )
    trainer.fit(CharGPT(**shape), datamodule=data)
    rows = report.summary()["end_of_fit"]
    if trainer.is_global_zero:
        append_record(
            args.out,
            {
                "layout": layout.name(),
                "step_s": statistics.median(timer.times[args.warmup :]),
                "rows": [
                    {k: r[k] for k in ("rank", "parameters", "gradients", "optimizer_state", "activations")}
                    for r in rows
                ],
                **({"cost": json.loads(args.run_cost)} if args.run_cost else {}),
            },
        )


def measured_peak(rows: list[dict]) -> tuple[int, dict]:
    """The largest rank's parameters + gradients + optimizer state + peak saved activations, and its row."""
    total = lambda r: r["parameters"] + r["gradients"] + r["optimizer_state"] + r["activations"]  # noqa: E731
    busiest = max(rows, key=total)
    return total(busiest), busiest


def measure_cost(layouts: list[Layout], shape: dict, global_batch: int, saved: Optional[str] = None) -> Any:
    """The model's ``ModelCost`` measured here (one thread, as a worker has; each tensor-parallel size of
    ``layouts`` timed on one rank's shard), or read from ``saved`` where that file exists (else written
    there): the step times of ``--records`` re-predicted against the block times of one quiet moment."""
    import torch

    from lightning_parallel.planner.command import EMBEDDED, model_cost

    if saved and Path(saved).is_file():
        return cost_from_dict(json.loads(Path(saved).read_text()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = sorted({layout.tp for layout in layouts if layout.tp > 1})
        cost = model_cost(EMBEDDED[0], shape, None, global_batch // 2, repeats=5, tensor_parallel=sizes)
    finally:
        torch.set_num_threads(threads)
    if saved:
        Path(saved).write_text(json.dumps(dataclasses.asdict(cost), indent=1))
    return cost


def cost_from_dict(values: dict) -> Any:
    """The ``ModelCost`` that ``dataclasses.asdict`` wrote (a ``--cost`` file, a record's ``cost``)."""
    from lightning_parallel.planner.cost_model import BlockCost, ModelCost

    values = dict(values)
    def pairs(fields: dict, names: tuple[str, ...]) -> dict:  # JSON's lists back to the tuples of pairs
        return {**fields, **{k: tuple(map(tuple, fields[k])) for k in names if k in fields}}

    blocks = [BlockCost(**pairs(b, ("tp_s", "tp_calls"))) for b in values.pop("blocks")]
    return ModelCost(blocks=blocks, **pairs(values, ("other_tp_s", "other_tp_calls")))


def this_box(calibrated: Optional[str] = None) -> Any:
    """The cluster the layouts are predicted on: ``cpu_2core``'s file, or with ``calibrated`` this box
    calibrated now over 2 processes (``planner.calibration_run``, as ``lp-train strategy=auto
    planner.calibrate=true`` does) and written there, or read from there where that file exists."""
    from lightning_parallel.planner.calibration_run import calibrate_here
    from lightning_parallel.planner.cluster import Cluster

    if calibrated is None:
        return Cluster.load("cpu_2core")
    if Path(calibrated).is_file():
        return Cluster.load(calibrated)
    return calibrate_here(2, output=calibrated)


def predict_on(machine: Any, cost: Any, layout: Layout) -> Any:
    """``layout`` predicted on ``machine`` (its processes all on this box, sharing its cores)."""
    from lightning_parallel.planner.cost_model import predict

    cluster = dataclasses.replace(machine, devices_per_node=max(layout.devices, machine.devices_per_node))
    return predict(cost, layout, cluster)


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def table(
    layouts: list[Layout], planned: list[Any], records: list[dict], machine: Any, fixed_cost: bool = False
) -> tuple[str, dict]:
    """The comparison table and its summary figures (medians, ranked first vs fastest measured).

    ``planned``: each layout predicted from one profile, the planner's own (its ranking). The error
    columns compare each run with its layout predicted from the profile taken just before that run, as
    ``lp-train strategy=auto`` plans and then trains (a record's ``cost``), or with ``fixed_cost`` (or no
    such profile) the planned prediction."""
    found = {r["layout"]: r for r in records}
    predicted = [
        p if fixed_cost or "cost" not in found.get(layout.name(), {}) else
        predict_on(machine, cost_from_dict(found[layout.name()]["cost"]), layout)
        for layout, p in zip(layouts, planned)
    ]
    head = (
        "| layout | processes | predicted step | measured step | error | predicted peak/rank | measured "
        "peak/rank | error | predicted p+g+o | measured p+g+o | predicted act. | measured act. |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows, time_errors, memory_errors = [], [], []
    for layout, p, first_p in zip(layouts, predicted, planned):
        record = found.get(layout.name())
        if record is None:
            lines.append(f"| {layout.name()} | {layout.devices} | {p.step_s * 1e3:.0f} ms | (failed) |")
            continue
        peak, busiest = measured_peak(record["rows"])
        states = busiest["parameters"] + busiest["gradients"] + busiest["optimizer_state"]
        predicted_peak = p.states.total + p.activation_bytes  # what the report counts (no gathered units)
        te, me = _error(p.step_s, record["step_s"]), _error(predicted_peak, peak)
        time_errors.append(te)
        memory_errors.append(me)
        rows.append((layout.name(), first_p.step_s, record["step_s"]))
        lines.append(
            f"| {layout.name()} | {layout.devices} | {p.step_s * 1e3:.0f} ms | {record['step_s'] * 1e3:.0f} ms "
            f"| {te:.1%} | {predicted_peak / MIB:.2f} MiB | {peak / MIB:.2f} MiB | {me:.1%} "
            f"| {p.states.total / MIB:.2f} MiB | {states / MIB:.2f} MiB "
            f"| {p.activation_bytes / MIB:.2f} MiB | {busiest['activations'] / MIB:.2f} MiB |"
        )
    summary: dict[str, Any] = {"layouts": len(rows)}
    if rows:
        first = min(rows, key=lambda r: r[1])
        fastest = min(rows, key=lambda r: r[2])
        summary.update(
            median_step_error=statistics.median(time_errors),
            median_memory_error=statistics.median(memory_errors),
            ranked_first=first[0],
            fastest_measured=fastest[0],
            ranked_first_slower_by=first[2] / fastest[2] - 1,
        )
        lines += [
            "",
            f"{len(rows)} layouts: median absolute error of the step time {summary['median_step_error']:.1%}, "
            f"of the peak memory per rank {summary['median_memory_error']:.1%}",
            f"ranked first by prediction: {first[0]} (measured {first[2] * 1e3:.0f} ms); fastest measured: "
            f"{fastest[0]} ({fastest[2] * 1e3:.0f} ms): {summary['ranked_first_slower_by']:.1%} slower",
        ]
    return "\n".join(lines), summary


def run(args: argparse.Namespace) -> dict:
    """Predict, run every layout, print the table; the summary figures and the records."""
    shape = TINY_MODEL if args.tiny else MODEL
    layouts = TINY_LAYOUTS if args.tiny else LAYOUTS
    if args.layouts:
        names = {layout.name(): layout for layout in layouts}
        unknown = [n for n in args.layouts if n not in names]
        if unknown:
            raise SystemExit(f"--layouts {unknown} are not among the benchmark's: {list(names)}")
        layouts = [names[n] for n in args.layouts]
    global_batch = layouts[0].global_batch
    machine = this_box(args.calibrate)
    cost = measure_cost(layouts, shape, global_batch, args.cost)
    planned = [predict_on(machine, cost, layout) for layout in layouts]
    out = Path(args.records) if args.records else Path(tempfile.mkdtemp()) / "results.jsonl"
    done = {r["layout"] for r in read_records(out)}
    for layout in [layout for layout in layouts if layout.name() not in done]:
        print(f"running {layout.name()} on {layout.devices} processes", flush=True)
        profile = measure_cost(layouts, shape, global_batch) if args.profile == "each" else cost
        line = ["--out", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        line += ["--layout", json.dumps(dataclasses.asdict(layout)), "--model", json.dumps(shape)]
        line += ["--run-cost", json.dumps(dataclasses.asdict(profile))]
        try:
            torchrun(__file__, layout.devices, line, timeout=args.timeout)
        except Exception as error:  # noqa: BLE001 - a failed layout is a row of the table, not the end
            print(f"  {layout.name()} failed: {str(error)[-1500:]}", flush=True)
    ran = len(done) < len(layouts)
    records = read_records(out)
    text, summary = table(layouts, planned, records, machine, fixed_cost=args.profile == "once")
    print(f"\n{cost.name}, global batch {global_batch}, {args.warmup} warm-up + {args.steps} timed steps\n")
    print(text)
    if ran and not args.tiny:
        summary["drift"] = drift(cost, measure_cost(layouts, shape, global_batch))
    result = {"summary": summary, "records": records, "predicted": _predicted_dicts(layouts, planned)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def drift(before: Any, after: Any) -> float:
    """How much slower the blocks timed after the runs were than those the predictions used (printed): on a
    shared machine its speed moves during the runs, and the step errors with it."""
    seconds = lambda cost: sum(b.forward_s + b.backward_s for b in cost.blocks)  # noqa: E731
    moved = seconds(after) / seconds(before) - 1
    print(
        f"the blocks timed again after the runs: {seconds(after) * 1e3:.0f} ms against "
        f"{seconds(before) * 1e3:.0f} ms for the predictions ({moved:+.1%}: the machine's speed moved by that much)"
    )
    return moved


def _predicted_dicts(layouts: list[Layout], predicted: list[Any]) -> list[dict]:
    return [
        {
            "layout": layout.name(),
            "step_s": p.step_s,
            "peak_bytes": p.peak_bytes,
            "states": p.states.total,
            "activations": p.activation_bytes,
            "gathered": p.gathered_bytes,
        }
        for layout, p in zip(layouts, predicted)
    ]


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--run-cost", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="2 layouts of 2 processes, a 2-block model")
    parser.add_argument("--layouts", nargs="+", help="layouts by name (Layout.name()), default all")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8, tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, tiny 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per layout")
    parser.add_argument("--json", help="write the summary, records and predictions here")
    parser.add_argument(
        "--records", help="the runs' JSON lines file: layouts already in it are not run again (predict only)"
    )
    parser.add_argument(
        "--cost",
        help="the measured ModelCost as JSON: read from this file where it exists, else measured and written",
    )
    parser.add_argument(
        "--profile",
        choices=("each", "once"),
        default="each",
        help="each (default): each run's step compared with its layout predicted from the model's profile "
        "taken just before that run, as lp-train strategy=auto profiles then trains; once: from the one "
        "profile the ranking uses (the only one where --records are re-predicted)",
    )
    parser.add_argument(
        "--calibrate",
        help="a cluster YAML: this box calibrated now and written there (read where that file exists); "
        "default: cpu_2core's file",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 3)
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        end_worker()
    else:
        run(args)


if __name__ == "__main__":
    main()
