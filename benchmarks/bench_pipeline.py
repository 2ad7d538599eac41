"""Our pipeline schedules vs ``torch.distributed.pipelining``'s implementation of each, side by side.

    python benchmarks/bench_pipeline.py                       # every schedule, 2 ranks on 2 CPU processes, m = 4 and 8
    python benchmarks/bench_pipeline.py --rounds 5 --steps 30
    python benchmarks/bench_pipeline.py --m 4 --rounds 10 --steps 30      # m = 4 only
    python benchmarks/bench_pipeline.py --schedules 1f1b zb_h1 interleaved_1f1b --width 512   # a subset
    python benchmarks/bench_pipeline.py --rounds 1 --timeline-dir docs   # + the timeline pictures (step 10)

Each schedule of ours runs against torch's own implementation of the same schedule (``TORCH_COUNTERPART``;
``zbv`` once ``schedules.SCHEDULES`` has it): gpipe / ``ScheduleGPipe``, 1f1b / ``Schedule1F1B``,
interleaved_1f1b / ``ScheduleInterleaved1F1B`` (``--virtual-stages`` chunks per rank, looping placement: rank
r holds virtual stages r, r+p, ...), zb_h1 / ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch
has no class named ZB-H1; with one stage per rank this one runs 1F1B's order with every backward split into
the input gradient I and the weight gradient W, rank r deferring up to r W's), zbv /
``ScheduleZBVZeroBubble`` (two chunks per rank in the V placement: rank r holds r and 2p-1-r, rank 0 runs the
loss). These three run the same order of actions per rank as ours (``schedules.schedule``; compared at p=2,
m=4 and 8, and p=4, m=8). async has no counterpart in torch.

The same GPT-style model (``CharGPT`` blocks, a causal mask computed in ``forward``), the same batches split
into the same micro-batches, and SGD on both sides. Ours runs inside ``Trainer.fit`` on the unmodified
LightningModule, cut by its ``balance="parameters"`` into p*v virtual stages of equal blocks; torch's runs a
hand written loop over the same cut, made by hand into p*v chunk modules (the embedding in the first, ln_f
and the head in the last), and a ``loss_fn``, which is what that API needs. ``--layers`` must divide by p*v
for every schedule run (the default 4 does for v=2, so every row trains the same model).

Reported per (schedule, m): median step time, the ratio torch/ours (> 1: ours is faster; like async's ratio to
gpipe, the median of the rounds' own ratios, since each round runs every side back to back, in reverse order
every other round), the same ratio of the time stage 0 spent computing (its forwards, backwards, I and W,
summed per step: where the step ratio strays from it, the difference is waits and overhead; where both stray
together, the machine ran one side slower), the bubble measured by our timeline on both sides (torch's
per-micro-batch forward, loss, backward, input and weight gradients wrapped in the same recorder), next to the
theory for equal stages and for the costs measured per virtual stage in our run (the last stage also runs the
head and the loss; ``schedules.expected_bubbles``, "n/a" where the installed one cannot time the schedule),
and the activations each rank holds at its peak (the most (micro-batch, chunk) activations it held at once in
a step, as the executor counted them, x the bytes autograd saves for one micro-batch in one chunk, parameters
left out, counted by the memory report's ``SavedTensorCounter``; with several chunks per rank, the bytes of
its largest chunk: a bound).

Width: the default (4 layers x 128) keeps the table comparable with the earlier runs in docs/benchmarks.md;
at that size the fixed per-transfer cost weighs on the bubble. Measure the schedules' goals with
``--width 512``, where compute dominates the per-transfer cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
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

from lightning_parallel.pipeline.schedules import SCHEDULES, expected_bubbles  # noqa: E402
from lightning_parallel.pipeline.timeline import bubble  # noqa: E402

RANKS = 2  # pipeline ranks (p), one CPU process each; set by --stages in the launcher and in each worker

#: torch's implementation of each of our schedules (a class of ``torch.distributed.pipelining``), None: none
TORCH_COUNTERPART = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "async": None,
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",  # with one stage per rank (torch has no ZB-H1 class)
    "zbv": "ScheduleZBVZeroBubble",
}
SPLIT_BACKWARD = ("zb_h1", "zbv")  # the schedules that run each backward as I and W


def available_schedules() -> list[str]:
    """The schedules this benchmark knows that the installed package runs (``zbv`` once it has it)."""
    return [s for s in TORCH_COUNTERPART if s in SCHEDULES]


def chunks_per_rank(schedule: str, args: argparse.Namespace) -> int:
    """v: the chunks (virtual stages) each rank holds under ``schedule``."""
    return args.virtual_stages if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1


def virtual_stage(schedule: str, rank: int, chunk: int) -> int:
    """The virtual stage (model order) that ``rank``'s local ``chunk`` holds: V placement for zbv (rank r
    holds r and 2p-1-r), looping for the others (r, r+p, ...); torch's stage indices, and ours."""
    if schedule == "zbv" and chunk % 2 == 1:
        return (chunk + 1) * RANKS - 1 - rank
    return chunk * RANKS + rank


