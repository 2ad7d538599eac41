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

``async`` (PipeDream-2BW) has the per-step order of 1F1B, but no flush: the next batch's forwards
start while this batch's backwards drain, see ``async_order``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "gpipe", "one_f_one_b", "schedule", "max_in_flight", "render", "SCHEDULES", "bubble_fraction"]

SCHEDULES = ("gpipe", "1f1b", "async")


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    _check(num_stages, num_microbatches, stage)
    return [Action("F", i) for i in range(num_microbatches)] + [Action("B", i) for i in range(num_microbatches)]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Warm-up forwards, then alternate one backward and one forward, then the remaining backwards."""
    _check(num_stages, num_microbatches, stage)
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < num_microbatches:
        if forward < num_microbatches:
            actions.append(Action("F", forward))
            forward += 1
        actions.append(Action("B", backward))
        backward += 1
    return actions


def schedule(name: str, num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """The actions of ``stage`` for one step of the named schedule (``async`` steps like ``1f1b``)."""
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


def render(name: str, num_stages: int, num_microbatches: int) -> str:
    """The schedule as text, one line per stage, in order of execution (no timing)."""
    return "\n".join(
        f"stage {s}: " + " ".join(str(a) for a in schedule(name, num_stages, num_microbatches, s))
        for s in range(num_stages)
    )


def _check(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1 or num_microbatches < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"bad schedule shape: stages={num_stages}, microbatches={num_microbatches}, stage={stage}")
