"""The end of a run at a glance (``cli/run_report.py``), from a summary: the table and the curves."""

from __future__ import annotations

import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

from lightning_parallel.cli.quiet import quiet_third_party
from lightning_parallel.cli.run_report import peak_memory_per_rank, run_table, svg_curves

MIB = 2**20
SUMMARY = {
    "status": "preempted",
    "global_step": 30,
    "wall_seconds": 12.5,
    "strategy": "lp_tensor_parallel",
    "world_size": 2,
    "train_loss": 1.23456,
    "val_loss": None,
    "samples_per_second": 1234.5,
    "checkpoint": "/runs/a/checkpoints/last.ckpt",
    "resume": "lp-train ckpt_path=/runs/a/checkpoints/last.ckpt hydra.run.dir=/runs/a",
    "memory": {
        "end_of_fit": [
            {"rank": 0, "peak_rss": 300 * MIB, "cuda_max_allocated": None},
            {"rank": 1, "peak_rss": 310 * MIB, "cuda_max_allocated": None},
        ]
    },
    "train_history": [
        {"step": 10, "train_loss": 2.0, "samples_per_second": 900.0},
        {"step": 20, "train_loss": 1.5, "samples_per_second": 1100.0},
    ],
    "val_history": [{"step": 20, "val_loss": 1.6}],
}


def test_the_table_names_losses_speed_memory_and_files() -> None:
    table = run_table(SUMMARY, Path("/runs/a/summary.json"), Path("/runs/a/curves.svg"))
    lines = dict(line.strip().split("  ", 1) for line in table.splitlines())
    lines = {k: v.strip() for k, v in lines.items()}
    assert lines["status"] == "preempted at step 30 after 12.5 s"
    assert lines["train loss"] == "1.235" and lines["val loss"] == "n/a" and lines["samples/s"] == "1234.5"
    assert lines["memory (peak resident)"] == "rank 0: 300.0 MiB, rank 1: 310.0 MiB"
    assert (
        lines["checkpoint"] == "/runs/a/checkpoints/last.ckpt" and lines["summary"] == "/runs/a/summary.json"
    )
    assert lines["resume with"].startswith("lp-train ckpt_path=")


def test_the_cuda_peak_is_preferred_on_a_gpu() -> None:
    summary = {"memory": {"end_of_fit": [{"rank": 0, "peak_rss": 9 * MIB, "cuda_max_allocated": 2 * MIB}]}}
    assert peak_memory_per_rank(summary) == [(0, 2.0, "CUDA peak")]


def test_the_curves_draw_train_and_validation_loss_and_throughput() -> None:
    svg = ET.fromstring(svg_curves(SUMMARY))
    lines = list(svg.iter("{http://www.w3.org/2000/svg}polyline"))
    assert [len(p.get("points").split()) for p in lines] == [2, 1, 2]
    assert {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")} >= {
        "train loss",
        "val loss",
        "samples/s",
    }


def test_only_the_named_third_party_messages_are_silenced() -> None:
    from torch.utils._pytree import LeafSpec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        LeafSpec()
        warnings.warn("lightning_parallel: a warning of our own", UserWarning)
        warnings.warn("another FutureWarning", FutureWarning)
    assert [str(w.message) for w in caught] == [
        "lightning_parallel: a warning of our own",
        "another FutureWarning",
    ]
