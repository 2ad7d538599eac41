"""Composition errors: each bad input fails with a message naming it, before any process starts."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_parallel.cli.train import instantiate_user
from lightning_parallel.config import ConfigError, problems, register_configs, validate
from tests.cli.lp import REPO, explain, run, survivors

CONF = REPO / "conf"


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _problems(*overrides: str) -> list[str]:
    return problems(_compose(*overrides))


def test_default_config_is_valid() -> None:
    cfg = _compose()
    assert problems(cfg) == []
    assert cfg.strategy._target_ == "lightning_parallel.DDPStrategy"
    assert cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu"


@pytest.mark.parametrize(
    "group",
    ["lp_ddp", "lp_dp", "ddp", "tensor_parallel", "pipeline_gpipe", "pipeline_1f1b", "pipeline_async"],
)
def test_every_strategy_composes(group: str) -> None:
    cfg = _compose(f"strategy={group}")
    assert "_target_" in cfg.strategy


@pytest.mark.parametrize("trainer", ["cpu", "gpu", "multinode"])
def test_every_trainer_composes(trainer: str) -> None:
    assert _compose(f"trainer={trainer}").trainer.accelerator in ("cpu", "gpu")


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "strategy.bucket_cap=5",
            ["bucket_cap", "not in 'DDPStrategyConf'"],
        ),  # unknown key (typo of bucket_cap_mb)
        ("trainer.max_stepz=5", ["max_stepz", "not in 'TrainerConf'"]),
        ("trainer.max_steps=many", ["max_steps", "many", "could not be converted to Integer"]),  # wrong type
        ("strategy.bucket_cap_mb=big", ["bucket_cap_mb", "big", "could not be converted to Float"]),
        ("strategy.find_unused_parameters=maybe", ["find_unused_parameters", "maybe", "bool"]),
        (
            "strategy.num_microbatches=four",
            ["num_microbatches", "four", "Integer"],
        ),  # with strategy=pipeline_1f1b
        ("strategy=no_such_strategy", ["no_such_strategy", "strategy"]),
    ],
)
def test_unknown_keys_and_wrong_types_fail_while_composing(override: str, words: list[str]) -> None:
    overrides = (
        ["strategy=pipeline_1f1b", override] if override.startswith("strategy.num_micro") else [override]
    )
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as err:
        _compose(*overrides)
    message = str(err.value) + str(err.value.__cause__ or "")
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["strategy=tensor_parallel", "trainer.devices=3", "strategy.tensor_parallel_size=2"],
            "trainer.devices=3 x trainer.num_nodes=1 = 3 process(es) is not divisible by "
            "strategy.tensor_parallel_size=2",
        ),
        (
            ["strategy=tensor_parallel", "trainer.devices=4", "strategy.tensor_parallel_size=2"],
            "strategy.data_parallel_size=1 x strategy.tensor_parallel_size=2 = 2 must equal",
        ),
        (
            ["strategy=tensor_parallel", "trainer.devices=4", "strategy.data_parallel_size=3"],
            "is not divisible by strategy.data_parallel_size=3",
        ),
        (
            ["strategy=pipeline_1f1b", "trainer.devices=2", "strategy.pipeline_parallel_size=4"],
            "strategy.pipeline_parallel_size=4 is more than the trainer.devices=2 x trainer.num_nodes=1 = 2 "
            "process(es); each part needs its own process: use strategy.pipeline_parallel_size=2 or less, or 4 or "
            "more devices",
        ),
        (
            ["strategy=pipeline_gpipe", "trainer.devices=4", "model.n_layer=2"],
            "4 pipeline stages but model.n_layer=2 blocks",
        ),
        (
            [
                "strategy=pipeline_gpipe",
                "trainer.devices=2",
                "strategy.split_points=[model.blocks.0,model.blocks.1]",
            ],
            "strategy.split_points has 2 entries, giving 3 stages, but the run has 2 pipeline stages",
        ),
        (
            ["strategy=pipeline_async", "strategy.schedule=zigzag"],
            "strategy.schedule='zigzag' is not supported",
        ),
        (
            ["strategy=pipeline_1f1b", "strategy.num_microbatches=0"],
            "strategy.num_microbatches must be a positive integer, got 0",
        ),
        (
            ["strategy.zero_stage=3", "strategy.data_parallel_shard_size=3", "trainer.devices=4"],
            "strategy.data_parallel_shard_size=3 must divide the data-parallel size 4 (trainer.devices=4 x "
            "trainer.num_nodes=1 = 4 process(es)) into shard groups of at least 2 ranks; use one of [2, 4]",
        ),
        (["trainer.devices=0"], "trainer.devices=0 is not a device count"),
        (["model.lr=nan"], "model.lr=nan is not a number; give a finite value"),
        (
            ["strategy=pipeline_1f1b", "strategy.num_microbatches=100000"],
            "strategy.num_microbatches=100000 with data.batch_size=32: the training batches hold 32 samples "
            "per data-parallel rank, fewer than num_microbatches=100000; use num_microbatches <= 32",
        ),
        # Hydra lets "+key=value" add a key to a structured node; the schema check catches it
        (["+strategy.bucket_cap=5"], "strategy.bucket_cap is not an option of DDPStrategyConf (options: "),
        (["+strategy.bucket_cap=5"], "did you mean strategy.bucket_cap_mb?"),
        (["trainer.num_nodes=0"], "trainer.num_nodes=0 must be at least 1"),
        (
            ["model._target_=no_such_module.Model"],
            "model._target_=no_such_module.Model: module 'no_such_module' cannot",
        ),
        (
            ["data._target_=lightning_parallel.data.NoSuchData"],
            "'lightning_parallel.data' has no attribute 'NoSuchData'",
        ),
    ],
)
def test_impossible_combinations_are_reported(overrides: list[str], expected: str) -> None:
    found = _problems(*overrides)
    assert any(expected in p for p in found), found
    with pytest.raises(ConfigError, match="invalid lp-train configuration"):
        validate(_compose(*overrides))


def test_gpu_without_cuda_is_reported() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert any("no CUDA device is visible" in p for p in _problems("trainer=gpu"))


def test_strategy_class_missing_from_this_installation_is_named() -> None:
    found = _problems("strategy=lp_ddp", "strategy._target_=lightning_parallel.NoSuchStrategy")
    assert any("has no attribute 'NoSuchStrategy'; this installation provides" in p for p in found), found


@pytest.mark.parametrize(
    "section, override, expected",
    [
        ("model", "model.n_embd=0", "GPT: n_embd=0: use an integer >= 1"),
        ("model", "model.lr=-1", "CharGPT: lr=-1: use a finite number > 0"),
        (
            "data",
            "data.max_chars=0",
            "CharCorpusData: max_chars=0; use an integer >= 1 (or None: the whole corpus)",
        ),
        ("data", "data.max_chars=100", "gives 1 training windows of 64 characters, fewer than one batch"),
    ],
)
def test_arguments_the_model_or_data_refuse_are_configuration_errors(section, override, expected) -> None:
    """The default model and data check their own arguments; lp-train builds both before any process starts
    and reports what their constructors refuse as a configuration error."""
    cfg = _compose(override)
    assert problems(cfg) == []
    with pytest.raises(ConfigError, match="invalid lp-train configuration") as err:
        instantiate_user(cfg[section], section)
    assert f"{section}: lightning_parallel." in str(err.value) and expected in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.devices=0", "trainer.devices=0 is not a device count"),
        ("model.n_embd=0", "CharGPT refused its arguments: GPT: n_embd=0"),
    ],
)
def test_cli_reports_impossible_combination_before_starting_processes(tmp_path, override, expected) -> None:
    proc = run(["strategy=lp_ddp", override], tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert expected in proc.stdout + proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not survivors(tmp_path)


def test_plan_group_feeds_the_tensor_parallel_strategy() -> None:
    assert _compose("strategy=tensor_parallel").strategy.plan == "auto"  # no plan chosen
    assert _compose("strategy=tensor_parallel", "strategy.plan=my_plan.yaml").strategy.plan == "my_plan.yaml"
    plans = sorted(p.stem for p in (CONF / "plan").glob("*.yaml"))
    if not plans:
        pytest.skip("no conf/plan/*.yaml in this branch yet (written with the tensor-parallel strategy)")
    cfg = _compose("strategy=tensor_parallel", f"plan={plans[0]}")
    assert cfg.strategy.plan == cfg.plan and cfg.plan != "auto"


LAYOUTS_8 = ["8x1x1", "4x2x1", "4x1x2", "2x2x2", "1x2x4", "2x1x4", "1x4x2"]


def test_the_8_process_layout_sweep_lists_seven_valid_layouts() -> None:
    """``lp-train -m experiment=layouts_8`` sweeps the seven layouts; each composes to a valid lp_parallel
    run of 8 processes (the layout check, the stages against the model's blocks)."""
    sweep = OmegaConf.load(CONF / "experiment" / "layouts_8.yaml")
    assert sweep.hydra.sweeper.params["+layout"].split(",") == LAYOUTS_8
    for name in LAYOUTS_8:
        cfg = _compose("experiment=layouts_8", f"+layout={name}")
        dp, tp, pp = (int(n) for n in name.split("x"))
        assert cfg.strategy._target_ == "lightning_parallel.ParallelStrategy"
        assert (cfg.strategy.data_parallel_size, cfg.strategy.tensor_parallel_size) == (dp, tp)
        assert cfg.strategy.pipeline_parallel_size == pp and cfg.trainer.devices == 8
        assert problems(cfg) == []


def test_the_zero_sweep_crosses_zero_stages_with_activation_checkpointing() -> None:
    """``lp-train -m experiment=zero_sweep``: zero_stage 0, 1, 2 x activation_checkpointing false, true under
    lp_ddp on 2 processes; each job composes to a valid run."""
    params = OmegaConf.load(CONF / "experiment" / "zero_sweep.yaml").hydra.sweeper.params
    assert params["strategy.zero_stage"].split(",") == ["0", "1", "2"]
    assert params["strategy.activation_checkpointing"].split(",") == ["false", "true"]
    for stage in (0, 1, 2):
        for checkpointing in (False, True):
            overrides = [f"strategy.zero_stage={stage}", f"strategy.activation_checkpointing={checkpointing}"]
            cfg = _compose("experiment=zero_sweep", *overrides)
            assert cfg.strategy._target_ == "lightning_parallel.DDPStrategy" and cfg.trainer.devices == 2
            assert (cfg.strategy.zero_stage, cfg.strategy.activation_checkpointing) == (stage, checkpointing)
            assert problems(cfg) == []


@pytest.mark.parametrize(
    "sizes, expected",
    [
        (["+layout=2x2x2", "strategy.tensor_parallel_size=4"], "= 16 does not divide the trainer.devices=8"),
        (
            ["strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=3"],
            "pipeline_parallel_size=3",
        ),
        (["strategy.data_parallel_size=null", "strategy.tensor_parallel_size=null"], "at most one of"),
    ],
)
def test_a_3d_layout_that_does_not_fit_is_refused_before_launch(sizes: list[str], expected: str) -> None:
    found = _problems("strategy=parallel", "trainer.devices=8", *sizes)
    assert any(expected in p for p in found), found