def block_bounds(layers: int, pieces: int) -> list[tuple[int, int]]:
    """[start, end) blocks of each of ``pieces`` virtual stages: equal counts, as ``balance="parameters"``
    cuts equal blocks."""
    size = layers // pieces
    return [(g * size, (g + 1) * size) for g in range(pieces)]


def build_model(args: argparse.Namespace):
    from lightning_parallel.models import CharGPT

    return CharGPT(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64, optimizer="sgd", lr=0.1)


def ours(args: argparse.Namespace) -> None:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_parallel import PipelineParallelStrategy
    from lightning_parallel.data import CharCorpusData

    seed_everything(0)
    timer = step_timer()
    costs = chunk_costs()
    timeline_step = 10 if args.timeline_dir else None
    strategy = PipelineParallelStrategy(
        schedule=args.schedule,
        virtual_stages=args.virtual_stages if args.schedule == "interleaved_1f1b" else None,
        num_microbatches=args.microbatches,
        timeline_step=timeline_step,
    )
    root = Path(args.timeline_dir or ".") / f"pipeline_timeline_{args.schedule}_m{args.microbatches}"
    trainer = Trainer(
        accelerator="cpu",
        devices=RANKS,
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
    record = {
        "impl": "ours",
        "schedule": args.schedule,
        "m": args.microbatches,
        "round": args.round,
        "rank": trainer.global_rank,
        "bubble": statistics.median(strategy.bubbles[args.warmup :]),
        "held": max(strategy.peak_held[args.warmup :]),
        "step_ms": statistics.median(timer.times[args.warmup :]) * 1e3,
        "busy_ms": statistics.median(costs.busy[args.warmup :]) * 1e3,
    }
    for (kind, chunk), per_step in costs.per_step.items():
        record[cost_key(kind, chunk)] = statistics.median(per_step[args.warmup :]) * 1e3
    append_record(args.out, record)


def cost_key(kind: str, chunk: int) -> str:
    """The record key of a rank's mean ``kind`` time per micro-batch in its local ``chunk`` (ms)."""
    return f"{kind}_ms{chunk}"


def busy_seconds(events) -> float:
    """The time a rank spent in compute actions (F, B, I, W; torch's loss counted as F) in one step: with the
    step time, what separates a slower step's compute from its waits."""
    from lightning_parallel.pipeline.timeline import COMPUTE

    return sum(e.end - e.start for e in events if e.kind in COMPUTE)


def chunk_costs():
    """A callback that keeps, per training step, this rank's mean time per micro-batch of each kind of
    action (F, B, or I and W) in each of its chunks (from the strategy's timeline): what the theory for
    unequal stages needs."""
    from lightning.pytorch import Callback

    class ChunkCosts(Callback):
        def __init__(self) -> None:
            self.per_step: dict[tuple[str, int], list[float]] = {}
            self.busy: list[float] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            self.busy.append(busy_seconds(trainer.strategy.last_timeline))
            for key, mean in mean_costs(trainer.strategy.last_timeline).items():
                self.per_step.setdefault(key, []).append(mean)

    return ChunkCosts()


def mean_costs(events) -> dict[tuple[str, int], float]:
    """A step's mean time per micro-batch of each (kind of compute action, local chunk), from its timeline
    ``events``: recorded alike for ours and torch's, so the two sides' forwards and backwards compare."""
    from lightning_parallel.pipeline.timeline import COMPUTE

    spans: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.kind in COMPUTE:
            spans.setdefault((e.kind, e.chunk), []).append(e.end - e.start)
    return {key: sum(times) / len(times) for key, times in spans.items()}


def chunk_module(gpt, bounds: list[tuple[int, int]], stage: int):
    """Virtual stage ``stage`` of ``gpt`` as a module for torch's ``PipelineStage``: its blocks (the mask
    computed in ``forward``, as ``CharGPT`` does), after the embeddings in the first, before ln_f and the
    head in the last."""
    import torch
    from torch import nn

    first, last = stage == 0, stage == len(bounds) - 1

    class Chunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = gpt.blocks[slice(*bounds[stage])]
            if first:
                self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
            if last:
                self.ln_f, self.head = gpt.ln_f, gpt.head

        def forward(self, x):
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            if first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(T))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln_f(x)) if last else x

    return Chunk()


