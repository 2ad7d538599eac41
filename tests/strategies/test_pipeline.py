"""lp_pipeline_gpipe / lp_pipeline_1f1b on 2 (pp=2) and 4 (dp=2 x pp=2) real processes equal
single-device training: float64, 5 steps, full gathered checkpoint vs single device to 1e-10."""

import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from tests.helpers.harness import (
    assert_given_back_whole,
    assert_params_close,
    max_param_diff,
    run_distributed,
    run_single,
    run_single_once,
)
from tests.helpers.worker import load_object

PP = "lightning_parallel:PipelineParallelStrategy"
GPT = ("tests.helpers.tp_models:SmallGPT", "tests.helpers.tp_models:TokenData", {"n_layer": 4})
SEQ = ("tests.helpers.pp_models:SequentialNet", "tests.helpers.models:RegressionData", {})
TUPLE = ("tests.helpers.pp_models:TupleNet", "tests.helpers.models:RegressionData", {})
UNEVEN = ("tests.helpers.pp_models:UnevenTimeNet", "tests.helpers.models:RegressionData", {})
METRIC = ("tests.helpers.pp_models:MetricNet", "tests.helpers.models:RegressionData", {})
FLAT = ("tests.helpers.pp_models:FlatSequentialNet", "tests.helpers.models:RegressionData", {})
GPT_VARIABLE = (GPT[0], "tests.helpers.pp_models:VariableLengthTokens", GPT[2])
MODELS = {
    "gpt": GPT,
    "gpt-variable": GPT_VARIABLE,
    "seq": SEQ,
    "tuple": TUPLE,
    "uneven": UNEVEN,
    "metric": METRIC,
    "flat": FLAT,
}


def case(
    name,
    model,
    dp=1,
    trainer=None,
    model_kwargs=None,
    validate_after_fit=False,
    callbacks=(),
    data_kwargs=None,
    **kwargs,
):
    target, data, defaults = MODELS[model]
    return {
        "name": name,
        "validate_after_fit": validate_after_fit,
        "callbacks": list(callbacks),
        "model": target,
        "data": data,
        "dp_size": dp,
        "model_kwargs": {**defaults, **(model_kwargs or {})},
        "data_kwargs": data_kwargs or {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 5, **(trainer or {})},
        "strategy": {"class": PP, "kwargs": {"data_parallel_size": dp, **kwargs}},
        "save_checkpoint": True,
        "forward_after_fit": True,
    }


