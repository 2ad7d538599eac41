"""lp_tensor_parallel on a CUDA device (skipped without one): tp=1 over NCCL, float64 and bf16-mixed."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed
from tests.strategies.test_tensor_parallel import SGD, case, reference


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_tp1_nccl_matches_cpu_reference(cuda_required, tmp_path):
    f64 = case("gpt-cuda-f64", "gpt", "auto", trainer={"accelerator": "cuda"})
    bf16 = case(
        "gpt-cuda-bf16",
        "gpt",
        "auto",
        trainer={"accelerator": "cuda", "precision": "bf16-mixed"},
        model_kwargs=SGD,
    )
    results = run_distributed([f64, bf16], world_size=1, tmp_path=tmp_path, timeout=240)
    ckpt = torch.load(
        tmp_path / "dist1" / "gpt-cuda-f64" / "last.ckpt", weights_only=False, map_location="cpu"
    )
    ref = reference("gpt", tmp_path)
    assert_params_close(ckpt["state_dict"], ref["state_dict"], atol=1e-10)
    losses = results["gpt-cuda-bf16"][0]["losses"]
    assert all(v == v and v < 10 for v in losses)  # finite, and near the uniform-guess loss (ln 32 = 3.47)
    bf16_ckpt = torch.load(
        tmp_path / "dist1" / "gpt-cuda-bf16" / "last.ckpt", weights_only=False, map_location="cpu"
    )
    sgd_ref = reference("gpt", tmp_path, model_kwargs=SGD)
    moved = max_param_diff(
        reference("gpt", tmp_path, steps=0, model_kwargs=SGD)["state_dict"], sgd_ref["state_dict"]
    )
    assert max_param_diff(bf16_ckpt["state_dict"], sgd_ref["state_dict"]) < 0.05 * moved