def torch_pipelining(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torch.nn import functional as F

    from lightning_parallel.data import CharCorpusData

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt = build_model(args).model
    v = chunks_per_rank(args.schedule, args)
    bounds = block_bounds(args.layers, RANKS * v)
    held = [virtual_stage(args.schedule, rank, c) for c in range(v)]
    modules = [chunk_module(gpt, bounds, g) for g in held]
    stages = [PipelineStage(m, g, len(bounds), torch.device("cpu")) for m, g in zip(modules, held)]
    cls = getattr(pipelining, TORCH_COUNTERPART[args.schedule])

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    timeline = record_timeline(stages, schedule, rank)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    loader = iter(CharCorpusData(batch_size=args.batch_size, block_size=64).train_dataloader())
    starts, ends = 0 in held, len(bounds) - 1 in held
    times, bubbles, busy = [], [], []
    per_step: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.steps):
        x, y = next(loader)
        timeline.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        schedule.step(*((x,) if starts else ()), target=y if ends else None)
        optimizer.step()
        times.append(time.perf_counter() - start)
        bubbles.append(bubble(timeline.events))
        busy.append(busy_seconds(timeline.events))
        for key, mean in mean_costs(timeline.events).items():
            per_step.setdefault(key, []).append(mean)
    record = {
        "impl": "torch",
        "schedule": args.schedule,
        "m": args.microbatches,
        "round": args.round,
        "rank": rank,
        "step_ms": statistics.median(times[args.warmup :]) * 1e3,
        "bubble": statistics.median(bubbles[args.warmup :]),
        "busy_ms": statistics.median(busy[args.warmup :]) * 1e3,
    }
    for (kind, chunk), values in per_step.items():
        record[cost_key(kind, chunk)] = statistics.median(values[args.warmup :]) * 1e3
    append_record(args.out, record)


def record_timeline(stages: list, schedule, rank: int):
    """Our ``Timeline`` around torch's per-micro-batch forward, loss, backward (whole, or its input part
    I) and weight part W of each of this rank's stages, so that torch's bubble is measured exactly as ours
    is (idle share of the span from the first forward to the last backward; the loss counts as forward, as
    in ours). Events carry the stage's local chunk index."""
    from lightning_parallel.pipeline.timeline import Timeline

    timeline = Timeline(rank)
    chunk_of = {id(stage): chunk for chunk, stage in enumerate(stages)}

    def timed(kind, fn, chunk: int):
        """``fn`` (its first argument the micro-batch) recorded as ``kind``, or ``kind(kwargs)``."""

        def wrapper(*args, **kwargs):
            with timeline.record(kind(kwargs) if callable(kind) else kind, args[0], chunk=chunk):
                return fn(*args, **kwargs)

        return wrapper

    def backward_kind(kwargs: dict) -> str:
        return "B" if kwargs.get("full_backward", True) else "I"

    for chunk, stage in enumerate(stages):
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk, chunk)
        stage.backward_one_chunk = timed(backward_kind, stage.backward_one_chunk, chunk)
        stage.backward_weight_one_chunk = timed("W", stage.backward_weight_one_chunk, chunk)
    compute_loss = schedule._maybe_compute_loss

    def timed_loss(stage, output, target_mbs, mb_index, *args, **kwargs):
        """The loss, recorded as a forward of its stage's chunk (torch calls this for every stage; only the
        last computes)."""
        if not stage.is_last:
            return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        with timeline.record("F", mb_index, chunk=chunk_of[id(stage)]):
            return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)

    schedule._maybe_compute_loss = timed_loss
    return timeline


