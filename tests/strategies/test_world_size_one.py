"""Where nothing is averaged (one process, so one data-parallel replica and tp = pp = 1), a training step
of every strategy runs no collective and holds no gradient reducer, and the memory report counts the saved
activations of a sample of steps only."""

import pytest

from lightning_parallel.memory.callback import COUNTED_STEPS
from tests.helpers.harness import run_distributed

COUNTER = {"class": "tests.helpers.probes:CollectiveCounter"}
STRATEGIES = {
    "lp_ddp": {"class": "lightning_parallel:DDPStrategy"},
    "lp_ddp_zero1": {"class": "lightning_parallel:DDPStrategy", "kwargs": {"zero_stage": 1}},
    "lp_tensor_parallel": {"class": "lightning_parallel:TensorParallelStrategy"},
    "lp_pipeline_1f1b": {
        "class": "lightning_parallel:PipelineParallelStrategy",
        "kwargs": {"schedule": "1f1b"},
    },
}


@pytest.mark.timeout(300)
def test_one_process_runs_no_collective_in_a_step(tmp_path):
    cases = [
        {
            "name": name,
            "model": "tests.helpers.models:MLP",
            "data": "tests.helpers.models:RegressionData",
            "strategy": strategy,
            "data_kwargs": {"global_batch_size": 16},
            "trainer": {"precision": "64-true", "max_steps": 5},
            "callbacks": [COUNTER],
            "probe": "tests.helpers.probes:collectives_in_steps",
        }
        for name, strategy in STRATEGIES.items()
    ]
    results = run_distributed(cases, world_size=1, tmp_path=tmp_path)
    for name in STRATEGIES:
        probe = results[name][0]["probe"]
        assert probe["calls"] == {}, (name, probe["calls"])
        assert not probe["reducer"], name
        assert probe["counted"] == COUNTED_STEPS and not probe["counting"], (name, probe)
        assert results[name][0]["losses"][-1] < results[name][0]["losses"][0], name
