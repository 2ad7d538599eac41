"""Checkpoints are layout-independent: one saved under lp_ddp (2), lp_tensor_parallel (2), the pipeline
(2 stages) or a single device loads and continues under every other, and into a plain
``load_from_checkpoint``. Every continuation equals single-device training continued from a
single-device checkpoint (Adam: the optimizer state must survive the change of layout too)."""

import pytest
import torch

from tests.helpers.harness import UNTRUSTED, assert_params_close, run_distributed, run_single
from tests.helpers.models import MLP

LAYOUTS = {
    "ddp": "lp_ddp",
    "tp": {"class": "lightning_parallel:TensorParallelStrategy", "kwargs": {"plan": "auto"}},
    "pp": {"class": "lightning_parallel:PipelineParallelStrategy", "kwargs": {"schedule": "1f1b"}},
}
DP_SIZE = {"ddp": 2, "tp": 1, "pp": 1, "single": 1}


def case(name, layout, steps, ckpt_path=None):
    return {
        "name": name,
        "model": "tests.helpers.models:MLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"optimizer": "adam", "lr": 0.01},
        "data_kwargs": {"global_batch_size": 16},
        "strategy": LAYOUTS.get(layout, "auto"),
        "dp_size": DP_SIZE[layout],
        "trainer": {"precision": "64-true", "max_steps": steps},
        "save_checkpoint": True,
        "ckpt_path": ckpt_path,
        **(UNTRUSTED if ckpt_path else {}),
    }


@pytest.mark.timeout(600)
def test_every_layout_continues_every_other_layouts_checkpoint(tmp_path):
    saved = run_distributed(
        [case(f"save-{src}", src, 3) for src in LAYOUTS], world_size=2, tmp_path=tmp_path / "save"
    )
    assert saved
    checkpoints = {src: str(tmp_path / "save" / "dist2" / f"save-{src}" / "last.ckpt") for src in LAYOUTS}
    run_single(case("save-single", "single", 3), tmp_path / "save")
    checkpoints["single"] = str(tmp_path / "save" / "single" / "save-single" / "last.ckpt")

    reference = run_single(case("ref", "single", 5, ckpt_path=checkpoints["single"]), tmp_path)["state_dict"]
    for src, path in checkpoints.items():  # plain single-device loading
        plain = MLP.load_from_checkpoint(path).double()
        state = torch.load(path, weights_only=False)["state_dict"]
        assert_params_close(plain.state_dict(), state, atol=1e-7)  # load_from_checkpoint builds float32
        assert state.keys() == reference.keys()
        continued = run_single(case(f"from-{src}-to-single", "single", 5, ckpt_path=path), tmp_path)
        assert_params_close(continued["state_dict"], reference, atol=1e-10)

    cases = [
        case(f"from-{src}-to-{dst}", dst, 5, ckpt_path=path)
        for src, path in checkpoints.items()
        for dst in LAYOUTS
    ]
    continued = run_distributed(cases, world_size=2, tmp_path=tmp_path / "load")
    for c in cases:
        full = torch.load(tmp_path / "load" / "dist2" / c["name"] / "last.ckpt", weights_only=False)
        assert full["global_step"] == 5, c["name"]
        assert_params_close(full["state_dict"], reference, atol=1e-10)