def activation_bytes_per_microbatch(args: argparse.Namespace, pieces: int) -> list[int]:
    """Bytes autograd saves for one micro-batch in each of ``pieces`` virtual stages: the memory report's
    counter (distinct storages, parameters left out), run over each virtual stage's blocks in turn (the
    embeddings in the first, ln_f and the head in the last)."""
    import torch

    from lightning_parallel.memory import SavedTensorCounter

    gpt = build_model(args).model
    idx = torch.randint(0, 128, (args.batch_size // args.microbatches, 64))
    counters = [SavedTensorCounter() for _ in range(pieces)]
    for counter in counters:
        counter.ignore(gpt.parameters())
    starts = {start: g for g, (start, _) in enumerate(block_bounds(args.layers, pieces))}
    T = idx.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    counters[0].start()
    x = gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(T))
    for i, block in enumerate(gpt.blocks):
        if i in starts and starts[i] > 0:
            counters[starts[i] - 1].stop()
            counters[starts[i]].start()
        x = block(x, mask)
    gpt.head(gpt.ln_f(x)).sum()
    counters[-1].stop()
    return [counter.peak for counter in counters]


def theory(schedule: str, m: int, forward, backward, weight, v: int) -> list[float] | None:
    """``schedules.expected_bubbles`` per rank for costs per virtual stage (model order; ``backward`` the
    whole backward, ``weight`` its W part); None where the installed one cannot time this schedule (an
    older signature without chunks or W, or a refused shape)."""
    extra = {}
    if schedule in SPLIT_BACKWARD:
        extra["weight"] = weight
    if v > 1:
        extra["virtual_stages"] = v
    try:
        return expected_bubbles(schedule, RANKS, m, forward, backward, **extra)
    except (TypeError, ValueError):
        return None


def measured_costs(records: list[dict], schedule: str, m: int, v: int) -> tuple[list, list, list]:
    """Our measured mean forward, whole backward (B, or I + W) and weight (W) time per micro-batch of each
    virtual stage, in model order (ms)."""
    pieces = RANKS * v
    forward, backward, weight = [float("nan")] * pieces, [float("nan")] * pieces, [0.0] * pieces
    for rank in range(RANKS):
        for chunk in range(v):
            g = virtual_stage(schedule, rank, chunk)

            def cost(kind: str) -> float:
                return median_of(
                    records, cost_key(kind, chunk), impl="ours", schedule=schedule, m=m, rank=rank
                )

            forward[g] = cost("F")
            if schedule in SPLIT_BACKWARD:
                weight[g] = cost("W")
                backward[g] = cost("I") + weight[g]
            else:
                backward[g] = cost("B")
    return forward, backward, weight


def held_text(count: float, chunk_bytes: list[int]) -> str:
    """``n x MiB = MiB`` for ``count`` (micro-batch, chunk) activations held; with several chunks, "<=" the
    largest chunk's bytes."""
    largest = max(chunk_bytes) / 2**20
    bound = "<=" if len(chunk_bytes) > 1 else ""
    return f"{count:.0f} x {bound}{largest:.1f} = {bound}{count * largest:.1f} MiB"


def main() -> None:
    parser = benchmark_parser(__doc__, rounds=3, steps=20, warmup=5)
    schedules = available_schedules()
    parser.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=schedules,
        default=schedules,
        help="our schedules to run, each with torch's counterpart (default: all)",
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks p, one CPU process each")
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="numbers of micro-batches to run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--layers", type=int, default=4, help="blocks; must divide by --stages x the chunks per rank"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=128,
        help="n_embd; 128 keeps the table comparable with the earlier runs, 512 is where compute dominates "
        "the per-transfer cost (the width the schedules' goals are judged at)",
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=2, help="chunks per rank of interleaved_1f1b (ours and torch's)"
    )
    parser.add_argument(
        "--results", help="JSON-lines file the runs append to, kept (default: a fresh temporary file)"
    )
    parser.add_argument(
        "--timeline-dir", default="", help="write our schedules' step-10 timelines (SVG + trace) here"
    )
    args = parser.parse_args()
    global RANKS
    RANKS = args.stages
    if args.worker:
        ours(args) if args.impl == "ours" else torch_pipelining(args)
        end_worker()
    for schedule in args.schedules:
        pieces = RANKS * chunks_per_rank(schedule, args)
        if args.layers % pieces:
            parser.error(
                f"--layers {args.layers} does not cut into the {pieces} equal virtual stages of {schedule} "
                f"({RANKS} ranks x {pieces // RANKS} chunks); use a multiple of {pieces}"
            )

    out = Path(args.results or Path(tempfile.mkdtemp()) / "results.jsonl")
    args.out = str(out)
    common = worker_args(args, ("batch_size", "layers", "width", "virtual_stages", "stages"))
    if args.timeline_dir:
        common += ["--timeline-dir", str(Path(args.timeline_dir).resolve())]
    runs = [
        (m, impl, schedule)
        for m in args.m
        for schedule in args.schedules
        for impl in ("ours", "torch")
        if impl == "ours" or TORCH_COUNTERPART[schedule]
    ]
    failed: dict[
        str, str
    ] = {}  # a torch counterpart that failed (torch 2.11's ZBV over gloo): its cells show "-"
    for round_, (m, impl, schedule) in interleaved(args.rounds, runs):
        if impl == "torch" and schedule in failed:
            continue
        line = ["--impl", impl, "--schedule", schedule, "--microbatches", str(m), "--round", str(round_)]
        try:
            torchrun(__file__, RANKS, [*line, *common])
        except RuntimeError as error:
            if impl == "ours":
                raise
            failed[schedule] = str(error).strip().splitlines()[-1]
            print(f"torch's {TORCH_COUNTERPART[schedule]} failed; its cells show '-'", file=sys.stderr)
            continue
        print(f"round {round_ + 1}/{args.rounds}: {impl} {schedule} m={m} done", file=sys.stderr)
    report(args, read_records(out))
    for schedule, why in failed.items():
        print(f"\ntorch's {TORCH_COUNTERPART[schedule]} ({schedule}) failed: {why}")


