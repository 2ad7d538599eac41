"""Our pipeline schedules vs ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B), side by side.

    python benchmarks/bench_pipeline.py                       # 2 stages on 2 CPU processes, m = 4 and 8
    python benchmarks/bench_pipeline.py --rounds 5 --steps 30
    python benchmarks/bench_pipeline.py --m 4 --rounds 10 --steps 30      # m = 4 only
    python benchmarks/bench_pipeline.py --rounds 1 --timeline-dir docs   # + the timeline pictures (step 10)

The same GPT-style model (``CharGPT`` blocks, a causal mask computed in ``forward``) is cut after half its
blocks. Ours runs inside ``Trainer.fit`` on the unmodified LightningModule; torch's runs a hand written loop
over two stage modules and a ``loss_fn``, which is what that API needs. Reported per schedule: median step
time, the ratio torch/ours (> 1: ours is faster; like async's ratio to gpipe, the median of the rounds' own
ratios, since each round runs both back to back, in reverse order every other round), the bubble measured by
our timeline on both sides (torch's per-micro-batch forward, loss and backward wrapped in the same recorder)
next to the theory (p-1)/(m+p-1) and next to the theory for the stage costs measured (the last stage also runs
the head and the loss; ``schedules.expected_bubbles``), and the activations each stage holds at its peak (the
most micro-batches whose activations the stage held at once in a step, as the executor counted them, x the
bytes autograd saves for one micro-batch, parameters left out, counted by the memory report's
``SavedTensorCounter``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_record, median_of, median_ratio, read_records, step_timer, torchrun  # noqa: E402

from lightning_parallel.pipeline.schedules import expected_bubbles  # noqa: E402
from lightning_parallel.pipeline.timeline import bubble  # noqa: E402


def build_model(args: argparse.Namespace):
    from lightning_parallel.models import CharGPT

    return CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64, optimizer="sgd", lr=0.1)


def ours(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    from lightning_parallel import PipelineParallelStrategy
    from lightning_parallel.data import CharCorpusData

    seed_everything(0)
    timer = step_timer()
    costs = stage_costs()
    timeline_step = 10 if args.timeline_dir else None
    strategy = PipelineParallelStrategy(
        schedule=args.schedule, num_microbatches=args.microbatches, timeline_step=timeline_step
    )
    root = Path(args.timeline_dir or ".") / f"pipeline_timeline_{args.schedule}_m{args.microbatches}"
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer, costs],
    )
    trainer.fit(build_model(args), datamodule=CharCorpusData(batch_size=args.batch_size, block_size=64))
    forward, backward = (statistics.median(c[args.warmup :]) * 1e3 for c in (costs.forward, costs.backward))
    append_record(
        args.out,
        {
            "impl": "ours",
            "schedule": args.schedule,
            "m": args.microbatches,
            "round": args.round,
            "rank": trainer.global_rank,
            "bubble": statistics.median(strategy.bubbles[args.warmup :]),
            "forward_ms": forward,
            "backward_ms": backward,
            "held": max(strategy.peak_held[args.warmup :]),
            "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
        },
    )
    del torch


def stage_costs():
    """A callback that keeps, per training step, this stage's mean forward and backward time per
    micro-batch (from the strategy's timeline): what the theory for unequal stages needs."""
    from lightning.pytorch import Callback

    class StageCosts(Callback):
        def __init__(self) -> None:
            self.forward: list[float] = []
            self.backward: list[float] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            events = trainer.strategy.last_timeline
            for kind, out in (("F", self.forward), ("B", self.backward)):
                spans = [e.end - e.start for e in events if e.kind == kind]
                out.append(sum(spans) / len(spans))

    return StageCosts()


def torch_pipelining(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn import functional as F

    from lightning_parallel.data import CharCorpusData

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt = build_model(args).model
    half = args.layers // 2

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb, self.pos_emb, self.blocks = gpt.tok_emb, gpt.pos_emb, gpt.blocks[:half]

        def forward(self, idx):
            T = idx.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(T))
            for block in self.blocks:
                x = block(x, mask)
            return x

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.ln_f, self.head = gpt.blocks[half:], gpt.ln_f, gpt.head

        def forward(self, x):
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln_f(x))

    module = First() if rank == 0 else Last()
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    timeline = record_timeline(stage, schedule, rank)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    loader = iter(CharCorpusData(batch_size=args.batch_size, block_size=64).train_dataloader())
    times, bubbles = [], []
    for _ in range(args.steps):
        x, y = next(loader)
        timeline.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        times.append(time.perf_counter() - start)
        bubbles.append(bubble(timeline.events))
    append_record(
        args.out,
        {
            "impl": "torch",
            "schedule": args.schedule,
            "m": args.microbatches,
            "round": args.round,
            "rank": rank,
            "step_ms": statistics.median(times[args.warmup :]) * 1e3,
            "bubble": statistics.median(bubbles[args.warmup :]),
        },
    )
    dist.destroy_process_group()


