"""Lightning's own callbacks under every strategy, on real gloo processes, against one device in float64.

Three fits per strategy, each with callbacks that do not interfere: ``EarlyStopping`` (stops after epoch 1),
``ModelCheckpoint(every_n_train_steps=3)``, ``LearningRateMonitor`` and ``GradientAccumulationScheduler`` (2
batches per step from epoch 1) in one, with a rank-zero-only sample under lp_ddp (on a split model a forward
on rank 0 alone is a collective the other ranks never join; under lp_ddp with ``zero_stage=3`` the sample runs
inside ``parameters_gathered()``, entered on every rank); ``StochasticWeightAveraging`` (from epoch 1) in
the second; ``BackboneFinetuning`` (the first block frozen, unfrozen at epoch 1) in the third. Each equals one
device (the gathered parameters, the step checkpoints, the stop, the learning rates, the samples) or is
refused before training with its reason. The async pipeline (PipeDream-2BW) is compared with its rule on one
process at its own timing (``AsyncCallbackGPT``), and runs ``GradientAccumulationScheduler`` in a fourth fit
of its own, where it is refused (one update per batch). lp_ddp, lp_tensor_parallel and the pipeline schedules
run on 2 processes (one launch); lp_parallel at 2x2x2 on 8 (one launch). BackboneFinetuning is refused under
ZeRO, tensor parallelism and the async pipeline, and SWA under zero_stage=3 (docs/changing_state.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.harness import assert_params_close, run_distributed, run_single

MODEL = "tests.helpers.callback_models:CallbackGPT"
STRATEGIES_2 = {
    "ddp": ("lightning_parallel:DDPStrategy", {}),
    "ddp-z3": ("lightning_parallel:DDPStrategy", {"zero_stage": 3}),
    "tp": ("lightning_parallel:TensorParallelStrategy", {"tensor_parallel_size": 2, "plan": "auto"}),
    **{
        schedule: (
            "lightning_parallel:PipelineParallelStrategy",
            {"schedule": schedule, "num_microbatches": 2},
        )
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "async")
    },
}
STRATEGIES_8 = {
    "2x2x2": (
        "lightning_parallel:ParallelStrategy",
        {
            "data_parallel_size": 2,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "schedule": "1f1b",
            "num_microbatches": 2,
            "plan": "auto",
        },
    )
}
DP = {"ddp": 2, "ddp-z3": 2, "2x2x2": 2}  # data-parallel size of each (the others: 1)


def callback(name: str, **kwargs) -> dict:
    return {"class": f"lightning.pytorch.callbacks:{name}", "kwargs": kwargs}


MONITORS = [
    callback("EarlyStopping", monitor="val_loss", patience=0, min_delta=10.0),
    callback("ModelCheckpoint", dirpath="steps", every_n_train_steps=3, save_top_k=-1, filename="{step}"),
    callback("LearningRateMonitor", logging_interval="step"),
]
ACCUMULATE = {"class": "tests.helpers.callback_models:accumulate_from_epoch_1"}
KINDS = {  # callbacks of one fit, its epochs
    "monitors": ([*MONITORS, ACCUMULATE], 3),
    "swa": ([callback("StochasticWeightAveraging", swa_lrs=1e-2, swa_epoch_start=1)], 3),
    "backbone": (
        [callback("BackboneFinetuning", unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)],
        3,
    ),
}


# The async pipeline takes one update per batch: GradientAccumulationScheduler is refused there, in a fit of
# its own, and the other monitors run without it, compared with the pipeline's rule on one process
ASYNC_KINDS = {**KINDS, "monitors": (MONITORS, 3), "accumulate": ([ACCUMULATE], 3)}
EMULATION = "tests.helpers.callback_models:AsyncCallbackGPT"

SAMPLE = {"class": "tests.helpers.callback_models:RankZeroSample"}
WHOLE_MODEL = (None, "ddp")  # where a forward on rank 0 alone is the model's forward (no collective inside)
#: the sample inside strategy.parameters_gathered(), entered on every rank: zero_stage=3's parameters whole
GATHERED_SAMPLE = {"class": "tests.helpers.callback_models:GatheredSample"}
GATHERED = ("ddp-z3",)


def kinds(strategy: str | None) -> dict:
    return ASYNC_KINDS if strategy == "async" else KINDS


def case(kind: str, strategy: str | None, dp: int = 1, may_refuse: bool = False) -> dict:
    callbacks, epochs = kinds(strategy)[kind]
    if kind == "monitors" and strategy in WHOLE_MODEL:
        callbacks = [*callbacks, SAMPLE]
    if kind == "monitors" and strategy in GATHERED:
        callbacks = [*callbacks, GATHERED_SAMPLE]
    c = {
        "name": f"{kind}-{strategy or 'one-device'}",
        "model": MODEL,
        "model_kwargs": {"n_layer": 4},
        "data": "tests.helpers.callback_models:ValidatedTokens",
        "data_kwargs": {"global_batch_size": 16, "n": 64},
        "dp_size": dp,
        "trainer": {"precision": "64-true", "max_epochs": epochs, "limit_val_batches": 2},
        "callbacks": callbacks,
        "csv_logger": True,
        "probe": "tests.helpers.callback_models:callback_report",
        "save_checkpoint": True,
        "may_refuse": may_refuse,
    }
    if strategy is not None:
        target, kwargs = {**STRATEGIES_2, **STRATEGIES_8}[strategy]
        c["strategy"] = {"class": target, "kwargs": kwargs}
    return c


def emulation(kind: str) -> dict:
    """The async pipeline's fit of ``kind`` on one process, by its rule (``AsyncCallbackGPT``)."""
    return {**case(kind, "async"), "name": f"{kind}-async-emulation", "model": EMULATION, "strategy": "auto"}


