"""lp_tensor_parallel on the model zoo (tiny public families), 2 and 4 real processes: the automatic
plan (traced from the first batch) and the written plans for Hugging Face GPT-2 and Llama equal
single-device training, float64, 5 SGD steps, to 1e-10."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import REPO, max_param_diff, run_distributed, run_single
from tests.helpers.zoo import ZooLM

TP = "lightning_parallel:TensorParallelStrategy"
ZOO = ("hf_gpt2", "hf_llama", "hf_bert", "torch_encoder", "lightning_demo", "inline_mlp", "nanogpt")
WRITTEN = {"hf_gpt2": str(REPO / "conf/plan/hf_gpt2.yaml"), "hf_llama": str(REPO / "conf/plan/hf_llama.yaml")}
F64 = {"precision": "64-true", "max_steps": 5}
# parameters each rank keeps, as a share of the model, at tp=2 (tiny configs: embeddings and norms weigh more
# than in real sizes).
# nanoGPT's attention computes head sizes from the input's width, so only its MLP, embeddings and head split.
MAX_SHARE = {
    "hf_gpt2": 0.55,
    "hf_llama": 0.55,
    "hf_bert": 0.55,
    "torch_encoder": 0.55,
    "lightning_demo": 0.55,
    "inline_mlp": 0.55,
    "nanogpt": 0.70,
}


def case(arch: str, plan: str, dp: int = 1) -> dict:
    return {
        "name": f"{arch}-{plan}-dp{dp}",
        "model": "tests.helpers.zoo:ZooLM",
        "model_kwargs": {"arch": arch},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "trainer": F64,
        "save_checkpoint": True,
        "probe": "tests.helpers.probes:tensor_parallel_plan",
        "strategy": {
            "class": TP,
            "kwargs": {
                "plan": WRITTEN.get(arch, "auto") if plan == "written" else "auto",
                "data_parallel_size": dp,
            },
        },
    }


CASES_2 = [case(a, "auto") for a in ZOO] + [case(a, "written") for a in WRITTEN]
CASES_4 = [case("hf_llama", "auto", dp=2)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zoo-single")
    return {
        a: run_single({**case(a, "auto"), "name": f"single-{a}", "strategy": "auto", "probe": None}, tmp)
        for a in ZOO
    }


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zoo-tp2")
    return tmp, run_distributed(CASES_2, world_size=2, tmp_path=tmp, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("c", CASES_2, ids=[c["name"] for c in CASES_2])
def test_zoo_tensor_parallel_equals_single_device(c, tp2, references):
    tmp, results = tp2
    arch = c["model_kwargs"]["arch"]
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    reference = references[arch]["state_dict"]
    diff = max_param_diff(full, reference)
    assert diff < 1e-10, f"{c['name']}: parameters differ from single-device training by {diff:.3e}"
    total = sum(p.numel() for p in ZooLM(arch=arch).parameters())  # tied weights once
    plan = results[c["name"]][0]["probe"]
    assert plan["local_parameters"] <= MAX_SHARE[arch] * total, plan


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zoo_llama_auto_dp2_tp2(tmp_path, references):
    run_distributed(CASES_4, world_size=4, tmp_path=tmp_path, timeout=400)
    full = torch.load(tmp_path / "dist4" / CASES_4[0]["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert max_param_diff(full, references["hf_llama"]["state_dict"]) < 1e-10
