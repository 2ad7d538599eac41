"""lp_ddp and lp_dp on 2 real processes equal single-device training on the global batch."""

import pytest
import torch

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single

MODEL = "tests.helpers.models:MLP"
DATA = "tests.helpers.models:RegressionData"
F64 = {"precision": "64-true", "max_steps": 5}


def case(name, strategy, model=MODEL, trainer=None, model_kwargs=None, **extra):
    return {"name": name, "model": model, "data": DATA, "strategy": strategy, "data_kwargs": {"global_batch_size": 16},
            "trainer": {**F64, **(trainer or {})}, "model_kwargs": model_kwargs or {}, **extra}


VARIANTS = {
    "plain": {},
    "accumulate": {"trainer": {"accumulate_grad_batches": 2}},
    "clip": {"trainer": {"gradient_clip_val": 0.05}},
    "unused": {"model": "tests.helpers.models:MLPWithUnusedBranch", "model_kwargs": {"optimizer": "adam", "lr": 0.01}},
}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    cases = []
    for variant, kw in VARIANTS.items():
        ddp = "lp_ddp_find_unused_parameters_true" if variant == "unused" else "lp_ddp"
        cases.append(case(f"lp_ddp-{variant}", ddp, **kw))
        cases.append(case(f"lp_dp-{variant}", "lp_dp", **kw))
    small_buckets = {"class": "lightning_parallel:DDPStrategy", "kwargs": {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}}
    cases.append(case("lp_ddp-small-buckets", small_buckets, model_kwargs={"momentum": 0.9}))
    return tmp, run_distributed(cases, world_size=2, tmp_path=tmp)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["lp_ddp", "lp_dp"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_single_device_float64(ddp_results, strategy, variant):
    tmp, results = ddp_results
    ranks = results[f"{strategy}-{variant}"]
    kw = VARIANTS[variant]
    reference = run_single(case(f"single-{variant}", "auto", **kw), tmp)
    for rank_result in ranks:
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)
    # the loss each rank saw is its half of the batch; their mean is the single-device loss (Lightning
    # hands accumulated step outputs back as float32, hence the looser tolerance on losses)
    mean_losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"], dtype=torch.float64), atol=1e-6, rtol=0)
    # training moved the parameters: the comparison is not vacuous
    initial = run_single(case(f"init-{variant}", "auto", trainer={"max_steps": 0}, **{k: v for k, v in kw.items() if k != "trainer"}), tmp)
    assert max_param_diff(initial["state_dict"], reference["state_dict"]) > 1e-3


@pytest.mark.timeout(400)
def test_many_small_buckets_match(ddp_results):
    tmp, results = ddp_results
    reference = run_single(case("single-momentum", "auto", model_kwargs={"momentum": 0.9}), tmp)
    for rank_result in results["lp_ddp-small-buckets"]:
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)
