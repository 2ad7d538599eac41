"""Per-block torch.compile against eager under each strategy, beside the same ratio on one device, in one run.

    python benchmarks/bench_compile.py                                   # CPU: CharGPT, 2 or 4 gloo processes
    python benchmarks/bench_compile.py --rounds 1 --steps 6 --warmup 3 --layers 4 --width 64 --backend eager
    python benchmarks/bench_compile.py --gpu                             # one GPU: HF Llama ~220M, seq 1024, bf16

Every measurement is a real ``Trainer.fit`` under torchrun, one thread per process, eager and compiled:
compiled is the strategies' ``compile`` option (each block of the block stack a rank holds compiled on its
own, ``lightning_parallel/block_compile.py``); on one device (``single``, Lightning's default strategy) the same
blocks are compiled by hand with the same function, so both sides compile the same code.

- CPU (default): ``CharGPT`` on its corpus under ``single`` (1 process), ``lp_ddp``, ``zero1``
  (``lp_ddp``, ``zero_stage=1``), ``tp`` and ``tp_sp`` (``lp_tensor_parallel``, tp=2, without and with
  sequence parallelism), ``1f1b`` (``lp_pipeline_1f1b``, 2 stages) on 2 processes, and ``tp2xpp2``
  (``lp_parallel``, tp=2 x pp=2) on 4. On a 2-core CPU inductor does not speed up small models: the CPU
  figures are the graph counts (dynamo's frames and graphs per rank 0, its graph breaks) and the loss of
  compiled against eager, not a speed-up.
- ``--gpu``: an unmodified Hugging Face Llama of about 220M parameters built from a config (never
  pretrained weights) under ``trainer.init_module()``, random tokens, seq 1024, bf16-mixed, every strategy at
  world size 1 (``single``, ``lp_ddp``, ``zero1``, ``tp``, ``1f1b``): the goal is a speed-up under each
  strategy of at least 90% of the single device's.

Runs are interleaved over rounds (reversed every other round). Reported per strategy: the median step time
eager and compiled (rank 0, steps after ``--warmup``), the median over rounds of compiled / eager, that ratio
divided by the single device's (1.0: the strategy keeps compile's whole gain), rank 0's compiled frames,
graphs and graph breaks, and the last loss of each.
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
    llama_lm,
    median_of,
    median_ratio,
    read_records,
    step_timer,
    torchrun,
    worker_args,
)

#: name -> (processes on CPU, strategy keyword arguments; None: Lightning's single-device default)
CPU_STRATEGIES = {
    "single": (1, None),
    "lp_ddp": (2, ("DDPStrategy", {})),
    "zero1": (2, ("DDPStrategy", {"zero_stage": 1})),
    "tp": (2, ("TensorParallelStrategy", {"tensor_parallel_size": 2, "plan": "auto"})),
    "tp_sp": (
        2,
        ("TensorParallelStrategy", {"tensor_parallel_size": 2, "plan": "auto", "sequence_parallel": True}),
    ),
    "1f1b": (2, ("PipelineParallelStrategy", {"schedule": "1f1b", "num_microbatches": 2})),
    "tp2xpp2": (
        4,
        ("ParallelStrategy", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "plan": "auto"}),
    ),
}
#: on one GPU, every strategy at world size 1 (what the issue's goal compares)
GPU_STRATEGIES = {
    "single": (1, None),
    "lp_ddp": (1, ("DDPStrategy", {})),
    "zero1": (1, ("DDPStrategy", {"zero_stage": 1})),
    "tp": (1, ("TensorParallelStrategy", {"tensor_parallel_size": 1})),
    "1f1b": (1, ("PipelineParallelStrategy", {"schedule": "1f1b", "num_microbatches": 2})),
}
#: the GPU model: Hugging Face Llama, about 220M parameters
LLAMA_220M = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=1024,
)


def strategies(gpu: bool) -> dict:
    return GPU_STRATEGIES if gpu else CPU_STRATEGIES


def llama_config(seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_220M, "max_position_embeddings": seq})


def llama_module(seq: int):
    """A LightningModule around an unmodified ``LlamaForCausalLM`` of ``LLAMA_220M``'s size, built from its
    config where ``trainer.init_module()`` puts it (the device, or meta for a split model)."""

    config = llama_config(seq)

    return llama_lm(config)


def strategy_of(args: argparse.Namespace):
    """The ``Trainer(strategy=...)`` of ``args.strategy``, with the ``compile`` option when compiled."""
    import lightning_parallel

    spec = strategies(args.gpu)[args.strategy][1]
    if spec is None:
        return "auto"
    name, kwargs = spec
    compile_option = {"backend": args.backend} if args.compiled else False
    return getattr(lightning_parallel, name)(compile=compile_option, **kwargs)


def compile_by_hand(module, backend: str) -> None:
    """On one device: the blocks compiled as the strategies' ``compile`` option compiles them."""
    import torch

    from lightning_parallel.block_compile import compile_blocks
    from lightning_parallel.module_names import find_block_stack

    _, stack = find_block_stack(module)
    compile_blocks(list(stack), lambda forward: torch.compile(forward, backend=backend))


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"].get("ok", 0),
        "graphs": counters["stats"].get("unique_graphs", 0),
        "breaks": sum(counters["graph_break"].values()),
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    seed_everything(0)
    timer = step_timer()
    processes = strategies(args.gpu)[args.strategy][0]
    trainer = Trainer(
        accelerator="cuda" if args.gpu else "cpu",
        devices=processes,
        strategy=strategy_of(args),
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[timer],
        **QUIET_TRAINER,
    )
    if args.gpu:
        with trainer.init_module():
            model = llama_module(args.seq)
        tokens = torch.randint(0, LLAMA_220M["vocab_size"], ((args.steps + 1) * args.batch, args.seq))
        data = {"train_dataloaders": DataLoader(tokens, batch_size=args.batch)}
    else:
        from lightning_parallel.data import CharCorpusData
        from lightning_parallel.models import CharGPT

        model = CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=args.seq)
        data = {"datamodule": CharCorpusData(batch_size=args.batch, block_size=args.seq)}
    if args.compiled and args.strategy == "single":
        compile_by_hand(model, args.backend)
    trainer.fit(model, **data)
    if trainer.is_global_zero:
        append_record(
            args.out,
            {
                "strategy": args.strategy,
                "compiled": args.compiled,
                "round": args.round,
                "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
                "loss": float(trainer.callback_metrics["train_loss"]),
                **dynamo_counts(),
            },
        )


