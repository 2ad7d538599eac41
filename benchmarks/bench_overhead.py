"""What the package costs per step where nothing is split: one process, against plain Lightning.

    python benchmarks/bench_overhead.py                                # CPU, one thread, 3 rounds
    python benchmarks/bench_overhead.py --device cuda --precision bf16-mixed --hidden 1024 --layers 12 \
        --seq 1024 --batch 8                                           # a GPU (the issue-34 table)

Every run is a real ``Trainer.fit`` of an unmodified Hugging Face Llama (built from a tiny config with
``from_config``, random tokens, AdamW) in a fresh process, one device:

- ``single``: Lightning's default strategy (``SingleDeviceStrategy``), the baseline;
- ``ddp``: Lightning's built-in ``ddp`` on one process;
- ``lp_ddp``, ``lp_tp1`` (``lp_tensor_parallel``, tp=1), ``lp_pp1`` (``lp_pipeline_1f1b``, one stage,
  ``--microbatches``): the package's strategies where there is nothing to split or average;
- ``lp_full``, ``lp_selective``: ``lp_ddp`` with ``activation_checkpointing=True`` / ``"selective"``;
- ``hf_ckpt``: single device with Hugging Face's own ``gradient_checkpointing_enable()`` (torch's
  non-reentrant checkpoint of every decoder layer), the bar for a recompute of whole blocks.

Runs are interleaved over rounds (reversed every other round). Reported: the median step time (steps after
``--warmup``) and the median over rounds of its ratio to ``single`` of the same round, the CPU time per step
on CPU, and the peak memory (CUDA allocator's peak on a GPU, peak resident memory on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUIET_TRAINER,
    REPO,
    append_record,
    benchmark_parser,
    interleaved,
    llama_lm,
    median_of,
    median_ratio,
    read_records,
    step_timer,
)

MIB = 2**20
VARIANTS = ("single", "ddp", "lp_ddp", "lp_tp1", "lp_pp1", "lp_full", "lp_selective", "hf_ckpt")


def strategy_of(variant: str, microbatches: int):
    """The ``Trainer(strategy=...)`` of a variant."""
    from lightning_parallel import DDPStrategy, PipelineParallelStrategy, TensorParallelStrategy

    if variant in ("single", "hf_ckpt"):
        return "auto"
    if variant == "ddp":
        return "ddp"
    if variant == "lp_tp1":
        return TensorParallelStrategy(tensor_parallel_size=1)
    if variant == "lp_pp1":
        return PipelineParallelStrategy(schedule="1f1b", num_microbatches=microbatches)
    recompute = {"lp_ddp": False, "lp_full": True, "lp_selective": "selective"}[variant]
    return DDPStrategy(activation_checkpointing=recompute)


def llama_module(args: argparse.Namespace):
    """A LightningModule around an unmodified ``LlamaForCausalLM`` of the benchmark's size."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
    )

    return llama_lm(config)


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    from lightning_parallel.memory.accounting import peak_rss_bytes

    torch.set_num_threads(args.threads)
    seed_everything(0)
    module = llama_module(args)
    if args.variant == "hf_ckpt":
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, args.vocab, ((args.steps + 1) * args.batch, args.seq))
    timer = step_timer()
    trainer = Trainer(
        accelerator=args.device,
        devices=1,
        strategy=strategy_of(args.variant, args.microbatches),
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[timer],
        use_distributed_sampler=False,  # every variant sees the same batches in the same order
        **QUIET_TRAINER,
    )
    trainer.fit(module, DataLoader(tokens, batch_size=args.batch))
    cuda = args.device == "cuda"
    append_record(
        args.out,
        {
            "variant": args.variant,
            "round": args.round,
            "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
            "cpu_ms": statistics.median(timer.cpu_times[args.warmup :]) * 1e3,
            "peak_mib": (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) / MIB,
            "loss": float(trainer.callback_metrics["train_loss"]),
        },
    )


def run_variant(args: argparse.Namespace, variant: str, round_: int) -> None:
    """One variant in a fresh process, one device."""
    line = [sys.executable, __file__, "--worker", "--variant", variant, "--round", str(round_)]
    for name in ("out", "steps", "warmup", "device", "precision", "threads", "microbatches"):
        line += [f"--{name}", str(getattr(args, name))]
    for name in ("hidden", "layers", "seq", "batch", "vocab"):
        line += [f"--{name}", str(getattr(args, name))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(line, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")


def print_table(records: list[dict], variants: list[str], cpu: bool) -> None:
    heads = ["run", "ms per step", "/ single"] + (["CPU ms per step", "/ single"] if cpu else [])
    heads += ["peak RSS MiB" if cpu else "peak CUDA MiB", "loss"]
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    base = {"variant": "single"}
    for variant in variants:
        mine = {"variant": variant}
        cells = [variant, f"{median_of(records, 'step_ms', **mine):.1f}"]
        cells.append(f"{median_ratio(records, 'step_ms', mine, base):.3f}")
        if cpu:
            cells.append(f"{median_of(records, 'cpu_ms', **mine):.1f}")
            cells.append(f"{median_ratio(records, 'cpu_ms', mine, base):.3f}")
        cells += [
            f"{median_of(records, 'peak_mib', **mine):.0f}",
            f"{median_of(records, 'loss', **mine):.4f}",
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=30, warmup=10)
    parser.add_argument("--variant", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=2, help="of the one-stage 1F1B pipeline")
    parser.add_argument(
        "--results", help="JSON-lines file the runs append to (default: a fresh temporary file)"
    )
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "single" not in variants:
        parser.error(
            f"--variants {unknown or args.variants}: choose from {', '.join(VARIANTS)}, 'single' included"
        )
    args.out = Path(args.results or Path(tempfile.mkdtemp()) / "results.jsonl")
    order = list(interleaved(args.rounds, variants))
    for i, (round_, variant) in enumerate(order):
        run_variant(args, variant, round_)
        print(f"round {round_ + 1}/{args.rounds}: {variant} done", file=sys.stderr)
        if round_ < args.rounds - 1 and (i + 1 == len(order) or order[i + 1][0] != round_):
            print(
                f"after round {round_ + 1}:", file=sys.stderr
            )  # a table so far, in case the run is cut short
            print_table(read_records(args.out), variants, cpu=args.device == "cpu")
    print(
        f"\nLlamaForCausalLM (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), sequence "
        f"{args.seq}, batch {args.batch}, {args.precision}, AdamW, one {args.device} process"
        f"{f' ({args.threads} thread)' if args.device == 'cpu' else ''}, {args.steps} steps ({args.warmup} "
        f"warm-up); medians over {args.rounds} rounds, ratios are medians of each round's own ratio\n"
    )
    print_table(read_records(args.out), variants, cpu=args.device == "cpu")


if __name__ == "__main__":
    main()