SGD = {"optimizer": "sgd", "lr": 0.5}
CASES_2 = [
    case(
        f"{model}-{schedule}-m{m}",
        model,
        schedule=schedule,
        num_microbatches=m,
        trainer={"log_every_n_steps": 5} if (model, schedule, m) == ("gpt", "1f1b", 4) else None,
    )
    for model in ("gpt", "seq")
    for schedule in ("gpipe", "1f1b")
    for m in (4, 8)
] + [
    case("tuple-1f1b", "tuple", schedule="1f1b", split_points=[3, 4]),  # (x, aux) tuples cross the stages
    case("gpt-1f1b-accumulate", "gpt", schedule="1f1b", trainer={"accumulate_grad_batches": 2}),
    case("gpt-gpipe-clip", "gpt", schedule="gpipe", trainer={"gradient_clip_val": 0.05}, model_kwargs=SGD),
    case("gpt-split", "gpt", schedule="1f1b", split_points=["model.blocks.1"]),
    case("gpt-variable-length", "gpt-variable", schedule="1f1b"),  # sequence length changes between steps
    case("seq-uneven", "seq", schedule="gpipe", num_microbatches=3),
    case("seq-validate", "seq", schedule="1f1b", trainer={"limit_val_batches": 2}, validate_after_fit=True),
    case("seq-async", "seq", schedule="async", model_kwargs=SGD),
    case(
        "seq-bf16",
        "seq",
        schedule="1f1b",
        trainer={"precision": "bf16-mixed"},
        data_kwargs={"global_batch_size": 16, "dtype": "float32"},
    ),
    {
        **case(
            "seq-fp16-scaler",
            "seq",
            schedule="gpipe",
            trainer={"precision": None},
            data_kwargs={"global_batch_size": 16, "dtype": "float32"},
        ),
        "fp16_cpu": True,
    },
    case(
        "seq-monitor",
        "seq",
        schedule="gpipe",
        trainer={"limit_val_batches": 2, "max_steps": 48, "max_epochs": 3},
        callbacks=[
            {
                "class": "lightning.pytorch.callbacks:ModelCheckpoint",
                "kwargs": {"monitor": "val_loss", "dirpath": "ckpts", "save_top_k": 1},
            },
            {
                "class": "lightning.pytorch.callbacks:EarlyStopping",
                "kwargs": {"monitor": "val_loss", "patience": 0, "min_delta": 10.0},
            },
        ],
    ),
    case(
        "gpt-async-m8",
        "gpt",
        schedule="async",
        num_microbatches=8,
        model_kwargs=SGD,
        trainer={"log_every_n_steps": 5},
    ),
    case("uneven-time", "uneven", schedule="1f1b", balance="time"),
    case("uneven-parameters", "uneven", schedule="1f1b"),
    case(
        "metric-objects",
        "metric",
        schedule="1f1b",
        data_kwargs={"global_batch_size": 16, "n": 64},
        trainer={"max_steps": 6, "limit_val_batches": 2},
    ),
]
for c in CASES_2:
    if c["name"].startswith("uneven"):
        c["probe"] = "tests.helpers.probes:pipeline_stages"
    if c["name"] in ("gpt-gpipe-m8", "gpt-1f1b-m8", "gpt-async-m8"):
        c["probe"] = "tests.helpers.probes:pipeline_peak_held"
    if c["name"] == "gpt-variable-length":
        c["probe"] = "tests.helpers.probes:sequence_lengths"
    if c["name"] == "gpt-1f1b-m4":
        c["callbacks"] = [{"class": "tests.helpers.probes:SummaryTotals"}]
        c["probe"] = "tests.helpers.probes:summary_totals"
CASES_4 = [
    case("gpt-dp2-1f1b", "gpt", dp=2, schedule="1f1b"),
    case("gpt-dp2-1f1b-accumulate", "gpt", dp=2, schedule="1f1b", trainer={"accumulate_grad_batches": 2}),
    case(
        "seq-dp2-gpipe-accumulate-clip",
        "seq",
        dp=2,
        schedule="gpipe",
        model_kwargs=SGD,
        trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),
    case(
        "seq-pp4",
        "seq",
        schedule="gpipe",
        pipeline_parallel_size=4,
        data_parallel_size=1,
        model_kwargs={"depth": 4},
    ),
    case(
        "metric-dp2",
        "metric",
        dp=2,
        schedule="1f1b",
        data_kwargs={"global_batch_size": 16, "n": 64},
        trainer={"max_steps": 6, "limit_val_batches": 2},
    ),
    case("seq-dp2-async-time", "seq", dp=2, schedule="async", balance="time", model_kwargs=SGD),
    # block 0 frozen before set-up and unfrozen at step 2: the stage's gradient buckets are rebuilt
    case(
        "gpt-dp2-1f1b-unfreeze",
        "gpt",
        dp=2,
        schedule="1f1b",
        callbacks=[
            {
                "class": "tests.helpers.state_changes:FreezeThenUnfreeze",
                "kwargs": {"module": "model.blocks.0", "freeze_at": "setup", "unfreeze_at": 2},
            }
        ],
    ),
]
CASES_4[0]["probe"] = "tests.helpers.probes:reducer_stats"
CASES_4_SYNC = [c for c in CASES_4 if "async" not in c["name"]]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2")
    return tmp, run_distributed(CASES_2, world_size=2, tmp_path=tmp, timeout=400)


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp4")
    return tmp, run_distributed(CASES_4, world_size=4, tmp_path=tmp, timeout=400)


