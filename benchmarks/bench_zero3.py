"""ZeRO-3 (``zero_stage=3`` of ``lp_ddp``) vs FSDP2 under Lightning's ``ModelParallelStrategy``, and vs ZeRO-0/1/2.

    python benchmarks/bench_zero3.py                       # 2 and 4 CPU processes (gloo), width 768 x 4 layers
    python benchmarks/bench_zero3.py --world-sizes 4 --layers 8 --rounds 2
    python benchmarks/bench_zero3.py --tiny                # seconds: a check that every side runs
    python benchmarks/bench_zero3.py --gpu                 # one rank per GPU, NCCL, bf16-mixed (needs >= 2 GPUs)

Every side is a real ``Trainer.fit`` of the same ``CharGPT`` (AdamW, float32 states) on the embedded corpus,
same batch, steps and seed, under torchrun, one thread per process. Stage 3 builds it on meta
(``trainer.init_module(empty_init=True)``: each rank materialises only its shard of each unit, from the
modules' own initializers, so its initial weights, and loss, differ from the others'), as a user who wants
its memory saving would; the other sides hold the whole model anyway and build it as Lightning does by
default (real tensors, before ``fit``). The criterion on the peak at dp=4 wants a model whose states
dominate: ``--layers 32 --width 512 --batch-size 1`` (docs/benchmarks.md).

- ``zero0`` .. ``zero3``: ``lp_ddp`` with ``zero_stage`` 0-3; ``zero3_keep``: stage 3 with
  ``reshard_after_forward=False`` (each block kept gathered from its forward to its backward);
  ``zero3_heap``: stage 3 with ``release_host_memory=False`` (glibc's heap policy left as it is);
- ``fsdp2`` / ``fsdp2_keep``: Lightning's ``ModelParallelStrategy(data_parallel_size=N,
  tensor_parallel_size=1)`` with ``fully_shard`` written in ``configure_model`` as Lightning's docs write it:
  one call per ``Block`` on the mesh's data-parallel dimension, then one on the whole model
  (``reshard_after_forward`` True / False on the blocks);
- named only with ``--configs`` (4 processes): ``dp2xtp2_zero0``-``2`` and ``dp2xpp2_zero0``-``2``,
  ``lp_parallel`` at dp2 x tp2 and dp2 x pp2 (1F1B), for the table of the memory report's expected column
  against what it measures (every run's, printed last). ``--bucket-cap-mb``: lp_ddp's gradient buckets.

Memory per rank comes from ``lightning_parallel.MemoryReport`` as a callback at the end of ``fit`` (between
steps: unique storages of the parameters, gradients and what the strategy holds besides, the optimizer
state, the formulas' expected p+g+o, the peak of the saved activations) and the process's peak resident
memory (``VmHWM``). ``base`` is each process's resident memory after its imports and the data, before the
model is built (torch, Lightning, gloo: the runtime), so ``peak - base`` is what training added. Step time:
the median of a run's steps after the warm-up, then the median over rounds (configurations interleaved,
reversed every other round); ratios are medians of each round's own ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUIET_TRAINER,
    append_record,
    benchmark_parser,
    end_worker,
    interleaved,
    median_of,
    median_ratio,
    read_records,
    step_timer,
    torchrun,
    worker_args,
)

#: configuration -> (strategy, zero_stage, reshard_after_forward, release_host_memory)
CONFIGS = {
    "zero0": ("lp_ddp", 0, True, True),
    "zero1": ("lp_ddp", 1, True, True),
    "zero2": ("lp_ddp", 2, True, True),
    "zero3": ("lp_ddp", 3, True, True),
    "zero3_heap": ("lp_ddp", 3, True, False),
    "zero3_keep": ("lp_ddp", 3, False, True),
    "fsdp2": ("fsdp2", 3, True, True),
    "fsdp2_keep": ("fsdp2", 3, False, True),
}
#: layouts of 4 processes for the memory report's expected column against what it measures (named with
#: ``--configs``): configuration -> (tensor-parallel size, pipeline-parallel size, zero_stage), dp = 2
LAYOUTS = {
    f"dp2x{axis}2_zero{z}": (2 if axis == "tp" else 1, 2 if axis == "pp" else 1, z)
    for axis in ("tp", "pp")
    for z in (0, 1, 2)
}
#: the sizes and run lengths of ``--tiny`` (a check that every side runs, in seconds) and ``--gpu``
TINY = dict(width=32, layers=2, heads=2, block_size=16, batch_size=2, steps=3, warmup=1, rounds=1)
GPU = dict(width=2048, layers=8, heads=16, block_size=1024, batch_size=4)
MODEL_ARGS = (
    "batch_size",
    "block_size",
    "layers",
    "width",
    "heads",
    "precision",
    "accelerator",
    "bucket_cap_mb",
)
MIB = 2**20
STATES = ("parameters", "gradients", "optimizer_state")


def build_model(config: str, args: argparse.Namespace):
    """CharGPT; for the FSDP2 sides a subclass whose ``configure_model`` calls ``fully_shard`` per block and
    on the whole model (Lightning's docs: "Train models with billions of parameters", FSDP2)."""
    from lightning_parallel.models import CharGPT

    keep = config in CONFIGS and not CONFIGS[config][2]

    class FullyShardedCharGPT(CharGPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
            fully_shard(self.model, mesh=mesh)

    cls = FullyShardedCharGPT if config in ("fsdp2", "fsdp2_keep") else CharGPT
    return cls(n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.block_size)


def builds_on_meta(config: str) -> bool:
    """Whether a side builds its model on the meta device, as its users would for the memory saving: stage
    3 under ``trainer.init_module(empty_init=True)`` (each rank then materialises only its shard of each
    unit); the other sides hold the whole model anyway, and are built as Lightning builds by default (real
    tensors, before ``fit``)."""
    return config in CONFIGS and CONFIGS[config][0] == "lp_ddp" and CONFIGS[config][1] == 3


def build_strategy(config: str, world_size: int, bucket_cap_mb: float = 25):
    from lightning.pytorch.strategies import ModelParallelStrategy

    import lightning_parallel as lp

    if config in LAYOUTS:
        tp, pp, stage = LAYOUTS[config]
        return lp.ParallelStrategy(
            data_parallel_size=2,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            zero_stage=stage,
            num_microbatches=2,
        )
    name, stage, reshard, release = CONFIGS[config]
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    return lp.DDPStrategy(
        zero_stage=stage,
        reshard_after_forward=reshard,
        release_host_memory=release,
        bucket_cap_mb=bucket_cap_mb,
    )


def unit_size():
    """A callback reading, at the end of training (before teardown drops the units), the largest unit's
    gathered parameters in bytes (``zero_stage=3``; else 0): the allowance the memory criterion gives stage
    3 above 1/dp of stage 0's states."""
    from lightning.pytorch import Callback

    class UnitSize(Callback):
        largest = 0

        def on_train_end(self, trainer, pl_module) -> None:
            sharded = getattr(trainer.strategy, "sharded_parameters", None)
            units = sharded.units() if sharded is not None else []
            self.largest = max((u.full.numel() * u.full.element_size() for u in units), default=0)

    return UnitSize()


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    import lightning_parallel as lp
    from lightning_parallel.data import CharCorpusData
    from lightning_parallel.memory.accounting import rss_bytes

    torch.set_num_threads(1)
    seed_everything(0)
    data = CharCorpusData(batch_size=args.batch_size, block_size=args.block_size)
    base = rss_bytes() or 0
    timer, report, units = step_timer(), lp.MemoryReport(), unit_size()
    strategy = build_strategy(args.config, args.world_size, args.bucket_cap_mb)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.world_size,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[timer, report, units],
    )
    if builds_on_meta(args.config):
        with trainer.init_module(empty_init=True):
            model = build_model(args.config, args)
    else:
        model = build_model(args.config, args)
    trainer.fit(model, datamodule=data)
    bases: list = [None] * args.world_size
    torch.distributed.all_gather_object(bases, base)
    if trainer.is_global_zero:
        append_record(args.out, fit_record(args, trainer, timer, report, units, bases))


def fit_record(args: argparse.Namespace, trainer, timer, report, units, bases: list) -> dict:
    """Rank 0's record of one fit: step and CPU times, and every rank's memory rows."""
    import statistics

    rows = report.summary()["end_of_fit"]
    record = {
        "config": args.config,
        "world_size": args.world_size,
        "round": args.round,
        "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
        "cpu_ms": statistics.median(timer.cpu_times[args.warmup :]) * 1e3,
        "step_faults": statistics.median(timer.faults[args.warmup :]),
        "model_parameters": rows[0]["model_parameters"],
        "largest_unit": units.largest,
        "base_rss": bases,
        "final_loss": float(trainer.callback_metrics["train_loss"]),
    }
    for name in (*STATES, "expected_states", "activations", "setup_peak", "peak_rss", "cuda_max_allocated"):
        record[name] = [row[name] for row in rows]
    return record


def peak(record: dict, args: argparse.Namespace) -> float:
    """The largest rank's peak memory that training added: the CUDA allocator's peak on a GPU, else the peak
    resident memory minus the process's runtime before the model was built (``base_rss``)."""
    if record["cuda_max_allocated"][0] is not None:
        return max(record["cuda_max_allocated"])
    return max(p - b for p, b in zip(record["peak_rss"], record["base_rss"]))


def peak_of(records: list[dict], config: str, world_size: int, args: argparse.Namespace) -> float:
    """``peak`` of ``config`` at ``world_size``, the median over rounds (nan where it did not run)."""
    mine = [
        dict(r, v=peak(r, args)) for r in records if r["config"] == config and r["world_size"] == world_size
    ]
    return median_of(mine, "v")


def report(records: list[dict], args: argparse.Namespace) -> None:
    device = "GPU (CUDA allocator peak)" if args.gpu else "CPU, gloo, one thread per process"
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}), AdamW, {args.precision}, "
        f"batch {args.batch_size} x {args.block_size} tokens per process, {args.steps} steps "
        f"({args.warmup} warm-up), median of {args.rounds} round(s), {device}\n"
    )
    print(
        "| processes | configuration | step ms | CPU ms | / zero1 | / fsdp2 | MiB per rank: parameters | gradients "
        "| optimizer | expected p+g+o | activations | peak RSS | runtime base | peak - base | / zero1 | / fsdp2 "
        "| final loss |"
    )
    print("|" + "---|" * 17)
    for world_size in args.world_sizes:
        for config in (c for c in CONFIGS if c in args.configs):
            mine = [r for r in records if r["config"] == config and r["world_size"] == world_size]
            if not mine:
                continue
            last = mine[-1]  # the tensors are the same every round; memory peaks: the median over rounds
            fsdp = "fsdp2" if CONFIGS[config][2] else "fsdp2_keep"
            me = {"config": config, "world_size": world_size}
            step_ratios = [median_ratio(records, "step_ms", me, dict(me, config=o)) for o in ("zero1", fsdp)]
            mine_peak = peak_of(records, config, world_size, args)
            others = {o: peak_of(records, o, world_size, args) for o in ("zero1", fsdp)}
            states = " | ".join("/".join(f"{v / MIB:.1f}" for v in sorted(set(last[n]))) for n in STATES)
            expected = last["expected_states"][0]
            cells = [
                f"{median_of(mine, 'step_ms'):.0f}",
                f"{median_of(mine, 'cpu_ms'):.0f}",
                *(f"{x:.3f}" for x in step_ratios),
                states,
                "-" if expected is None else f"{max(last['expected_states']) / MIB:.1f}",
                f"{max(last['activations']) / MIB:.1f}",
                f"{median_of([dict(r, v=max(r['peak_rss'])) for r in mine], 'v') / MIB:.0f}",
                f"{max(last['base_rss']) / MIB:.0f}",
                f"{mine_peak / MIB:.0f}",
                *(f"{mine_peak / others[o]:.3f}" for o in ("zero1", fsdp)),
                f"{median_of(mine, 'final_loss'):.4f}",
            ]
            print(f"| {world_size} | {config} | " + " | ".join(cells) + " |")
    criteria(records, args)
    expected_table(records)


