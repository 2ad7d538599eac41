"""lp_ddp and lp_dp on 2 real processes equal single-device training on the global batch."""

import pytest
import torch

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single_once

MODEL = "tests.helpers.models:MLP"
DATA = "tests.helpers.models:RegressionData"
F64 = {"precision": "64-true", "max_steps": 5}


F32_DATA = {"global_batch_size": 16, "dtype": "float32"}


def case(name, strategy, model=MODEL, trainer=None, model_kwargs=None, data_kwargs=None, **extra):
    return {
        "name": name,
        "model": model,
        "data": DATA,
        "strategy": strategy,
        "data_kwargs": data_kwargs or {"global_batch_size": 16},
        "trainer": {**F64, **(trainer or {})},
        "model_kwargs": model_kwargs or {},
        "forward_after_fit": True,
        **extra,
    }


VARIANTS = {
    "plain": {},
    "accumulate": {"trainer": {"accumulate_grad_batches": 2}},
    "clip": {"trainer": {"gradient_clip_val": 0.05}},
    "unused": {
        "model": "tests.helpers.models:MLPWithUnusedBranch",
        "model_kwargs": {"optimizer": "adam", "lr": 0.01},
    },
    "manual": {"model": "tests.helpers.models:ManualOptimizationMLP"},
}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    cases = []
    for variant, kw in VARIANTS.items():
        ddp = "lp_ddp_find_unused_parameters_true" if variant == "unused" else "lp_ddp"
        cases.append(case(f"lp_ddp-{variant}", ddp, **kw))
        cases.append(case(f"lp_dp-{variant}", "lp_dp", **kw))
    small_buckets = {
        "class": "lightning_parallel:DDPStrategy",
        "kwargs": {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005},
    }
    cases.append(case("lp_ddp-small-buckets", small_buckets, model_kwargs={"momentum": 0.9}))
    return tmp, run_distributed(cases, world_size=2, tmp_path=tmp)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["lp_ddp", "lp_dp"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_single_device_float64(ddp_results, strategy, variant):
    tmp, results = ddp_results
    ranks = results[f"{strategy}-{variant}"]
    kw = VARIANTS[variant]
    reference = run_single_once(case(f"single-{variant}", "auto", **kw), tmp)
    for rank_result in ranks:
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)
        assert list(rank_result["state_dict"]) == list(reference["state_dict"])
    assert (ranks[0]["forward"] - reference["forward"]).abs().max().item() <= 1e-10  # one device's output
    # the loss each rank saw is its half of the batch; their mean is the single-device loss (Lightning
    # hands accumulated step outputs back as float32, hence the looser tolerance on losses)
    mean_losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(
        mean_losses, torch.tensor(reference["losses"], dtype=torch.float64), atol=1e-6, rtol=0
    )
    # training moved the parameters: the comparison is not vacuous
    initial = run_single_once(
        case(
            f"init-{variant}",
            "auto",
            trainer={"max_steps": 0},
            **{k: v for k, v in kw.items() if k != "trainer"},
        ),
        tmp,
    )
    assert max_param_diff(initial["state_dict"], reference["state_dict"]) > 1e-3


@pytest.mark.timeout(400)
def test_many_small_buckets_match(ddp_results):
    tmp, results = ddp_results
    reference = run_single_once(case("single-momentum", "auto", model_kwargs={"momentum": 0.9}), tmp)
    for rank_result in results["lp_ddp-small-buckets"]:
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# What happens inside: buckets, overlap, accumulation, unused parameters, compression, BatchNorm
# ---------------------------------------------------------------------------------------------------
SMALL = {
    "class": "lightning_parallel:DDPStrategy",
    "kwargs": {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001},
}
PROBE = "tests.helpers.probes:reducer_stats"


@pytest.fixture(scope="module")
def inside_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_inside")
    cases = [
        case("stats-accumulate", SMALL, trainer={"accumulate_grad_batches": 3, "max_steps": 2}, probe=PROBE),
        case("fp16", {"class": "lightning_parallel:DDPStrategy", "kwargs": {"ddp_comm_hook": "fp16"}}),
        case("bf16", {"class": "lightning_parallel:DDPStrategy", "kwargs": {"ddp_comm_hook": "bf16"}}),
        case("syncbn", "lp_ddp", model="tests.helpers.models:BatchNormNet", trainer={"sync_batchnorm": True}),
        case("lp_ddp-f32", "lp_ddp", trainer={"precision": "32-true"}, data_kwargs=F32_DATA),
        case("ddp-f32", "ddp", trainer={"precision": "32-true"}, data_kwargs=F32_DATA),
        case("bf16-mixed", "lp_ddp", trainer={"precision": "bf16-mixed"}, data_kwargs=F32_DATA),
    ]
    return tmp, run_distributed(cases, world_size=2, tmp_path=tmp)