def reference(c, tmp, **trainer):
    ref = {
        **c,
        "name": "ref-" + c["name"] + str(trainer),
        "strategy": "auto",
        "dp_size": 1,
        "save_checkpoint": False,
        "trainer": {**c["trainer"], **trainer},
        "probe": None,
    }
    return run_single_once(ref, tmp)


def emulation(c, tmp, model="tests.helpers.pp_models:AsyncRuleEmulation", **fields):
    """Case ``c`` trained on one process by the async rule written out (``AsyncRule``), to compare with."""
    run = {
        **c,
        "name": "emulation-" + c["name"],
        "model": model,
        "strategy": "auto",
        "save_checkpoint": False,
    }
    return run_single_once({**run, **fields}, tmp)


def check(tmp, results, world, c):
    ref = reference(c, tmp)
    full = torch.load(tmp / f"dist{world}" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, ref["state_dict"], atol=1e-10)
    initial = reference(c, tmp, max_steps=0)
    assert max_param_diff(initial["state_dict"], ref["state_dict"]) > 1e-3  # training moved the parameters
    ranks = results[c["name"]]
    assert_given_back_whole(ranks, full, ref)  # each stage held only part of the blocks until fit ended
    # every stage reports its replica's full-batch loss; over the replicas that is the single-device loss
    dp = c["dp_size"]
    stages = len(ranks) // dp
    for replica in range(dp):
        for rank in ranks[replica * stages : (replica + 1) * stages]:
            assert rank["losses"] == ranks[replica * stages]["losses"]
    mean = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"], dtype=torch.float64), atol=1e-6, rtol=0)


ASYNC = [c for c in CASES_2 if "async" in c["name"]]
OTHER = [c for c in CASES_2 if c["name"] in ("seq-bf16", "seq-monitor", "seq-fp16-scaler")]
CASES_2_SYNC = [c for c in CASES_2 if c not in ASYNC + OTHER]


@pytest.mark.timeout(600)
def test_bf16_mixed_runs_and_stays_close(pp2):
    tmp, results = pp2
    c = next(c for c in OTHER if c["name"] == "seq-bf16")
    ref = run_single(
        {
            **c,
            "name": "ref-bf16",
            "strategy": "auto",
            "dp_size": 1,
            "save_checkpoint": False,
            "data_kwargs": {"global_batch_size": 16, "dtype": "float32"},
        },
        tmp,
    )
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert max_param_diff(full, ref["state_dict"]) < 2e-2


@pytest.mark.timeout(600)
def test_fp16_with_a_gradient_scaler_scales_the_micro_batch_losses(pp2):
    """16-mixed with a GradScaler: the stages' backwards run on the scaled loss, so unscaling gives the true
    gradient. (Unscaled, every step would be 65536 times too small and the weights would hardly move.)"""
    tmp, results = pp2
    c = next(c for c in OTHER if c["name"] == "seq-fp16-scaler")
    ref = run_single(
        {**c, "name": "ref-fp16", "strategy": "auto", "dp_size": 1, "save_checkpoint": False}, tmp
    )
    initial = run_single(
        {
            **c,
            "name": "init-fp16",
            "strategy": "auto",
            "dp_size": 1,
            "save_checkpoint": False,
            "trainer": {**c["trainer"], "max_steps": 0},
        },
        tmp,
    )
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    moved = max_param_diff(initial["state_dict"], ref["state_dict"])
    assert moved > 1e-2
    assert max_param_diff(full, ref["state_dict"]) < 0.02 * moved


