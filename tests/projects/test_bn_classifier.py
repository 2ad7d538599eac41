"""A Lightning + Hydra project written the way the popular templates write one (``bn_classifier/``): its
own config tree and code (a dense net with BatchNorm1d passed into the LightningModule and saved in its
hyperparameters, torchmetrics, ModelCheckpoint, fit then test of the best checkpoint, float64, 2 CPU
processes), never naming lightning_parallel. Every strategy comes from the package's Hydra plugin,
``+lp/strategy@trainer.strategy=NAME``; each run must fit, write its checkpoint and log test metrics."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.cli.lp import assert_no_survivors, env, explain, run_bounded

PROJECT = Path(__file__).parent / "bn_classifier"
TRAIN = [sys.executable, str(PROJECT / "train.py")]
# the classes the plugin's group names, and how many data-parallel replicas share the global batch of 32
EXPECTED = {
    "lp_ddp": ("DDPStrategy", 2),
    "lp_dp": ("DataParallelStrategy", 2),
    "tensor_parallel": ("TensorParallelStrategy", 1),
    "pipeline_gpipe": ("PipelineParallelStrategy", 1),
    "pipeline_1f1b": ("PipelineParallelStrategy", 1),
    "pipeline_async": ("PipelineParallelStrategy", 1),
    "pipeline_zb": ("PipelineParallelStrategy", 1),
}


def _check_run(run_dir: Path, strategy: str) -> None:
    """Fit ran on 2 processes with the global batch split over the data-parallel replicas, the best
    checkpoint was written and then tested, and the test metrics were logged."""
    results = json.loads((run_dir / "results.json").read_text())
    cls, replicas = EXPECTED[strategy]
    assert results["strategy"] == cls and results["world_size"] == 2, results
    assert results["batch_size_per_device"] == 32 // replicas and results["global_step"] == 128 // 32, results
    assert results["best_model_path"] and Path(results["best_model_path"]).is_file(), results
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    test = results["test"]
    assert set(test) == {"test/loss", "test/acc"} and all(math.isfinite(v) for v in test.values()), test
    assert test["test/acc"] > 0.5, test  # 4 classes: it learned something in 4 steps
    assert (run_dir / "train_rank1.out").is_file()  # rank 1 was started by the strategy's launcher


def test_the_project_never_names_the_package() -> None:
    files = [p for p in PROJECT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) > 8
    assert not [p for p in files if "lightning_parallel" in p.read_text()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy",
    [
        "tensor_parallel",
        "pipeline_gpipe",
        "pipeline_1f1b",
        "pipeline_async",
        "pipeline_zb",
    ],
)
def test_model_parallel_strategy_from_the_plugin(tmp_path, strategy) -> None:
    run_dir = tmp_path / "run"
    proc = run_bounded(
        [*TRAIN, f"+lp/strategy@trainer.strategy={strategy}", f"hydra.run.dir={run_dir}"],
        tmp_path,
        env(str(tmp_path)),
        timeout=220,
    )
    assert_no_survivors(tmp_path)
    assert proc.returncode == 0, explain(proc)
    _check_run(run_dir, strategy)


@pytest.mark.timeout(280)
def test_sweep_over_data_parallel_strategies_from_the_plugin(tmp_path) -> None:
    """``-m`` over the group: one job per strategy, each on its own 2 processes."""
    sweep = tmp_path / "multirun"
    proc = run_bounded(
        [*TRAIN, "-m", "+lp/strategy@trainer.strategy=lp_ddp,lp_dp", f"hydra.sweep.dir={sweep}"],
        tmp_path,
        env(str(tmp_path)),
        timeout=260,
    )
    assert_no_survivors(tmp_path)
    assert proc.returncode == 0, explain(proc)
    for job, strategy in enumerate(("lp_ddp", "lp_dp")):
        _check_run(sweep / str(job), strategy)
