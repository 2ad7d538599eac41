"""What each stage did and when during a step: forwards, backwards and waits for communication.

From the events we get the measured bubble (the share of a step a stage spends not computing), a
Chrome-trace JSON (open it in https://ui.perfetto.dev or chrome://tracing) and an SVG picture with
one row per rank, F and B blocks (I and W where a zero-bubble schedule splits the backward), and the idle
gaps visible as empty space.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

__all__ = ["COMPUTE", "Event", "Timeline", "bubble", "write_chrome_trace", "write_svg"]

COMPUTE = ("F", "B", "I", "W")  # the kinds of event that compute (the rest is waiting)


@dataclass
class Event:
    rank: int
    kind: str  # "F", "B" (whole backward), "I" (input gradient), "W" (weight gradient) or "wait"
    microbatch: int
    start: float
    end: float
    previous: bool = False  # async: a backward of the previous batch, carried into this step
    chunk: int = 0  # the rank's local chunk (interleaved and V-shaped schedules hold several)

    @property
    def label(self) -> str:
        """``F2``, ``B0``, ``B3'`` for the previous batch's micro-batch 3, ``F2.1`` for chunk 1's."""
        return (
            f"{self.kind}{self.microbatch}"
            + (f".{self.chunk}" if self.chunk else "")
            + ("'" if self.previous else "")
        )


@dataclass
class Timeline:
    """Events of one step on one rank."""

    rank: int
    events: list[Event] = field(default_factory=list)

    @contextmanager
    def record(self, kind: str, microbatch: int, previous: bool = False, chunk: int = 0) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(
                Event(self.rank, kind, microbatch, start, time.perf_counter(), previous, chunk)
            )

    def clear(self) -> None:
        self.events.clear()


def bubble(events: list[Event]) -> float:
    """1 - (compute time / step span) on one rank: the idle share, waits included."""
    compute = [e for e in events if e.kind in COMPUTE]
    if not compute:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in compute)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def _normalised(events: list[Event]) -> list[Event]:
    t0 = min(e.start for e in events)
    return [
        Event(e.rank, e.kind, e.microbatch, e.start - t0, e.end - t0, e.previous, e.chunk) for e in events
    ]


def write_chrome_trace(events: list[Event], path: Path) -> Path:
    """Events of all ranks (clocks of one machine, or roughly aligned) as a Chrome trace."""
    trace = [
        {
            "name": e.label if e.kind != "wait" else "wait",
            "cat": e.kind,
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "pid": 0,
            "tid": e.rank,
        }
        for e in _normalised(events)
    ]
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def write_svg(events: list[Event], path: Path, title: str = "") -> Path:
    """Ranks as rows, F (blue) and B (green) blocks labelled with the micro-batch, waits in grey."""
    events = _normalised(events)
    ranks = sorted({e.rank for e in events})
    span = max(e.end for e in events) or 1.0
    width, row, left, top = 900, 34, 60, 30
    scale = (width - left - 10) / span
    colors = {"F": "#4c78a8", "B": "#54a24b", "I": "#54a24b", "W": "#e4a33a", "wait": "#d0d0d0"}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + row * len(ranks) + 30}" '
        'font-family="monospace" font-size="11">',
        f'<text x="{left}" y="18">{title} ({span * 1e3:.1f} ms)</text>',
    ]
    for i, rank in enumerate(ranks):
        y = top + i * row
        parts.append(f'<text x="4" y="{y + 20}">rank {rank}</text>')
        for e in (e for e in events if e.rank == rank):
            x, w = left + e.start * scale, max(1.0, (e.end - e.start) * scale)
            h = row - 8 if e.kind != "wait" else 6
            dy = 0 if e.kind != "wait" else row - 14
            label = e.label if e.kind != "wait" else f"wait (micro-batch {e.microbatch})"
            parts.append(
                f'<rect x="{x:.1f}" y="{y + dy}" width="{w:.1f}" height="{h}" fill="{colors[e.kind]}" '
                f'stroke="white" stroke-width="0.5"><title>{label}: {(e.end - e.start) * 1e3:.2f} ms</title></rect>'
            )
            if e.kind != "wait" and w > 14:
                parts.append(f'<text x="{x + 3:.1f}" y="{y + 17}" fill="white">{e.label}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path


def to_dicts(events: list[Event]) -> list[dict]:
    return [asdict(e) for e in events]


def from_dicts(items: list[dict]) -> list[Event]:
    return [Event(**d) for d in items]