@pytest.mark.timeout(600)
def test_model_summary_counts_the_whole_model(pp2):
    """Lightning's model summary (at on_fit_start, after set-up) shows the whole model's parameters, not the
    stage's."""
    _, results = pp2
    c = next(c for c in CASES_2 if c["name"] == "gpt-1f1b-m4")
    module = load_object(c["model"])(**c["model_kwargs"])
    totals = results[c["name"]][0]["probe"]
    assert totals["total"] == totals["trainable"] == sum(p.numel() for p in module.parameters())
    children = [get_human_readable_count(sum(p.numel() for p in m.parameters())) for m in module.children()]
    assert totals["layers"]["Params"] == children


def test_model_checkpoint_and_early_stopping_monitor_what_the_last_stage_logs(pp2):
    tmp, results = pp2
    for rank in results["seq-monitor"]:
        ckpt = rank["callback_state"]["ModelCheckpoint"]["best_model_path"]
        assert "ckpts" in ckpt and ckpt.endswith(".ckpt")
        # min_delta=10: the first validation sets the best score, the second is "no improvement" and, with
        # patience 0, stops the run in epoch 1 of 3, on every stage alike (else the stages would hang)
        assert rank["callback_state"]["EarlyStopping"]["stopped_epoch"] == 1


EPOCHS = case(
    "seq-async-epochs",
    "seq",
    schedule="async",
    model_kwargs=SGD,
    data_kwargs={"global_batch_size": 16, "n": 64},
    trainer={"max_steps": 10, "val_check_interval": 2, "limit_val_batches": 1},
    callbacks=[
        {
            "class": "lightning.pytorch.callbacks:ModelCheckpoint",
            "kwargs": {"dirpath": "ckpts", "every_n_train_steps": 3, "save_top_k": -1},
        }
    ],
)


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    """10 async steps over 3 epochs of 4 batches: flushes at epoch ends, drains before each mid-epoch
    validation and each checkpoint (every 3 steps); then a second fit resumes from the step-6 checkpoint
    (mid-epoch, with the drained gradient not yet applied) and runs to step 10."""
    tmp = tmp_path_factory.mktemp("async")
    ckpt = tmp / "dist2" / EPOCHS["name"] / "ckpts" / "epoch=1-step=6.ckpt"
    resume = {**EPOCHS, "name": "seq-async-resume", "callbacks": [], "ckpt_path": str(ckpt)}
    return tmp, run_distributed([EPOCHS, resume], world_size=2, tmp_path=tmp, timeout=300)


@pytest.mark.timeout(600)
def test_async_across_epochs_validation_checkpoints_and_resume_follows_its_rule(async_runs):
    tmp, results = async_runs
    emulated = emulation(EPOCHS, tmp, callbacks=[])
    assert len(emulated["losses"]) == 10
    for name in ("seq-async-epochs", "seq-async-resume"):
        full = torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]
        assert_params_close(full, emulated["state_dict"], atol=1e-10)
    resumed = results["seq-async-resume"][1]["losses"]  # steps 6..9 show batches 5..8
    assert len(resumed) == 4
    torch.testing.assert_close(
        torch.tensor(resumed), torch.tensor(emulated["losses"][5:9]), atol=1e-10, rtol=0
    )
    saved = torch.load(
        tmp / "dist2" / "seq-async-epochs" / "ckpts" / "epoch=1-step=6.ckpt", weights_only=False
    )
    assert saved["lightning_parallel"]["async_pending_gradient"]  # the drained batch's gradient travels
    assert "val_loss" in results["seq-async-epochs"][0]["metrics"]


@pytest.mark.timeout(600)
def test_async_equals_an_emulation_of_its_update_rule(pp2):
    """W(t+1) = W(t) - lr * grad f_t(W(t-1)), written out by hand on one process (SGD, float64)."""
    tmp, results = pp2
    c = next(c for c in ASYNC if c["name"] == "seq-async")
    emulated = emulation(c, tmp)
    full = torch.load(tmp / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulated["state_dict"], atol=1e-10)
    # the loss shown at step t is batch t-1's (the emulation shows batch t's at step t)
    for rank in results[c["name"]]:
        torch.testing.assert_close(
            torch.tensor(rank["losses"][1:]), torch.tensor(emulated["losses"][:-1]), atol=1e-10, rtol=0
        )
    synchronous = reference(c, tmp)  # the rule really differs from plain SGD
    assert max_param_diff(full, synchronous["state_dict"]) > 1e-4


