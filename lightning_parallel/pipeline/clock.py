"""The clock simulation of a pipeline schedule: every rank's action list run against the others.

Each rank does its actions in list order, one at a time. An action starts when its rank is free and its
inputs exist: the forward of a virtual stage needs the previous virtual stage's forward of that
micro-batch; a backward (``B`` or ``I``) needs its own forward and the next virtual stage's input
gradient; a ``W`` needs its own ``I``. Sends never block and communication is free, so the times are the
schedule's own. A rank whose next action waits for something that never comes deadlocks the pipeline.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from lightning_parallel.pipeline.actions import Action
from lightning_parallel.pipeline.placement import next_stage, previous_stage

__all__ = ["ScheduleError", "run_clock", "check_plans"]

#: what an action made, a forward output or an input gradient: (F or B, rank, chunk, micro-batch)
Product = tuple[str, int, int, int]


class ScheduleError(ValueError):
    """A schedule that cannot run: missing or repeated work, a deadlock, or messages out of order."""


def run_clock(
    name: str,
    plans: Sequence[Sequence[Action]],
    virtual_stages: int,
    cost: Callable[[int, Action], float],
) -> list[list[tuple[float, float]]]:
    """The (start, end) of each rank's actions when rank ``r``'s action ``a`` takes ``cost(r, a)``.
    Raises ``ScheduleError`` naming what each stuck rank waits for if the ranks deadlock."""
    p = len(plans)
    done: dict[Product, float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in plans]
    free = [0.0] * p
    while any(len(times[r]) < len(plans[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while len(times[r]) < len(plans[r]):
                action = plans[r][len(times[r])]
                needs = _needs(name, p, virtual_stages, r, action)
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = start + cost(r, action)
                times[r].append((start, free[r]))
                if action.kind != "W":
                    done[("F" if action.kind == "F" else "B", r, action.chunk, action.microbatch)] = free[r]
                progressed = True
        if not progressed:
            raise ScheduleError(
                f"schedule {name!r} deadlocks: {_waits(name, plans, virtual_stages, times, done)}"
            )
    return times


def check_plans(
    name: str, plans: Sequence[Sequence[Action]], num_microbatches: int, virtual_stages: int
) -> None:
    """Raise ``ScheduleError`` unless every rank does, for each (micro-batch, chunk), one F and either
    one B or one I and one W; the ranks run against each other without deadlock; and every chunk
    receives its activations and gradients in the order their sender sends them (the executor matches
    messages per peer, chunk and kind, in order)."""
    expected = Counter((c, i) for c in range(virtual_stages) for i in range(num_microbatches))
    for r, plan in enumerate(plans):

        def count(kinds: str) -> Counter:
            return Counter((a.chunk, a.microbatch) for a in plan if a.kind in kinds)

        if (
            any(a.batch != 0 for a in plan)
            or not count("F") == count("BI") == expected
            or count("W") != count("I")
        ):
            raise ScheduleError(
                f"schedule {name!r}, rank {r} does not do one F and one B (or one I, then one W) for each of "
                f"{num_microbatches} micro-batches x {virtual_stages} chunks: {' '.join(map(str, plan))}"
            )
    run_clock(name, plans, virtual_stages, lambda r, a: 1.0)
    _check_order(name, plans, virtual_stages)


def _needs(name: str, p: int, v: int, rank: int, action: Action) -> list[Product]:
    """What ``action`` waits for (its inputs), as keys of finished work."""
    chunk, i = action.chunk, action.microbatch
    if action.kind == "W":
        return [("B", rank, chunk, i)]
    if action.kind == "F":
        source = previous_stage(name, p, rank, chunk, v)
        return [] if source is None else [("F", *source, i)]
    source = next_stage(name, p, rank, chunk, v)
    return [("F", rank, chunk, i)] + ([] if source is None else [("B", *source, i)])


def _waits(
    name: str, plans: Sequence[Sequence[Action]], v: int, times: list[list[tuple[float, float]]], done: dict
) -> str:
    stuck = []
    for r, plan in enumerate(plans):
        if len(times[r]) < len(plan):
            action = plan[len(times[r])]
            missing = [n for n in _needs(name, len(plans), v, r, action) if n not in done]
            what = ", ".join(f"{k}{i} of rank {rr} chunk {c}" for k, rr, c, i in missing)
            stuck.append(f"rank {r} at {action} waits for {what}")
    return "; ".join(stuck)


def _check_order(name: str, plans: Sequence[Sequence[Action]], v: int) -> None:
    """Each chunk consumes its neighbours' messages (activations from the previous virtual stage,
    gradients from the next) in the order the neighbour produces them, hand-offs on one rank included."""
    p = len(plans)

    def order(rank: int, chunk: int, kinds: str) -> list[int]:
        return [a.microbatch for a in plans[rank] if a.chunk == chunk and a.kind in kinds]

    for r in range(p):
        for c in range(v):
            for kinds, source in (
                ("F", previous_stage(name, p, r, c, v)),
                ("BI", next_stage(name, p, r, c, v)),
            ):
                if source is not None and order(r, c, kinds) != order(*source, kinds):
                    raise ScheduleError(
                        f"schedule {name!r}: rank {r} chunk {c} takes its {'/'.join(kinds)} inputs in the order "
                        f"{order(r, c, kinds)}, but rank {source[0]} chunk {source[1]} sends them in the order "
                        f"{order(*source, kinds)}"
                    )
