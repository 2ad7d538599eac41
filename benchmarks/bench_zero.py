"""ZeRO (``zero_stage``) of ``lp_ddp`` vs torch's ``ZeroRedundancyOptimizer`` and FSDP ``SHARD_GRAD_OP``.

    python benchmarks/bench_zero.py                          # 2 CPU processes (gloo), 3 rounds
    python benchmarks/bench_zero.py --world-sizes 2 4 --rounds 5 --steps 20
    python benchmarks/bench_zero.py --collectives --steps 40    # the collectives alone, on the model's size

Every side is a real ``Trainer.fit`` of the same ``CharGPT`` (AdamW) on the embedded corpus, same batch,
steps and seed, under torchrun, one thread per process:

- ``ddp``: Lightning's ``ddp`` (torch DDP, ``gradient_as_bucket_view=True`` so that the gradients it
  holds are the buckets the memory report counts); ``lp_ddp``: ours, ``zero_stage=0``;
- ``lp_ddp_zero1`` (``zero_stage=1``) vs ``ddp_zero_redundancy``: Lightning's ``ddp`` with a
  ``configure_optimizers`` that returns ``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping AdamW;
- ``lp_ddp_zero2`` (``zero_stage=2``) vs ``fsdp_shard_grad_op``: Lightning's ``FSDPStrategy`` with
  ``sharding_strategy="SHARD_GRAD_OP"``, each ``Block`` its own FSDP unit. Lightning refuses FSDP without a
  GPU when the strategy is its own class (``accelerator_connector.py``: "requires a GPU accelerator");
  the check is ``type(strategy) is FSDPStrategy``, so the benchmark passes a subclass, and torch's FSDP
  itself runs on CPU tensors over gloo.

Each configuration's memory per rank comes from ``lightning_parallel.MemoryReport`` used as a callback
(the same counters under every strategy: unique storages of the parameters, their ``.grad`` and what the
strategy holds besides, every tensor in the optimizers' state, the process's peak resident memory) at
the end of ``fit``. Rounds run every configuration back to back, in reverse order every other round;
step times are the median of a run's steps after the warm-up, the table the median over rounds, the
ratios the median of the rounds' own ratios (``median_ratio``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUIET_TRAINER,
    append_record,
    benchmark_parser,
    end_worker,
    median_of,
    median_ratio,
    read_records,
    step_timer,
    torchrun,
)

#: configuration -> (strategy, zero_stage); the optimizer is AdamW in all of them
CONFIGS = {
    "ddp": ("ddp", 0),
    "lp_ddp": ("lp_ddp", 0),
    "lp_ddp_zero1": ("lp_ddp", 1),
    "ddp_zero_redundancy": ("ddp", 1),
    "lp_ddp_zero2": ("lp_ddp", 2),
    "fsdp_shard_grad_op": ("fsdp", 2),
}
#: (ours, theirs) compared by ratio
PAIRS = (("lp_ddp", "ddp"), ("lp_ddp_zero1", "ddp_zero_redundancy"), ("lp_ddp_zero2", "fsdp_shard_grad_op"))
MEMORY = ("parameters", "gradients", "optimizer_state", "peak_rss")
MIB = 2**20


def build_model(config: str, args: argparse.Namespace):
    """CharGPT; for ``ddp_zero_redundancy`` a subclass whose optimizer is torch's ZeroRedundancyOptimizer."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_parallel.models import CharGPT

    class ZeroRedundancyCharGPT(CharGPT):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            h = self.hparams
            return ZeroRedundancyOptimizer(
                self.parameters(), optimizer_class=torch.optim.AdamW, lr=h.lr, weight_decay=h.weight_decay
            )

    cls = ZeroRedundancyCharGPT if config == "ddp_zero_redundancy" else CharGPT
    return cls(n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.block_size)