@pytest.mark.timeout(600)
def test_async_with_parameters_in_one_flat_storage_equals_an_emulation_of_its_rule(tmp_path):
    """Stage 0's parameters are views into one buffer at different offsets: the weights its in-flight
    graphs keep are still each parameter's own, so the run follows the rule."""
    c = case("flat-async", "flat", schedule="async", model_kwargs=SGD)
    run_distributed([c], world_size=2, tmp_path=tmp_path, timeout=300)
    emulated = emulation(c, tmp_path, model="tests.helpers.pp_models:AsyncRuleFlatEmulation")
    full = torch.load(tmp_path / "dist2" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulated["state_dict"], atol=1e-10)


@pytest.mark.timeout(600)
def test_async_with_two_replicas_follows_the_rule_on_the_global_batch(pp4):
    """dp=2 x pp=2, stages balanced by measured time: replicas average the stale gradient, so the update is
    the emulated rule's on the global batch."""
    tmp, results = pp4
    c = next(c for c in CASES_4 if c["name"] == "seq-dp2-async-time")
    check_rule_on_global_batch(tmp, results, c)


def check_rule_on_global_batch(tmp, results, c) -> None:
    """Case ``c`` (async, dp=2 x pp=2) ended where the rule's emulation on the global batch ends, and its
    ranks showed that emulation's losses one step late (averaged over the replicas)."""
    emulated = emulation(c, tmp, dp_size=1)
    full = torch.load(tmp / "dist4" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, emulated["state_dict"], atol=1e-10)
    mean = torch.tensor([r["losses"][1:] for r in results[c["name"]]], dtype=torch.float64).mean(0)
    torch.testing.assert_close(
        mean, torch.tensor(emulated["losses"][:-1], dtype=torch.float64), atol=1e-10, rtol=0
    )


@pytest.mark.timeout(600)
def test_async_gpt_losses_are_shown_one_batch_late_and_one_step_stale(pp2):
    """No flush: step t shows batch t-1's loss (step 0 has none yet). Batch 0 is computed at W(0) like
    synchronous training; batch 1 also at W(0), not at W(1): one step stale."""
    tmp, results = pp2
    c = next(c for c in ASYNC if c["name"] == "gpt-async-m8")
    sync = reference(c, tmp)["losses"]
    first_stage, last_stage = results[c["name"]]
    assert len(last_stage["losses"]) == c["trainer"]["max_steps"]
    assert torch.isnan(torch.tensor(last_stage["losses"][0]))
    assert first_stage["losses"][1:] == last_stage["losses"][1:]
    assert abs(last_stage["losses"][1] - sync[0]) < 1e-9
    assert abs(last_stage["losses"][2] - sync[1]) > 1e-6


@pytest.mark.timeout(600)
@pytest.mark.parametrize("c", CASES_2_SYNC, ids=[c["name"] for c in CASES_2_SYNC])
def test_two_stages_match_single_device(pp2, c):
    tmp, results = pp2
    check(tmp, results, 2, c)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("c", CASES_4_SYNC, ids=[c["name"] for c in CASES_4_SYNC])
def test_four_processes_match_single_device(pp4, c):
    tmp, results = pp4
    check(tmp, results, 4, c)


@pytest.mark.timeout(600)
def test_data_parallel_stages_average_during_their_last_backward(pp4):
    """dp2 x pp2: every stage's gradient buckets are averaged by the reducer, their all-reduces launched from
    the gradient hooks of the stage's last backward of the step (the case also equals one device, above)."""
    _, results = pp4
    for rank in results["gpt-dp2-1f1b"]:
        stats = rank["probe"]
        assert stats["synced_steps"] == 5  # max_steps: one average per optimizer step
        assert stats["launched_in_backward"] > 0
        assert stats["bucket_all_reduces"] >= stats["launched_in_backward"]