@pytest.mark.timeout(400)
def test_buckets_overlap_backward_and_skip_accumulating_steps(inside_results):
    _, results = inside_results
    stats = results["stats-accumulate"][0]["probe"]
    n_buckets = len(stats["bucket_names"])
    assert n_buckets >= 3, stats["bucket_names"]
    # 2 optimizer steps x 3 micro-batches: only the last micro-batch of each step communicates
    assert stats["synced_steps"] == 2
    assert stats["bucket_all_reduces"] == 2 * n_buckets
    # buckets were sent from gradient hooks while backward was still running, not all at the end
    assert stats["launched_in_backward"] >= 2 * (n_buckets - 1)
    assert stats["rebuilt"]
    assert stats["grads_are_bucket_views"], "each .grad must alias its bucket's flat buffer (no copies)"
    # rebuilt in arrival order: the head's parameters arrive first, the input layer's last
    assert stats["bucket_names"][0][0].startswith("net.4"), stats["bucket_names"]
    assert stats["bucket_names"][-1][-1].startswith("net.0"), stats["bucket_names"]
    # every rank bucketed identically (collectives must line up)
    assert results["stats-accumulate"][1]["probe"]["bucket_names"] == stats["bucket_names"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compressed_gradients_stay_close(inside_results, hook):
    tmp, results = inside_results
    reference = run_single_once(case("single-plain", "auto"), tmp)
    diff = max_param_diff(results[hook][0]["state_dict"], reference["state_dict"])
    assert 0 < diff < (1e-3 if hook == "fp16" else 1e-2), diff  # lossy, but only by the wire's precision
    assert max_param_diff(results[hook][0]["state_dict"], results[hook][1]["state_dict"]) == 0


@pytest.mark.timeout(400)
def test_sync_batchnorm_matches_single_device_batchnorm(inside_results):
    tmp, results = inside_results
    reference = run_single_once(case("single-bn", "auto", model="tests.helpers.models:BatchNormNet"), tmp)
    for rank_result in results["syncbn"]:
        # parameters and running statistics (buffers are in the state dict)
        assert_params_close(rank_result["state_dict"], reference["state_dict"], atol=1e-10)


@pytest.mark.timeout(400)
def test_matches_lightning_builtin_ddp_in_float32(inside_results):
    _, results = inside_results
    ours, theirs = results["lp_ddp-f32"][0], results["ddp-f32"][0]
    assert max_param_diff(ours["state_dict"], theirs["state_dict"]) < 1e-6
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), atol=1e-6, rtol=0
    )


@pytest.mark.timeout(200)
def test_unused_parameters_without_flag_fail_with_their_names(tmp_path):
    bad = case("unused-no-flag", "lp_ddp", model="tests.helpers.models:MLPWithUnusedBranch")
    with pytest.raises(RuntimeError) as err:
        run_distributed([bad], world_size=2, tmp_path=tmp_path, timeout=120)
    message = str(err.value)
    assert "unused.weight" in message and "unused.bias" in message
    assert "find_unused_parameters=True" in message
    # Lightning's words first
    assert "It looks like your LightningModule has parameters that were not used" in message


@pytest.mark.timeout(400)
def test_bf16_mixed_precision_trains_like_single_device(inside_results):
    tmp, results = inside_results
    reference = run_single_once(
        case("single-bf16", "auto", trainer={"precision": "bf16-mixed"}, data_kwargs=F32_DATA), tmp
    )
    ours = results["bf16-mixed"]
    assert max_param_diff(ours[0]["state_dict"], ours[1]["state_dict"]) == 0
    # autocast rounds activations to bf16 (8 bits of mantissa), on half batches vs the whole batch
    assert max_param_diff(ours[0]["state_dict"], reference["state_dict"]) < 2e-2