def build_strategy(config: str, bucket_cap_mb: float):
    import torch
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    import lightning_parallel as lp
    from lightning_parallel.models.gpt import Block

    name, stage = CONFIGS[config]
    if name == "lp_ddp":
        return lp.DDPStrategy(zero_stage=stage, bucket_cap_mb=bucket_cap_mb)
    if name == "ddp":
        return DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's FSDP on CPU: a subclass, which the connector's GPU-only check (``type(...) is``) lets
        by, wrapping with ``device_id=cpu`` (Lightning passes the device index, None on CPU, and torch's FSDP
        then looks for an accelerator: "FSDP needs a non-CPU accelerator device")."""

        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel

            cpu = torch.device("cpu")
            return FullyShardedDataParallel(
                model, sharding_strategy=self.sharding_strategy, device_id=cpu, **self.kwargs
            )

    return CPUFSDPStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block})


def update_timer():
    """A callback timing each step from the end of its backward (``on_before_optimizer_step``) to the end of
    the batch: the optimizer's update and, with ZeRO, the parameters' all-gather (broadcasts for torch's
    ZeroRedundancyOptimizer)."""
    import time

    from lightning.pytorch import Callback

    class UpdateTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)

    return UpdateTimer()


def worker(args: argparse.Namespace) -> None:
    import statistics

    import torch
    from lightning.pytorch import Trainer, seed_everything

    import lightning_parallel as lp
    from lightning_parallel.data import CharCorpusData

    torch.set_num_threads(1)
    seed_everything(0)
    timer, update, report = step_timer(), update_timer(), lp.MemoryReport()
    model = build_model(args.config, args)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=build_strategy(args.config, args.bucket_cap_mb),
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[timer, update, report],
    )
    trainer.fit(model, datamodule=CharCorpusData(batch_size=args.batch_size, block_size=args.block_size))
    rows = report.summary()["end_of_fit"]
    if not trainer.is_global_zero:
        return
    step = statistics.median(timer.times[args.warmup :])
    record = {
        "config": args.config,
        "world_size": args.world_size,
        "round": args.round,
        "step_ms": step * 1e3,
        "update_ms": statistics.median(update.times[args.warmup :]) * 1e3,
        "samples_per_s": args.batch_size * args.world_size / step,
        "model_parameters": rows[0]["model_parameters"],
        "final_loss": float(trainer.callback_metrics["train_loss"]),
    }
    for name in (*MEMORY, "setup_peak", "rss", "activations"):
        record[name] = [row[name] for row in rows]
    append_record(args.out, record)


def collectives(args: argparse.Namespace) -> None:
    """The collectives of each side on a flat float32 tensor of the model's size, alone: the median time of a
    call and how much each rank's resident memory grew over ``--steps`` calls (the most of any rank)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from lightning_parallel.memory.accounting import rss_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    size = sum(p.numel() for p in build_model("lp_ddp", args).parameters()) // world
    full, part = torch.randn(size * world), torch.empty(size)
    calls = {
        "all_reduce (DDP)": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor (ZeRO, FSDP)": lambda: dist.reduce_scatter_tensor(part, full),
        "all_gather_into_tensor (ZeRO, FSDP)": lambda: dist.all_gather_into_tensor(full, part),
        "a broadcast from each rank (ZeroRedundancyOptimizer)": lambda: [
            dist.broadcast(full[i * size : (i + 1) * size], i) for i in range(world)
        ],
    }
    for name, call in calls.items():
        before, times = rss_bytes() or 0, []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        grown: list = [None] * world
        dist.all_gather_object(grown, (rss_bytes() or 0) - before)
        if dist.get_rank() == 0:
            ms = statistics.median(times[args.warmup :]) * 1e3
            append_record(
                args.out, {"collective": name, "world_size": world, "ms": ms, "rss_growth": max(grown)}
            )


