"""Checkpoints of the pipelines as one device would write and read them, on 2 real gloo processes
(2 stages, float64): a strict load refuses a key the module does not have."""

import pytest
import torch

from tests.helpers.harness import assert_params_close, run_distributed
from tests.strategies.test_pipeline import PP


def case(name, schedule, model, data, probe=None, **kwargs):
    return {
        "name": name,
        "model": model,
        "data": data,
        "dp_size": 1,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": 3},
        "strategy": {"class": PP, "kwargs": {"schedule": schedule, "num_microbatches": 2, **kwargs}},
        "save_checkpoint": True,
        "probe": probe,
    }


SEQ = ("tests.helpers.pp_models:SequentialNet", "tests.helpers.models:RegressionData")


@pytest.mark.timeout(300)
def test_a_strict_load_into_the_stages_names_the_unexpected_key(tmp_path):
    """``fit(ckpt_path=...)`` into a module already split over the stages (a second fit of the trainer)."""
    strict = case("strict", "1f1b", *SEQ, probe="tests.helpers.probes:refit_with_an_extra_key")
    with pytest.raises(RuntimeError, match="extra.weight"):
        run_distributed([strict], world_size=2, tmp_path=tmp_path, timeout=200)


@pytest.mark.timeout(300)
def test_strict_loading_false_loads_and_ignores_the_unexpected_key(tmp_path):
    lenient = case("lenient", "1f1b", *SEQ, probe="tests.helpers.probes:refit_with_an_extra_key_not_strict")
    ranks = run_distributed([lenient], world_size=2, tmp_path=tmp_path, timeout=200)["lenient"]
    saved = torch.load(ranks[0]["probe"]["checkpoint"], weights_only=False)["state_dict"]
    for rank in ranks:
        held = rank["probe"]["state_dict"]
        assert held and set(held) < set(saved) - {"extra.weight"}
        assert_params_close(held, {k: saved[k] for k in held}, atol=0)
