"""Pipeline schedules as pure data: for each stage (rank), the ordered list of work it does in one step.

Nothing here communicates or computes; ``executor.py`` runs these lists. ``F i`` is the forward of
micro-batch ``i`` on a stage, ``B i`` its backward. With 3 stages and 4 micro-batches (time ->, each
action one slot, as ``render(..., timed=True)`` draws them)::

    gpipe (fill, drain, then one optimizer step)       1f1b (warm-up, one-forward-one-backward, cool-down)
    stage 0: F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3       stage 0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1: .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..       stage 1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2: .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..       stage 2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Both do the same work (one F and one B per micro-batch per stage); 1F1B keeps at most
``num_stages - stage`` micro-batches' activations alive instead of all of them. The idle slots (the
bubble) are (p - 1) / (m + p - 1) of a step for both.

``interleaved_1f1b`` (Megatron) gives each rank ``v`` chunks of the model in the looping placement
(``placement.py``); ``F3.1`` is micro-batch 3 on the rank's chunk 1. A micro-batch crosses the ranks
``v`` times, each chunk ``1/v`` of a stage, so the fill and drain shrink ``v``-fold:
(p - 1) / (v m + p - 1) idle. 2 ranks, 4 micro-batches, v = 2::

    rank 0: F0   F1   F0.1 F1.1 F2   B0.1 F3   B1.1 F2.1 B0   F3.1 B1   ..   B2.1 ..   B3.1 B2   B3
    rank 1: ..   F0   F1   F0.1 B0.1 F1.1 B1.1 F2   B0   F3   B1   F2.1 B2.1 F3.1 B3.1 B2   B3   ..

Zero-bubble schedules (Qi et al., ICLR 2024) split a backward into ``I`` (the input's gradient, sent
upstream at once) and ``W`` (the weights' gradient, which nothing waits for) and run the ``W``'s where
1F1B idles. ``zb_h1``, 3 stages and 4 micro-batches (1F1B's B is here two slots, I and W)::

    stage 0: F0 F1 F2 .. .. I0 W0 F3 I1 W1 I2 W2 I3 W3
    stage 1: .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    stage 2: .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

``zbv`` does the same with two chunks per rank in the V placement and comes near no bubble at all.
``clock.py`` runs the lists against each other: ``verify_schedule`` checks a schedule with it, and
``expected_bubbles`` times it for given costs.

``async`` (PipeDream-2BW) is 1F1B with no flush: one endless stream in which stage ``s`` keeps
``w = p - s - 1`` micro-batches in flight, so batch t+1's first forwards fill batch t's cool-down.
``async_step`` cuts that stream at batch boundaries, one piece per training step; the backwards a
piece carries over from the previous batch are marked ``batch=-1``. 2 stages, 4 micro-batches::

    step t                          step t+1
    stage 0: F0 B3' F1 B0 F2 B1 F3 B2 | F0 B3 F1 B0 ...      (B3' = batch t-1's micro-batch 3)
    stage 1: F0 B0  F1 B1 F2 B2 F3 B3 | F0 B0 F1 B1 ...

``cooldown`` lists what is still in flight when the stream must stop (before a checkpoint, at the
end of an epoch or of fit). 1F1B itself is one ``async_step`` from an empty pipeline plus its cool-down.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from lightning_parallel.pipeline.actions import Action
from lightning_parallel.pipeline.clock import ScheduleError, check_plans, run_clock
from lightning_parallel.pipeline.placement import global_stage

__all__ = [
    "Action",
    "gpipe",
    "one_f_one_b",
    "async_step",
    "cooldown",
    "warmup_depth",
    "interleaved_1f1b",
    "interleaved_round",
    "interleaved_warmup",
    "zb_h1",
    "zbv",
    "schedule",
    "chunks_per_rank",
    "virtual_stages_problem",
    "schedule_problem",
    "forward_only",
    "verify_schedule",
    "ScheduleError",
    "max_in_flight",
    "activation_bound",
    "render",
    "SCHEDULES",
    "OVERLAPPED",
    "SPLIT_BACKWARD",
    "bubble_fraction",
    "zb_h1_bubble_fraction",
    "expected_bubbles",
]

SCHEDULES = ("gpipe", "1f1b", "async", "interleaved_1f1b", "zb_h1", "zbv")
#: the schedules with one chunk per rank and whole backwards: a data-parallel bucket is finished by one
#: backward (the step's last), so its average can start during it
OVERLAPPED = ("gpipe", "1f1b")
#: the schedules that split each backward into I and W (``split_backward.py``)
SPLIT_BACKWARD = ("zb_h1", "zbv")


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    _check_shape(num_stages, num_microbatches, stage)
    return [Action("F", i) for i in range(num_microbatches)] + [
        Action("B", i) for i in range(num_microbatches)
    ]


def warmup_depth(num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 1) -> int:
    """How many forwards (of chunks) ``stage`` runs ahead of its backwards in the (async) 1F1B stream:
    1F1B's ``p - stage - 1`` with one chunk, interleaved 1F1B's warm-up (``interleaved_warmup``) with
    ``virtual_stages`` chunks in the looping placement."""
    if virtual_stages > 1:
        return interleaved_warmup(num_stages, num_microbatches, stage, virtual_stages)
    return min(num_stages - stage - 1, num_microbatches)


def _stream_order(
    num_stages: int, num_microbatches: int, virtual_stages: int, backward: bool
) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) order of one batch's forwards or backwards in the 1F1B stream."""
    if virtual_stages == 1:
        return [(i, 0) for i in range(num_microbatches)]
    return _looping_order(num_stages, num_microbatches, virtual_stages, backward)


