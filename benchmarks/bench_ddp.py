"""lp_ddp vs Lightning's built-in ``ddp`` (torch DDP) vs master-based lp_dp, side by side in one run.

    python benchmarks/bench_ddp.py                      # 2 and 4 CPU processes, 3 rounds
    python benchmarks/bench_ddp.py --world-sizes 2 --rounds 5 --steps 40

Every measurement is a real ``Trainer.fit`` of the default model (``CharGPT`` on the embedded corpus)
under torchrun, one thread per process. Strategies are interleaved round by round so machine noise
hits them alike; the table shows the median samples/s over rounds and the ratio to torch DDP.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUIET_TRAINER,
    append_record,
    benchmark_parser,
    end_worker,
    read_records,
    step_timer,
    torchrun,
)


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    import lightning_parallel  # noqa: F401
    from lightning_parallel.data import CharCorpusData
    from lightning_parallel.models import CharGPT

    torch.set_num_threads(1)
    seed_everything(0)
    timer = step_timer()
    model = CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4)
    data = CharCorpusData(batch_size=args.batch_size, block_size=64)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=args.strategy,
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        step = statistics.median(timer.times[args.warmup :])
        append_record(
            args.out,
            {
                "strategy": args.strategy,
                "world_size": args.world_size,
                "samples_per_s": args.batch_size * args.world_size / step,
                "step_ms": step * 1e3,
            },
        )


def launch(strategy: str, world_size: int, out: Path, args: argparse.Namespace) -> None:
    torchrun(
        __file__,
        world_size,
        [
            "--strategy",
            strategy,
            "--world-size",
            str(world_size),
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch-size",
            str(args.batch_size),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
        ],
    )


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=30, warmup=5)
    parser.add_argument("--strategy", default="lp_ddp", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "lp_ddp", "lp_dp"])
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        end_worker()

    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    for round_ in range(args.rounds):
        for world_size in args.world_sizes:
            for strategy in args.strategies:
                launch(strategy, world_size, out, args)
                print(f"round {round_ + 1}/{args.rounds}: {strategy} x{world_size} done", file=sys.stderr)
    records = read_records(out)
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}), batch {args.batch_size}/process, "
        f"{args.steps} steps ({args.warmup} warm-up), median of {args.rounds} rounds, CPU, gloo\n"
    )
    print("| processes | strategy | samples/s (median) | step ms | ratio vs ddp |")
    print("|---|---|---|---|---|")
    for world_size in args.world_sizes:
        medians = {}
        for strategy in args.strategies:
            runs = [r for r in records if r["strategy"] == strategy and r["world_size"] == world_size]
            medians[strategy] = (
                statistics.median(r["samples_per_s"] for r in runs),
                statistics.median(r["step_ms"] for r in runs),
            )
        base = medians.get("ddp", (None,))[0]
        for strategy, (sps, ms) in medians.items():
            ratio = f"{sps / base:.3f}" if base else "-"
            print(f"| {world_size} | {strategy} | {sps:.1f} | {ms:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
