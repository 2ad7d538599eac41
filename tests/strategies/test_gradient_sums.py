"""The gradients summed over the tensor-parallel group (the plan's per-head norms, sequence parallelism's
norms and biases; ``tensor.gradient_sums``) on real gloo processes: one all-reduce per backward whatever the
number of parameters (Qwen3's q_norm/k_norm add one to Llama's count per step; sequence parallelism's count
does not grow with the layers), and equal to one device in float64 (1e-10) at tp=2 with gradient
accumulation, with two ``manual_backward`` per optimizer step (sequence parallel), at dp2 x tp2 under ZeRO 0, 1
and 2 (with manual optimization at 2), at tp2 x pp2 and at dp2 x tp2 x pp2 (ZeRO 2, accumulation)."""

from __future__ import annotations

import pytest

from tests.helpers.harness import REPO, assert_params_close, run_distributed, run_single, saved_checkpoint

PARALLEL = "lightning_parallel:ParallelStrategy"
ZOO = "tests.helpers.zoo:ZooLM"
GPT = "tests.helpers.tp_models:SmallGPT"
MANUAL_GPT = "tests.helpers.tp_models:ManualAccumulationGPT"
CHAR_GPT = str(REPO / "conf/plan/char_gpt.yaml")
STEPS = 3
COUNTER = {"class": "tests.helpers.probes:CollectiveCounter"}
QWEN3 = {"arch": "qwen3"}  # its q_norm and k_norm weights meet split heads: their gradients are summed


def case(name, model, model_kwargs, dp=1, tp=2, pp=1, trainer=None, counted=False, **strategy) -> dict:
    return {
        "name": name,
        "model": model,
        "model_kwargs": model_kwargs,
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "trainer": {"precision": "64-true", "max_steps": STEPS, **(trainer or {})},
        "strategy": {
            "class": PARALLEL,
            "kwargs": {
                "data_parallel_size": dp,
                "tensor_parallel_size": tp,
                "pipeline_parallel_size": pp,
                "num_microbatches": 2,
                "plan": "auto",
                **strategy,
            },
        },
        "save_checkpoint": True,
        **({"callbacks": [COUNTER], "probe": "tests.helpers.probes:collectives_in_steps"} if counted else {}),
    }


ACCUMULATE = {"accumulate_grad_batches": 2}
SP = {"plan": CHAR_GPT, "sequence_parallel": True}
#: name: (world size, case, its one-device reference)
RUNS = {
    "qwen3-tp2": (2, case("qwen3-tp2", ZOO, QWEN3, counted=True), "qwen3"),
    "llama-tp2": (2, case("llama-tp2", ZOO, {"arch": "hf_llama"}, counted=True), None),
    "gpt-sp-2-layers": (2, case("gpt-sp-2-layers", GPT, {"n_layer": 2}, counted=True, **SP), "gpt-2"),
    "gpt-sp-4-layers": (2, case("gpt-sp-4-layers", GPT, {"n_layer": 4}, counted=True, **SP), "gpt-4"),
    "qwen3-tp2-accumulate": (2, case("qwen3-tp2-accumulate", ZOO, QWEN3, trainer=ACCUMULATE), "qwen3-acc"),
    "gpt-sp-tp2-manual": (2, case("gpt-sp-tp2-manual", MANUAL_GPT, {}, **SP), "gpt-manual"),
    "qwen3-dp2tp2-z0": (4, case("qwen3-dp2tp2-z0", ZOO, QWEN3, dp=2), "qwen3"),
    "qwen3-dp2tp2-z1-accumulate": (
        4,
        case("qwen3-dp2tp2-z1-accumulate", ZOO, QWEN3, dp=2, trainer=ACCUMULATE, zero_stage=1),
        "qwen3-acc",
    ),
    "qwen3-dp2tp2-z2": (4, case("qwen3-dp2tp2-z2", ZOO, QWEN3, dp=2, zero_stage=2), "qwen3"),
    "qwen3-tp2pp2": (4, case("qwen3-tp2pp2", ZOO, QWEN3, pp=2), "qwen3"),
    "qwen3-2x2x2-z2-accumulate": (
        8,
        case("qwen3-2x2x2-z2-accumulate", ZOO, QWEN3, dp=2, pp=2, trainer=ACCUMULATE, zero_stage=2),
        "qwen3-acc",
    ),
    "gpt-sp-dp2tp2-z2-manual": (
        4,
        case("gpt-sp-dp2tp2-z2-manual", MANUAL_GPT, {}, dp=2, zero_stage=2, **SP),
        "gpt-manual",
    ),
}
REFERENCES = {
    "qwen3": case("single-qwen3", ZOO, QWEN3),
    "qwen3-acc": case("single-qwen3-acc", ZOO, QWEN3, trainer=ACCUMULATE),
    "gpt-2": case("single-gpt-2", GPT, {"n_layer": 2}),
    "gpt-4": case("single-gpt-4", GPT, {"n_layer": 4}),
    "gpt-manual": case("single-gpt-manual", MANUAL_GPT, {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gradient_sums")
    single = {
        name: run_single({**c, "strategy": "auto", "dp_size": 1}, tmp) for name, c in REFERENCES.items()
    }
    results = {}
    for world in (2, 4, 8):
        cases = [c for w, c, _ in RUNS.values() if w == world]
        results.update(run_distributed(cases, world_size=world, tmp_path=tmp, timeout=600))
    return tmp, single, results


def _all_reduces_per_step(results, name: str) -> float:
    calls = [rank["probe"]["calls"].get("all_reduce", 0) for rank in results[name]]
    assert len(set(calls)) == 1, (name, calls)
    return calls[0] / STEPS


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_all_reduce_per_backward_sums_every_such_gradient(runs):
    """Qwen3 is Llama with a q_norm and a k_norm weight per layer, summed over tp: 4 parameters, one
    collective more per step. Sequence parallelism sums 6 parameters per GPT block (2 norms, 2 row-parallel
    biases) and the final norm's in one all-reduce per step, whatever the depth. On gloo its sequence
    collectives are all-reduces too (``distributed/collectives.py``): per column/row pair, the forward's
    gather and reduce-scatter, and in backward the reduce-scatter of the gather's gradient, the gather of
    the reduce-scatter's and the pair's input gathered again: 5, so 10 per block, and nothing else grows
    with the depth (one more all-reduce per summed parameter would add 6 per block)."""
    _, _, results = runs
    qwen3, llama = (_all_reduces_per_step(results, n) for n in ("qwen3-tp2", "llama-tp2"))
    assert qwen3 - llama == 1, (qwen3, llama)
    two, four = (_all_reduces_per_step(results, f"gpt-sp-{n}-layers") for n in (2, 4))
    per_block = 2 * 5
    assert four - two == 2 * per_block, (two, four)  # the rest (embedding, loss, the one sum) stays


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [n for n, (_, _, ref) in RUNS.items() if ref is not None])
def test_summed_gradients_equal_one_device(runs, name):
    tmp, single, _ = runs
    world, _, reference = RUNS[name]
    full = saved_checkpoint(tmp, world, name)["state_dict"]
    assert_params_close(full, single[reference]["state_dict"], atol=1e-10)