PIPELINES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "async")
SPLIT = ("ddp-z3", "tp", *PIPELINES, "2x2x2")  # the strategies whose model is split: SWA refused
# where BackboneFinetuning is refused at set-up: ZeRO cuts the trainable parameters into pieces once, the
# tensor-parallel gradient sums are fixed at set-up, and the async pipeline applies a batch's gradient a step
# later (docs/changing_state.md); everywhere else it equals one device
BACKBONE_REFUSED = ("ddp-z3", "tp", "async", "2x2x2")


def refused(kind: str, strategy: str) -> bool:
    return (
        (kind == "swa" and strategy in SPLIT)
        or (kind == "backbone" and strategy in BACKBONE_REFUSED)
        or kind == "accumulate"
    )


def fits(strategies) -> list[tuple[str, str]]:
    """(strategy, kind) of every fit the matrix runs."""
    return [(s, kind) for s in strategies for kind in kinds(s)]


def distributed_cases(strategies) -> list[dict]:
    return [
        {
            **case(kind, s, DP.get(s, 1), may_refuse=refused(kind, s)),
            "save_checkpoint": not refused(kind, s),
        }
        for s, kind in fits(strategies)
    ]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The references by strategy and kind: one device's fits, and for the async pipeline the fits of its
    rule on one process."""
    tmp = tmp_path_factory.mktemp("callbacks1")
    references = {kind: run_single(case(kind, None), tmp) for kind in KINDS}
    emulated = {"monitors": run_single(emulation("monitors"), tmp)}  # its other fits are refused
    return tmp, {"one-device": references, "async": emulated}


def reference(references: dict, strategy: str, kind: str) -> dict:
    return references["async" if strategy == "async" else "one-device"][kind]


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("callbacks2")
    return tmp, run_distributed(distributed_cases(STRATEGIES_2), 2, tmp, timeout=900)


@pytest.fixture(scope="module")
def runs8(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("callbacks8")
    return tmp, run_distributed(distributed_cases(STRATEGIES_8), 8, tmp, timeout=900)


def step_checkpoints(folder: Path) -> dict[str, dict]:
    return {f.name: torch.load(f, weights_only=False)["state_dict"] for f in sorted(folder.glob("*.ckpt"))}


def check_equal(kind: str, strategy: str, ranks: list[dict], reference: dict) -> None:
    """The fit under ``strategy`` did what one device did."""
    ref = reference["probe"]
    assert_params_close(ranks[0]["probe"]["full_state"], ref["full_state"], atol=1e-10)
    for rank in ranks:
        assert rank["probe"]["global_step"] == ref["global_step"]
        assert rank["probe"]["epoch"] == ref["epoch"]
    if kind == "monitors":
        assert reference["callback_state"]["EarlyStopping"]["stopped_epoch"] == 1
        assert [r["callback_state"]["EarlyStopping"]["stopped_epoch"] for r in ranks] == [1] * len(ranks)
        assert all(r["probe"]["lrs"] == ref["lrs"] for r in ranks)


def check_step_checkpoints(tmp: Path, world: int, strategy: str, one: Path) -> None:
    """``ModelCheckpoint(every_n_train_steps=3)`` saved the same steps with the same weights."""
    saved = step_checkpoints(tmp / f"dist{world}" / f"monitors-{strategy}" / "steps")
    name = "monitors-async-emulation" if strategy == "async" else "monitors-one-device"
    expected = step_checkpoints(one / "single" / name / "steps")
    assert list(saved) == list(expected) and len(expected) >= 2
    for name in expected:
        assert_params_close(saved[name], expected[name], atol=1e-10)


def param(strategy: str, kind: str):
    return pytest.param(strategy, kind, id=f"{kind}-{strategy}")


def check_backbone_refused(ranks: list[dict]) -> None:
    for rank in ranks:  # refused as the strategy set up: not one step taken
        assert rank["global_step"] == 0
        assert "BackboneFinetuning callback freezes and unfreezes parameters" in rank["refused"]


def check_accumulation_refused(ranks: list[dict]) -> None:
    for rank in ranks:  # refused before any process group: not one step taken
        assert rank["global_step"] == 0
        assert "GradientAccumulationScheduler" in rank["refused"] and "schedule='async'" in rank["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind", [param(s, k) for s, k in fits(STRATEGIES_2)])
def test_callbacks_equal_one_device_or_are_refused(runs2, one_device, strategy, kind):
    """Under the async pipeline, "one device" is its rule on one process (``AsyncCallbackGPT``)."""
    (tmp, results), (one, references) = runs2, one_device
    ranks = results[f"{kind}-{strategy}"]
    if kind == "accumulate":
        return check_accumulation_refused(ranks)
    if kind == "swa" and strategy in SPLIT:
        for rank in ranks:  # refused as Lightning set up the strategy: not one step taken
            assert rank["global_step"] == 0
            assert (
                "does not support the StochasticWeightAveraging callback with a split model"
                in rank["refused"]
            )
            assert strategy != "ddp-z3" or "zero_stage=3" in rank["refused"]
        return
    if kind == "backbone" and strategy in BACKBONE_REFUSED:
        return check_backbone_refused(ranks)
    check_equal(kind, strategy, ranks, reference(references, strategy, kind))
    if kind == "monitors":
        check_step_checkpoints(tmp, 2, strategy, one)
    if kind == "monitors" and strategy in (
        *WHOLE_MODEL,
        *GATHERED,
    ):  # the sample on rank 0 only, as on one device
        assert ranks[0]["probe"]["samples"] == reference(references, strategy, kind)["probe"]["samples"]
        assert ranks[1]["probe"]["samples"] == [[]]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind", [param(s, k) for k in KINDS for s in STRATEGIES_8])
def test_callbacks_at_2x2x2_equal_one_device_or_are_refused(runs8, one_device, strategy, kind):
    (tmp, results), (one, references) = runs8, one_device
    ranks = results[f"{kind}-{strategy}"]
    if kind == "swa":
        for rank in ranks:
            assert rank["global_step"] == 0
            assert (
                "StochasticWeightAveraging" in rank["refused"] and "tensor_parallel_size=2" in rank["refused"]
            )
        return
    if kind == "backbone":
        return check_backbone_refused(ranks)
    check_equal(kind, strategy, ranks, reference(references, strategy, kind))
    if kind == "monitors":
        check_step_checkpoints(tmp, 8, strategy, one)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES_2 if s not in BACKBONE_REFUSED])
def test_a_checkpoint_after_backbone_finetuning_holds_one_devices_state(runs2, one_device, strategy):
    """The param group BackboneFinetuning adds (on the stages that hold the backbone only) is saved as one
    device's: the checkpoint written after fit holds one device's parameters."""
    (tmp, _), (_, references) = runs2, one_device
    saved = torch.load(tmp / "dist2" / f"backbone-{strategy}" / "last.ckpt", weights_only=False)
    expected = reference(references, strategy, "backbone")["probe"]["full_state"]
    assert_params_close(saved["state_dict"], expected, atol=1e-10)
    assert len(saved["optimizer_states"][0]["param_groups"]) == 2