def record_timeline(stage, schedule, rank: int):
    """Our ``Timeline`` around torch's per-micro-batch forward, loss and backward, so that torch's
    bubble is measured exactly as ours is (idle share of the span from the first forward to the last
    backward; the last stage's loss counts as forward, as in ours)."""
    from lightning_parallel.pipeline.timeline import Timeline

    timeline = Timeline(rank)

    def timed(kind: str, fn, microbatch_arg: int):
        def wrapper(*args, **kwargs):
            with timeline.record(kind, args[microbatch_arg]):
                return fn(*args, **kwargs)

        return wrapper

    stage.forward_one_chunk = timed("F", stage.forward_one_chunk, 0)
    stage.backward_one_chunk = timed("B", stage.backward_one_chunk, 0)
    schedule._maybe_compute_loss = timed("F", schedule._maybe_compute_loss, 3)
    return timeline


def activation_bytes_per_microbatch(args: argparse.Namespace) -> list[int]:
    """Bytes autograd saves for one micro-batch on each of the 2 stages: the memory report's counter
    (distinct storages, parameters left out), run over each stage's blocks in turn."""
    import torch

    from lightning_parallel.memory import SavedTensorCounter

    gpt = build_model(args).model
    idx = torch.randint(0, 128, (args.batch_size // args.microbatches, 64))
    stages = [SavedTensorCounter(), SavedTensorCounter()]
    for counter in stages:
        counter.ignore(gpt.parameters())
    half, T = args.layers // 2, idx.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    stages[0].start()
    x = gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(T))
    for i, block in enumerate(gpt.blocks):
        if i == half:
            stages[0].stop()
            stages[1].start()
        x = block(x, mask)
    gpt.head(gpt.ln_f(x)).sum()
    stages[1].stop()
    return [counter.peak for counter in stages]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="numbers of micro-batches to run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument(
        "--timeline-dir", default="", help="write our schedules' step-10 timelines (SVG + trace) here"
    )
    args = parser.parse_args()
    if args.worker:
        return ours(args) if args.impl == "ours" else torch_pipelining(args)

    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    common = [
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
    ]
    if args.timeline_dir:
        common += ["--timeline-dir", str(Path(args.timeline_dir).resolve())]
    runs = [("ours", s) for s in ("gpipe", "1f1b", "async")] + [("torch", s) for s in ("gpipe", "1f1b")]
    for round_ in range(args.rounds):
        for m in args.m:
            # every other round in reverse order, so no side always runs first (or last) in a round
            for impl, schedule in runs if round_ % 2 == 0 else runs[::-1]:
                torchrun(
                    __file__,
                    2,
                    [
                        "--impl",
                        impl,
                        "--schedule",
                        schedule,
                        "--microbatches",
                        str(m),
                        "--round",
                        str(round_),
                        *common,
                    ],
                )
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    records = read_records(out)
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}), 2 stages on 2 CPU processes (gloo), batch "
        f"{args.batch_size}, {args.steps} steps ({args.warmup} warm-up), median over {args.rounds} rounds\n"
    )
    print(
        "| m | schedule | ours ms | torch ms | torch/ours | bubble measured, ours (stage 0, 1) "
        "| torch (stage 0, 1) | theory | theory for the measured stage costs (stage 0, 1) "
        "| activations held at peak, stage 0 / 1 (micro-batches x MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in args.m:
        args.microbatches = m
        per_mb = activation_bytes_per_microbatch(args)
        for schedule in ("gpipe", "1f1b", "async"):
            mine = {"impl": "ours", "schedule": schedule, "m": m, "rank": 0}
            ours_ms = median_of(records, "step_ms", **mine)
            theirs = median_of(records, "step_ms", **{**mine, "impl": "torch"})
            bubbles = {
                impl: [
                    median_of(records, "bubble", impl=impl, schedule=schedule, m=m, rank=r) for r in (0, 1)
                ]
                for impl in ("ours", "torch")
            }
            costs = [
                [median_of(records, key, impl="ours", schedule=schedule, m=m, rank=r) for r in (0, 1)]
                for key in ("forward_ms", "backward_ms")
            ]
            unequal = expected_bubbles(schedule, 2, m, *costs) if schedule != "async" else None
            in_flight = [
                median_of(records, "held", impl="ours", schedule=schedule, m=m, rank=r) for r in (0, 1)
            ]
            held = " / ".join(
                f"{n:.0f} x {b / 2**20:.1f} = {n * b / 2**20:.1f} MiB" for n, b in zip(in_flight, per_mb)
            )
            theirs_ms = f"{theirs:.1f}" if theirs == theirs else "-"
            ratio = (
                f"{median_ratio(records, 'step_ms', {**mine, 'impl': 'torch'}, mine):.2f}"
                if theirs == theirs
                else "-"
            )
            theory = 1 / (m + 1)
            faster = median_ratio(records, "step_ms", {**mine, "schedule": "gpipe"}, mine)
            note = f" (vs gpipe {faster:.2f}x)" if schedule == "async" else ""
            expected = percents(unequal) if unequal else "-"
            print(
                f"| {m} | {schedule}{note} | {ours_ms:.1f} | {theirs_ms} | {ratio} | "
                f"{percents(bubbles['ours'])} | {percents(bubbles['torch'])} | {theory:.0%} | {expected} | {held} |"
            )


def percents(values: list[float]) -> str:
    return ", ".join("-" if v != v else f"{v:.0%}" for v in values)


if __name__ == "__main__":
    main()
