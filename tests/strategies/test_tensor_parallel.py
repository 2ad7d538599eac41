"""lp_tensor_parallel on 2 (tp=2) and 4 (dp=2 x tp=2) real processes equals single-device training.

Every case runs 5 float64 steps and compares the full (gathered) checkpoint with the single-device
parameters to 1e-10. One ``run_distributed`` call per world size holds all cases (start-up is costly).
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.table import params_per_rank
from tests.helpers.harness import (
    REPO,
    assert_given_back_whole,
    assert_params_close,
    max_param_diff,
    run_distributed,
    run_single,
)
from tests.helpers.worker import load_object

TP = "lightning_parallel:TensorParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 5}
MODELS = {
    "mlp": (
        "tests.helpers.models:MLP",
        "tests.helpers.models:RegressionData",
        {"optimizer": "adam", "lr": 0.01},
        str(REPO / "conf/plan/mlp.yaml"),
    ),
    "gpt": (
        "tests.helpers.tp_models:SmallGPT",
        "tests.helpers.tp_models:TokenData",
        {},
        str(REPO / "conf/plan/char_gpt.yaml"),
    ),
    "encoder": (
        "tests.helpers.tp_models:EncoderRegressor",
        "tests.helpers.tp_models:SequenceData",
        {},
        {
            "encoder.self_attn": "attention",
            "encoder.linear1": "colwise",
            "encoder.linear2": "rowwise",
            "head": {"style": "colwise", "gather_output": True},
        },
    ),
    "transformer": (
        "tests.helpers.tp_models:TransformerRegressor",
        "tests.helpers.tp_models:SequenceData",
        {},
        {
            "transformer.*.layers.*.self_attn": "attention",
            "transformer.decoder.layers.*.multihead_attn": "attention",
            "transformer.*.layers.*.linear1": "colwise",
            "transformer.*.layers.*.linear2": "rowwise",
        },
    ),
}
PLANS = ("written", "auto")
SGD = {"optimizer": "sgd", "lr": 0.5}  # an update proportional to the gradient, unlike Adam's


def case(name, model, plan, dp=1, trainer=None, model_kwargs=None, **strategy_kwargs):
    target, data, defaults, written = MODELS[model]
    model_kwargs = {**defaults, **(model_kwargs or {})}
    kwargs = {"plan": written if plan == "written" else "auto", "data_parallel_size": dp, **strategy_kwargs}
    return {
        "name": name,
        "model": target,
        "data": data,
        "model_kwargs": model_kwargs,
        "dp_size": dp,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {**F64, **(trainer or {})},
        "strategy": {"class": TP, "kwargs": kwargs},
        "save_checkpoint": True,
        "forward_after_fit": True,
    }


def reference(model, tmp, trainer=None, steps=None, model_kwargs=None, save=False):
    target, data, defaults, _ = MODELS[model]
    model_kwargs = {**defaults, **(model_kwargs or {})}
    c = {
        "name": f"single-{model}-{steps}-{sorted((trainer or {}).items())}-{sorted(model_kwargs.items())}",
        "model": target,
        "data": data,
        "model_kwargs": model_kwargs,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {**F64, **(trainer or {}), **({"max_steps": steps} if steps is not None else {})},
        "save_checkpoint": save,
        "forward_after_fit": True,
    }
    result = run_single(c, tmp)
    if save:
        result["checkpoint"] = torch.load(tmp / "single" / c["name"] / "last.ckpt", weights_only=False)
    return result


CASES_2 = [case(f"{m}-{p}", m, p) for m in MODELS for p in PLANS] + [
    case("gpt-auto-clip", "gpt", "auto", trainer={"gradient_clip_val": 0.05}),
    {
        **case("mlp-written-verify", "mlp", "written", verify_plan=True),
        "callbacks": [{"class": "tests.helpers.probes:SummaryTotals"}],
        "probe": "tests.helpers.probes:summary_totals",
    },
    {
        **case("mlp-auto-validate", "mlp", "auto", trainer={"limit_val_batches": 2}),
        "validate_after_fit": True,
    },
    case("gpt-auto-bf16", "gpt", "auto", trainer={"precision": "bf16-mixed"}, model_kwargs=SGD),
]
for c in CASES_2:
    if c["name"].count("-") == 1:
        c["probe"] = "tests.helpers.probes:held_state_numel"
CASES_4 = [case(f"{m}-{p}-dp2", m, p, dp=2) for m in MODELS for p in PLANS] + [
    case(
        "gpt-auto-dp2-accumulate",
        "gpt",
        "auto",
        dp=2,
        trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),
]


def single_checkpoint(tmp):
    """A full checkpoint written by single-device training (5 AdamW steps: optimizer state included)."""
    target, data, model_kwargs, _ = MODELS["gpt"]
    c = {
        "name": "single-gpt-save",
        "model": target,
        "data": data,
        "model_kwargs": model_kwargs,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": F64,
        "save_checkpoint": True,
    }
    run_single(c, tmp)
    return tmp / "single" / "single-gpt-save" / "last.ckpt"


def resumed_single(tmp, ckpt, name):
    """Single-device training resumed from ``ckpt`` up to step 10."""
    target, data, model_kwargs, _ = MODELS["gpt"]
    c = {
        "name": name,
        "model": target,
        "data": data,
        "model_kwargs": model_kwargs,
        "ckpt_path": str(ckpt),
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {**F64, "max_steps": 10},
    }
    return run_single(c, tmp)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    resume = case("gpt-resume-from-single", "gpt", "auto", trainer={"max_steps": 10})
    resume["ckpt_path"] = str(single_checkpoint(tmp))
    return tmp, run_distributed(CASES_2 + [resume], world_size=2, tmp_path=tmp, timeout=400)


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
    assert_given_back_whole(results[name], full, ref)
    initial = reference(model, tmp, steps=0)
    assert max_param_diff(initial["state_dict"], ref["state_dict"]) > 1e-3  # training moved the parameters
    for rank in results[name]:  # every tensor-parallel rank saw the whole loss of the same batch
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), atol=1e-6, rtol=0
        )


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
    assert_given_back_whole(results[f"{model}-{plan}-dp2"], full, ref)
    # each dp replica saw half the global batch: the mean of the replicas' losses is the global loss
    ranks = results[f"{model}-{plan}-dp2"]
    mean = torch.tensor([ranks[0]["losses"], ranks[2]["losses"]], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"], dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.timeout(600)
def test_dp2_tp2_accumulation_and_clipping_match_single_device(tp4):
    tmp, _ = tp4
    trainer = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    ref = reference("gpt", tmp, trainer)
    assert_params_close(_checkpoint(tmp, 4, "gpt-auto-dp2-accumulate"), ref["state_dict"], atol=1e-10)


@pytest.mark.timeout(600)
def test_bf16_mixed_runs_and_stays_close(tp2):
    """bf16 autocast: activations and their all-reduces in bf16, so only closeness can be asked for."""
    tmp, results = tp2
    ref = reference("gpt", tmp, {"precision": "bf16-mixed"}, model_kwargs=SGD)
    moved = max_param_diff(reference("gpt", tmp, steps=0, model_kwargs=SGD)["state_dict"], ref["state_dict"])
    full = _checkpoint(tmp, 2, "gpt-auto-bf16")
    assert full["model.head.weight"].dtype == torch.float32
    diff = max_param_diff(full, ref["state_dict"])
    print(f"bf16-mixed tp=2 vs single: largest parameter difference {diff:.3e}, largest update {moved:.3e}")
    assert diff < 0.05 * moved
    losses = torch.tensor(results["gpt-auto-bf16"][0]["losses"])
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), atol=2e-2, rtol=0)


@pytest.mark.timeout(600)
def test_global_norm_clipping_matches_single_device(tp2):
    tmp, results = tp2
    _check(tmp, results, 2, "gpt-auto-clip", "gpt", trainer={"gradient_clip_val": 0.05})
    unclipped = _checkpoint(tmp, 2, "gpt-auto")
    assert max_param_diff(unclipped, _checkpoint(tmp, 2, "gpt-auto-clip")) > 1e-6  # clipping took effect


@pytest.mark.timeout(600)
def test_validate_after_fit_keeps_every_ranks_shards(tp2):
    """Lightning's DDPStrategy broadcasts rank 0's tensors before validate/test: not over shards (the
    module, split again for validate and whole after it, still equals one device's)."""
    tmp, results = tp2
    _check(tmp, results, 2, "mlp-auto-validate", "mlp")


@pytest.mark.timeout(600)
def test_verify_plan_passes_on_a_correct_plan(tp2):
    tmp, results = tp2
    _check(tmp, results, 2, "mlp-written-verify", "mlp")


@pytest.mark.timeout(600)
def test_model_summary_counts_the_whole_model(tp2):
    """Lightning's model summary (at on_fit_start, after set-up) shows the whole model's parameters."""
    _, results = tp2
    c = next(c for c in CASES_2 if c["name"] == "mlp-written-verify")
    module = load_object(c["model"])(**c["model_kwargs"])
    totals = results[c["name"]][0]["probe"]
    assert totals["total"] == totals["trainable"] == sum(p.numel() for p in module.parameters())
    assert totals["layers"]["Params"] == [
        get_human_readable_count(sum(p.numel() for p in module.net.parameters()))
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 if c["name"].count("-") == 1])
def test_ranks_hold_the_share_the_table_reports(tp2, name):
    """Parameters, not only compute, are split: what each rank holds equals the plan table's count."""
    tmp, results = tp2
    c = next(c for c in CASES_2 if c["name"] == name)
    module = load_object(c["model"])(**c["model_kwargs"]).double()  # the run's precision: 64-true
    batch = next(iter(load_object(c["data"])(batch_size=16).train_dataloader()))
    run = lambda: module.training_step(batch, 0)  # noqa: E731  (what the strategy traces for "auto")
    expected = params_per_rank(module, resolve(module, c["strategy"]["kwargs"]["plan"], 2, run=run))
    total = sum(p.numel() for p in module.parameters())
    for rank in results[name]:
        assert rank["probe"] == expected < total


