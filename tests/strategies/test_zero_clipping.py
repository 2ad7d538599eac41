"""Clipping under ZeRO on real gloo processes, with a clip value that clips every step: in manual
optimization the user's ``self.clip_gradients(opt, ..., "norm")`` clips by the whole model's norm, so
``zero_stage`` 1, 2 and 3 equal ``zero_stage=0`` and one device (float64, 1e-10) under lp_ddp and dp2 x tp2;
in automatic optimization the strategy's step does under dp2 x pp2; and the full-file checkpoints of these
runs (each tp and pp position's data-parallel rank 0 gathers the optimizer state) hold the single-device
optimizer state. ``torch.nn.utils.clip_grad_norm_(self.parameters())``, which cannot see the pieces'
gradients, raises naming ``self.clip_gradients`` instead of clipping nothing."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import (
    assert_params_close,
    distributed_command,
    max_param_diff,
    run_distributed,
    saved_checkpoint,
    start_processes,
)
from tests.strategies.test_zero import DDP, PARALLEL, case, layout

MANUAL = "tests.helpers.tp_models:ManualClipGPT"
#: name: (world, strategy, kwargs); every one clips with self.clip_gradients at 0.05 (every step clips)
RUNS = {
    "ddp2-z0": (2, DDP, {"zero_stage": 0}),
    "ddp2-z1": (2, DDP, {"zero_stage": 1, "bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.002}),
    "ddp2-z2": (2, DDP, {"zero_stage": 2}),
    "ddp2-z3": (2, DDP, {"zero_stage": 3}),
    "dp2tp2-z1": (4, PARALLEL, layout(2, 2, 1, 1)),
    "dp2tp2-z2": (4, PARALLEL, layout(2, 2, 1, 2)),
    "dp2tp2-z3": (4, PARALLEL, layout(2, 2, 1, 3)),
}
CLIP = {"gradient_clip_val": 0.05}


def manual(name: str, strategy: str, kwargs: dict, dp: int, clip: str = "lightning", clip_val: float = 0.05):
    run = case(name, "gpt", "adamw", strategy, kwargs, dp)
    return {
        **run,
        "model": MANUAL,
        "model_kwargs": {**run["model_kwargs"], "clip": clip, "clip_val": clip_val},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_clipping")
    by_world: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    by_world[1].append(manual("ref", DDP, {}, 1))
    by_world[1].append(manual("ref-unclipped", DDP, {}, 1, clip_val=1e6))
    by_world[1].append(case("ref-automatic", "gpt", "adamw", DDP, {}, 1, trainer=CLIP))
    by_world[4].append(
        case("dp2pp2-z1-automatic", "gpt", "adamw", PARALLEL, layout(2, 1, 2, 1), 2, trainer=CLIP)
    )
    for name, (world, strategy, kwargs) in RUNS.items():
        by_world[world].append(manual(name, strategy, kwargs, 2))
    results = {}
    for world, cases in by_world.items():
        results.update(run_distributed(cases, world_size=world, tmp_path=tmp, timeout=600))
    return tmp, results


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RUNS))
def test_the_users_clip_gradients_under_zero_clips_by_the_whole_models_norm(runs, name):
    tmp, results = runs
    world = RUNS[name][0]
    expected = results["ref"][0]["state_dict"]
    assert max_param_diff(expected, results["ref-unclipped"][0]["state_dict"]) > 1e-4  # the clipping acts
    assert_params_close(saved_checkpoint(tmp, world, name)["state_dict"], expected, atol=1e-10)
    if world == 2:
        assert_params_close(
            saved_checkpoint(tmp, world, name)["state_dict"],
            saved_checkpoint(tmp, 2, "ddp2-z0")["state_dict"],
            atol=1e-10,
        )


@pytest.mark.timeout(900)
def test_the_strategys_clipping_under_zero_and_pipeline_stages_clips_by_the_whole_models_norm(runs):
    tmp, results = runs
    full = saved_checkpoint(tmp, 4, "dp2pp2-z1-automatic")["state_dict"]
    assert_params_close(full, results["ref-automatic"][0]["state_dict"], atol=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name, world, reference",
    [
        ("ddp2-z1", 2, "ref"),
        ("ddp2-z3", 2, "ref"),
        ("dp2tp2-z2", 4, "ref"),
        ("dp2pp2-z1-automatic", 4, "ref-automatic"),
    ],
)
def test_a_full_checkpoint_under_zero_holds_the_single_device_optimizer_state(runs, name, world, reference):
    tmp, _ = runs
    ours = saved_checkpoint(tmp, world, name)["optimizer_states"][0]
    theirs = saved_checkpoint(tmp, 1, reference)["optimizer_states"][0]
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"])
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, atol=1e-10, rtol=0)


@pytest.mark.timeout(300)
def test_torchs_clip_grad_norm_on_the_models_parameters_under_zero_raises_naming_clip_gradients(tmp_path):
    commands, envs, out = distributed_command(
        [manual("raw", DDP, {"zero_stage": 1, "failure_timeout": 20}, 2, clip="torch")], 2, tmp_path
    )
    result = start_processes(commands, envs, timeout=240, cwd=out, grace=60, rendezvous=True)
    assert result.codes != [0, 0], "torch's clip_grad_norm_ of the model's parameters under ZeRO did not fail"
    for output in result.outputs:
        assert "zero_stage=1: the model's parameters hold no gradient" in output, output[-3000:]
        assert "self.clip_gradients(optimizer" in output, output[-3000:]
