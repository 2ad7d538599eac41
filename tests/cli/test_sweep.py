"""Multirun (``lp-train -m``) with multi-process strategies: one sweep folder, the right world size per
job, per-rank logs in each job's folder, no process left, a failing job reported while the sweep goes on,
the same under the joblib launcher, and the sweep summary (CSV, Markdown, SVG). A sweep defined in a config
file (``experiment=sweep_strategies``) is checked where the sweep example runs it (``tests/test_examples.py``)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import xml.etree.ElementTree as ET

import pytest

import lightning_parallel
from lightning_parallel.cli.json_file import write_json
from lightning_parallel.cli.sweep import COLUMNS, collect_jobs, sweep_exit_status, write_summary
from lightning_parallel.cli.train import EXIT_PREEMPTED
from tests.cli.lp import QUICK, assert_no_survivors, check_sweep, explain, run, summary, sweep_dir


@pytest.mark.timeout(280)
def test_failing_job_is_reported_and_the_sweep_goes_on(tmp_path) -> None:
    """Job 0: rank 1 raises at step 3; job 1: rank 0 (the launching process) does. Both fail quickly,
    job 2 still trains on 2 processes, and the sweep exits with status 1."""
    proc = run(
        [
            "-m",
            "model._target_=tests.helpers.user_project.Regressor",
            "data._target_=tests.helpers.user_project.RandomRegressionData",
            "+model.fail_on_rank=1,0,null",
            "trainer.max_steps=8",
            "trainer.val_check_interval=4",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, explain(proc)
    root = sweep_dir(tmp_path)
    child_failed, parent_failed, ok = (summary(root / str(i)) for i in range(3))
    assert child_failed["status"] == "failed"
    assert child_failed["error"].startswith("rank 1 (pid ")
    assert "deliberate failure on rank 1 at step 3" in child_failed["error"].splitlines()[0]
    assert parent_failed["status"] == "failed"
    assert parent_failed["error"].startswith("RuntimeError: deliberate failure on rank 0 at step 3")
    assert parent_failed["world_size"] == 2 and parent_failed["global_step"] == 3  # as far as it got
    assert parent_failed["wall_seconds"] < 45  # rank 1 was released, not left waiting for a timeout
    assert ok["status"] == "completed", ok.get("error")
    assert ok["world_size"] == 2 and ok["global_step"] == 8
    rows = collect_jobs(root)
    assert [r["status"] for r in rows] == ["failed", "failed", "completed"]
    assert "2 of 3 jobs did not complete: 0 (failed), 1 (failed)" in proc.stdout + proc.stderr
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(280)
def test_sweep_with_the_joblib_launcher(tmp_path) -> None:
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all
        found = False
    if not found:
        pytest.skip("hydra-joblib-launcher is not installed (pip install 'lightning-parallel[joblib]')")
    proc = run(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "strategy=lp_ddp,lp_dp",
            "trainer.devices=2,1",
            *QUICK,
        ],
        tmp_path,
    )
    assert proc.returncode == 0, explain(proc)
    check_sweep(
        tmp_path,
        {
            "strategy=lp_ddp trainer.devices=1": 1,
            "strategy=lp_ddp trainer.devices=2": 2,
            "strategy=lp_dp trainer.devices=1": 1,
            "strategy=lp_dp trainer.devices=2": 2,
        },
        proc,
    )


@pytest.mark.timeout(290)
def test_sweep_over_ddp_tensor_and_pipeline_parallel(tmp_path) -> None:
    """The issue's sweep (ddp, tensor_parallel, pipeline_1f1b x devices 1, 2), with the model-parallel
    strategies this branch has: 6 jobs once both are merged."""
    present = [
        group
        for group, name in (
            ("tensor_parallel", "TensorParallelStrategy"),
            ("pipeline_1f1b", "PipelineParallelStrategy"),
        )
        if hasattr(lightning_parallel, name)
    ]
    if not present:
        pytest.skip("neither TensorParallelStrategy nor PipelineParallelStrategy is in this branch yet")
    strategies = ["ddp", *present]
    proc = run(
        ["-m", f"strategy={','.join(strategies)}", "trainer.devices=1,2", *QUICK, "model.n_layer=2"],
        tmp_path,
        timeout=285,
    )
    assert proc.returncode == 0, explain(proc)
    root = check_sweep(
        tmp_path,
        {f"strategy={s} trainer.devices={d} model.n_layer=2": d for s in strategies for d in (1, 2)},
        proc,
    )
    rows = list(csv.DictReader(open(root / "sweep_summary.csv")))
    assert [r["world_size"] for r in rows] == ["1", "2"] * len(strategies)
    assert all(r["status"] == "completed" and float(r["samples_per_second"]) > 0 for r in rows)


def test_summary_table_from_job_folders(tmp_path) -> None:
    """Rows come from the files jobs leave; a job without summary.json is listed, not lost."""
    for num, (overrides, body) in enumerate(
        [
            (
                ["strategy=lp_ddp"],
                {
                    "status": "completed",
                    "world_size": 2,
                    "samples_per_second": 1500.0,
                    "train_loss": 1.5,
                    "val_loss": 1.6,
                    "devices": 2,
                },
            ),
            (["strategy=lp_dp"], {"status": "failed", "error": "RuntimeError: boom\nmore", "devices": 2}),
            (["strategy=x<y&z"], None),
        ]
    ):
        job = tmp_path / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        if body is not None:
            (job / "summary.json").write_text(json.dumps(body))
    rows = write_summary(tmp_path)
    assert [r["status"] for r in rows] == ["completed", "failed", "no summary"]
    assert rows[1]["error"] == "RuntimeError: boom"
    table = (tmp_path / "sweep_summary.md").read_text()
    assert "| 0 | strategy=lp_ddp | completed | " in table and "1500" in table
    assert list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))[0].keys() == set(COLUMNS)
    svg = ET.parse(tmp_path / "sweep_summary.svg").getroot()  # well-formed, special characters escaped
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "samples/s" in texts and any("x<y&z" in (t or "") for t in texts)
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}rect"))) == 1 + 2  # background + 2 bars of job 0


@pytest.mark.timeout(200)
def test_child_failing_before_the_rendezvous_does_not_hang_the_sweep(tmp_path) -> None:
    """Rank 1 raises in the model's __init__, before joining the process group: without care, rank 0
    would wait in the rendezvous for the process-group timeout (30 minutes)."""
    proc = run(
        [
            "-m",
            "model._target_=tests.helpers.user_project.Regressor",
            "data._target_=tests.helpers.user_project.RandomRegressionData",
            "+model.fail_on_rank=1",
            "+model.fail_at_step=-1",
            "trainer.max_steps=4",
            "trainer.devices=2,1",
        ],
        tmp_path,
        timeout=180,
    )
    assert proc.returncode == 1, explain(proc)
    root = sweep_dir(tmp_path)
    failed, ok = summary(root / "0"), summary(root / "1")
    assert failed["status"] == "failed" and "exited before joining the process group" in failed["error"]
    assert "deliberate failure in __init__ on local rank 1" in failed["error"].splitlines()[0]
    assert failed["error"].count("exited before joining") == 1
    assert ok["status"] == "completed" and ok["world_size"] == 1  # devices=1: no rank 1 to fail
    assert_no_survivors(tmp_path)


def test_an_unreadable_summary_is_listed_and_the_others_kept(tmp_path) -> None:
    """A truncated ``summary.json`` (a job killed while writing it) is one row that says so; the sweep summary
    is still written with every other job. The exit status: 1 when a job did not complete for any other
    reason than preemption, 75 when jobs were preempted only."""
    bodies = [
        json.dumps({"status": "completed", "samples_per_second": 10.0}),
        '{"status": "compl',
        json.dumps({"status": "preempted", "resumable": True}),
    ]
    for num, body in enumerate(bodies):
        job = tmp_path / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
        (job / "summary.json").write_text(body)
    rows = write_summary(tmp_path)
    assert [r["status"] for r in rows] == ["completed", "unreadable summary", "preempted"]
    assert "summary.json cannot be read (JSONDecodeError" in rows[1]["error"]
    assert "| 0 | seed=0 | completed |" in (tmp_path / "sweep_summary.md").read_text()
    assert sweep_exit_status(rows) == 1
    assert sweep_exit_status([rows[0], rows[2]]) == EXIT_PREEMPTED
    assert sweep_exit_status([rows[0]]) == 0


def test_summary_files_are_replaced_whole(tmp_path) -> None:
    """``write_json`` leaves the old file or the new one, and no temporary file; the mode follows the umask."""
    path = tmp_path / "summary.json"
    write_json(path, {"status": "running"})
    write_json(path, {"status": "completed"})
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
