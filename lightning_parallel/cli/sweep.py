"""The summary of a sweep: one row per job, as CSV, Markdown and a small SVG chart, in the sweep folder.

Built from the files the jobs leave (``.hydra/overrides.yaml`` and ``summary.json`` in each job
folder), not from in-memory results, so it works for every Hydra launcher (jobs in this process, in
joblib workers, or on SLURM) and lists a job that died without writing its summary as "no summary".

A ``summary.json`` that cannot be read (a job killed while an older version wrote it) is listed as
"unreadable summary" with the reason; the other jobs are listed as usual.

``SweepSummaryCallback`` (wired in ``conf/config.yaml``) writes it when a multirun ends and exits with
status 1 if a job failed, or 75 (``lp-train``'s preempted status) if jobs were preempted and none failed.
``python -m lightning_parallel.cli.sweep SWEEP_DIR`` rewrites it.
"""

from __future__ import annotations

import csv
import html
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "collect_jobs",
    "write_summary",
    "markdown_table",
    "svg_chart",
    "sweep_exit_status",
    "SweepSummaryCallback",
    "COLUMNS",
]

log = logging.getLogger("lp-train.sweep")

COLUMNS = (
    "job",
    "overrides",
    "status",
    "strategy",
    "devices",
    "world_size",
    "global_step",
    "samples_per_second",
    "seconds_per_step",
    "train_loss",
    "val_loss",
    "memory_parameters_mib",
    "memory_gradients_mib",
    "memory_optimizer_state_mib",
    "memory_activations_mib",
    "memory_peak_rss_mib",
    "wall_seconds",
    "error",
)


def _job_sort_key(path: Path) -> tuple:
    name = path.name
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (a folder holding ``.hydra/overrides.yaml``)."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted({p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}, key=_job_sort_key)
    rows = []
    for job_dir in job_dirs:
        overrides = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row["job"] = str(job_dir.relative_to(sweep_dir))
        row["overrides"] = " ".join(str(o) for o in (overrides or []))
        summary_path = job_dir / "summary.json"
        summary = _read_summary(summary_path) if summary_path.is_file() else None
        if isinstance(summary, str):
            row["status"] = "unreadable summary"
            row["error"] = summary
            log.warning("%s: %s", row["job"], summary)
        elif summary is not None:
            for column in COLUMNS[2:]:
                row[column] = summary.get(column)
            if row["error"]:
                lines = [line.strip() for line in str(row["error"]).strip().splitlines() if line.strip()]
                first = lines[0] if not lines[0].endswith(":") or len(lines) < 2 else f"{lines[0]} {lines[1]}"
                row["error"] = first[:200]
        else:
            row["status"] = "no summary"
            row["error"] = "the job wrote no summary.json (killed, or not started)"
        rows.append(row)
    return rows


def _read_summary(path: Path) -> dict[str, Any] | str:
    """A job's summary, or why it cannot be read."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path.name} cannot be read ({type(err).__name__}: {err})"
    return summary if isinstance(summary, dict) else f"{path.name} holds no JSON object"


def sweep_exit_status(rows: list[dict[str, Any]]) -> int:
    """1 if a job failed (or left no readable summary), else 75 if a job was preempted, else 0."""
    from lightning_parallel.cli.train import EXIT_FAILED, EXIT_PREEMPTED

    statuses = {r["status"] for r in rows} - {"completed"}
    if statuses - {"preempted"}:
        return EXIT_FAILED
    return EXIT_PREEMPTED if statuses else 0


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [_fmt(row[c]).replace("|", "\\|").replace("\n", " ") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bars(
    rows: list[dict[str, Any]],
    key: str,
    title: str,
    x0: float,
    width: float,
    top: float,
    row_h: float,
    color: str,
) -> list[str]:
    values = [r[key] if isinstance(r[key], (int, float)) else None for r in rows]
    peak = max([v for v in values if v is not None] or [1.0]) or 1.0
    out = [f'<text x="{x0:.1f}" y="{top - 12:.1f}" font-weight="bold">{html.escape(title)}</text>']
    for i, value in enumerate(values):
        y = top + i * row_h
        if value is None:
            out.append(
                f'<text x="{x0 + 4:.1f}" y="{y + row_h * 0.65:.1f}" fill="#a00">'
                f"n/a ({html.escape(str(rows[i]['status']))})</text>"
            )
            continue
        w = max(width * value / peak, 1.0)
        out.append(
            f'<rect x="{x0:.1f}" y="{y + 3:.1f}" width="{w:.1f}" height="{row_h - 6:.1f}" fill="{color}"/>'
        )
        out.append(f'<text x="{x0 + w + 4:.1f}" y="{y + row_h * 0.65:.1f}">{_fmt(float(value))}</text>')
    return out


def _model_states(row: dict[str, Any]) -> Optional[float]:
    """The largest rank's parameters + gradients + optimizer state (MiB), where the report has them."""
    parts = [row[f"memory_{n}_mib"] for n in ("parameters", "gradients", "optimizer_state")]
    return sum(parts) if all(isinstance(p, (int, float)) for p in parts) else None