@pytest.mark.timeout(600)
def test_sequence_length_changes_between_steps_in_the_variable_length_case(pp2):
    """The case gpt-variable-length matches single-device training above; here: its batches really
    changed length, on both stages alike (so activations and gradients of new shapes crossed)."""
    _, results = pp2
    stages = [r["probe"] for r in results["gpt-variable-length"]]
    assert stages[0] == stages[1]
    assert len(set(stages[0][:5])) > 1, f"the first 5 batches were all cut to one length: {stages[0]}"


@pytest.mark.timeout(600)
def test_balance_by_time_moves_the_slow_block_to_its_own_stage(pp2):
    """Same parameters per block, but block 3 does 20x the work: measured times put the cut before it."""
    _, results = pp2
    by_time = results["uneven-time"][0]["probe"]
    by_parameters = results["uneven-parameters"][0]["probe"]
    assert [s["blocks"] for s in by_parameters] == ["0..1", "2..4"]
    assert [s["blocks"] for s in by_time] == ["0..2", "3..4"]
    assert by_time[1]["seconds"] > by_time[0]["seconds"]
    assert all(s["seconds"] is None for s in by_parameters)
    assert [s["parameters"] for s in by_parameters] == [544 + 1056, 2 * 1056 + 132]
    for reports in (by_time, by_parameters):  # every rank reports the same table
        assert all(
            r["probe"] == reports
            for r in results["uneven-time" if reports is by_time else "uneven-parameters"]
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,world", [("metric-objects", 2), ("metric-dp2", 4)])
def test_torchmetrics_objects_logged_on_the_last_stage_reach_every_stage(pp2, pp4, name, world):
    """A Metric logged by training/validation_step: every rank reports the single-device values, the step
    value for the whole batch (not the last micro-batch) and compute() over the epoch (dp: over replicas)."""
    tmp, results = pp2 if world == 2 else pp4
    c = next(c for c in CASES_2 + CASES_4 if c["name"] == name)
    ref = reference(c, tmp)["metrics"]
    ranks = results[name]
    for key in ("train_mse_epoch", "val_mae"):  # computed over the epoch: synced over the replicas
        for rank in ranks:
            assert rank["metrics"][key] == pytest.approx(ref[key], rel=1e-5), (key, rank["metrics"], ref)
    # the step value is each replica's own half batch (as with Lightning's ddp); every stage of a replica
    # shows the same, and (equal halves) their mean is the whole batch's
    replicas = [ranks[i : i + 2] for i in range(0, len(ranks), 2)]
    assert all(a["metrics"]["train_mse_step"] == b["metrics"]["train_mse_step"] for a, b in replicas)
    mean = sum(r[0]["metrics"]["train_mse_step"] for r in replicas) / len(replicas)
    assert mean == pytest.approx(ref["train_mse_step"], rel=1e-5)
    # a maximum: the whole batch's, which no mix of the micro-batches' own maxima gives
    worst = [r[0]["metrics"]["train_worst"] for r in replicas]
    assert all(a["metrics"]["train_worst"] == b["metrics"]["train_worst"] for a, b in replicas)
    assert max(worst) == pytest.approx(ref["train_worst"], rel=1e-6), (worst, ref["train_worst"])


@pytest.mark.timeout(600)
def test_logged_metrics_reach_every_stage(pp2):
    """The first stage (rank 0: progress bar, ModelCheckpoint) gets what the last stage logged."""
    tmp, results = pp2
    for name in ("seq-validate", "gpt-1f1b-m4"):
        ranks = results[name]
        key = "val_loss" if name == "seq-validate" else "train_loss"
        assert key in ranks[0]["metrics"], ranks[0]["metrics"]
        assert ranks[0]["metrics"] == ranks[1]["metrics"]
        c = next(c for c in CASES_2 if c["name"] == name)
        ref = reference(c, tmp)
        assert abs(ranks[0]["metrics"][key] - ref["metrics"][key]) < 1e-9, (
            ranks[0]["metrics"],
            ref["metrics"],
        )


def test_activations_held_at_once_as_the_schedule_says(pp2):
    """Counted while the steps ran: GPipe holds all 8 micro-batches on both stages; 1F1B at most
    pp - stage (2, 1), and so does async, counting the previous batch's micro-batch still in flight."""
    _, results = pp2
    for name, held in (("gpt-gpipe-m8", [8, 8]), ("gpt-1f1b-m8", [2, 1]), ("gpt-async-m8", [2, 1])):
        per_rank = [r["probe"] for r in results[name]]
        assert all(len(steps) == 5 for steps in per_rank), (name, per_rank)
        assert [set(steps) for steps in per_rank] == [{h} for h in held], (name, per_rank)


def test_every_stage_logs_every_stages_bubble(pp2):
    """``pipeline_bubble_stage<s>`` (the previous step's, gathered without a wait) and their mean, alike
    on every rank, on the steps whose logs Lightning writes (step 5 here: log_every_n_steps=5, none with
    the default 50); with 4 micro-batches on 2 stages each stage idles part of a synchronous step."""
    _, results = pp2
    assert not any(k.startswith("pipeline_bubble") for k in results["gpt-gpipe-m4"][0]["metrics"])
    for name in ("gpt-1f1b-m4", "gpt-async-m8"):
        ranks = results[name]
        bubbles = {k: v for k, v in ranks[0]["metrics"].items() if k.startswith("pipeline_bubble")}
        assert set(bubbles) == {"pipeline_bubble", "pipeline_bubble_stage0", "pipeline_bubble_stage1"}, ranks[
            0
        ]["metrics"]
        assert all(0 <= v < 1 for v in bubbles.values()), bubbles
        assert (
            abs(
                bubbles["pipeline_bubble"]
                - (bubbles["pipeline_bubble_stage0"] + bubbles["pipeline_bubble_stage1"]) / 2
            )
            < 1e-6
        )  # logged as float32
        assert {k: ranks[1]["metrics"][k] for k in bubbles} == bubbles
    sync = results["gpt-1f1b-m4"][0]["metrics"]
    assert sync["pipeline_bubble_stage0"] > 0.01 and sync["pipeline_bubble_stage1"] > 0.01, sync


@pytest.mark.timeout(600)
def test_timeline_files_written(pp2):
    tmp, _ = pp2
    svgs = list(tmp.rglob("pipeline_timeline_step2.svg"))
    traces = list(tmp.rglob("pipeline_timeline_step2.json"))
    assert svgs and traces
    assert "F0" in svgs[0].read_text() and "B3" in svgs[0].read_text()


@pytest.mark.timeout(300)
def test_a_last_batch_smaller_than_num_microbatches_is_refused_before_training(tmp_path):
    """258 samples in batches of 16: the 17th batch holds 2, which 4 micro-batches cannot split. Refused
    when training starts (on_train_start), not at the end of the epoch, naming the sizes and the fixes."""
    bad = case(
        "last-batch",
        "seq",
        schedule="gpipe",
        num_microbatches=4,
        data_kwargs={"global_batch_size": 16, "n": 258},
    )
    bad["trainer"] = {"precision": "64-true", "max_epochs": 1}
    with pytest.raises(RuntimeError) as err:
        run_distributed([bad], world_size=2, tmp_path=tmp_path, timeout=120)
    output = str(err.value)
    for fragment in (
        "last batch holds 2 samples",
        "258",
        "batches of 16",
        "drop_last=True",
        "num_microbatches <= 2",
    ):
        assert fragment in output, output[-3000:]
    assert "on_train_start" in output and "split_microbatches" not in output, output[-3000:]