def async_step(
    num_stages: int, num_microbatches: int, stage: int, carried: int, virtual_stages: int = 1
) -> list[Action]:
    """One batch's piece of the no-flush 1F1B stream: each forward, then (once more than the warm-up
    depth is in flight) the oldest backward in flight. The first ``carried`` backwards are the previous
    batch's last (0 after a flush, else the warm-up depth). With ``virtual_stages`` chunks (looping) it
    is interleaved 1F1B's stream: the forwards and backwards in its round order, one batch after another."""
    _check_shape(num_stages, num_microbatches, stage)
    if virtual_stages > 1:
        problem = schedule_problem("async", num_stages, num_microbatches, virtual_stages)
        if problem is not None:
            raise ValueError(problem)
    depth = warmup_depth(num_stages, num_microbatches, stage, virtual_stages)
    if not 0 <= carried <= depth:
        raise ValueError(f"stage {stage} can carry 0..{depth} micro-batches over, not {carried}")
    forwards = _stream_order(num_stages, num_microbatches, virtual_stages, backward=False)
    backwards = _stream_order(num_stages, num_microbatches, virtual_stages, backward=True)
    in_flight = [Action("B", i, -1, c) for i, c in backwards[len(backwards) - carried :]]
    actions = []
    for (i, c), (j, d) in zip(forwards, backwards):
        actions.append(Action("F", i, chunk=c))
        in_flight.append(Action("B", j, chunk=d))
        if len(in_flight) > depth:
            actions.append(in_flight.pop(0))
    return actions


def cooldown(
    num_stages: int, num_microbatches: int, stage: int, batch: int = 0, virtual_stages: int = 1
) -> list[Action]:
    """The backwards an ``async_step`` leaves in flight, in order (``batch=-1``: run in a later step)."""
    depth = warmup_depth(num_stages, num_microbatches, stage, virtual_stages)
    backwards = _stream_order(num_stages, num_microbatches, virtual_stages, backward=True)
    return [Action("B", i, batch, c) for i, c in backwards[len(backwards) - depth :]]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    return async_step(num_stages, num_microbatches, stage, carried=0) + cooldown(
        num_stages, num_microbatches, stage
    )


def interleaved_round(num_stages: int, num_microbatches: int) -> int:
    """How many micro-batches interleaved 1F1B runs through all chunks together (Megatron's group): ``m``
    in ``m // p`` equal rounds, so one round of ``m`` when ``m < 2p`` and ``p`` when ``p`` divides ``m``.

    Rounds must be equal: a shorter last round deadlocks (its forwards on the later chunks wait for
    forwards that the ranks run only after backwards that wait for them). So ``m`` must be below ``2p``
    or a multiple of ``m // p``; other values raise, naming the nearest ones that work."""
    problem = _rounds_problem(num_stages, num_microbatches)
    if problem is not None:
        raise ValueError(problem)
    return num_microbatches // max(1, num_microbatches // num_stages)


