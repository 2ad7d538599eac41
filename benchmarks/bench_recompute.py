"""Activation checkpointing: the activation memory it saves against the step time it costs, in one run.

    python benchmarks/bench_recompute.py                      # 2 CPU processes (gloo), 3 rounds
    python benchmarks/bench_recompute.py --rounds 5 --layers 8 --width 128 --no-pipeline

Every measurement is a real ``Trainer.fit`` of ``CharGPT`` under torchrun, one thread per process:

- ``lp_ddp`` on 2 processes with ``activation_checkpointing`` False (``off``), True (``full``: every block
  recomputed in backward) and ``"selective"`` (only each block's attention);
- ``torch wrapper``: ``lp_ddp`` without the option, the blocks wrapped instead by torch's own
  ``checkpoint_wrapper`` through torch's ``apply_activation_checkpointing``, exactly as Lightning's FSDP
  ``activation_checkpointing_policy`` applies it (without FSDP's sharding, so only the recompute differs).
  Its activations column leaves out what the recompute saves in backward (torch's own saved-tensor hooks
  hide it from the memory report's counter); compare the peak RSS;
- unless ``--no-pipeline``: ``lp_pipeline_1f1b`` of 2 stages, off / full / selective.

``--math-attention`` runs every configuration with torch's math attention kernel, which saves the attention
probabilities as Megatron's attention did (the regime of Korthikanti et al.'s selective recompute); the
default CPU kernel is fused and saves none of them.

Configurations run back to back in each round, in reverse order every other round. Reported: rank 0's
median step time, wall and CPU (the median of each run's steps after warm-up, then over rounds), every
rank's peak saved activations from the memory report (docs/memory.md) and peak resident memory, the median
over rounds of each run's ratio to ``off`` of the same layout in the same round, and the training loss at
the last step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import nullcontext
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

MIB = 2**20
#: name -> (layout, activation_checkpointing); ``torch`` marks torch's wrapper applied by hand
CONFIGS = {
    "off": ("ddp", False),
    "full": ("ddp", True),
    "selective": ("ddp", "selective"),
    "torch wrapper": ("ddp", "torch"),
    "1f1b off": ("1f1b", False),
    "1f1b full": ("1f1b", True),
    "1f1b selective": ("1f1b", "selective"),
}


def wrap_blocks_with_torch(model) -> None:
    """What Lightning's FSDP ``activation_checkpointing_policy={Block}`` does to the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from lightning_parallel.models.gpt import Block

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block)
    )


def strategy_of(name: str, microbatches: int):
    from lightning_parallel import DDPStrategy, PipelineParallelStrategy

    layout, spec = CONFIGS[name]
    spec = False if spec == "torch" else spec
    if layout == "ddp":
        return DDPStrategy(activation_checkpointing=spec)
    return PipelineParallelStrategy(
        schedule="1f1b", num_microbatches=microbatches, activation_checkpointing=spec
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_parallel.data import CharCorpusData
    from lightning_parallel.memory import report_of
    from lightning_parallel.models import CharGPT

    torch.set_num_threads(1)
    seed_everything(0)
    timer = step_timer()
    model = CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=args.block_size)
    if CONFIGS[args.config][1] == "torch":
        wrap_blocks_with_torch(model)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_of(args.config, args.microbatches),
        max_steps=args.steps,
        **QUIET_TRAINER,
        callbacks=[timer],
    )
    with sdpa_kernel([SDPBackend.MATH]) if args.math_attention else nullcontext():
        trainer.fit(model, datamodule=CharCorpusData(batch_size=args.batch_size, block_size=args.block_size))
    rows = report_of(trainer).tables["end_of_fit"]
    if trainer.is_global_zero:
        append_record(
            args.out,
            {
                "config": args.config,
                "round": args.round,
                "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
                "cpu_ms": statistics.median(timer.cpu_times[args.warmup :]) * 1e3,
                "activations": [r.activations for r in rows],
                "peak_rss": [r.peak_rss for r in rows],
                "max_activations": max(r.activations for r in rows),
                "max_peak_rss": max(r.peak_rss for r in rows),
                "loss": float(trainer.callback_metrics["train_loss"]),
            },
        )


