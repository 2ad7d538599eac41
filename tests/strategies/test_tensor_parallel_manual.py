"""``plan="auto"`` under manual optimization (``automatic_optimization=False``), 2 real processes: the plan is
traced from the user's ``training_step`` with its optimization made inert (``tensor.sample``), so a Hugging
Face model splits as it does under automatic optimization, and training equals one device (float64, 5 SGD
steps, 1e-10)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import max_param_diff, run_distributed, run_single
from tests.helpers.manual_zoo import ManualZooLM
from tests.strategies.test_tensor_parallel_families import F64
from tests.strategies.test_tensor_parallel_families import case as family_case


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_manual_optimization_auto_plan_splits_and_equals_one_device(tmp_path):
    case = {
        **family_case("hf_llama"),
        "name": "manual-llama",
        "model": "tests.helpers.manual_zoo:ManualZooLM",
    }
    single = run_single({**case, "name": "single-manual", "strategy": "auto", "probe": None}, tmp_path)
    results = run_distributed([case], world_size=2, tmp_path=tmp_path, timeout=400)
    full = torch.load(tmp_path / "dist2" / "manual-llama" / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(full, single["state_dict"])
    assert diff < 1e-10, f"parameters differ from single-device training by {diff:.3e}"
    moved = max_param_diff(
        single["state_dict"],
        run_single(
            {**case, "name": "s0", "strategy": "auto", "probe": None, "trainer": {**F64, "max_steps": 0}},
            tmp_path,
        )["state_dict"],
    )
    assert moved > 1e-3  # the optimizer really stepped
    total = sum(p.numel() for p in ManualZooLM(arch="hf_llama").parameters())
    plan = results["manual-llama"][0]["probe"]
    assert plan["local_parameters"] / total <= 0.55, plan["report"]