def summarize(records: list[dict], names: list[str]) -> list[dict]:
    """One row per strategy: medians over rounds, compiled / eager, and that ratio over the single device's."""
    rows = []
    for name in names:
        on, off = {"strategy": name, "compiled": True}, {"strategy": name, "compiled": False}
        rows.append(
            {
                "strategy": name,
                "eager_ms": median_of(records, "step_ms", **off),
                "compiled_ms": median_of(records, "step_ms", **on),
                "ratio": median_ratio(records, "step_ms", on, off),
                "frames": median_of(records, "frames", **on),
                "graphs": median_of(records, "graphs", **on),
                "breaks": median_of(records, "breaks", **on),
                "eager_loss": median_of(records, "loss", **off),
                "compiled_loss": median_of(records, "loss", **on),
            }
        )
    single = next((r["ratio"] for r in rows if r["strategy"] == "single"), float("nan"))
    for row in rows:
        row["of_single"] = row["ratio"] / single
    return rows


def print_table(rows: list[dict]) -> None:
    heads = ("strategy", "eager ms", "compiled ms", "compiled / eager", "/ single's", "frames", "graphs")
    heads += ("graph breaks", "loss eager", "loss compiled")
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    for r in rows:
        cells = [r["strategy"], f"{r['eager_ms']:.1f}", f"{r['compiled_ms']:.1f}", f"{r['ratio']:.3f}"]
        cells += [f"{r['of_single']:.3f}", f"{r['frames']:.0f}", f"{r['graphs']:.0f}", f"{r['breaks']:.0f}"]
        cells += [f"{r['eager_loss']:.6f}", f"{r['compiled_loss']:.6f}"]
        print("| " + " | ".join(cells) + " |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, rounds=3, steps=12, warmup=4)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help="one GPU: HF Llama ~220M, seq 1024, bf16-mixed")
    parser.add_argument(
        "--strategies", default="", help="comma-separated subset (default: all of the mode's)"
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--layers", type=int, default=4, help="CharGPT's (CPU)")
    parser.add_argument("--width", type=int, default=128, help="CharGPT's (CPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: CPU 64, GPU 1024)")
    parser.add_argument("--batch", type=int, default=None, help="per process (default: CPU 8, GPU 4)")
    parser.add_argument("--precision", default=None, help="default: CPU 32-true, GPU bf16-mixed")
    args = parser.parse_args(argv)
    gpu = args.gpu
    args.seq = args.seq or (1024 if gpu else 64)
    args.batch = args.batch or (4 if gpu else 8)
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    names = [s for s in args.strategies.split(",") if s] or list(strategies(gpu))
    unknown = sorted(set(names) - set(strategies(gpu)))
    if unknown or "single" not in names:
        parser.error(
            f"--strategies {args.strategies}: choose from {', '.join(strategies(gpu))}, 'single' included"
        )
    args.names = names
    return args


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        end_worker()

    args.out = Path(tempfile.mkdtemp()) / "results.jsonl"
    shared = worker_args(args, ("backend", "layers", "width", "seq", "batch", "precision"))
    shared += ["--gpu"] if args.gpu else []
    variants = [f"{name}:{mode}" for name in args.names for mode in ("eager", "compiled")]
    for round_, variant in interleaved(args.rounds, variants):
        name, mode = variant.split(":")
        mine = ["--strategy", name, "--round", str(round_)] + (["--compiled"] if mode == "compiled" else [])
        torchrun(__file__, strategies(args.gpu)[name][0], mine + shared, timeout=1800)
        print(f"round {round_ + 1}/{args.rounds}: {variant} done", file=sys.stderr)
    rows = summarize(read_records(args.out), args.names)
    model = (
        f"HF Llama ({LLAMA_220M['num_hidden_layers']} layers, hidden {LLAMA_220M['hidden_size']}), one GPU"
        if args.gpu
        else f"CharGPT(n_layer={args.layers}, n_embd={args.width}, n_head=4), CPU processes (gloo, 1 thread each)"
    )
    print(
        f"\n{model}, batch {args.batch} x {args.seq} tokens per process, {args.precision}, backend "
        f"{args.backend}, {args.steps} steps ({args.warmup} warm-up); medians over {args.rounds} rounds; frames, "
        "graphs and graph breaks: rank 0's, compiled\n"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
