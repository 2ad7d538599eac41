"""Calibration (``planner/calibrate.py``): the alpha-beta fit, and on 2 real gloo processes the collectives
timed, fitted (positive, reproducing the measured times) and the blocks timed forward and backward.

The per-rank program is this module itself (``python -m tests.planner.test_calibrate OUT``)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.planner.calibrate import COLLECTIVES, FLOOR, fit_alpha_beta
from lightning_parallel.planner.calibration_run import CALIBRATED, cluster_yaml
from lightning_parallel.planner.planning import cluster_for, is_this_machine
from tests.helpers.harness import REPO, run_program

SIZES = (2**10, 2**14, 2**17, 2**19)


def test_fit_recovers_a_latency_and_a_bandwidth():
    samples = [(n, 5e-5 + n / 2e9) for n in SIZES]
    alpha, beta = fit_alpha_beta(samples)
    assert alpha == pytest.approx(5e-5, rel=1e-9) and beta == pytest.approx(1 / 2e9, rel=1e-9)


def test_fit_is_never_negative():
    alpha, beta = fit_alpha_beta([(1, 1.0), (2, 0.5), (4, 0.25)])  # slower for fewer bytes: no bandwidth term
    assert beta == FLOOR[1] and 0.25 < alpha < 1.0
    alpha, beta = fit_alpha_beta([(1e3, 0.5e-6), (1e6, 1e-3)])  # a negative latency unconstrained
    # through the origin, in relative errors: sum(x / y) / sum((x / y)^2) = 3e9 / 5e18
    assert alpha == FLOOR[0] and beta == pytest.approx(6e-10, rel=1e-9)


class Stack(nn.Module):
    """Three Linear(8, 8) blocks in a ModuleList: the stack the calibration times."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def calibrate_program(out: Path) -> None:
    from lightning_parallel.planner.calibrate import calibrate

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def not_what_zero_runs(*args, **kwargs):
        raise AssertionError("on gloo the calibration times the ZeRO stages' per-range forms, not gloo's own")

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
        setattr(dist, name, not_what_zero_runs)
    model, x = Stack(), torch.randn(4, 8)
    result = calibrate(module=model, run_step=lambda: model(x).sum(), sizes=SIZES, repeats=5)
    fits = {
        name: {"latency": f.latency, "seconds_per_byte": f.seconds_per_byte, "samples": f.samples}
        for name, f in result.collectives.items()
    }
    report = {
        "fits": fits,
        "link": [result.cluster.within_node.bandwidth, result.cluster.within_node.latency],
        "devices": result.cluster.devices,
        "flops": result.cluster.flops,
        "shared_compute": result.cluster.shared_compute,
        "wake_s": result.cluster.wake_s,
        "blocks": [b.__dict__ for b in result.blocks],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:  # what calibration_run writes: the file the planner reads as its cluster
        calibrated = dataclasses.replace(result.cluster, name=f"{CALIBRATED}-gloo-2")
        (out / "cluster.yaml").write_text(cluster_yaml(calibrated, result.collectives))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_calibration_on_two_gloo_processes(tmp_path):
    cmd = [sys.executable, "-m", "tests.planner.test_calibrate", str(tmp_path)]
    run_program(cmd, tmp_path, timeout=90)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    fits = reports[0]["fits"]
    for name, fit in reports[1]["fits"].items():  # every rank fits the slowest rank's times
        assert fit["samples"] == fits[name]["samples"]
        assert fit["latency"] == pytest.approx(fits[name]["latency"], rel=1e-9)
    assert sorted(fits) == sorted(COLLECTIVES)
    for name, fit in fits.items():
        assert fit["latency"] > 0 and fit["seconds_per_byte"] > 0, name
        errors = [
            abs(fit["latency"] + n * fit["seconds_per_byte"] - seconds) / seconds for n, seconds in fit["samples"]
        ]
        # within a factor of 2 at the median sample: the machine this runs on is 2 cores shared by many
        # processes, whose scheduling adds milliseconds to a collective of microseconds
        assert sorted(errors)[len(errors) // 2] < 1.0, (name, fit)
    bandwidth, latency = reports[0]["link"]
    assert bandwidth == 1 / fits["send_recv"]["seconds_per_byte"] and latency == fits["send_recv"]["latency"]
    # the calibration's file is the cluster the planner plans on (--cluster FILE, planner.cluster=FILE)
    cluster = cluster_for(str(tmp_path / "cluster.yaml"), 2)
    assert cluster.name == "calibrated-gloo-2" and is_this_machine(cluster) and cluster.devices == 2
    assert cluster.within_node.bandwidth == pytest.approx(bandwidth, rel=1e-12)
    assert cluster.within_node.latency == pytest.approx(latency, rel=1e-12)
    assert reports[0]["devices"] == 2 and reports[0]["flops"] > 0
    # both ranks computing at once on the box's cores: every rank has rank 0's ratio, at least 1, in the file
    assert reports[0]["shared_compute"] == reports[1]["shared_compute"] >= 1.0
    assert cluster.shared_compute == pytest.approx(reports[0]["shared_compute"], rel=1e-12)
    # a collective between computations: every rank has the slowest rank's excess per call, in the file
    assert reports[0]["wake_s"] == reports[1]["wake_s"] and 0.0 <= reports[0]["wake_s"] < 0.05
    assert cluster.wake_s == pytest.approx(reports[0]["wake_s"], rel=1e-12)
    blocks = reports[0]["blocks"]
    assert [b["name"] for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    for b in blocks:
        assert b["forward_s"] > 0 and b["backward_s"] > 0
        assert b["parameter_bytes"] == (8 * 8 + 8) * 4
        assert b["activation_bytes"] == 4 * 8 * 4  # the Linear saves its input (its weight is not counted)


if __name__ == "__main__":
    os.chdir(REPO)
    calibrate_program(Path(sys.argv[1]))
