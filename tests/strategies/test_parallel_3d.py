"""``lp_parallel`` (data x tensor x pipeline on one mesh) on real gloo processes: 2x2x2 on 8 processes equals
one device in float64 (1e-10) on the GPT-style model and the Hugging Face Llama-style zoo model, for gpipe and
1f1b, with plan="auto" and the model built on meta; async equals its one-process emulation; 1x2x2, 2x2x1 and
2x1x2 run through the same class. A 2x2x2 checkpoint loads on one device and resumes exactly on one process,
at tp=2 and at dp2 x pp2; a 2x2x2 save_distributed folder resumes exactly with 2 stages."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import (
    UNTRUSTED,
    assert_given_back_whole,
    assert_params_close,
    max_param_diff,
    run_distributed,
    saved_checkpoint,
)
from tests.helpers.tp_models import SmallGPT
from tests.strategies.test_deferred_init import MODELS
from tests.strategies.test_deferred_init import case as deferred_case

PARALLEL = "lightning_parallel:ParallelStrategy"
DDP = "lightning_parallel:DDPStrategy"


def layout(dp: int, tp: int, pp: int, schedule: str = "1f1b") -> dict:
    return {
        "data_parallel_size": dp,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "schedule": schedule,
        "num_microbatches": 2,
        "plan": "auto",
    }


def case(name: str, model: str, strategy: str, kwargs: dict, dp: int, steps: int = 5, **more) -> dict:
    """``model`` under ``strategy``, built on meta, float64, ``steps`` steps, a checkpoint at the end."""
    untrusted = UNTRUSTED if more.get("ckpt_path") else {}
    return {**deferred_case(model, "", strategy, kwargs, dp, steps), "name": name, **untrusted, **more}


def async_case(name: str, strategy: str, kwargs: dict, dp: int, model: str, steps: int = 5, **more) -> dict:
    """GPT with plain SGD (the async rule's optimizer), built normally from the seed."""
    c = case(name, "gpt", strategy, kwargs, dp, steps, **more)
    c["model_kwargs"] = {"optimizer": "sgd", "lr": 0.05}
    c.pop("empty_init")
    return {**c, "model": model}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel3d")
    cases: dict[int, list[dict]] = {1: [], 8: [], 4: []}
    for model in MODELS:
        cases[1].append(case(f"{model}-ref", model, DDP, {}, 1))
        for schedule in ("gpipe", "1f1b"):
            cases[8].append(case(f"{model}-2x2x2-{schedule}", model, PARALLEL, layout(2, 2, 2, schedule), 2))
    cases[1].append(case("gpt-ref-10", "gpt", DDP, {}, 1, steps=10))
    emulation = async_case("async-emulation", DDP, {}, 1, "tests.helpers.pp_models:AsyncRuleGPT")
    cases[1].append({**emulation, "strategy": "auto", "save_checkpoint": False})
    emulation = async_case("async-emulation-10", DDP, {}, 1, "tests.helpers.pp_models:AsyncRuleGPT", steps=10)
    cases[1].append({**emulation, "strategy": "auto", "save_checkpoint": False})
    every_3 = {  # a checkpoint mid-run, a batch's gradient still unapplied
        "class": "lightning.pytorch.callbacks:ModelCheckpoint",
        "kwargs": {"dirpath": "ckpt", "every_n_train_steps": 3, "save_top_k": -1, "filename": "{step}"},
    }
    cases[4].append(
        async_case(
            "async-1x2x2", PARALLEL, layout(1, 2, 2, "async"), 1, MODELS["gpt"][0], callbacks=[every_3]
        )
    )
    sharded = {**layout(2, 2, 2), "save_distributed": True}
    cases[8].append(case("gpt-2x2x2-sharded", "gpt", PARALLEL, sharded, 2))
    cases[8].append(async_case("async-2x2x2", PARALLEL, layout(2, 2, 2, "async"), 2, MODELS["gpt"][0]))
    clip = {"precision": "64-true", "max_steps": 5, "gradient_clip_val": 0.05}  # small: every step clips
    cases[1].append({**case("gpt-ref-clip", "gpt", DDP, {}, 1), "trainer": clip})
    cases[4].append({**case("gpt-1x2x2-clip", "gpt", PARALLEL, layout(1, 2, 2), 1), "trainer": clip})
    for dp, tp, pp in ((1, 2, 2), (2, 2, 1), (2, 1, 2)):
        cases[4].append(case(f"gpt-{dp}x{tp}x{pp}", "gpt", PARALLEL, layout(dp, tp, pp), dp))
    results = {}
    for world in (1, 8, 4):
        results.update(run_distributed(cases[world], world_size=world, tmp_path=tmp, timeout=600))
    saved = tmp / "dist8" / "gpt-2x2x2-1f1b" / "last.ckpt"
    folder = tmp / "dist8" / "gpt-2x2x2-sharded" / "last.ckpt"  # save_distributed: a folder of shards
    later: dict[int, list[dict]] = {
        1: [case("resume-1", "gpt", DDP, {}, 1, steps=10, ckpt_path=str(saved))],
        2: [
            case("resume-tp2", "gpt", PARALLEL, layout(1, 2, 1), 1, steps=10, ckpt_path=str(saved)),
            case("resume-sharded-pp2", "gpt", PARALLEL, layout(1, 1, 2), 1, steps=10, ckpt_path=str(folder)),
        ],
        4: [
            case("resume-dp2xpp2", "gpt", PARALLEL, layout(2, 1, 2), 2, steps=10, ckpt_path=str(saved)),
            async_case(
                "async-resume-1x2x2",
                PARALLEL,
                layout(1, 2, 2, "async"),
                1,
                MODELS["gpt"][0],
                steps=10,
                ckpt_path=str(tmp / "dist4" / "async-1x2x2" / "ckpt" / "step=3.ckpt"),
            ),
        ],
    }
    for world, group in later.items():
        results.update(run_distributed(group, world_size=world, tmp_path=tmp / "later", timeout=400))
    return tmp, results


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("model", list(MODELS))
def test_2x2x2_equals_one_device(runs, model, schedule):
    tmp, results = runs
    reference = results[f"{model}-ref"][0]["state_dict"]
    full = saved_checkpoint(tmp, 8, f"{model}-2x2x2-{schedule}")["state_dict"]
    assert set(full) == set(reference)
    assert_params_close(full, reference, atol=1e-10)
    initial = results[f"{model}-ref"][0]["losses"]
    assert len(initial) == 5
    ranks = results[f"{model}-2x2x2-{schedule}"]
    assert len(ranks) == 8
    assert_given_back_whole(ranks, full, results[f"{model}-ref"][0])  # split during fit, whole after it
    replicas = [ranks[:4], ranks[4:]]  # rank = (dp * pp + pp_rank) * tp + tp_rank
    for replica in replicas:  # every rank of a replica reports the replica's loss
        for rank in replica:
            assert rank["losses"] == pytest.approx(replica[0]["losses"], abs=1e-12)
    mean = [sum(values) / 2 for values in zip(*(replica[0]["losses"] for replica in replicas))]
    assert mean == pytest.approx(results[f"{model}-ref"][0]["losses"], abs=1e-10)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("shape", ["1x2x2", "2x2x1", "2x1x2"])
def test_other_layouts_through_the_same_class(runs, shape):
    tmp, results = runs
    world = {"1x2x2": 4, "2x2x1": 4, "2x1x2": 4}[shape]
    full = saved_checkpoint(tmp, world, f"gpt-{shape}")["state_dict"]
    assert_params_close(full, results["gpt-ref"][0]["state_dict"], atol=1e-10)


@pytest.mark.timeout(1500)
def test_async_2x2x2_equals_its_emulation(runs):
    tmp, results = runs
    full = saved_checkpoint(tmp, 8, "async-2x2x2")["state_dict"]
    emulated = results["async-emulation"][0]["state_dict"]
    assert_params_close(full, emulated, atol=1e-10)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "resumed, world",
    [("resume-1", 1), ("resume-tp2", 2), ("resume-dp2xpp2", 4), ("resume-sharded-pp2", 2)],
)
def test_2x2x2_checkpoint_resumes_exactly_in_other_layouts(runs, resumed, world):
    tmp, results = runs
    full = torch.load(tmp / "later" / f"dist{world}" / resumed / "last.ckpt", weights_only=False)
    assert_params_close(full["state_dict"], results["gpt-ref-10"][0]["state_dict"], atol=1e-10)
    assert full["global_step"] == 10


