"""What ``lp-train`` shows when a run ends: a short table (``run_table``) and the run's curves (``svg_curves``,
written as ``curves.svg`` beside ``summary.json``): train and validation loss, and samples/s, per step.

Both read only the run's summary (``summary.json``'s body), so ``python -m lightning_parallel.cli.run_report
RUN_DIR`` redraws them for any finished run. The SVG is drawn by hand, as the sweep's chart is
(``cli/sweep.py``): no plotting library is needed.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["run_table", "svg_curves", "peak_memory_per_rank", "planner_line", "PLOT_FILE"]

PLOT_FILE = "curves.svg"
MIB = 2**20


def peak_memory_per_rank(summary: dict[str, Any]) -> list[tuple[int, float, str]]:
    """``(rank, MiB, what)`` per rank at the end of fit: the CUDA allocator's peak on a GPU, else the peak
    resident set of the process."""
    memory = summary.get("memory") or {}
    rows = memory.get("end_of_fit") or memory.get("after_setup") or []
    out = []
    for row in rows:
        cuda = row.get("cuda_max_allocated")
        value, what = (cuda, "CUDA peak") if cuda is not None else (row.get("peak_rss"), "peak resident")
        if value is not None:
            out.append((int(row["rank"]), value / MIB, what))
    return out


def planner_line(planned: dict[str, Any]) -> str:
    """``strategy=auto``'s prediction against the run (``summary['planner']``), one line."""
    predicted, measured, error = planned["predicted"], planned["measured"], planned["error_percent"]

    def pct(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{value:+.1f}%"

    step = measured["step_seconds"]
    peak = measured["peak_bytes"]
    return (
        f"{planned['layout']}: step {predicted['step_seconds'] * 1e3:.4g} ms predicted, "
        f"{'n/a' if step is None else f'{step * 1e3:.4g} ms'} measured (median), error {pct(error['step_time'])}; "
        f"peak per rank {predicted['peak_bytes_per_rank'] / MIB:.4g} MiB predicted, "
        f"{'n/a' if peak is None else f'{peak / MIB:.4g} MiB'} measured, error {pct(error['peak_memory'])}"
    )



def _number(value: Any, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def run_table(summary: dict[str, Any], summary_file: Path, plot_file: Optional[Path]) -> str:
    """The end of a run at a glance: status, losses, throughput, memory per rank, where the files are."""
    rows = [
        (
            "status",
            f"{summary['status']} at step {summary.get('global_step')} after {summary.get('wall_seconds', 0):.1f} s",
        ),
        ("strategy", f"{summary.get('strategy')} on {summary.get('world_size') or '?'} process(es)"),
        ("train loss", _number(summary.get("train_loss"))),
        ("val loss", _number(summary.get("val_loss"))),
        ("samples/s", _number(summary.get("samples_per_second"), 5)),
    ]
    peaks = peak_memory_per_rank(summary)
    if peaks:
        rows.append((f"memory ({peaks[0][2]})", ", ".join(f"rank {r}: {mib:.1f} MiB" for r, mib, _ in peaks)))
    if summary.get("planner") and summary["planner"].get("measured"):
        rows.append(("planned (strategy=auto)", planner_line(summary["planner"])))
    rows.append(("checkpoint", str(summary.get("checkpoint") or "none")))
    rows.append(("summary", str(summary_file)))
    if plot_file is not None:
        rows.append(("curves", str(plot_file)))
    if summary.get("resume"):
        rows.append(("resume with", summary["resume"]))
    if summary.get("error"):
        rows.append(("error", str(summary["error"]).strip().splitlines()[0][:200]))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _panel(
    series: list[tuple[str, str, list[tuple[float, float]]]],
    title: str,
    x0: float,
    width: float,
    height: float,
) -> list[str]:
    """One chart: a line per series (label, color, points), axes scaled to all of them."""
    top, bottom = 40.0, 40.0 + height
    points = [p for _, _, pts in series for p in pts]
    out = [f'<text x="{x0:.1f}" y="24" font-weight="bold">{html.escape(title)}</text>']
    out.append(
        f'<rect x="{x0:.1f}" y="{top}" width="{width:.1f}" height="{height:.1f}" fill="none" stroke="#999"/>'
    )
    if not points:
        out.append(f'<text x="{x0 + 8:.1f}" y="{top + 20:.1f}" fill="#a00">no values recorded</text>')
        return out
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_lo, y_hi = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def at(x: float, y: float) -> str:
        return f"{x0 + width * (x - x_lo) / (x_hi - x_lo):.1f},{bottom - height * (y - y_lo) / (y_hi - y_lo):.1f}"

    for i, (label, color, pts) in enumerate(series):
        if pts:
            path = " ".join(at(x, y) for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(
            f'<text x="{x0 + 110 * i:.1f}" y="{bottom + 34:.1f}" fill="{color}">{html.escape(label)}</text>'
        )
    out.append(f'<text x="{x0 - 4:.1f}" y="{top + 10:.1f}" text-anchor="end">{y_hi:.4g}</text>')
    out.append(f'<text x="{x0 - 4:.1f}" y="{bottom:.1f}" text-anchor="end">{y_lo:.4g}</text>')
    out.append(f'<text x="{x0:.1f}" y="{bottom + 16:.1f}">step {x_lo:.0f}</text>')
    out.append(f'<text x="{x0 + width:.1f}" y="{bottom + 16:.1f}" text-anchor="end">step {x_hi:.0f}</text>')
    return out


def svg_curves(summary: dict[str, Any]) -> str:
    """Loss (train, validation) and samples/s against the step, side by side."""
    train = [(h["step"], h["train_loss"]) for h in summary.get("train_history") or [] if "train_loss" in h]
    val = [(h["step"], h["val_loss"]) for h in summary.get("val_history") or []]
    speed = [
        (h["step"], h["samples_per_second"])
        for h in summary.get("train_history") or []
        if h.get("samples_per_second")
    ]
    width, height, gap = 360.0, 200.0, 90.0
    total_w, total_h = 60 + 2 * width + gap + 20, 40 + height + 50
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{total_w:.0f}" height="{total_h:.0f}" fill="white"/>',
    ]
    parts += _panel(
        [("train loss", "#4a7fb5", train), ("val loss", "#d08c3a", val)], "loss", 60, width, height
    )
    parts += _panel(
        [("samples/s", "#5a9e6f", speed)], "samples/s (since step 1)", 60 + width + gap, width, height
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m lightning_parallel.cli.run_report RUN_DIR")
    run_dir = Path(args[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / PLOT_FILE).write_text(svg_curves(summary))
    print(run_table(summary, run_dir / "summary.json", run_dir / PLOT_FILE))


if __name__ == "__main__":
    main()
