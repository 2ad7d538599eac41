"""BatchNorm under the pipelines, on 2 real gloo processes (2 stages, float64), against one process.

With 4 micro-batches each stage updates its BatchNorm running statistics once per batch, over the whole
batch. In training mode each micro-batch is still normalised with its own statistics (the start-up
warning says so), so only a layer whose input does not depend on an earlier BatchNorm sees what it sees
on one device: after the first step the first layer's statistics equal one device's, and every layer's
count. The second layer's input and, after the first step, the parameters differ from one device's; they
are compared, parameters and every layer's statistics after every batch, with one process that trains
that way (``MicroBatchNorm``; under async also by the async rule). With 1 micro-batch everything equals
one device and nothing is warned."""

import pytest
import torch

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single

PP = "lightning_parallel:PipelineParallelStrategy"
MODEL = "tests.helpers.pp_models:BatchNormStack"
WARNING = "normalise each of the 4 micro-batches with that micro-batch's statistics"
SGD = {"optimizer": "sgd", "lr": 0.5}


def case(name, schedule, num_microbatches=4, model_kwargs=None, trainer=None, **kwargs):
    return {
        "name": name,
        "validate_after_fit": True,  # evaluation normalises with the running statistics
        "model": MODEL,
        "data": "tests.helpers.models:RegressionData",
        "dp_size": 1,
        "model_kwargs": {**SGD, **(model_kwargs or {})},
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 3, "limit_val_batches": 2, **(trainer or {})},
        "strategy": {
            "class": PP,
            "kwargs": {"schedule": schedule, "num_microbatches": num_microbatches, **kwargs},
        },
        "probe": "tests.helpers.probes:batchnorm_history",
        "save_checkpoint": True,
    }


CASES = [
    case("gpipe", "gpipe"),
    # the first stage ends with a BatchNorm (the stage boundary's hook runs after the layer's)
    case("1f1b-cumulative", "1f1b", model_kwargs={"bn_momentum": None}, split_points=[2, 5]),
    case("async", "async"),
    case("1f1b-accumulate", "1f1b", trainer={"accumulate_grad_batches": 2, "max_steps": 2}),
    case("gpipe-m1", "gpipe", num_microbatches=1),
]
RULES = {  # the one-process model that trains as each case does
    "gpipe": "tests.helpers.pp_models:MicroBatchNormStack",
    "1f1b-cumulative": "tests.helpers.pp_models:MicroBatchNormStack",
    "async": "tests.helpers.pp_models:AsyncMicroBatchNormStack",
    "1f1b-accumulate": "tests.helpers.pp_models:MicroBatchNormStack",
    "gpipe-m1": MODEL,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-bn")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONWARNINGS", "always")  # every warning call is printed: counted below
        return tmp, run_distributed(CASES, world_size=2, tmp_path=tmp, timeout=300)


def one_process(c, tmp, model):
    kwargs = dict(c["model_kwargs"])
    if model != MODEL:
        kwargs["num_microbatches"] = c["strategy"]["kwargs"]["num_microbatches"]
    return run_single(
        {**c, "name": f"{c['name']}-{model}", "model": model, "model_kwargs": kwargs, "strategy": "auto"}, tmp
    )


def assert_stage_statistics(ranks, reference, steps, keys=lambda key: True):
    """Every stage's BatchNorm buffers (those ``keys`` selects) after each of ``steps`` equal the
    reference's; the stages hold all 6 between them."""
    held = set()
    for rank in ranks:
        for step in steps:
            mine, theirs = rank["probe"][step], reference["probe"][step]
            held |= set(mine)
            for key, value in mine.items():
                if not keys(key):
                    continue
                diff = (value.double() - theirs[key].double()).abs().max().item()
                assert diff <= 1e-10, f"step {step}, {key}: |diff| {diff:.3e}"
    assert held == set(reference["probe"][0]) and len(held) == 6


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_running_statistics_and_parameters(runs, name):
    tmp, results = runs
    c = next(c for c in CASES if c["name"] == name)
    ranks = results[name]
    single = one_process(c, tmp, MODEL)
    batches = len(single["probe"])
    assert batches == (4 if "accumulate" in name else 3)
    first_layer = lambda key: key.startswith("net.1.") or key.endswith("num_batches_tracked")  # noqa: E731
    assert_stage_statistics(ranks, single, [0], first_layer)  # one device, after the first batch
    rule = one_process(c, tmp, RULES[name]) if RULES[name] != MODEL else single
    assert_stage_statistics(ranks, rule, range(batches))
    full = torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, rule["state_dict"], atol=1e-10)
    for rank in ranks:
        assert abs(rank["metrics"]["val_loss"] - rule["metrics"]["val_loss"]) <= 1e-10
    if RULES[name] != MODEL:  # micro-batch statistics do change training: the comparisons can tell
        assert max_param_diff(full, single["state_dict"]) > 1e-6
        second = (ranks[1]["probe"][0]["net.4.running_mean"] - single["probe"][0]["net.4.running_mean"]).abs()
        assert second.max() > 1e-6


def test_the_warning_is_shown_once_per_fit_on_rank_0(runs):
    tmp, _ = runs
    logs = [(tmp / "dist2" / f"rank{r}.log").read_text() for r in range(2)]
    assert logs[0].count(WARNING) == 4, logs[0][-3000:]  # the 4 cases with 4 micro-batches, not gpipe-m1
    assert "BatchNorm layers net.1, net.4 normalise" in logs[0]
    assert "num_microbatches=1, or a normalisation without batch statistics" in logs[0]
    assert logs[1].count(WARNING) == 0