def launch(config: str, world_size: int, round_: int, out: Path, args: argparse.Namespace) -> None:
    shared = ["--out", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for name in ("batch_size", "block_size", "layers", "width", "heads", "bucket_cap_mb"):
        shared += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    torchrun(
        __file__,
        world_size,
        ["--config", config, "--world-size", str(world_size), "--round", str(round_), *shared],
    )


def model_states(record: dict) -> float:
    """The largest rank's parameters + gradients + optimizer state, in bytes per parameter of the model."""
    per_rank = [sum(record[n][r] for n in MEMORY[:3]) for r in range(record["world_size"])]
    return max(per_rank) / (record["model_parameters"] / 4)  # float32


def report(records: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}, n_head={args.heads}), AdamW, batch "
        f"{args.batch_size} x {args.block_size} tokens per process, {args.steps} steps ({args.warmup} warm-up), "
        f"buckets {args.bucket_cap_mb:g} MB, median of {args.rounds} rounds, CPU, gloo, one thread per process\n"
    )
    print(
        "| processes | configuration | step ms | update ms | samples/s | MiB per rank: optimizer state "
        "| gradients | parameters | peak RSS (largest rank) | model states, bytes/parameter | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        for config in (c for c in CONFIGS if c in args.configs):
            mine = [r for r in records if r["config"] == config and r["world_size"] == world_size]
            if not mine:
                continue
            last = mine[-1]  # tensor sizes are the same in every round; peak RSS: the median over rounds
            mib = {n: "/".join(f"{v / MIB:.2f}" for v in last[n]) for n in MEMORY[:3]}
            rss = median_of([dict(r, rss=max(r["peak_rss"])) for r in mine], "rss") / MIB
            times = " | ".join(
                f"{median_of(mine, key):.1f}" for key in ("step_ms", "update_ms", "samples_per_s")
            )
            print(
                f"| {world_size} | {config} | {times} | {mib['optimizer_state']} | {mib['gradients']} | "
                f"{mib['parameters']} | {rss:.0f} | {model_states(last):.2f} | {median_of(mine, 'final_loss'):.4f} |"
            )
    print(
        "\n| processes | ours | theirs | step time theirs / ours (> 1: ours faster) | model states ours / theirs |"
    )
    print("|---|---|---|---|---|")
    for world_size in args.world_sizes:
        for ours, theirs in PAIRS:
            pair = [{"config": c, "world_size": world_size} for c in (theirs, ours)]
            ratio = median_ratio(records, "step_ms", *pair)
            last = {
                c: [r for r in records if r["config"] == c and r["world_size"] == world_size]
                for c in (ours, theirs)
            }
            if not all(last.values()):
                continue
            states = model_states(last[ours][-1]) / model_states(last[theirs][-1])
            print(f"| {world_size} | {ours} | {theirs} | {ratio:.3f} | {states:.3f} |")


#: (configuration, the one it is measured against) for the peak resident memory it saves per rank
SAVINGS = (("lp_ddp_zero1", "lp_ddp"), ("lp_ddp_zero2", "lp_ddp_zero1"))


def report_savings(records: list[dict], args: argparse.Namespace) -> None:
    """Each rank's peak resident memory (median over rounds) per configuration, and what a ZeRO stage saves
    of it against the stage below (the largest rank's peak there minus the largest rank's here), in MiB and
    bytes."""
    print(
        "\n| processes | configuration | peak RSS per rank, MiB | saved against | peak RSS saved (largest rank) |"
    )
    print("|---|---|---|---|---|")
    for world_size in args.world_sizes:
        peaks = {}
        for config in (c for c in CONFIGS if c in args.configs):
            mine = [r for r in records if r["config"] == config and r["world_size"] == world_size]
            if mine:
                ranks = range(world_size)
                peaks[config] = [median_of([dict(r, v=r["peak_rss"][i]) for r in mine], "v") for i in ranks]
        for config, below in SAVINGS:
            if config in peaks and below in peaks:
                saved = int(max(peaks[below]) - max(peaks[config]))
                ours, theirs = ("/".join(f"{v / MIB:.0f}" for v in peaks[c]) for c in (config, below))
                saving = f"{saved / MIB:.0f} MiB ({saved:,} bytes)"
                print(f"| {world_size} | {config} | {ours} | {below} ({theirs}) | {saving} |")


def time_collectives(args: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp()) / "collectives.jsonl"
    for world_size in args.world_sizes:
        launch("collectives", world_size, 0, out, args)
    print(f"\nflat float32 tensor of the model's size, {args.steps} calls ({args.warmup} warm-up), gloo\n")
    print("| processes | collective | ms per call (median) | resident memory growth, MiB (largest rank) |")
    print("|---|---|---|---|")
    for r in read_records(out):
        print(f"| {r['world_size']} | {r['collective']} | {r['ms']:.1f} | {r['rss_growth'] / MIB:.1f} |")


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=20, warmup=5)
    parser.add_argument("--config", default="lp_ddp", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25, help="gradient buckets of lp_ddp and torch DDP (both: 25)"
    )
    parser.add_argument(
        "--collectives", action="store_true", help="time the collectives alone on the model's size instead"
    )
    args = parser.parse_args()
    if args.worker:
        collectives(args) if args.config == "collectives" else worker(args)
        end_worker()
    if args.collectives:
        return time_collectives(args)

    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    configs = [c for c in CONFIGS if c in args.configs]
    for round_ in range(args.rounds):
        for world_size in args.world_sizes:
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                launch(config, world_size, round_, out, args)
                print(f"round {round_ + 1}/{args.rounds}: {config} x{world_size} done", file=sys.stderr)
    print(f"records: {out}", file=sys.stderr)
    report(read_records(out), args)
    report_savings(read_records(out), args)


if __name__ == "__main__":
    main()
