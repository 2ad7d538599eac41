"""torchmetrics objects and ``self.log(sync_dist=True)`` reduce over the data-parallel group only, so
ranks that hold the same batch (tensor-parallel peers) are not counted twice."""

import pytest

from tests.helpers.harness import run_distributed


def case(name, strategy, dp_size):
    return {
        "name": name,
        "model": "tests.helpers.models:CountingMLP",
        "data": "tests.helpers.models:RegressionData",
        "strategy": strategy,
        "dp_size": dp_size,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 5},
        "probe": "tests.helpers.probes:samples_seen",
    }


@pytest.mark.timeout(300)
def test_metric_counts_each_sample_once(tmp_path):
    tp = {"class": "lightning_parallel:TensorParallelStrategy", "kwargs": {"plan": "auto"}}
    results = run_distributed([case("ddp", "lp_ddp", 2), case("tp", tp, 1)], world_size=2, tmp_path=tmp_path)
    for name in ("ddp", "tp"):
        for rank in results[name]:
            assert rank["probe"] == 5 * 16, f"{name}: {rank['probe']} samples counted for 5 steps of 16"
        assert (
            abs(results[name][0]["metrics"]["train_loss"] - results["ddp"][0]["metrics"]["train_loss"])
            < 1e-12
        )
