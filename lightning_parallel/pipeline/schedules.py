"""Pipeline schedules as pure data: for each stage, the ordered list of work it does in one step.

Nothing here communicates or computes; ``executor.py`` runs these lists. ``F i`` is the forward of
micro-batch ``i`` on a stage, ``B i`` its backward. With 3 stages and 4 micro-batches (time ->)::

    gpipe (fill, drain, then one optimizer step)       1f1b (warm-up, one-forward-one-backward, cool-down)
    stage 0: F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3       stage 0: F0 F1 F2 .. .. B0 F3 .. B1 .. B2 .. B3
    stage 1: .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..       stage 1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2: .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..       stage 2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Both do the same work (one F and one B per micro-batch per stage); 1F1B keeps at most
``num_stages - stage`` micro-batches' activations alive instead of all of them. The idle slots (the
bubble) are (p - 1) / (m + p - 1) of a step for both.

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

from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = [
    "Action",
    "gpipe",
    "one_f_one_b",
    "async_step",
    "cooldown",
    "warmup_depth",
    "schedule",
    "max_in_flight",
    "render",
    "SCHEDULES",
    "bubble_fraction",
    "expected_bubbles",
]

SCHEDULES = ("gpipe", "1f1b", "async", "interleaved_1f1b", "zb_h1")
OVERLAPPED = ("gpipe", "1f1b")


def chunks_per_rank(name: str, virtual_stages=None) -> int:  # TEMPORARY
    return (virtual_stages or 2) if name == "interleaved_1f1b" else 2 if name == "zbv" else 1


def placement(name: str, num_stages: int, virtual_stages: int) -> list[int]:  # TEMPORARY
    n = num_stages * virtual_stages
    if name == "zbv":
        return [g if g < num_stages else n - 1 - g for g in range(n)]
    return [g % num_stages for g in range(n)]


def virtual_stages_problem(name, virtual_stages, prefix=""):  # TEMPORARY
    if virtual_stages is None:
        return None
    if name == "interleaved_1f1b":
        if isinstance(virtual_stages, int) and virtual_stages >= 2:
            return None
        return f"{prefix}virtual_stages must be an integer >= 2 with schedule='interleaved_1f1b', got {virtual_stages!r}"
    return f"{prefix}virtual_stages={virtual_stages!r} is for schedule='interleaved_1f1b'; schedule={name!r} sets its own"


def schedule_problem(name, num_stages, num_microbatches, virtual_stages):  # TEMPORARY
    return None


def forward_only(name, num_stages, num_microbatches, stage, virtual_stages=1):  # TEMPORARY
    return [Action("F", i, chunk=c) for c in range(virtual_stages) for i in range(num_microbatches)]


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B", "I", "W"]
    microbatch: int
    batch: int = 0  # 0: this step's batch; -1: the previous batch (async carries its cool-down over)
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + ("'" if self.batch == -1 else "")


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    _check(num_stages, num_microbatches, stage)
    return [Action("F", i) for i in range(num_microbatches)] + [
        Action("B", i) for i in range(num_microbatches)
    ]


def warmup_depth(num_stages: int, num_microbatches: int, stage: int) -> int:
    """How many micro-batches 1F1B keeps in flight on ``stage`` between its forwards and backwards."""
    return min(num_stages - stage - 1, num_microbatches)


def async_step(num_stages: int, num_microbatches: int, stage: int, carried: int) -> list[Action]:
    """One batch's piece of the no-flush 1F1B stream: each forward, then (once more than the warm-up
    depth is in flight) the backward of the oldest micro-batch in flight. The first ``carried``
    backwards are the previous batch's last micro-batches (0 after a flush, else the warm-up depth)."""
    _check(num_stages, num_microbatches, stage)
    depth = warmup_depth(num_stages, num_microbatches, stage)
    if not 0 <= carried <= depth:
        raise ValueError(f"stage {stage} can carry 0..{depth} micro-batches over, not {carried}")
    in_flight = [Action("B", i, -1) for i in range(num_microbatches - carried, num_microbatches)]
    actions = []
    for i in range(num_microbatches):
        actions.append(Action("F", i))
        in_flight.append(Action("B", i))
        if len(in_flight) > depth:
            actions.append(in_flight.pop(0))
    return actions