def summarize(records: list[dict], configs: list[str]) -> list[dict]:
    """One row per configuration: medians over rounds and the median ratios to ``off`` of its layout."""
    rows = []
    for name in configs:
        off = "1f1b off" if CONFIGS[name][0] == "1f1b" else "off"
        mine = [r for r in records if r["config"] == name]
        rows.append(
            {
                "config": name,
                "step_ms": median_of(records, "step_ms", config=name),
                "time_ratio": median_ratio(records, "step_ms", {"config": name}, {"config": off}),
                "cpu_ms": median_of(records, "cpu_ms", config=name),
                "cpu_ratio": median_ratio(records, "cpu_ms", {"config": name}, {"config": off}),
                "activations_mib": [
                    statistics.median(a) / MIB for a in zip(*(r["activations"] for r in mine))
                ],
                "memory_ratio": median_ratio(records, "max_activations", {"config": name}, {"config": off}),
                "peak_rss_mib": [statistics.median(p) / MIB for p in zip(*(r["peak_rss"] for r in mine))],
                "rss_ratio": median_ratio(records, "max_peak_rss", {"config": name}, {"config": off}),
                "loss": median_of(records, "loss", config=name),
            }
        )
    return rows


def overhead_kept(rows: list[dict], key: str, full: str, selective: str) -> float:
    """The share of full recompute's overhead (time ratio ``key`` minus 1) that selective recompute pays."""
    ratio = {r["config"]: r[key] for r in rows}
    return (ratio[selective] - 1) / (ratio[full] - 1)


def print_table(rows: list[dict]) -> None:
    def ranks(values: list[float]) -> str:
        return " / ".join(f"{v:.1f}" for v in values)

    heads = ("configuration", "step ms", "/ off", "CPU ms per step", "/ off", "activations MiB (rank 0 / 1)")
    heads += ("/ off", "peak RSS MiB (rank 0 / 1)", "/ off", "loss")
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    for r in rows:
        cells = [r["config"], f"{r['step_ms']:.1f}", f"{r['time_ratio']:.3f}", f"{r['cpu_ms']:.1f}"]
        cells += [f"{r['cpu_ratio']:.3f}", ranks(r["activations_mib"]), f"{r['memory_ratio']:.3f}"]
        cells += [ranks(r["peak_rss_mib"]), f"{r['rss_ratio']:.3f}", f"{r['loss']:.6f}"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=12, warmup=4)
    parser.add_argument("--config", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel replica")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4, help="of the 1F1B pipeline")
    parser.add_argument("--no-pipeline", action="store_true", help="lp_ddp only")
    parser.add_argument(
        "--math-attention",
        action="store_true",
        help="torch's math attention kernel, which saves the attention probabilities (T x T per head) as "
        "Megatron's did; the default CPU kernel is fused and saves none",
    )
    parser.add_argument("--json", default="", help="also write the rows and the raw records to this file")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        end_worker()

    configs = [c for c in CONFIGS if not (args.no_pipeline and CONFIGS[c][0] == "1f1b")]
    args.out = Path(tempfile.mkdtemp()) / "results.jsonl"
    shared = worker_args(args, ("layers", "width", "batch_size", "block_size", "microbatches"))
    shared += ["--math-attention"] if args.math_attention else []
    for round_, config in interleaved(args.rounds, configs):
        torchrun(__file__, 2, ["--config", config, "--round", str(round_), *shared])
        print(f"round {round_ + 1}/{args.rounds}: {config} done", file=sys.stderr)
    records = read_records(args.out)
    rows = summarize(records, configs)
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}, n_head=4), batch {args.batch_size} x "
        f"{args.block_size} tokens per replica, 2 CPU processes (gloo, 1 thread each), {args.steps} steps "
        f"({args.warmup} warm-up), {'math' if args.math_attention else 'default (fused)'} attention kernel, "
        f"1F1B m={args.microbatches}; medians over {args.rounds} rounds, ratios are "
        "medians of the rounds' own ratios (rank 0's step time, the largest rank's memory)\n"
    )
    print_table(rows)
    if "torch wrapper" in configs:
        print(
            "\ntorch wrapper: its activations leave out what the recompute saves in backward (torch's own "
            "saved-tensor hooks hide it from the counter, docs/memory.md); its peak RSS counts everything"
        )
    for full, selective in [("full", "selective"), ("1f1b full", "1f1b selective")]:
        if selective in configs:
            wall, cpu = (overhead_kept(rows, key, full, selective) for key in ("time_ratio", "cpu_ratio"))
            print(f"\n{selective} pays {wall:.0%} (wall) / {cpu:.0%} (CPU) of {full}'s time overhead")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "records": records}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