def expected_table(records: list[dict]) -> None:
    """Every run's parameters + gradients + optimizer state per rank against the memory report's expected
    column (the ZeRO paper's formulas over the rank's share), the last round's."""
    print(
        "\n| processes | configuration | p+g+o per rank, MiB (measured) | expected, MiB | measured / expected |"
    )
    print("|" + "---|" * 5)
    last = {(r["world_size"], r["config"]): r for r in records}
    for (world_size, config), r in sorted(last.items()):
        held = [sum(r[n][i] for n in STATES) for i in range(world_size)]
        if r["expected_states"][0] is None:
            continue
        ratios = [h / e for h, e in zip(held, r["expected_states"])]
        spread = lambda xs, f: "/".join(sorted({f(x) for x in xs}))  # noqa: E731
        print(
            f"| {world_size} | {config} | {spread(held, lambda x: f'{x / MIB:.2f}')} | "
            f"{spread(r['expected_states'], lambda x: f'{x / MIB:.2f}')} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} |"
        )


def criteria(records: list[dict], args: argparse.Namespace) -> None:
    """Issue 45's memory criteria, per world size: stage 3's parameters, gradients and optimizer state each
    against 1/dp of stage 0's (plus the largest unit, which the criterion allows), and its peak against
    ZeRO-1's."""
    print(
        "\n| processes | configuration | parameters x dp / zero0 | gradients x dp / zero0 | optimizer x dp / zero0 "
        "| largest unit MiB | peak - base / zero1's | peak RSS / zero1's |"
    )
    print("|" + "---|" * 8)
    for world_size in args.world_sizes:
        found = {
            c: [r for r in records if r["config"] == c and r["world_size"] == world_size] for c in CONFIGS
        }
        for config in ("zero3", "zero3_heap", "zero3_keep"):
            if not (found[config] and found["zero0"] and found["zero1"]):
                continue
            mine, zero0 = found[config][-1], found["zero0"][-1]
            share = [max(mine[n]) * world_size / max(zero0[n]) for n in STATES]
            peaks = [peak_of(records, c, world_size, args) for c in (config, "zero1")]
            rss = [
                median_of([dict(r, v=max(r["peak_rss"])) for r in found[c]], "v") for c in (config, "zero1")
            ]
            print(
                f"| {world_size} | {config} | "
                + " | ".join(f"{s:.3f}" for s in share)
                + f" | {mine['largest_unit'] / MIB:.1f} | {peaks[0] / peaks[1]:.3f} | {rss[0] / rss[1]:.3f} |"
            )


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, with ``--tiny``'s or ``--gpu``'s sizes as defaults under what it says."""
    parser = benchmark_parser(__doc__, rounds=1, steps=8, warmup=3)
    parser.add_argument("--config", default="zero3", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=[*CONFIGS, *LAYOUTS])
    parser.add_argument("--batch-size", type=int, default=2, help="per process")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25, help="lp_ddp's gradient buckets (stages 0-2)"
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, a few steps: every side runs")
    parser.add_argument("--gpu", action="store_true", help="CUDA, NCCL, bf16-mixed, a larger model")
    mode = parser.parse_args(argv)
    if mode.tiny:
        parser.set_defaults(**TINY)
    if mode.gpu:
        parser.set_defaults(**GPU, accelerator="cuda", precision="bf16-mixed")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """Every configuration at every world size, interleaved over rounds: rank 0's record of each fit."""
    if args.gpu:
        import torch

        if torch.cuda.device_count() < max(args.world_sizes):
            raise SystemExit(
                f"--gpu runs one process per GPU (NCCL refuses two on one); {torch.cuda.device_count()} GPU(s) "
                f"here, --world-sizes {args.world_sizes}: pass --world-sizes up to the GPU count"
            )
    args.out = Path(tempfile.mkdtemp()) / "results.jsonl"
    configs = [c for c in [*CONFIGS, *LAYOUTS] if c in args.configs]
    for round_, config in interleaved(args.rounds, configs):
        for world_size in args.world_sizes:
            line = [*worker_args(args, MODEL_ARGS), "--config", config, "--world-size", str(world_size)]
            torchrun(__file__, world_size, [*line, "--round", str(round_)])
            done = f"round {round_ + 1}/{args.rounds}: {config} x{world_size} done"
            print(done, file=sys.stderr, flush=True)
    print(f"records: {args.out}", file=sys.stderr)
    return read_records(args.out)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        end_worker()
    report(run(args), args)


if __name__ == "__main__":
    main()
