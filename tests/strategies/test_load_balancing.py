"""A mixture of experts' load-balancing loss under data parallelism (``lightning_parallel.moe.load_balancing``), real
processes: with the router's loss in the loss, lp_ddp on Mixtral (also with full and selective recompute, with
ZeRO-2 and under manual optimization) and expert parallelism (ep=2 = dp) on Qwen2-MoE (also with recompute and
manual optimization) equal single-device training on the global batch (float64, 5 SGD steps, 1e-10), where
each rank's own loss (Hugging Face's, on its half of the batch) trains another objective; a forward and a
``generate`` on rank 0 alone in callbacks between the steps finish and change nothing. The layouts where it
cannot be one device's are refused before training."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.moe.load_balancing import refusal, routes_with_aux_loss
from tests.helpers.harness import max_param_diff, run_distributed, run_single
from tests.helpers.zoo import ZooLM
from tests.strategies.test_parallel_3d import DDP, PARALLEL

AUX = 0.5  # the load-balancing loss weighs enough to move the routers


def case(name: str, arch: str, strategy: str, **kwargs) -> dict:
    return {
        "name": name,
        "model": "tests.helpers.zoo:ZooLM",
        "model_kwargs": {"arch": arch, "router_aux": AUX},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": 2,
        "trainer": {"precision": "64-true", "max_steps": 5},
        "save_checkpoint": True,
        "probe": None,
        "strategy": {"class": strategy, "kwargs": kwargs},
    }


EP2 = {"data_parallel_size": 2, "expert_parallel_size": 2}


def manual(c: dict) -> dict:
    """``c`` trained by manual optimization (the user's ``manual_backward`` and optimizer step)."""
    return {**c, "name": f"{c['name']}-manual", "model": "tests.helpers.manual_zoo:ManualZooLM"}


def rank_zero_sample(c: dict) -> dict:
    """``c`` with epochs of 2 steps and a forward on rank 0 alone after each step and a ``generate`` after each
    epoch (``moe_models.RankZeroSample``): the router's loss there is rank 0's own, with no collective."""
    return {
        **c,
        "name": f"{c['name']}-rank0-sample",
        "trainer": {**c["trainer"], "limit_train_batches": 2},
        "callbacks": [{"class": "tests.helpers.moe_models:RankZeroSample"}],
    }


CASES = [
    case("mixtral-ddp", "mixtral", DDP),
    rank_zero_sample(case("mixtral-ddp", "mixtral", DDP)),
    case(
        "mixtral-ddp-recompute", "mixtral", DDP, activation_checkpointing=True
    ),  # the router's forward rerun
    case("mixtral-ddp-selective", "mixtral", DDP, activation_checkpointing="selective"),
    case("mixtral-ddp-zero2", "mixtral", DDP, zero_stage=2),
    case("qwen2_moe-ep2", "qwen2_moe", PARALLEL, **EP2),
    case("qwen2_moe-ep2-recompute", "qwen2_moe", PARALLEL, **EP2, activation_checkpointing=True),
    manual(case("mixtral-ddp", "mixtral", DDP)),
    manual(case("qwen2_moe-ep2", "qwen2_moe", PARALLEL, **EP2)),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load-balancing")
    single = {
        c["name"]: run_single({**c, "name": f"single-{c['name']}", "strategy": "auto"}, tmp) for c in CASES
    }
    run_distributed(CASES, world_size=2, tmp_path=tmp, timeout=400)
    return tmp, single


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_load_balancing_loss_over_data_parallel_ranks_equals_one_device(name, runs):
    tmp, single = runs
    full = torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(full, single[name]["state_dict"])
    assert diff < 1e-10, f"{name}: parameters differ from single-device training by {diff:.3e}"


def test_layouts_that_cannot_give_one_devices_loss_are_refused():
    module = ZooLM(arch="mixtral", router_aux=AUX)
    assert routes_with_aux_loss(module)[0] == "MixtralForCausalLM"
    assert refusal(module, pipeline_stages=1, sequence_parallel=False) is None
    assert "pipeline_parallel_size=2" in refusal(module, pipeline_stages=2, sequence_parallel=False)
    assert "sequence_parallel=True" in refusal(module, pipeline_stages=1, sequence_parallel=True)
    assert refusal(ZooLM(arch="mixtral"), pipeline_stages=2, sequence_parallel=True) is None