@pytest.mark.timeout(1500)
def test_2x2x2_checkpoint_loads_on_one_device(runs):
    tmp, results = runs
    path = tmp / "dist8" / "gpt-2x2x2-1f1b" / "last.ckpt"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the run trained in float64
    try:
        model = SmallGPT.load_from_checkpoint(path, map_location="cpu")
    finally:
        torch.set_default_dtype(default)
    assert_params_close(model.state_dict(), results["gpt-ref"][0]["state_dict"], atol=1e-10)
    optimizer = torch.load(path, weights_only=False)["optimizer_states"][0]
    names = [n for n, _ in model.named_parameters()]
    assert len(optimizer["state"]) == len(names)  # AdamW moments of every parameter, single-device indices
    for index, name in enumerate(names):
        assert optimizer["state"][index]["exp_avg"].shape == model.get_parameter(name).shape


@pytest.mark.timeout(1500)
def test_clipping_uses_the_norm_of_the_whole_model(runs):
    """Clipped by norm at 1x2x2, each rank holding half of its stage's sharded layers: equal to one device."""
    tmp, results = runs
    full = saved_checkpoint(tmp, 4, "gpt-1x2x2-clip")["state_dict"]
    assert_params_close(full, results["gpt-ref-clip"][0]["state_dict"], atol=1e-10)
    assert max_param_diff(full, results["gpt-ref"][0]["state_dict"]) > 1e-4  # the clipping changed the run


@pytest.mark.timeout(1500)
def test_async_with_tensor_parallel_resumes_as_its_emulation(runs):
    """The unapplied gradient of the async rule travels in the checkpoint whole (its shards gathered over
    tp) and is cut back into shards: resumed at 1x2x2 from step 3's checkpoint (saved mid-run), 10 steps
    equal 10 steps of the rule."""
    tmp, results = runs
    resumed = torch.load(tmp / "later" / "dist4" / "async-resume-1x2x2" / "last.ckpt", weights_only=False)
    assert_params_close(resumed["state_dict"], results["async-emulation-10"][0]["state_dict"], atol=1e-10)