@pytest.mark.timeout(600)
def test_full_checkpoint_loads_into_tp2(tp2):
    """single device -> tp=2: a full checkpoint (weights and AdamW moments) resumes under tp=2 exactly as
    it resumes on one device."""
    tmp, _ = tp2
    ckpt = tmp / "single" / "single-gpt-save" / "last.ckpt"
    expected = resumed_single(tmp, ckpt, "single-gpt-resume")
    assert_params_close(_checkpoint(tmp, 2, "gpt-resume-from-single"), expected["state_dict"], atol=1e-10)
    assert max_param_diff(torch.load(ckpt, weights_only=False)["state_dict"], expected["state_dict"]) > 1e-4


@pytest.mark.timeout(600)
def test_tp2_checkpoint_loads_into_plain_module(tp2):
    """tp=2 -> single device: full tensors under the original names, optimizer state included."""
    tmp, _ = tp2
    ckpt_path = tmp / "dist2" / "gpt-auto" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    plain = load_object(MODELS["gpt"][0])()
    plain.load_state_dict(ckpt["state_dict"])  # strict: same names and full shapes
    moments = ckpt["optimizer_states"][0]["state"]
    assert all(s["exp_avg"].shape == p.shape for s, p in zip(moments.values(), plain.parameters()))
    from_tp = resumed_single(tmp, ckpt_path, "single-gpt-resume-from-tp2")
    from_single = resumed_single(tmp, single_checkpoint(tmp), "single-gpt-resume-2")
    assert_params_close(from_tp["state_dict"], from_single["state_dict"], atol=1e-10)


