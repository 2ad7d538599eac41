"""A rank that raises or dies must not leave its peers hanging: all exit non-zero within the bounded
time, and the survivors name the rank that failed."""

import pytest

from tests.helpers.harness import distributed_command, start_processes

FAILURE_TIMEOUT = 5.0


def failing_case(strategy_class, mode):
    return {
        "name": f"fail-{mode}",
        "model": "tests.helpers.models:FailingMLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"mode": mode, "fail_rank": 1, "fail_step": 2},
        "strategy": {
            "class": f"lightning_parallel:{strategy_class}",
            "kwargs": {"failure_timeout": FAILURE_TIMEOUT},
        },
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 50},
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "strategy_class",
    ["DDPStrategy", "DataParallelStrategy", "TensorParallelStrategy", "PipelineParallelStrategy"],
)
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_peers_exit_within_the_failure_timeout(tmp_path, strategy_class, mode):
    commands, envs, out = distributed_command([failing_case(strategy_class, mode)], 2, tmp_path)
    # generous grace: the harness must not be the one that ends the survivors
    result = start_processes(commands, envs, timeout=150, cwd=out, grace=120, rendezvous=True)
    assert result.codes[1] != 0
    assert result.codes[0] not in (0, -9), f"rank 0 exit {result.codes[0]}:\n{result.outputs[0][-2000:]}"
    assert result.seconds < 60, f"took {result.seconds:.0f} s"
    if mode == "raise":
        assert "rank 1 failed: RuntimeError: injected failure (in training_step" in result.outputs[0]


def nan_case(strategy_class, nan_rank):
    name, _, schedule = strategy_class.partition("-")
    extra = {"schedule": schedule} if schedule else {}
    return {
        "name": "nan",
        "model": "tests.helpers.models:NaNLossMLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"nan_step": 2, "nan_rank": nan_rank},
        "strategy": {
            "class": f"lightning_parallel:{name}",
            "kwargs": {"failure_timeout": FAILURE_TIMEOUT, "check_finite_loss": True, **extra},
        },
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 50},
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "strategy_class,nan_rank",
    [
        ("DDPStrategy", 1),
        ("TensorParallelStrategy", 1),
        ("TensorParallelStrategy", None),
        ("PipelineParallelStrategy", None),
        ("PipelineParallelStrategy-async", None),
    ],
)
def test_non_finite_loss_names_step_and_rank(tmp_path, strategy_class, nan_rank):
    commands, envs, out = distributed_command([nan_case(strategy_class, nan_rank)], 2, tmp_path)
    result = start_processes(commands, envs, timeout=150, cwd=out, grace=120, rendezvous=True)
    assert result.codes[0] not in (0, -9) and result.codes[1] not in (0, -9), result.codes
    assert result.seconds < 60, f"took {result.seconds:.0f} s"
    expected = "NonFiniteLossError: non-finite training loss (nan) at global step 2, batch 2, on rank"
    for rank in (0, 1):
        assert expected in result.outputs[rank], result.outputs[rank][-3000:]
    if strategy_class.startswith(
        "PipelineParallelStrategy"
    ):  # only the last stage (rank 1) computes the loss
        # (async shows batch 2's loss in step 3, before step 3's optimizer step applies batch 2's gradient)
        assert "on rank 1;" in result.outputs[0] and "on rank 1;" in result.outputs[1]
    if nan_rank == 1:  # rank 0 never saw a NaN: it names rank 1 (through the watchdog)
        assert "rank 1 failed: NonFiniteLossError" in result.outputs[0]
        assert "on rank 1;" in result.outputs[0]
