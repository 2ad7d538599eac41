"""``python -m lightning_parallel.planner`` on the embedded model: a ranked table, the excluded layouts with
their reasons, and the best layout's overrides, which lp-train's config composes and validates."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from lightning_parallel.config import problems, register_configs
from lightning_parallel.planner.command import main
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