def interleaved_warmup(num_stages: int, num_microbatches: int, stage: int, virtual_stages: int) -> int:
    """How many forwards (of chunks) interleaved 1F1B runs on ``stage`` before its first backward
    (Megatron's count): a round through every chunk but the last, plus two per stage below this one."""
    first_round = interleaved_round(num_stages, num_microbatches)
    warmup = (virtual_stages - 1) * first_round + 2 * (num_stages - stage - 1)
    return min(warmup, num_microbatches * virtual_stages)


def interleaved_1f1b(num_stages: int, num_microbatches: int, stage: int, virtual_stages: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the rank holds ``virtual_stages`` chunks in the looping placement.
    The micro-batches go in rounds (``interleaved_round``); a round runs through chunk 0, then chunk 1,
    ... (its backwards through the last chunk first). Warm-up forwards (``interleaved_warmup``), then
    one forward and one backward, then the remaining backwards."""
    _check_shape(num_stages, num_microbatches, stage)
    _require_placeable("interleaved_1f1b", virtual_stages)
    forwards = _looping_order(num_stages, num_microbatches, virtual_stages, backward=False)
    backwards = _looping_order(num_stages, num_microbatches, virtual_stages, backward=True)
    warmup = interleaved_warmup(num_stages, num_microbatches, stage, virtual_stages)
    actions = [Action("F", i, chunk=c) for i, c in forwards[:warmup]]
    for (i, c), (j, d) in zip(forwards[warmup:], backwards):
        actions += [Action("F", i, chunk=c), Action("B", j, chunk=d)]
    return actions + [Action("B", j, chunk=d) for j, d in backwards[len(forwards) - warmup :]]


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's order, each backward
    split into ``I`` and ``W``. Stage ``s`` defers up to ``s`` W's, which the later stages (idle
    longest at the end of 1F1B) run in the cool-down; every stage then holds at most ``num_stages``
    micro-batches, 1F1B's peak (its stage 0)."""
    actions, deferred = [], []
    for a in one_f_one_b(num_stages, num_microbatches, stage):
        if a.kind == "F":
            actions.append(a)
            continue
        actions.append(Action("I", a.microbatch))
        deferred.append(Action("W", a.microbatch))
        if len(deferred) > stage:
            actions.append(deferred.pop(0))
    return actions + deferred


def zbv(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZBV (Qi et al., section 6): two chunks per rank in the V placement, chunk 0 on the way down and
    chunk 1 on the way back up, backwards split into ``I`` and ``W``. Rank ``r`` (of ``p``):

    - fill: 2(p - r) - 1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0);
    - p - r times F, I, W of chunk 1;
    - steady: F chunk 0 (while any is left), I and W chunk 0, F, I and W chunk 1;
    - drain: r pairs (I chunk 0, I chunk 1), p - r pairs (I chunk 0, oldest W chunk 0), then the W's
      still owed, chunk 1's first.

    The pattern fills the V with 2p - 1 micro-batches; with fewer, it is the pattern for 2p - 1 without
    the missing micro-batches' actions. A rank holds at most 2p chunks' activations: p stages' worth.
    """
    _check_shape(num_stages, num_microbatches, stage)
    p, r = num_stages, stage
    n = max(num_microbatches, 2 * p - 1)
    steps = (
        [("F", 0)] * (2 * (p - r) - 1) + [("F", 1), ("F", 0)] * r + [("F", 1), ("I", 1), ("W", 1)] * (p - r)
    )
    for k in range(n - p):
        steps += [("F", 0)] * (2 * p - r - 1 + k < n) + [("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1)]
    steps += [("I", 0), ("I", 1)] * r + [("I", 0), ("W", 0)] * (p - r)
    steps += [("W", 1)] * (n - steps.count(("W", 1))) + [("W", 0)] * (n - steps.count(("W", 0)))
    numbered: Counter = Counter()
    actions = []
    for kind, chunk in steps:
        numbered[kind, chunk] += 1
        if numbered[kind, chunk] <= num_microbatches:
            actions.append(Action(kind, numbered[kind, chunk] - 1, chunk=chunk))
    return actions


def schedule(
    name: str, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> list[Action]:
    """The actions of ``stage`` (a rank) for one flushed step of the named schedule (``async`` flushes
    like 1F1B; its no-flush steps are ``async_step``)."""
    _require_placeable(name, virtual_stages)
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches, stage)
    if name == "async":  # one async step from an empty pipeline, then its cool-down
        return async_step(num_stages, num_microbatches, stage, 0, virtual_stages) + cooldown(
            num_stages, num_microbatches, stage, 0, virtual_stages
        )
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches, stage)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_stages, num_microbatches, stage, virtual_stages)
    if name == "zb_h1":
        return zb_h1(num_stages, num_microbatches, stage)
    return zbv(num_stages, num_microbatches, stage)


def chunks_per_rank(name: str, virtual_stages: Optional[int] = None) -> int:
    """How many chunks (virtual stages) each rank holds under the named schedule: ``virtual_stages``
    (None: 2) for interleaved 1F1B, (None: 1) for async, 2 for zbv, 1 for the others."""
    if name == "interleaved_1f1b":
        return 2 if virtual_stages is None else virtual_stages
    if name == "async":
        return 1 if virtual_stages is None else virtual_stages
    return 2 if name == "zbv" else 1


def virtual_stages_problem(name: str, virtual_stages: Optional[int], prefix: str = "") -> Optional[str]:
    """What is wrong with ``virtual_stages`` chunks per rank for the named schedule; None if nothing (None
    takes the schedule's own, ``chunks_per_rank``). An unknown ``name`` is left to the schedule check."""
    if virtual_stages is None or name not in SCHEDULES:
        return None
    given = f"{prefix}virtual_stages={virtual_stages!r} with schedule={name!r}"
    if name == "interleaved_1f1b":
        if isinstance(virtual_stages, int) and not isinstance(virtual_stages, bool) and virtual_stages >= 2:
            return None
        return f"{given}: it needs an integer >= 2 chunks per rank (with one chunk it is schedule='1f1b')."
    if name == "async":
        if isinstance(virtual_stages, int) and not isinstance(virtual_stages, bool) and virtual_stages >= 1:
            return None
        return f"{given}: it needs an integer >= 1 chunks per rank (>= 2: the looping placement)."
    if virtual_stages == chunks_per_rank(name):
        return None
    if name == "zbv":
        return f"{given}: it places exactly 2 chunks per rank (the V)."
    return (
        f"{given}, which runs one chunk per rank; several chunks per rank need "
        "schedule='interleaved_1f1b' (virtual_stages >= 2) or schedule='zbv' (2)."
    )


def schedule_problem(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: Optional[int] = None
) -> Optional[str]:
    """What keeps the named schedule from running ``num_microbatches`` on ``num_stages`` ranks with
    ``virtual_stages`` chunks each; None if nothing. The one check of a schedule's shape: the pipeline
    strategies call it at set-up (``virtual_stages_problem``, its part that needs no sizes, also at
    construction); the schedule builders raise its name and chunk parts."""
    problem = _name_problem(name) or virtual_stages_problem(name, virtual_stages)
    if problem is None and name == "1f1b" and num_microbatches < num_stages:
        problem = (
            f"schedule='1f1b' needs num_microbatches >= the number of stages ({num_stages}), got "
            f"{num_microbatches} (with fewer it is gpipe); raise num_microbatches or use schedule='gpipe'."
        )
    looping = name == "interleaved_1f1b" or (name == "async" and (virtual_stages or 1) > 1)
    if problem is None and looping:
        problem = _rounds_problem(num_stages, num_microbatches, name)
    if problem is None and looping and name == "async":
        problem = _third_version_problem(num_stages, num_microbatches, virtual_stages)
    return problem


def _require_placeable(name: str, virtual_stages: int) -> None:
    """Refuse an unknown schedule, or a number of chunks per rank that it cannot place (the part of
    ``schedule_problem`` that the schedule builders check)."""
    problem = _name_problem(name) or virtual_stages_problem(name, virtual_stages)
    if problem is not None:
        raise ValueError(problem)


def forward_only(
    name: str, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> list[Action]:
    """The forwards of an evaluation step: every micro-batch through chunk 0, then chunk 1, ... Each
    rank's chunks lie in model order in both placements, so no rank waits on a later one of its own."""
    _require_placeable(name, virtual_stages)
    _check_shape(num_stages, num_microbatches, stage)
    return [Action("F", i, chunk=c) for c in range(virtual_stages) for i in range(num_microbatches)]


def verify_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ``ScheduleError`` unless the named schedule's ranks, run against each other by the clock
    simulation, do all the work once, without deadlock, with messages in order (``clock.check_plans``)."""
    plans = [schedule(name, num_stages, num_microbatches, s, virtual_stages) for s in range(num_stages)]
    check_plans(name, plans, num_microbatches, virtual_stages)


def max_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose forward ran but whose backward did not yet finish (its
    ``B``, or its ``W`` for a split one): the activations held, in chunks (a chunk is 1/v of a stage).
    An upper bound for split ones: after its ``I`` a micro-batch keeps only what its ``W`` needs."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
        peak = max(peak, live)
    return peak


def activation_bound(
    name: str, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> int:
    """The schedule's theoretical ``max_in_flight`` on ``stage``, in chunks: gpipe all ``m``; 1F1B
    ``p - stage``; interleaved its warm-up plus one (stage 0: ``p * v + p - 1`` chunks, Megatron's
    ``p * (1 + (p - 1) / (p * v))`` stages); ZB-H1 ``p`` on every stage and ZBV ``2p`` chunks, both
    1F1B's peak of ``p`` stages. Never more than all ``m * v``."""
    _require_placeable(name, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name == "interleaved_1f1b":
        return min(interleaved_warmup(p, m, stage, v) + 1, m * v)
    if name == "async":  # its warm-up plus one, across batches too
        return min(warmup_depth(p, m, stage, v) + 1, m * v)
    bound = {"gpipe": m, "1f1b": p - stage, "zb_h1": p, "zbv": 2 * p}[name]
    return min(bound, m * v)


def bubble_fraction(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a synchronous step in theory, with F and B of equal cost per stage (each
    chunk 1/v of it): (p - 1) / (v * m + p - 1). Megatron's (p - 1) / (v * m) is the same idle time
    relative to the busy time instead of the whole step. For interleaved 1F1B it holds when m >= p."""
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def zb_h1_bubble_fraction(
    num_stages: int, num_microbatches: int, forward: float, backward_input: float, weight: float
) -> float:
    """ZB-H1's idle share of stage 0 in theory: (p - 1)(F + I - W) idle against 1F1B's (p - 1)(F + I + W)
    (the paper's (p - 1)(F + B - 2W), B the full backward), over m (F + I + W) busy. The clock
    simulation agrees when m >= p and W <= F; beyond that, ``expected_bubbles`` is the theory."""
    idle = (num_stages - 1) * (forward + backward_input - weight)
    return idle / (num_microbatches * (forward + backward_input + weight) + idle)


def expected_bubbles(
    name: str,
    num_stages: int,
    num_microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Optional[Sequence[float]] = None,
    virtual_stages: int = 1,
) -> list[float]:
    """The idle share of each rank when virtual stage ``g`` (model order, 0..p*v-1) takes ``forward[g]``
    and ``backward[g]`` (its full backward) per micro-batch and communication is free: the theory for
    stages of unequal cost.

    Split schedules run the backward as ``I`` (``backward[g] - weight[g]``) and ``W`` (``weight[g]``);
    without ``weight``, half the backward each (a linear layer's backward is two matmuls of equal cost).
    ``bubble_fraction`` assumes equal stages; a real model's last stage also runs the head and the loss.
    Timing is ``clock.run_clock``'s. Idle is measured like the timeline's: from the step's start to the
    rank's last action. With equal costs, stage 0 of gpipe and 1F1B gets ``bubble_fraction``, and so
    does interleaved 1F1B's when m >= p.
    """
    p, v = num_stages, virtual_stages
    weight = [b / 2 for b in backward] if weight is None else weight
    if not len(forward) == len(backward) == len(weight) == p * v:
        raise ValueError(
            f"give one forward, backward and weight cost per virtual stage ({p} x {v} = {p * v}), got "
            f"{len(forward)}, {len(backward)} and {len(weight)}"
        )
    if not all(0 <= w <= b for w, b in zip(weight, backward)):
        raise ValueError(f"each weight cost is a part of its full backward cost: {weight} against {backward}")
    costs = {"F": forward, "B": backward, "I": [b - w for b, w in zip(backward, weight)], "W": weight}

    def cost(rank: int, action: Action) -> float:
        return costs[action.kind][global_stage(name, p, rank, action.chunk, v)]

    plans = [schedule(name, p, num_microbatches, r, v) for r in range(p)]
    times = run_clock(name, plans, v, cost)
    return [1 - sum(cost(r, a) for a in plans[r]) / times[r][-1][1] for r in range(p)]


def render(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1, timed: bool = False
) -> str:
    """The schedule as text, one line per stage (rank), in order of execution. ``timed``: on the clock
    of ``clock.run_clock`` with every action one slot long, ``..`` for an idle slot."""
    p, v = num_stages, virtual_stages
    plans = [schedule(name, p, num_microbatches, s, v) for s in range(p)]
    label = "stage" if v == 1 else "rank"
    if not timed:
        return "\n".join(f"{label} {s}: " + " ".join(map(str, plan)) for s, plan in enumerate(plans))
    times = run_clock(name, plans, v, lambda r, a: 1.0)
    width = max(len(str(a)) for plan in plans for a in plan)
    slots = int(max(t[-1][1] for t in times))
    lines = []
    for s, plan in enumerate(plans):
        cells = [".."] * slots
        for a, (start, _) in zip(plan, times[s]):
            cells[int(start)] = str(a)
        lines.append(f"{label} {s}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def _looping_order(
    num_stages: int, num_microbatches: int, virtual_stages: int, backward: bool
) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) order of interleaved 1F1B: round after round, each through every chunk
    in turn (the last chunk first for the backwards)."""
    size = interleaved_round(num_stages, num_microbatches)
    chunks = range(virtual_stages - 1, -1, -1) if backward else range(virtual_stages)
    return [
        (i, c)
        for first in range(0, num_microbatches, size)
        for c in chunks
        for i in range(first, first + size)
    ]


def _name_problem(name: str) -> Optional[str]:
    return (
        None if name in SCHEDULES else f"schedule={name!r} is not known; use one of {', '.join(SCHEDULES)}."
    )


def _third_version_problem(num_stages: int, num_microbatches: int, virtual_stages: int) -> Optional[str]:
    """Why the async stream over ``virtual_stages`` looping chunks would need a third weight version (None:
    two suffice): rank 0 runs ``interleaved_warmup`` forwards ahead of its backwards, and when that is more
    than a batch's ``m * v`` the last backwards of batch t still wait when batch t + 2's first forward must
    run on W(t + 1), a version that needs batch t's gradient (``pipeline_async.py``)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    ahead = (v - 1) * interleaved_round(p, m) + 2 * (p - 1)
    if ahead <= m * v:
        return None
    works = next(
        n
        for n in range(m + 1, 4 * p + 1)
        if _rounds_problem(p, n) is None and ((v - 1) * interleaved_round(p, n) + 2 * (p - 1) <= n * v)
    )
    return (
        f"schedule='async' with virtual_stages={v} on {p} stages and num_microbatches={m}: rank 0 runs "
        f"{ahead} chunk forwards ahead of its backwards ((v - 1) x a round of {interleaved_round(p, m)} + "
        f"2 x (p - 1)), more than a batch's {m} x {v} = {m * v}, so batch t's last backwards would still be "
        f"waiting when batch t + 2's forwards start: PipeDream-2BW's rule would need a third weight version "
        f"(W(t - 1) for batch t, W(t) for batch t + 1, W(t + 1) for batch t + 2), and it keeps two. Use "
        f"num_microbatches >= {works} (two versions suffice when m x v >= that warm-up), or virtual_stages=1."
    )


def _rounds_problem(num_stages: int, num_microbatches: int, name: str = "interleaved_1f1b") -> Optional[str]:
    rounds = max(1, num_microbatches // num_stages)
    if num_microbatches % rounds == 0:
        return None
    p, m = num_stages, num_microbatches
    works = [n for n in range(1, 2 * m) if n < 2 * p or n % (n // p) == 0]
    below, above = max(n for n in works if n < m), min(n for n in works if n > m)
    return (
        f"schedule={name!r} runs the micro-batches in equal rounds of {p} to {2 * p - 1} "
        f"(num_microbatches // {p} rounds; a shorter last round would deadlock), so num_microbatches must be "
        f"below {2 * p} or a multiple of num_microbatches // {p}; got {m}: use {below} or {above} (any "
        f"multiple of {p} works)."
    )


def _check_shape(num_stages: int, num_microbatches: int, stage: int) -> None:
    """Refuse a pipeline without stages or micro-batches, or a stage outside it (a caller's bug)."""
    if num_stages < 1 or num_microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"bad schedule shape: stages={num_stages}, microbatches={num_microbatches}, stage={stage}"
        )
