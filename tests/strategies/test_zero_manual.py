"""ZeRO accumulates the gradients of every backward before a step, as ``.grad`` does: manual optimization with
two ``manual_backward`` calls per ``step()`` (Lightning's documented accumulation) under ``zero_stage`` 1 and 2
(and 3 under lp_ddp) equals ``zero_stage=0`` in float32 (1e-6), with AdamW and with SGD with momentum, under
lp_ddp (2 gloo processes) and dp2 x tp2; a pipeline refuses manual optimization before training, so dp2 x pp2
accumulates through ``accumulate_grad_batches``. ZeRO-2 holds fewer gradient bytes than ZeRO-1, between steps
and at its peak (the memory report's accounting, read at every gradient's arrival)."""

from __future__ import annotations

import pytest

from lightning_parallel.distributed.zero import IN_FLIGHT
from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, saved_checkpoint
from tests.strategies.test_zero import DDP, OPTIMIZERS, PARALLEL, SMALL_BUCKETS, layout

MANUAL = "tests.helpers.tp_models:ManualAccumulationGPT"
TWO_BACKWARDS = "tests.helpers.tp_models:TwoBackwardsGPT"
AUTOMATIC = "tests.helpers.tp_models:SmallGPT"
F32 = {"precision": "32-true", "max_steps": 4}
#: layout: (world size, strategy class, its arguments, model, trainer options)
LAYOUTS = {
    "ddp2": (2, DDP, SMALL_BUCKETS, MANUAL, {}),
    "ddp2-one-step": (2, DDP, {}, TWO_BACKWARDS, {}),  # two forwards and backwards in one training_step
    "dp2tp2": (4, PARALLEL, layout(2, 2, 1, 0), MANUAL, {}),
    "dp2pp2": (4, PARALLEL, layout(2, 1, 2, 0), AUTOMATIC, {"accumulate_grad_batches": 2}),
}
GRADIENT_PEAK = {"class": "tests.helpers.probes:GradientPeak"}
#: the stages each layout runs (3, the parameters sharded too, under lp_ddp only)
STAGES = {"ddp2": (1, 2, 3), "ddp2-one-step": (3,), "dp2tp2": (1, 2), "dp2pp2": (1, 2)}


def case(layout_name: str, optimizer: str, zero: int) -> dict:
    world, strategy, kwargs, model, trainer = LAYOUTS[layout_name]
    measured = layout_name == "ddp2"  # the gradient bytes: where every rank holds the whole model
    return {
        "name": f"{layout_name}-{optimizer}-z{zero}",
        "model": model,
        "model_kwargs": OPTIMIZERS[optimizer],
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": 2,
        "trainer": {**F32, **trainer},
        "strategy": {"class": strategy, "kwargs": {**kwargs, "zero_stage": zero}},
        "save_checkpoint": True,
        **({"callbacks": [GRADIENT_PEAK], "probe": "tests.helpers.probes:gradient_peak"} if measured else {}),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_manual")
    by_world: dict[int, list[dict]] = {2: [], 4: []}
    for name, (world, *_) in LAYOUTS.items():
        for optimizer in OPTIMIZERS:
            by_world[world] += [case(name, optimizer, zero) for zero in (0, *STAGES[name])]
    results = {}
    for world, cases in by_world.items():
        results.update(run_distributed(cases, world_size=world, tmp_path=tmp, timeout=600))
    return tmp, results


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("layout_name, zero", [(name, zero) for name in LAYOUTS for zero in STAGES[name]])
def test_accumulated_backwards_under_zero_equal_zero_stage_0(runs, layout_name, optimizer, zero):
    tmp, _ = runs
    world = LAYOUTS[layout_name][0]
    expected = saved_checkpoint(tmp, world, f"{layout_name}-{optimizer}-z0")["state_dict"]
    sharded = saved_checkpoint(tmp, world, f"{layout_name}-{optimizer}-z{zero}")["state_dict"]
    assert_params_close(sharded, expected, atol=1e-6)


@pytest.mark.timeout(900)
def test_the_comparison_means_something(runs):
    """4 steps move the parameters far more than the tolerance: AdamW and SGD end 1e-3 apart or more."""
    tmp, _ = runs
    adamw, sgdm = (saved_checkpoint(tmp, 2, f"ddp2-{o}-z0")["state_dict"] for o in OPTIMIZERS)
    assert max_param_diff(adamw, sgdm) > 1e-3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_zero_2_holds_fewer_gradient_bytes_than_zero_1(runs, optimizer):
    """Between steps ZeRO-2 holds half of ZeRO-1's gradient bytes (its received ranges). At its peak it holds
    those and at most ``IN_FLIGHT`` + 1 full-size buckets (the one filling, those whose reduce-scatter is in
    flight), below ZeRO-1, whose buckets are whole all the time."""
    _, results = runs
    for rank in range(2):
        one = results[f"ddp2-{optimizer}-z1"][rank]["probe"]
        two = results[f"ddp2-{optimizer}-z2"][rank]["probe"]
        assert two["between_steps"] == pytest.approx(one["between_steps"] / 2, rel=0.05)
        assert two["peak"] <= two["between_steps"] + (IN_FLIGHT + 1) * two["largest_bucket"], two
        assert two["peak"] < one["peak"], (one, two)