def report(args: argparse.Namespace, records: list[dict]) -> None:
    """The table: one row per (schedule, m), ours and torch's counterpart side by side."""
    print(
        f"\nCharGPT(n_layer={args.layers}, n_embd={args.width}), {RANKS} ranks on {RANKS} CPU processes (gloo), "
        f"batch {args.batch_size}, {args.steps} steps ({args.warmup} warm-up), median over {args.rounds} rounds"
    )
    for schedule in args.schedules:
        v = chunks_per_rank(schedule, args)
        counterpart = TORCH_COUNTERPART[schedule]
        if schedule == "zb_h1":
            counterpart += " with one stage per rank (torch has no ZB-H1 class; same order of F, I, W)"
        print(
            f"  {schedule}: {v} chunk(s) per rank, {args.layers // (RANKS * v)} block(s) each; "
            f"torch: {counterpart or 'none'}"
        )
    print(
        "\n| m | schedule | ours ms | torch ms | torch/ours | compute, torch/ours "
        "| bubble measured, ours (stage 0..p-1) "
        "| torch (stage 0..p-1) | theory, equal stages (B = 2F, W = B/2) "
        "| theory for the measured stage costs (stage 0..p-1) "
        "| activations held at peak, stage 0 / ... / p-1 ((micro-batch, chunk)s x MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in args.m:
        args.microbatches = m
        pieces_run = {RANKS * chunks_per_rank(s, args) for s in args.schedules}
        bytes_of = {pieces: activation_bytes_per_microbatch(args, pieces) for pieces in pieces_run}
        for schedule in args.schedules:
            v = chunks_per_rank(schedule, args)
            pieces = RANKS * v
            mine = {"impl": "ours", "schedule": schedule, "m": m, "rank": 0}
            ours_ms = median_of(records, "step_ms", **mine)
            theirs = median_of(records, "step_ms", **{**mine, "impl": "torch"})
            bubbles = {
                impl: [
                    median_of(records, "bubble", impl=impl, schedule=schedule, m=m, rank=r)
                    for r in range(RANKS)
                ]
                for impl in ("ours", "torch")
            }
            equal = theory(schedule, m, [1.0] * pieces, [2.0] * pieces, [1.0] * pieces, v)
            unequal = (
                theory(schedule, m, *measured_costs(records, schedule, m, v), v)
                if schedule != "async"
                else None
            )
            held = " / ".join(
                held_text(
                    median_of(records, "held", impl="ours", schedule=schedule, m=m, rank=r),
                    [bytes_of[pieces][virtual_stage(schedule, r, c)] for c in range(v)],
                )
                for r in range(RANKS)
            )
            ratio = median_ratio(records, "step_ms", {**mine, "impl": "torch"}, mine)
            compute = median_ratio(records, "busy_ms", {**mine, "impl": "torch"}, mine)
            faster = median_ratio(records, "step_ms", {**mine, "schedule": "gpipe"}, mine)
            note = f" ({faster:.2f}x gpipe)" if schedule == "async" and faster == faster else ""
            expected = "-" if schedule == "async" else percents(unequal) if unequal else "n/a"
            print(
                f"| {m} | {schedule}{note} | {ours_ms:.1f} | {number(theirs, '.1f')} | {number(ratio, '.2f')} | "
                f"{number(compute, '.2f')} | "
                f"{percents(bubbles['ours'])} | {percents(bubbles['torch'])} | "
                f"{f'{equal[0]:.0%}' if equal else 'n/a'} | {expected} | {held} |"
            )


def number(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)


def percents(values: list[float]) -> str:
    return ", ".join("-" if v != v else f"{v:.0%}" for v in values)


if __name__ == "__main__":
    main()
