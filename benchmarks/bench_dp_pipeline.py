"""dp2 x pp2: the gradient average overlapped with each stage's last backward vs the same average after the step.

    python benchmarks/bench_dp_pipeline.py                    # 4 CPU processes (gloo), 3 rounds
    python benchmarks/bench_dp_pipeline.py --rounds 5 --steps 20 --width 768

Both sides are ``lp_pipeline_1f1b`` with ``data_parallel_size=2`` (two replicas of two stages) inside
``Trainer.fit``, on a wide ``CharGPT`` with a small batch, so each stage's gradient all-reduce is a visible
share of the step. They differ only in when the ``GradientReducer``'s buckets are sent:

- ``overlapped`` (the strategy as shipped): a bucket's all-reduce starts from the gradient hooks of the
  stage's last backward of the step, as soon as that backward has filled it;
- ``after step``: every bucket is sent in ``finish_sync``, after the stage's schedule, and waited for at
  once (defined here, for this comparison only: the blocking average that pipeline stages used before).

Rounds run both back to back, in reverse order every other round; reported: the median step time of each
(rank 0, stage 0: the stage that runs the step's last backward) and the median over rounds of the ratio
after-step / overlapped (> 1: the overlap is faster).
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
    interleaved,
    median_of,
    median_ratio,
    read_records,
    step_timer,
    torchrun,
    worker_args,
)

VARIANTS = ("overlapped", "after step")


def strategy_class(variant: str) -> type:
    """The shipped strategy, or (``after step``) one whose reducer sends nothing from the gradient hooks."""
    from lightning_parallel import PipelineParallelStrategy
    from lightning_parallel.distributed.reducer import GradientReducer

    if variant == "overlapped":
        return PipelineParallelStrategy

    class AfterStepReducer(GradientReducer):
        def _launch_ready(self, in_backward: bool = False) -> None:
            if not in_backward:  # only finish_sync sends
                super()._launch_ready()

    class AfterStep(PipelineParallelStrategy):
        reducer_class = AfterStepReducer

    return AfterStep


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    from lightning_parallel.data import CharCorpusData
    from lightning_parallel.models import CharGPT

    torch.set_num_threads(1)
    seed_everything(0)
    timer = step_timer()
    strategy = strategy_class(args.variant)(
        schedule="1f1b", num_microbatches=args.microbatches, data_parallel_size=2
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[timer],
    )
    model = CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=args.block_size)
    trainer.fit(model, datamodule=CharCorpusData(batch_size=args.batch_size, block_size=args.block_size))
    stats = strategy.reducer.stats
    append_record(
        args.out,
        {
            "variant": args.variant,
            "round": args.round,
            "rank": trainer.global_rank,
            "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
            "launched_in_backward": stats.launched_in_backward,
            "bucket_all_reduces": stats.bucket_all_reduces,
            "gradient_mib": sum(b.buffer.numel() * b.buffer.element_size() for b in strategy.reducer.buckets)
            / 2**20,
        },
    )


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=15, warmup=3)
    parser.add_argument("--variant", default="overlapped", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=4, help="per replica")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        end_worker()

    args.out = Path(tempfile.mkdtemp()) / "results.jsonl"
    shared = worker_args(args, ("batch_size", "block_size", "microbatches", "layers", "width"))
    for round_, variant in interleaved(args.rounds, list(VARIANTS)):
        torchrun(__file__, 4, ["--variant", variant, "--round", str(round_), *shared])
        print(f"round {round_ + 1}/{args.rounds}: {variant} done", file=sys.stderr)
    records = read_records(args.out)
    first = next(r for r in records if r["rank"] == 0)
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}), dp2 x pp2 (1f1b, m={args.microbatches}) on 4 CPU "
        f"processes (gloo), batch {args.batch_size} x {args.block_size} tokens per replica, {args.steps} steps "
        f"({args.warmup} warm-up), {first['gradient_mib']:.1f} MiB of gradients averaged per stage (rank 0), "
        f"median over {args.rounds} rounds\n"
    )
    print("| variant | step ms (median, rank 0) | buckets sent from backward hooks / all, rank 0 |")
    print("|---|---|---|")
    for variant in VARIANTS:
        mine = [r for r in records if r["variant"] == variant and r["rank"] == 0]
        hooks = statistics.median(r["launched_in_backward"] for r in mine)
        total = statistics.median(r["bucket_all_reduces"] for r in mine)
        ms = median_of(records, "step_ms", variant=variant, rank=0)
        print(f"| {variant} | {ms:.1f} | {hooks:.0f} / {total:.0f} |")
    ratio = median_ratio(
        records, "step_ms", {"variant": "after step", "rank": 0}, {"variant": "overlapped", "rank": 0}
    )
    print(f"\nafter step / overlapped (median of the rounds' ratios): {ratio:.3f}")


if __name__ == "__main__":
    main()
