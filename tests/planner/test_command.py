"""``python -m lightning_parallel.planner`` on the embedded model: a ranked table, the excluded layouts with
their reasons, and the best layout's overrides, which lp-train's config composes and validates."""

from __future__ import annotations

import json
import time

import pytest
from hydra import compose, initialize_config_dir

from lightning_parallel.config import problems, register_configs
from lightning_parallel.models.gpt import CharGPT
from lightning_parallel.planner.calibrate import COLLECTIVES, CollectiveFit, cluster_from_fits
from lightning_parallel.planner.calibration_run import cluster_yaml
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.command import main
from lightning_parallel.planner.cost_model import predict
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.measure import flop_times
from lightning_parallel.planner.planning import cluster_for, model_cost, module_cost
from tests.cli.lp import REPO

SMALL = json.dumps({"n_layer": 4, "n_embd": 32, "block_size": 16})


def test_the_command_plans_the_embedded_model(tmp_path, capsys) -> None:
    output = tmp_path / "best.txt"
    assert main(["--devices", "4", "--kwargs", SMALL, "--repeats", "1", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "layouts predicted, fastest first" in printed and "step ms" in printed and "peak/rank" in printed
    assert "excluded:" in printed and "refused by the strategy" in printed
    assert "Best layout:" in printed
    overrides = output.read_text().split()
    assert overrides[0] == "strategy=lp_parallel" and "trainer.devices=4" in overrides
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, "model.n_layer=4", "model.block_size=16"])
    assert problems(cfg) == []


def test_a_cluster_that_is_not_here_plans_from_flops(capsys) -> None:
    args = ["--devices", "8", "--cluster", "h100_8x", "--kwargs", SMALL, "--repeats", "1", "--top", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "h100-8x" in printed and "block times flops" in printed


def test_a_calibration_file_is_the_cluster_planned_on(tmp_path, capsys) -> None:
    """calibration output -> cluster YAML -> Cluster -> prediction: a slow calibrated link (2 ms a message,
    10 MB/s) is what the data-parallel reduce is predicted on, in place of cpu_2core's figures."""
    fits = {name: CollectiveFit(name, 2e-3, 1e-7, ((1024, 2e-3),)) for name in COLLECTIVES}
    calibrated = cluster_from_fits(fits, 4, 8 * 2**30, 1e10, name="calibrated-gloo-4")
    path = tmp_path / "calibrated.yaml"
    path.write_text(cluster_yaml(calibrated, fits))
    assert Cluster.load(path) == calibrated == cluster_for(str(path), 4)
    cost = model_cost("lightning_parallel.models.gpt:CharGPT", json.loads(SMALL), None, 8, 1)
    dp4 = Layout(dp=4, tp=1, pp=1, global_batch=32)
    slow, here = predict(cost, dp4, calibrated), predict(cost, dp4, cluster_for(None, 4))
    assert slow.data_parallel_s > 10 * here.data_parallel_s > 0  # the link the calibration measured
    args = ["--devices", "4", "--cluster", str(path), "--kwargs", SMALL, "--repeats", "1", "--top", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "on 4 of calibrated-gloo-4 (1 x 4)" in printed and "block times measured" in printed
    with pytest.raises(SystemExit, match="calibrated over 4 processes, not 2: calibrate again"):
        main(["--devices", "2", "--cluster", str(path)])


class _BusyHook(CharGPT):
    """The embedded model with 30 ms of CPU work in a hook each step: Lightning runs it, the module's
    forward, backward and optimizer step timed alone do not."""

    def on_before_optimizer_step(self, optimizer) -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.03:
            pass


def test_the_work_lightning_does_around_a_step_is_measured_on_a_real_fit() -> None:
    """A one-device ``Trainer.fit`` of the module gives the step's work beyond its measured parts: the 30 ms
    hook and Lightning's own loop; the module without the hook pays only the loop (a few ms, within the
    parts' timing noise: not checked above 0)."""
    plain = module_cost(CharGPT(**json.loads(SMALL)), batch_size=4, repeats=3)
    busy = module_cost(_BusyHook(**json.loads(SMALL)), batch_size=4, repeats=3)
    assert plain.step_overhead_s < 0.03 <= busy.step_overhead_s
    assert flop_times(busy, 1e12).step_overhead_s == 0.0  # measured on this host, not the cluster's
