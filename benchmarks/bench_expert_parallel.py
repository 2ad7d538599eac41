"""Expert parallelism vs the experts split by tensor parallelism vs replicated experts, on a Mixtral.

    python benchmarks/bench_expert_parallel.py                       # 2 processes, 3 rounds
    python benchmarks/bench_expert_parallel.py --configs ep dp --rounds 5 --steps 30

Each measurement is a real ``Trainer.fit`` of a Hugging Face ``MixtralForCausalLM`` (random tokens,
float32, the experts' eager loop) under torchrun, one thread per process, on gloo:

- ``ep``: ``lp_parallel`` with ``data_parallel_size=P, expert_parallel_size=P``: each rank holds 1/P of the
  experts, tokens travel by all-to-all, the rest is data parallel;
- ``tp``: ``lp_parallel`` with ``tensor_parallel_size=P, plan="auto"``: what the automatic plan splits
  of the model (the experts too, where the plan splits them; otherwise they stay whole on every rank);
- ``dp``: ``lp_ddp``, every expert replicated.

``ep`` and ``dp`` see P batches per step, ``tp`` one (its ranks share the batch), so step times compare
the cost of one step of each layout and samples/s the throughput. Communication is counted, not
profiled, by ``lightning_parallel.step_traffic.StepTraffic``: every ``torch.distributed``
collective a rank issues during a step, with the bytes of the tensor it hands over (all-reduce and
broadcast: the tensor, of which a ring all-reduce sends 2 (P - 1) / P; all-gather and reduce-scatter: the
rank's input; all-to-all: the rows it sends to the other ranks, not those it keeps), summed per step and
kind; the table shows the median step's total per rank, averaged over the ranks (their all-to-alls
differ with the routing). ``python -m lightning_parallel.cli.plan_table ... --ep P`` predicts the
all-to-all part from the traced batch. Strategies are interleaved round by round; the table shows
medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUIET_TRAINER,
    append_record,
    benchmark_parser,
    end_worker,
    interleaved,
    read_records,
    step_timer,
    torchrun,
    worker_args,
)

CONFIGS = ("ep", "tp", "dp")
MODEL_OPTIONS = ("width", "layers", "experts", "top_k", "batch_size", "seq")
MEMORY = ("parameters", "gradients", "optimizer_state", "peak_rss")  # the memory report's, bytes per rank


def mixtral(args: argparse.Namespace):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.seq,
        sliding_window=None,
        experts_implementation="eager",
    )
    return transformers.MixtralForCausalLM(config)


def strategy(config: str, world: int):
    import lightning_parallel as lp

    if config == "ep":
        return lp.ParallelStrategy(data_parallel_size=world, expert_parallel_size=world)
    if config == "tp":
        return lp.ParallelStrategy(tensor_parallel_size=world, data_parallel_size=1, require_sharded=0.0)
    return lp.DDPStrategy()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel.memory import MemoryReport
    from lightning_parallel.step_traffic import StepTraffic

    torch.set_num_threads(1)
    seed_everything(0)

    class MoELM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = mixtral(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    tokens = torch.randint(
        0, 256, (args.batch_size * 64, args.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    loader = DataLoader(
        TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size, drop_last=True
    )
    timer, counted, memory = step_timer(), StepTraffic(), MemoryReport()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=strategy(args.config, args.world_size),
        max_steps=args.steps,
        callbacks=[timer, counted, memory],
        **QUIET_TRAINER,
    )
    model = MoELM()
    trainer.fit(model, train_dataloaders=loader)
    held = sum(p.numel() for p in model.parameters())
    measured = [dict(step.sent) for step in counted.steps[args.warmup :]]
    totals = [sum(s.values()) for s in measured]
    middle = measured[totals.index(statistics.median_low(totals))]
    append_record(
        args.out,
        {
            "config": args.config,
            "round": args.round,
            "rank": trainer.global_rank,
            "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
            "bytes_per_step": statistics.median(totals),
            "bytes_by_kind": middle,
            "parameters_held": held,
            "batches_per_step": args.world_size if args.config != "tp" else 1,
            **{name: memory.summary()["end_of_fit"][trainer.global_rank][name] for name in MEMORY},
        },
    )


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=20, warmup=5)
    parser.add_argument("--config", default="ep", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per batch")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        end_worker()

    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    args.out = out
    for round_, config in interleaved(args.rounds, args.configs):
        line = worker_args(args, MODEL_OPTIONS + ("world_size",)) + [
            "--config",
            config,
            "--round",
            str(round_),
        ]
        torchrun(__file__, args.world_size, line)
        print(f"round {round_ + 1}/{args.rounds}: {config} done", file=sys.stderr)
    report(read_records(out), args)


def report(records: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nMixtral: width {args.width}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
        f"batch {args.batch_size} x {args.seq} tokens, {args.world_size} processes, {args.steps} steps "
        f"({args.warmup} warm-up), median of {args.rounds} rounds, CPU, gloo\n"
    )
    print(
        "| layout | step ms (rank 0) | samples/s | bytes per step per rank | by kind | parameters per rank "
        "| MiB per rank: parameters + gradients + optimizer state (largest rank) | peak RSS MiB (largest rank) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        mine = [r for r in records if r["config"] == config]
        if not mine:
            continue
        first = [r for r in mine if r["rank"] == 0]
        step = statistics.median(r["step_ms"] for r in first)
        samples = first[0]["batches_per_step"] * args.batch_size / step * 1e3
        per_rank = statistics.mean(r["bytes_per_step"] for r in mine)
        kinds: Counter = Counter()
        for r in mine:
            kinds.update({k: v / len(mine) for k, v in r["bytes_by_kind"].items()})
        by_kind = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(kinds.items()))
        held = statistics.mean(r["parameters_held"] for r in mine)
        states = max(sum(r[name] for name in MEMORY[:3]) for r in mine) / 2**20
        rss = max(r["peak_rss"] for r in mine) / 2**20
        print(
            f"| {config} | {step:.1f} | {samples:.1f} | {per_rank / 2**20:.2f} MiB | {by_kind} | "
            f"{held / 1e6:.3f} M | {states:.2f} | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
