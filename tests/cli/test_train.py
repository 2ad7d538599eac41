"""``lp-train`` end to end: the default run, and a user's own LightningModule/DataModule via ``_target_``."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from lightning_parallel.cli.train import SUMMARY_KEYS
from tests.cli.lp import QUICK, assert_no_survivors, explain, run, summary


@pytest.mark.timeout(280)
def test_default_run_trains_chargpt_with_lp_ddp_on_two_processes(tmp_path) -> None:
    """``lp-train`` with no arguments (only the output folder pinned): the embedded default."""
    run_dir = tmp_path / "run"
    proc = run([f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    s = summary(run_dir)
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["status"] == "completed"
    assert s["strategy"] == "lp_ddp" and s["strategy_target"] == "lightning_parallel.DDPStrategy"
    assert s["world_size"] == 2 and s["backend"] == "gloo"  # from torch.distributed, inside training
    assert s["devices"] == 2 and s["num_nodes"] == 1
    assert s["global_step"] == 500
    assert s["samples_per_second"] > 0
    start = math.log(128)  # an untrained model's loss, ~4.85
    assert s["val_loss"] < 0.45 * start, s["val_history"]
    assert s["train_loss"] < 0.45 * start
    history = [h["val_loss"] for h in s["val_history"]]
    assert len(history) == 5 and history[-1] < history[0]
    # the checkpoint exists and holds the trained weights
    ckpt = torch.load(s["checkpoint"], map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 500
    # progress and losses were printed; each rank has its own log in the run folder
    assert "step 500/500 | train_loss" in proc.stdout + proc.stderr
    assert "validation at step 500 | val_loss" in (run_dir / "train.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 1" in (run_dir / "train_rank1.out").read_text()
    assert (run_dir / "train_rank1.log").exists()
    assert s["wall_seconds"] < 120
    # the end at a glance: the table names the files; the curves are drawn; no third-party noise
    out = proc.stdout + proc.stderr
    assert (
        f"  checkpoint              {s['checkpoint']}" in out
        and f"  summary                 {run_dir}" in out
    )
    assert "  memory (peak resident)  rank 0: " in out and ", rank 1: " in out
    curves = ET.parse(run_dir / "curves.svg").getroot()
    assert len(list(curves.iter("{http://www.w3.org/2000/svg}polyline"))) == 3  # train, val, samples/s
    assert "LeafSpec" not in out and "Tip:" not in out
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(200)
def test_user_module_runs_unmodified_via_target(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        [
            "model._target_=tests.helpers.user_project.Regressor",
            "data._target_=tests.helpers.user_project.RandomRegressionData",
            "+model.hidden=8",
            "trainer.max_steps=12",
            "trainer.val_check_interval=6",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, explain(proc)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["model"] == "tests.helpers.user_project.Regressor"
    assert s["world_size"] == 2 and s["global_step"] == 12
    assert s["train_loss"] is not None and s["val_loss"] is not None  # its own names: "loss", "val_mse"
    assert "val_mse" in s["metrics"]
    hparams = torch.load(s["checkpoint"], map_location="cpu", weights_only=False)["hyper_parameters"]
    assert hparams["hidden"] == 8 and "n_layer" not in hparams  # the default model's keys were not passed
    assert_no_survivors(tmp_path)


@pytest.mark.timeout(200)
def test_spawn_start_method(tmp_path) -> None:
    """With start_method=spawn training runs in spawned processes and rank 0 still reports its figures; the
    preset's Python name (``lp_ddp_spawn``) is lp-train's too.
    (Lightning's own ddp on 1 and 2 devices, and one process at devices=1: tests/cli/test_sweep.py.)"""
    for name, devices, extra in (("lp_ddp_spawn", 2, []),):
        run_dir = tmp_path / f"{name}_{len(extra)}"
        proc = run(
            [f"strategy={name}", f"trainer.devices={devices}", *extra, *QUICK, f"hydra.run.dir={run_dir}"],
            tmp_path,
        )
        assert proc.returncode == 0, explain(proc)
        s = summary(run_dir)
        assert s["world_size"] == devices and s["strategy"] == name and s["global_step"] == 20
        assert s["samples_per_second"] > 0 and s["checkpoint"].endswith("last.ckpt")
    assert_no_survivors(tmp_path)
