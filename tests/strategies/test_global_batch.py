"""The start-up log says what a training batch is: the data-parallel size and the global batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.processes import run_processes
from lightning_parallel.strategies.global_batch import data_parallel_size, describe_global_batch
from tests.helpers.harness import REPO, distributed_command


def test_describe_global_batch_counts_replicas_not_processes() -> None:
    text = describe_global_batch("lp_tensor_parallel", MeshShape(dp=2, tp=2), 8, accumulate_grad_batches=3)
    assert "4 process(es) = 2 data-parallel replicas x 2 tensor-parallel ranks" in text
    assert "global batch of 48 (8 x 2 replicas x 3 accumulated)" in text
    assert "['num_replicas'] = 2), not by trainer.world_size = 4" in text


def test_describe_global_batch_pure_data_parallel_gives_no_advice() -> None:
    text = describe_global_batch("lp_ddp", MeshShape(dp=2), 8, accumulate_grad_batches=1)
    assert "global batch of 16 (8 x 2 replicas)" in text
    assert "world_size" not in text
    assert "could not be read" in describe_global_batch("lp_ddp", MeshShape(dp=2), None, 1)


def test_data_parallel_size_reads_the_sampler_arguments_of_any_strategy() -> None:
    assert data_parallel_size(SimpleNamespace(strategy=SimpleNamespace())) == 1  # single device
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 3, "rank": 0})
    assert data_parallel_size(SimpleNamespace(strategy=strategy)) == 3


@pytest.mark.timeout(180)
def test_tensor_parallel_start_up_log_states_the_global_batch(tmp_path) -> None:
    case = {
        "name": "batch_log",
        "model": "tests.helpers.models:MLP",
        "data": "tests.helpers.models:RegressionData",
        "model_kwargs": {"optimizer": "sgd", "lr": 0.1},
        "dp_size": 1,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 1},
        "strategy": {
            "class": "lightning_parallel:TensorParallelStrategy",
            "kwargs": {"plan": str(REPO / "conf/plan/mlp.yaml")},
        },
    }
    commands, envs, out = distributed_command([case], 2, tmp_path)
    outputs = run_processes(commands, envs, 150, out, rendezvous=True)
    assert "2 process(es) = 1 data-parallel replica x 2 tensor-parallel ranks" in outputs[0]
    assert "global batch of 16 (16 x 1 replica)" in outputs[0]
    assert "not by trainer.world_size = 2" in outputs[0]