def cooldown(num_stages: int, num_microbatches: int, stage: int, batch: int = 0) -> list[Action]:
    """The backwards an ``async_step`` leaves in flight, in order (``batch=-1``: run in a later step)."""
    depth = warmup_depth(num_stages, num_microbatches, stage)
    return [Action("B", i, batch) for i in range(num_microbatches - depth, num_microbatches)]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    return async_step(num_stages, num_microbatches, stage, carried=0) + cooldown(
        num_stages, num_microbatches, stage
    )


def schedule(name: str, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 1) -> list[Action]:
    """The actions of ``stage`` for one flushed step of the named schedule (``async`` flushes like 1F1B;
    its no-flush steps are ``async_step``)."""
    if name == "interleaved_1f1b":  # TEMPORARY
        fs = [Action("F", i, chunk=c) for c in range(virtual_stages) for i in range(num_microbatches)]
        return fs + [Action("B", a.microbatch, chunk=a.chunk) for a in reversed(fs)]
    if name == "zb_h1":  # TEMPORARY
        out = []
        for a in one_f_one_b(num_stages, num_microbatches, stage):
            out += [a] if a.kind == "F" else [Action("I", a.microbatch), Action("W", a.microbatch)]
        return out
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches, stage)
    if name in ("1f1b", "async"):
        return one_f_one_b(num_stages, num_microbatches, stage)
    raise ValueError(f"schedule={name!r} is not known; use one of {', '.join(SCHEDULES)}.")


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran but whose backward did not yet (activations held)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a synchronous step in theory, with F and B of equal cost per stage."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def expected_bubbles(
    name: str, num_stages: int, num_microbatches: int, forward: Sequence[float], backward: Sequence[float]
) -> list[float]:
    """The idle share of each stage when stage ``s`` takes ``forward[s]`` and ``backward[s]`` per
    micro-batch and communication is free: the theory for stages of unequal cost.

    ``bubble_fraction`` assumes equal stages; a real model's last stage also runs the head and the
    loss. Each action starts when its stage is free and its input exists (F after the previous stage's
    F, B after the next stage's B). Idle is measured like the timeline's: from the step's start to the
    stage's last action. With equal costs, stage 0 gets ``bubble_fraction``.
    """
    plans = [schedule(name, num_stages, num_microbatches, s) for s in range(num_stages)]
    finished: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * num_stages, [0] * num_stages
    while any(position[s] < len(plans[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if position[s] == len(plans[s]):
                continue
            action = plans[s][position[s]]
            source = s - 1 if action.kind == "F" else s + 1
            needs = (action.kind, source, action.microbatch) if 0 <= source < num_stages else None
            if needs is not None and needs not in finished:
                continue
            cost = forward[s] if action.kind == "F" else backward[s]
            clock[s] = max(clock[s], finished.get(needs, 0.0)) + cost
            finished[(action.kind, s, action.microbatch)] = clock[s]
            position[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - would mean a schedule whose dependencies form a cycle
            raise RuntimeError(f"schedule {name!r} cannot proceed")
    return [1 - num_microbatches * (forward[s] + backward[s]) / clock[s] for s in range(num_stages)]


def render(name: str, num_stages: int, num_microbatches: int) -> str:
    """The schedule as text, one line per stage, in order of execution (no timing)."""
    return "\n".join(
        f"stage {s}: " + " ".join(str(a) for a in schedule(name, num_stages, num_microbatches, s))
        for s in range(num_stages)
    )


def _check(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1 or num_microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"bad schedule shape: stages={num_stages}, microbatches={num_microbatches}, stage={stage}"
        )