def svg_chart(rows: list[dict[str, Any]]) -> str:
    """Horizontal bars per job: samples/s, final validation loss (train loss where no validation ran), and
    the largest rank's memory (model states, saved activations, peak resident)."""
    rows = [
        dict(
            r,
            final_loss=r["val_loss"] if r["val_loss"] is not None else r["train_loss"],
            model_states=_model_states(r),
        )
        for r in rows
    ]
    # label each bar with what varies between jobs; what all jobs share goes in a footnote
    tokens = [str(r["overrides"] or "").split() for r in rows]
    common = [t for t in tokens[0] if all(t in other for other in tokens)] if tokens else []
    labels = [f"{r['job']}: {' '.join(t for t in toks if t not in common)}" for r, toks in zip(rows, tokens)]
    labels = [label if len(label) <= 90 else label[:89] + "\u2026" for label in labels]
    row_h, bar_w, top = 26.0, 220.0, 50.0
    label_w = 12 + 6.6 * max(
        [len(label) for label in labels] + [20]
    )  # ~6.6 px per 12 px sans-serif character
    panels = (
        ("samples_per_second", "samples/s", "#4a7fb5"),
        ("final_loss", "final loss (val, else train)", "#d08c3a"),
        ("model_states", "largest rank: params+grads+optimizer MiB", "#5a9e6f"),
        ("memory_activations_mib", "largest rank: saved activations MiB", "#b55a5a"),
        ("memory_peak_rss_mib", "largest rank: peak resident MiB", "#8a6bb5"),
    )
    width = label_w + len(panels) * (bar_w + 90)
    height = top + row_h * max(len(rows), 1) + (40 if common else 20)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    for i, label in enumerate(labels):
        y = top + i * row_h + row_h * 0.65
        parts.append(f'<text x="6" y="{y:.1f}">{html.escape(label)}</text>')
    if common:
        shared = html.escape("all jobs: " + " ".join(common))
        parts.append(f'<text x="6" y="{height - 14:.1f}" fill="#555">{shared}</text>')
    for i, (key, title, color) in enumerate(panels):
        parts += _bars(rows, key, title, label_w + i * (bar_w + 90), bar_w, top, row_h, color)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_summary(sweep_dir: Path, stem: str = "sweep_summary") -> list[dict[str, Any]]:
    """Write ``<stem>.csv``, ``.md`` and ``.svg`` into ``sweep_dir``; return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect_jobs(sweep_dir)
    with open(sweep_dir / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (sweep_dir / f"{stem}.md").write_text(f"# Sweep {sweep_dir}\n\n" + markdown_table(rows))
    (sweep_dir / f"{stem}.svg").write_text(svg_chart(rows))
    return rows


class SweepSummaryCallback(Callback):
    """Hydra callback: at the end of a multirun, print and write the summary; exit 1 if a job failed."""

    def __init__(self, fail_on_error: bool = True) -> None:
        self.fail_on_error = fail_on_error

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        table = markdown_table(rows)
        print(
            f"\nSweep summary ({len(rows)} jobs) written to {sweep_dir}/sweep_summary.{{csv,md,svg}}\n{table}",
            flush=True,
        )
        failed = [r for r in rows if r["status"] != "completed"]
        if failed and self.fail_on_error:
            log.error(
                "%d of %d jobs did not complete: %s",
                len(failed),
                len(rows),
                ", ".join(f"{r['job']} ({r['status']})" for r in failed),
            )
            sys.exit(sweep_exit_status(rows))


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m lightning_parallel.cli.sweep SWEEP_DIR")
    print(markdown_table(write_summary(Path(args[0]))))


if __name__ == "__main__":
    main()
