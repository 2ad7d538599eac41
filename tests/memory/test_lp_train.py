"""``lp-train`` writes the memory report into ``summary.json`` (every rank's tables, the largest rank's
figures), and into the sweep summary's columns; ``strategy.memory_report=false`` turns it off."""

from __future__ import annotations

import pytest

from lightning_parallel.cli.sweep import collect_jobs
from tests.cli.lp import QUICK, assert_no_survivors, explain, run, summary

SHORT = [*QUICK, "trainer.max_steps=2", "trainer.val_check_interval=2", "data.max_chars=20000"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_summary_json_holds_every_ranks_memory(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run(["strategy=pipeline_1f1b", "model.n_layer=2", *SHORT, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    s = summary(run_dir)
    for when in ("after_setup", "end_of_fit"):
        rows = s["memory"][when]
        assert [r["rank"] for r in rows] == [0, 1]
        assert all(r["parameters"] > 0 and r["optimizer_state"] > 0 and r["activations"] > 0 for r in rows)
        assert all(r["parameters"] < r["model_parameters"] for r in rows)  # two stages
    assert s["memory_activations_mib"] > 0 and s["memory_peak_rss_mib"] > 0
    assert (proc.stdout + proc.stderr).count("Memory per rank, at the end of fit") == 1
    row = collect_jobs(tmp_path)[0]
    assert row["memory_activations_mib"] == s["memory_activations_mib"]
    assert_no_survivors(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_memory_report_false_leaves_it_out(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        ["strategy=lp_ddp", "strategy.memory_report=false", *SHORT, f"hydra.run.dir={run_dir}"], tmp_path
    )
    assert proc.returncode == 0, explain(proc)
    assert summary(run_dir)["memory"] is None
    assert "Memory per rank" not in proc.stdout + proc.stderr
    assert_no_survivors(tmp_path)
