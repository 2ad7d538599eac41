"""Checkpoints of the pipelines as one device would write and read them, on 2 real gloo processes
(2 stages, float64): a network held in the hyperparameters is saved whole, and a strict load refuses a
key the module does not have."""

import pytest
import torch
from torch import nn

from tests.helpers.bn_project import ClassificationData, Classifier, bn_classifier
from tests.helpers.harness import assert_params_close, run_distributed
from tests.strategies.test_pipeline import PP

HELD = "tests.helpers.bn_project"


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


HELD_CASES = [
    case(f"held-{s}", s, f"{HELD}:bn_classifier", f"{HELD}:ClassificationData")
    for s in ("gpipe", "1f1b", "async")
]


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-held")
    return tmp, run_distributed(HELD_CASES, world_size=2, tmp_path=tmp, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [c["name"] for c in HELD_CASES])
def test_a_network_held_in_the_hyperparameters_loads_on_one_device(held, name):
    """``save_hyperparameters()`` with an ``nn.Module`` argument: ``load_from_checkpoint`` (strict) on one
    device rebuilds the whole network, with the checkpoint's values, computing what the trained model does."""
    tmp, _ = held
    path = tmp / "dist2" / name / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    net = checkpoint["hyper_parameters"]["net"]
    assert not [m for m in net.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not [m for m in net.modules() if "forward" in vars(m)]  # no block's forward replaced
    model = Classifier.load_from_checkpoint(path, weights_only=False)  # strict
    assert_params_close(model.state_dict(), checkpoint["state_dict"], atol=0)
    trained = bn_classifier().double()
    trained.load_state_dict(checkpoint["state_dict"])
    x = ClassificationData().held_out.tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), trained.eval()(x), atol=0, rtol=0)
    assert isinstance(model.net.model[0], nn.Linear) and model.net.model[-1].weight.device.type == "cpu"


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
        assert list(held) == [k for k in saved if k != "extra.weight"]  # whole again after the second fit
        assert_params_close(held, {k: saved[k] for k in held}, atol=0)
