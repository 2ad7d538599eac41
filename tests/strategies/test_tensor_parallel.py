"""lp_tensor_parallel on 2 (tp=2) and 4 (dp=2 x tp=2) real processes equals single-device training.

Every case runs 5 float64 steps and compares the full (gathered) checkpoint with the single-device
parameters to 1e-10. One ``run_distributed`` call per world size holds all cases (start-up is costly).
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.table import params_per_rank
from tests.helpers.harness import REPO, assert_params_close, max_param_diff, run_distributed, run_single
from tests.helpers.worker import load_object

TP = "lightning_parallel:TensorParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 5}
MODELS = {
    "mlp": ("tests.helpers.models:MLP", "tests.helpers.models:RegressionData", {"optimizer": "adam", "lr": 0.01},
            str(REPO / "conf/plan/mlp.yaml")),
    "gpt": ("tests.helpers.tp_models:SmallGPT", "tests.helpers.tp_models:TokenData", {},
            str(REPO / "conf/plan/char_gpt.yaml")),
    "encoder": ("tests.helpers.tp_models:EncoderRegressor", "tests.helpers.tp_models:SequenceData", {},
                {"encoder.self_attn": "attention", "encoder.linear1": "colwise", "encoder.linear2": "rowwise",
                 "head": {"style": "colwise", "gather_output": True}}),
}
PLANS = ("written", "auto")


def case(name, model, plan, dp=1, trainer=None, **strategy_kwargs):
    target, data, model_kwargs, written = MODELS[model]
    kwargs = {"plan": written if plan == "written" else "auto", "data_parallel_size": dp, **strategy_kwargs}
    return {"name": name, "model": target, "data": data, "model_kwargs": model_kwargs, "dp_size": dp,
            "data_kwargs": {"global_batch_size": 16}, "trainer": {**F64, **(trainer or {})},
            "strategy": {"class": TP, "kwargs": kwargs}, "save_checkpoint": True}


def reference(model, tmp, trainer=None, steps=None):
    target, data, model_kwargs, _ = MODELS[model]
    c = {"name": f"single-{model}-{steps}-{sorted((trainer or {}).items())}", "model": target, "data": data,
         "model_kwargs": model_kwargs, "data_kwargs": {"global_batch_size": 16},
         "trainer": {**F64, **(trainer or {}), **({"max_steps": steps} if steps is not None else {})}}
    return run_single(c, tmp)


CASES_2 = [case(f"{m}-{p}", m, p) for m in MODELS for p in PLANS] + [
    case("gpt-auto-clip", "gpt", "auto", trainer={"gradient_clip_val": 0.05}),
    case("mlp-written-verify", "mlp", "written", verify_plan=True),
]
CASES_4 = [case(f"{m}-{p}-dp2", m, p, dp=2) for m in MODELS for p in PLANS]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    return tmp, run_distributed(CASES_2, world_size=2, tmp_path=tmp, timeout=400)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp4")
    return tmp, run_distributed(CASES_4, world_size=4, tmp_path=tmp, timeout=400)


def _checkpoint(tmp, world, name):
    return torch.load(tmp / f"dist{world}" / name / "last.ckpt", weights_only=False)["state_dict"]


def _check(tmp, results, world, name, model, trainer=None):
    ref = reference(model, tmp, trainer)
    full = _checkpoint(tmp, world, name)
    assert_params_close(full, ref["state_dict"], atol=1e-10)
    initial = reference(model, tmp, steps=0)
    assert max_param_diff(initial["state_dict"], ref["state_dict"]) > 1e-3  # training moved the parameters
    for rank in results[name]:  # every tensor-parallel rank saw the whole loss of the same batch
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), atol=1e-6, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_matches_single_device(tp2, model, plan):
    tmp, results = tp2
    _check(tmp, results, 2, f"{model}-{plan}", model)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_dp2_tp2_matches_single_device(tp4, model, plan):
    tmp, results = tp4
    ref = reference(model, tmp)
    full = _checkpoint(tmp, 4, f"{model}-{plan}-dp2")
    assert_params_close(full, ref["state_dict"], atol=1e-10)
    # each dp replica saw half the global batch: the mean of the replicas' losses is the global loss
    ranks = results[f"{model}-{plan}-dp2"]
    mean = torch.tensor([ranks[0]["losses"], ranks[2]["losses"]], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"], dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.timeout(600)
def test_global_norm_clipping_matches_single_device(tp2):
    tmp, results = tp2
    _check(tmp, results, 2, "gpt-auto-clip", "gpt", trainer={"gradient_clip_val": 0.05})
    unclipped = _checkpoint(tmp, 2, "gpt-auto")
    assert max_param_diff(unclipped, _checkpoint(tmp, 2, "gpt-auto-clip")) > 1e-6  # clipping took effect


@pytest.mark.timeout(600)
def test_verify_plan_passes_on_a_correct_plan(tp2):
    tmp, results = tp2
    _check(tmp, results, 2, "mlp-written-verify", "mlp")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 if "clip" not in c["name"] and "verify" not in c["name"]])
def test_ranks_hold_the_share_the_table_reports(tp2, name):
    """Parameters, not only compute, are split: what each rank holds equals the plan table's count."""
    tmp, results = tp2
    c = next(c for c in CASES_2 if c["name"] == name)
    module = load_object(c["model"])(**c["model_kwargs"])
    expected = params_per_rank(module, resolve(module, c["strategy"]["kwargs"]["plan"], 2))
    total = sum(p.numel() for p in module.parameters())
    for rank in results[name]:
        held = sum(t.numel() for t in rank["state_dict"].values())
        assert held == expected < total
