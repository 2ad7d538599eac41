"""Deferred initialization on real processes: a model built under ``trainer.init_module(empty_init=True)`` is
created on the meta device, each rank materializes only its share from the modules' own initializers, and the same
seed gives the same training in every layout (float64, 5 steps, 1e-10): lp_ddp on one process, tensor parallel,
both synchronous pipelines, the 2-D layouts, lp_ddp with zero_stage=3 (each rank fills only its shard of each
unit, from initializers, a full checkpoint or pretrained weights) and dp2 x pp2 with zero_stage=3 (each rank fills
only its shard of its stage's units), on a GPT-style model and on the Hugging Face Llama-style zoo model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.harness import (
    assert_given_back_whole,
    assert_params_close,
    max_param_diff,
    run_distributed,
)
from tests.helpers.worker import load_object

DDP = "lightning_parallel:DDPStrategy"
TP = "lightning_parallel:TensorParallelStrategy"
PP = "lightning_parallel:PipelineParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 5}
MODELS = {
    "gpt": ("tests.helpers.tp_models:SmallGPT", {"optimizer": "adamw", "lr": 1e-2}),
    "llama": ("tests.helpers.zoo:ZooLM", {"arch": "hf_llama", "optimizer": "adamw", "lr": 1e-2}),
}
LAYOUTS = {  # name: (world size, strategy class, its arguments, data-parallel size)
    "tp2": (2, TP, {"plan": "auto"}, 1),
    "1f1b": (2, PP, {"schedule": "1f1b", "num_microbatches": 2}, 1),
    "gpipe": (2, PP, {"schedule": "gpipe", "num_microbatches": 2}, 1),
    "dp2_tp2": (4, TP, {"plan": "auto", "data_parallel_size": 2}, 2),
    "dp2_pp2": (4, PP, {"schedule": "1f1b", "num_microbatches": 2, "data_parallel_size": 2}, 2),
    "dp2_z3": (2, DDP, {"zero_stage": 3}, 2),  # each rank fills only its shard of each unit
    # each rank fills only its shard of its stage's units
    "dp2_pp2_z3": (
        4,
        PP,
        {"schedule": "1f1b", "num_microbatches": 2, "data_parallel_size": 2, "zero_stage": 3},
        2,
    ),
}


def case(model: str, layout: str, strategy: str, kwargs: dict, dp: int, steps: int = 5) -> dict:
    target, model_kwargs = MODELS[model]
    return {
        "name": f"{model}-{layout}",
        "model": target,
        "model_kwargs": model_kwargs,
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "empty_init": True,
        "trainer": {**F64, "max_steps": steps},
        "strategy": {"class": strategy, "kwargs": kwargs},
        "save_checkpoint": True,
        "forward_after_fit": True,
    }


def _full(tmp, world, name):
    return torch.load(tmp / f"dist{world}" / name / "last.ckpt", weights_only=False)["state_dict"]


USERS = {  # models written without this package: (module, data, its arguments, layout)
    "transformer": (
        "tests.helpers.tp_models:TransformerRegressor",
        "tests.helpers.tp_models:SequenceData",
        {},
        "tp2",
    ),
    "mixtral": ("tests.helpers.zoo:ZooLM", "tests.helpers.tp_models:TokenData", {"arch": "mixtral"}, "1f1b"),
    "batchnorm": ("tests.helpers.models:BatchNormNet", "tests.helpers.models:RegressionData", {}, "tp2"),
}


def user_case(name: str, layout: str, steps: int = 4) -> dict:
    """A ``USERS`` model under ``layout`` (or lp_ddp on one process: ``"ddp1"``), built on meta."""
    model, data, model_kwargs, _ = USERS[name]
    _, strategy, kwargs, dp = LAYOUTS[layout] if layout in LAYOUTS else (1, DDP, {}, 1)
    c = case("gpt", layout, strategy, kwargs, dp, steps)
    return {**c, "name": f"{name}-{layout}", "model": model, "model_kwargs": model_kwargs, "data": data}


def resumed(name: str, layout: str, ckpt, **kwargs) -> dict:
    """GPT under ``layout``, built on meta, resumed from ``ckpt`` up to step 10."""
    _, strategy, strategy_kwargs, dp = LAYOUTS[layout]
    c = case("gpt", layout, strategy, {**strategy_kwargs, **kwargs}, dp, steps=10)
    return {**c, "name": name, "ckpt_path": str(ckpt)}


def save_pretrained_llama(folder):
    """A Hugging Face Llama (the zoo's), trained by nobody, saved as Hugging Face saves it (safetensors)."""
    torch.manual_seed(7)
    model = load_object(MODELS["llama"][0])(**MODELS["llama"][1]).double()
    model.model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def deferred(tmp_path_factory):
    """Every layout's run, and lp_ddp on one process (the reference), each in its own processes; then
    resumes of a deferred-init model from a full checkpoint and from a sharded directory."""
    tmp = tmp_path_factory.mktemp("deferred")
    cases: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for model in MODELS:
        cases[1].append(case(model, "ddp1", DDP, {}, 1))
        cases[1].append(case(model, "initial", DDP, {}, 1, steps=0))
        for layout, (world, strategy, kwargs, dp) in LAYOUTS.items():
            cases[world].append(case(model, layout, strategy, kwargs, dp))
    cases[1].append({**case("gpt", "ddp1-10", DDP, {}, 1, steps=10)})
    cases[2].append({**case("gpt", "tp2-sharded", TP, {"plan": "auto", "save_distributed": True}, 1)})
    for layout in ("tp2", "1f1b"):  # built on meta, too large for the host to hold whole after fit
        _, strategy, kwargs, dp = LAYOUTS[layout]
        no_room = {"class": "tests.helpers.probes:NoRoomForTheWhole"}
        cases[2].append({**case("gpt", f"{layout}-no-room", strategy, kwargs, dp), "callbacks": [no_room]})
        cases[2][-1].update(split_after_fit=True, forward_after_fit=False)
    full = tmp / "dist1" / "gpt-ddp1" / "last.ckpt"
    cases[2] += [resumed(f"resume-full-{layout}", layout, full) for layout in ("tp2", "1f1b", "dp2_z3")]
    for layout in ("tp2", "1f1b"):  # the network built in configure_model: on meta by default
        _, strategy, kwargs, dp = LAYOUTS[layout]
        built_late = case("gpt", f"configure-{layout}", strategy, kwargs, dp)
        built_late.pop("empty_init")
        cases[2].append({**built_late, "model": "tests.helpers.tp_models:ConfiguredGPT"})
    for name, (*_, layout) in USERS.items():
        cases[1].append(user_case(name, "ddp1"))
        cases[2].append(user_case(name, layout))
    pretrained = save_pretrained_llama(tmp / "pretrained")
    weights = {"initial_weights": str(pretrained), "initial_weights_prefix": "model."}
    cases[1] += [
        {**case("llama", "pretrained-ddp1", DDP, weights, 1)},
        {**case("llama", "pretrained-initial", DDP, weights, 1, steps=0)},
    ]
    cases[2].append(case("llama", "pretrained-tp2", TP, {"plan": "auto", **weights}, 1))
    cases[2].append(case("llama", "pretrained-dp2_z3", DDP, {"zero_stage": 3, **weights}, 2))
    results = {}
    for world, group in cases.items():
        results.update(run_distributed(group, world_size=world, tmp_path=tmp, timeout=500))
    sharded = tmp / "dist2" / "gpt-tp2-sharded" / "last.ckpt"
    later = [resumed("resume-sharded-1f1b", "1f1b", sharded), resumed("resume-sharded-tp2", "tp2", sharded)]
    results.update(run_distributed(later, world_size=2, tmp_path=tmp / "later", timeout=500))
    return tmp, results


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_every_layout_trains_as_one_process_from_the_same_initial_weights(deferred, model, layout):
    tmp, results = deferred
    world = LAYOUTS[layout][0]
    reference = _full(tmp, 1, f"{model}-ddp1")
    assert_params_close(_full(tmp, world, f"{model}-{layout}"), reference, atol=1e-10)
    assert max_param_diff(_full(tmp, 1, f"{model}-initial"), reference) > 1e-3  # the steps moved them
    # built on meta, it fits the host: every rank's module is whole after fit
    ranks = results[f"{model}-{layout}"]
    assert_given_back_whole(ranks, _full(tmp, world, f"{model}-{layout}"), results[f"{model}-ddp1"][0])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["tp2", "1f1b"])