@pytest.mark.timeout(300)
def test_verify_plan_reports_the_largest_difference(tmp_path):
    """A plan that runs but computes something else (head count not divided) fails on the first batch."""
    bad = {
        "model.blocks.*.attn.q": "colwise",
        "model.blocks.*.attn.k": "colwise",
        "model.blocks.*.attn.v": "colwise",
        "model.blocks.*.attn.proj": "rowwise",
    }
    c = case("gpt-bad-plan", "gpt", "written", verify_plan=True)
    c["strategy"]["kwargs"]["plan"] = bad
    with pytest.raises(
        RuntimeError,
        match=r"verify_plan: the sharded 'model' differs from the unsharded one by "
        r"\d\.\d+e[-+]\d+ on the first batch",
    ):
        run_distributed([c], world_size=2, tmp_path=tmp_path, timeout=120)


# ---------------------------------------------------------------------------------------------- configuration
def _fit_one_process(strategy):
    from lightning.pytorch import Trainer

    from tests.helpers.models import MLP, RegressionData

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(), datamodule=RegressionData())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"tensor_parallel_size": 2},
            r"TensorParallelStrategy: tensor_parallel_size=2 is more than the 1 process\(es\) of this run",
        ),
        (
            {"data_parallel_size": 2},
            r"TensorParallelStrategy: 1 process\(es\) of this run \(num_nodes=1 x devices=1\) is not divisible by "
            r"data_parallel_size=2",
        ),
    ],
)
def test_layout_that_does_not_fit_the_devices_fails_before_any_process_group(kwargs, message):
    from lightning_parallel import TensorParallelStrategy

    with pytest.raises(ValueError, match=message):
        _fit_one_process(TensorParallelStrategy(**kwargs))
    assert not torch.distributed.is_initialized()
    # the launch was ended: a next fit in this process starts its own processes again
    assert not {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE"} & set(os.environ)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"tensor_parallel_size": 0},
            r"tensor_parallel_size must be a positive integer or None \(all devices\), got 0",
        ),
        ({"data_parallel_size": "2"}, r"data_parallel_size must be a positive integer, got '2'"),
        ({"start_method": "spawn"}, r"start_method='spawn' is not supported by TensorParallelStrategy"),
        ({"plan": "missing.yaml"}, r"plan file 'missing.yaml' does not exist"),
        ({"plan": {"net.0": "diagonal"}}, r"unknown style 'diagonal'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    from lightning_parallel import TensorParallelStrategy

    with pytest.raises(ValueError, match=message):
        TensorParallelStrategy(**kwargs)


def test_registered_name():
    from lightning.pytorch import Trainer

    from lightning_parallel import TensorParallelStrategy

    trainer = Trainer(accelerator="cpu", devices=1, strategy="lp_tensor_parallel", logger=False)
    assert isinstance(trainer.strategy, TensorParallelStrategy) and trainer.strategy.plan == "auto"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world, name", [(2, "gpt-auto"), (2, "encoder-written"), (4, "gpt-auto-dp2"), (4, "mlp-written-dp2")]
)
def test_logged_loss_equals_single_device(tp2, tp4, world, name):
    """``self.log(sync_dist=True)`` gives the single-device value on every rank (a mean over the
    data-parallel group; note that a mean would also hide tensor-parallel peers counted twice)."""
    tmp, results = tp2 if world == 2 else tp4
    model = name.split("-")[0]
    ref = reference(model, tmp)
    for rank in results[name]:
        assert rank["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)


@pytest.mark.timeout(300)
def test_tensor_parallel_size_one_is_plain_training(tmp_path):
    c = case("gpt-tp1", "gpt", "auto")
    result = run_distributed([c], world_size=1, tmp_path=tmp_path, timeout=120)
    assert_params_close(
        torch.load(tmp_path / "dist1" / "gpt-tp1" / "last.ckpt", weights_only=False)["state_dict"],
        reference("gpt", tmp_path)["state_dict"],
        atol=1e-10,
    )
    assert result["gpt-tp1"][0]["losses"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [f"{m}-{p}" for m in MODELS for p in PLANS])
def test_checkpoint_optimizer_state_is_full(tp2, name):
    """Adam's moments / SGD's momentum of sharded parameters are gathered too (MHA's packed q/k/v
    included): the tp=2 checkpoint's optimizer state equals the single-device one."""
    tmp, _ = tp2
    ours = torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    single = reference(name.split("-")[0], tmp, save=True)["checkpoint"]["optimizer_states"][0]["state"]
    assert ours.keys() == single.keys()
    for index, state in single.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert ours[index][key].shape == value.shape, (index, key)
                assert (ours[index][key] - value).abs().max() <= 1e-10, (index, key)
