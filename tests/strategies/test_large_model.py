"""A model larger than a rank's share, on real processes: set-up never holds more than the rank's share
(plus one module at a time), under tensor parallel, a pipeline, dp2 x tp2 and lp_ddp with zero_stage=3, and dp2 x tp2
with zero_stage=3 (each rank's tensor-parallel slices sharded over dp on the meta module: a quarter of the model).
GPT-style, 1.13 GB of float32 parameters (width 1536, 10 blocks), one SGD step; memory is the resident
memory measured in each rank (``tests.helpers.worker.SetupMemory``)."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_distributed

TP = "lightning_parallel:TensorParallelStrategy"
PP = "lightning_parallel:PipelineParallelStrategy"
WIDTH, LAYERS, VOCAB = 1536, 10, 32
PARAMETER_BYTES = 4 * (
    LAYERS * (12 * WIDTH * WIDTH + 13 * WIDTH) + 2 * VOCAB * WIDTH + 8 * WIDTH + 3 * WIDTH + VOCAB
)
# the rank's share (half the model) plus one block held whole while it is cut (a tenth): 0.6 of the model,
# plus 32 MiB for what the runtime itself allocates during set-up (the tp2 peak measured 0.58-0.60 of the
# model over five runs, once 0.4 MB above 0.6 exactly)
SETUP_PEAK_LIMIT = 0.6 * PARAMETER_BYTES + 32 * 2**20
LAYOUTS = {  # name: (world size, strategy class, its arguments, data-parallel size)
    "one": (1, "lightning_parallel:DDPStrategy", {}, 1),
    "tp2": (2, TP, {"plan": "auto"}, 1),
    "1f1b": (2, PP, {"schedule": "1f1b", "num_microbatches": 2}, 1),
    "dp2_tp2": (4, TP, {"plan": "auto", "data_parallel_size": 2}, 2),
    "dp2_z3": (2, "lightning_parallel:DDPStrategy", {"zero_stage": 3}, 2),  # each rank fills its shards only
    "dp2_tp2_z3": (4, TP, {"plan": "auto", "data_parallel_size": 2, "zero_stage": 3}, 2),
}
# dp2 x tp2 at zero_stage=3: the rank's quarter, plus one block's full values while it is cut (a tenth) and
# their tensor-parallel slice before its range is placed (a twentieth), plus the runtime's 32 MiB (measured
# 0.33-0.37 of the model over two runs)
QUARTER_SETUP_PEAK_LIMIT = 0.4 * PARAMETER_BYTES + 32 * 2**20


#: left split after fit (the host reports no room for the whole): four ranks each given the whole model back
#: would not fit a 24 GiB machine beside the others
LEFT_SPLIT = {
    "callbacks": [{"class": "tests.helpers.probes:NoRoomForTheWhole"}],
    "split_after_fit": True,
    "forward_after_fit": False,
}


def case(layout: str, empty_init: bool | None) -> dict:
    _, strategy, kwargs, dp = LAYOUTS[layout]
    built = {"empty_init": True} if empty_init else {}
    return {
        **(LEFT_SPLIT if layout == "dp2_tp2_z3" else {}),
        "name": f"{layout}-{'deferred' if empty_init else 'normal'}",
        "model": "tests.helpers.tp_models:SmallGPT",
        "model_kwargs": {"n_embd": WIDTH, "n_layer": LAYERS, "vocab_size": VOCAB, "optimizer": "sgd"},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 2 * dp, "n": 8},
        "dp_size": dp,
        "no_state_dict": True,
        **built,
        "trainer": {"max_steps": 1},
        "strategy": {"class": strategy, "kwargs": {**kwargs, "failure_timeout": 300}},
    }


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("large")
    results = {}
    # each case in processes of its own, as a user's run starts: a fit that ran before in the same process
    # leaves its heap behind, and the set-up peak of the next one moved by up to 0.1 of the model with it
    # (dp2 x tp2 at zero_stage=3 after dp2 x tp2: 0.30-0.45 over four runs; first in its processes: 0.33-0.34)
    for layout, empty_init in [("tp2", True), ("1f1b", True), ("tp2", False), ("dp2_z3", True)]:
        results.update(
            run_distributed([case(layout, empty_init)], 2, tmp / f"{layout}-{empty_init}", timeout=600)
        )
    for layout in ("dp2_tp2", "dp2_tp2_z3"):
        results.update(run_distributed([case(layout, True)], 4, tmp / layout, timeout=600))
    results.update(run_distributed([case("one", True)], 1, tmp, timeout=600))
    return results


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", ["tp2", "1f1b", "dp2_tp2", "dp2_z3"])
def test_deferred_set_up_peaks_below_60_percent_of_the_model(large, layout):
    for rank, figures in enumerate(large[f"{layout}-deferred"]):
        setup = figures["setup_memory"]
        print(f"{layout} rank {rank}: {setup} of a {PARAMETER_BYTES / 2**20:.0f} MiB model")
        assert setup["setup_peak_growth"] <= SETUP_PEAK_LIMIT, (rank, setup)
        assert setup["parameter_bytes"] <= 0.55 * PARAMETER_BYTES, (rank, setup)


@pytest.mark.timeout(1500)
def test_deferred_set_up_under_tp_and_zero_3_peaks_near_a_quarter_of_the_model(large):
    for rank, figures in enumerate(large["dp2_tp2_z3-deferred"]):
        setup = figures["setup_memory"]
        print(f"dp2_tp2_z3 rank {rank}: {setup} of a {PARAMETER_BYTES / 2**20:.0f} MiB model")
        assert setup["setup_peak_growth"] <= QUARTER_SETUP_PEAK_LIMIT, (rank, setup)
        assert setup["parameter_bytes"] <= 0.27 * PARAMETER_BYTES, (rank, setup)


@pytest.mark.timeout(1500)
def test_a_normally_built_model_is_freed_once_cut(large):
    for rank, figures in enumerate(large["tp2-normal"]):
        setup = figures["setup_memory"]
        print(f"tp2, built normally, rank {rank}: {setup}")
        assert setup["parameter_bytes"] <= 0.55 * PARAMETER_BYTES, (rank, setup)
        # the whole model was resident once (built on the host); after set-up only the share is
        assert setup["rss_growth_at_first_step"] <= 0.7 * PARAMETER_BYTES, (rank, setup)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", ["tp2", "1f1b", "dp2_tp2", "dp2_z3", "dp2_tp2_z3"])
def test_a_step_peaks_below_one_process_on_the_same_per_rank_batch(large, layout):
    one = large["one-deferred"][0]["setup_memory"]["peak_at_end"]
    for rank, figures in enumerate(large[f"{layout}-deferred"]):
        peak = figures["setup_memory"]["peak_at_end"]
        print(f"{layout} rank {rank}: peak {peak / 2**20:.0f} MiB; one process {one / 2**20:.0f} MiB")
        assert peak < one, (rank, peak, one)