def test_a_model_too_large_to_gather_stays_split_and_refuses_to_pass_for_whole(deferred, layout):
    """Built on meta and too large for the host to hold whole: after fit its state_dict() and forward raise,
    naming trainer.save_checkpoint and how to load that whole; the checkpoint is whole and trained."""
    tmp, results = deferred
    for rank in results[f"gpt-{layout}-no-room"]:
        for call in ("state_dict", "forward"):
            kind, message = rank["refused"][call]
            assert kind == "ShardedModuleError", (call, kind, message)
            for fragment in (
                "built on the meta device",
                "stays split",
                "trainer.save_checkpoint",
                "load_from_checkpoint",
            ):
                assert fragment in message, (call, message)
    full = _full(tmp, 2, f"gpt-{layout}-no-room")
    assert_params_close(full, _full(tmp, 1, "gpt-ddp1"), atol=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", list(MODELS))
def test_initial_weights_come_from_the_initializers(deferred, model):
    tmp, _ = deferred
    initial = _full(tmp, 1, f"{model}-initial")
    for name, tensor in initial.items():
        assert torch.isfinite(tensor).all(), name
        if name.endswith("norm.weight") or ".ln" in name and name.endswith("weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name  # norms start at 1
    weights = [t for n, t in initial.items() if n.endswith("weight") and t.dim() == 2]
    assert all(0 < t.std().item() < 2 for t in weights)  # random (embeddings: N(0, 1)), not empty memory
    if model == "gpt":  # nn.Linear's own reset_parameters: uniform within 1/sqrt(fan_in)
        w = initial["model.blocks.0.mlp.fc.weight"]
        assert w.abs().max().item() <= 1 / math.sqrt(w.shape[1])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["tp2", "1f1b", "dp2_tp2", "dp2_z3", "dp2_pp2_z3"])
def test_a_rank_holds_its_share_after_set_up(deferred, layout):
    tmp, results = deferred
    full = sum(
        t.numel() * t.element_size()
        for k, t in _full(tmp, 1, "gpt-ddp1").items()
        if "weight" in k or "bias" in k
    )
    for rank in results[f"gpt-{layout}"]:
        held = rank["setup_memory"]["parameter_bytes"]
        assert held < 0.8 * full, (layout, held, full)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name",
    [
        "resume-full-tp2",
        "resume-full-1f1b",
        "resume-full-dp2_z3",
        "resume-sharded-1f1b",
        "resume-sharded-tp2",
    ],
)
def test_checkpoints_load_straight_into_the_shards_and_resume_exactly(deferred, name):
    tmp, _ = deferred
    where = tmp / "later" if "sharded" in name else tmp
    resumed_full = torch.load(where / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(resumed_full, _full(tmp, 1, "gpt-ddp1-10"), atol=1e-10)
    assert max_param_diff(_full(tmp, 1, "gpt-ddp1"), _full(tmp, 1, "gpt-ddp1-10")) > 1e-3


@pytest.mark.timeout(900)
def test_pretrained_weights_are_read_into_the_shards(deferred):
    tmp, _ = deferred
    from safetensors.torch import load_file

    saved = {f"model.{k}": v for k, v in load_file(str(tmp / "pretrained" / "model.safetensors")).items()}
    initial = _full(tmp, 1, "llama-pretrained-initial")
    assert set(saved) <= set(initial)
    for name, tensor in saved.items():
        assert torch.equal(initial[name], tensor), name
    reference = _full(tmp, 1, "llama-pretrained-ddp1")
    assert_params_close(_full(tmp, 2, "llama-pretrained-tp2"), reference, atol=1e-10)
    assert_params_close(_full(tmp, 2, "llama-pretrained-dp2_z3"), reference, atol=1e-10)
    assert max_param_diff(initial, reference) > 1e-3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["tp2", "1f1b"])
def test_a_network_built_in_configure_model_is_deferred_too(deferred, layout):
    tmp, _ = deferred
    assert_params_close(_full(tmp, 2, f"gpt-configure-{layout}"), _full(tmp, 1, "gpt-ddp1"), atol=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(USERS))
def test_models_written_without_the_package_are_deferred_too(deferred, name):
    """torch's nn.Transformer under tp=2, Hugging Face Mixtral (mixture of experts) under 1F1B, a BatchNorm
    network under tp=2: each built on meta equals lp_ddp on one process."""
    tmp, _ = deferred
    layout = USERS[name][3]
    assert_params_close(_full(tmp, 2, f"{name}-{layout}"), _full(tmp, 1, f"{name}-ddp1"), atol=1e-10)
