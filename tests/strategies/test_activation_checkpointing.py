"""``activation_checkpointing`` on real gloo processes, float64, 4 steps: lp_ddp with dropout (replayed)
and with SyncBatchNorm (statistics updated once) equals the same run without it; tensor parallel (tp=2)
and the 1F1B pipeline (2 stages; True and "selective"; the GPT and Hugging Face Llama) equal one device to
1e-10; the async pipeline equals its one-process emulation; and the memory report's peak saved
activations of 8 blocks (one process, and a stage of a 2-stage pipeline) drop to at most a third."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.helpers.harness import assert_params_close, run_distributed
from tests.strategies.test_parallel_3d import async_case, case, layout

DDP = "lightning_parallel:DDPStrategy"
PARALLEL = "lightning_parallel:ParallelStrategy"
STEPS = 4
PP2 = {"class": PARALLEL, "kwargs": layout(1, 1, 2)}  # 1F1B, 2 stages, 2 micro-batches
DROPOUT_GPT = {
    "vocab_size": 32,
    "block_size": 8,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 16,
    "dropout": 0.2,
    "lr": 1e-2,
}


def with_checkpointing(c: dict, spec) -> dict:
    strategy = c["strategy"]
    kwargs = {**strategy["kwargs"], "activation_checkpointing": spec}
    return {**c, "name": f"{c['name']}-ckpt-{spec}", "strategy": {**strategy, "kwargs": kwargs}}


def plain(name: str, model: str, data: str, model_kwargs: dict, **trainer) -> dict:
    """``model`` under lp_ddp, built from the seed."""
    return {
        "name": name,
        "model": model,
        "model_kwargs": model_kwargs,
        "data": data,
        "data_kwargs": {"global_batch_size": 16},
        "trainer": {"precision": "64-true", "max_steps": STEPS, **trainer},
        "strategy": {"class": DDP, "kwargs": {}},
    }


def memory_case(spec, name: str = "mem", n_layer: int = 8, strategy: Optional[dict] = None) -> dict:
    """A ``n_layer``-block GPT for 2 steps, with the memory report's tables."""
    c = plain(
        name, "tests.helpers.tp_models:SmallGPT", "tests.helpers.tp_models:TokenData", {"n_layer": n_layer}
    )
    c = {**c, "strategy": strategy or c["strategy"], "dp_size": 1}
    c = {**with_checkpointing(c, spec), "probe": "tests.helpers.probes:memory_report", "no_state_dict": True}
    return {**c, "trainer": {**c["trainer"], "max_steps": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recompute")
    dropout = plain(
        "dropout", "lightning_parallel.models.gpt:CharGPT", "tests.helpers.tp_models:TokenData", DROPOUT_GPT
    )
    bn = plain(
        "bn",
        "tests.helpers.models:BatchNormNet",
        "tests.helpers.models:RegressionData",
        {},
        sync_batchnorm=True,
    )
    emulation = async_case("async-emulation", DDP, {}, 1, "tests.helpers.pp_models:AsyncRuleGPT", STEPS)
    cases = {
        1: [
            case("ref", "gpt", DDP, {}, 1, STEPS),
            case("llama-ref", "llama", DDP, {}, 1, STEPS),
            {**emulation, "strategy": "auto", "save_checkpoint": False},
            memory_case(False),
            memory_case(True),
        ],
        2: [
            dropout,
            with_checkpointing(dropout, True),
            bn,
            with_checkpointing(bn, True),
            with_checkpointing(case("tp2", "gpt", PARALLEL, layout(1, 2, 1), 1, STEPS), True),
            with_checkpointing(case("1f1b", "gpt", PARALLEL, layout(1, 1, 2), 1, STEPS), True),
            with_checkpointing(case("1f1b", "gpt", PARALLEL, layout(1, 1, 2), 1, STEPS), "selective"),
            memory_case(False, "mem-pp2", 16, PP2),
            memory_case(True, "mem-pp2", 16, PP2),
            with_checkpointing(case("llama-1f1b", "llama", PARALLEL, layout(1, 1, 2), 1, STEPS), True),
            with_checkpointing(case("tp2", "gpt", PARALLEL, layout(1, 2, 1), 1, STEPS), "selective"),
            with_checkpointing(
                async_case("async", PARALLEL, layout(1, 1, 2, "async"), 1, "gpt", STEPS), True
            ),
        ],
    }
    cases[2][-1]["model"] = "tests.helpers.tp_models:SmallGPT"
    results = {}
    for world, group in cases.items():
        results.update(run_distributed(group, world_size=world, tmp_path=tmp, timeout=600))
        for c in group:  # the full model as one device holds it, gathered from the split ranks
            if c.get("save_checkpoint"):
                path = tmp / f"dist{world}" / c["name"] / "last.ckpt"
                results[c["name"]][0]["full"] = torch.load(path, weights_only=False)["state_dict"]
    return results


@pytest.mark.parametrize("name", ["dropout", "bn"])
def test_lp_ddp_equals_the_run_without_checkpointing(runs, name):
    """Dropout masks replayed in the recompute; BatchNorm running statistics (in the state dict) updated
    once per forward, SyncBatchNorm's collectives repeated in backward."""
    for rank in (0, 1):
        assert_params_close(
            runs[f"{name}-ckpt-True"][rank]["state_dict"], runs[name][rank]["state_dict"], 1e-10
        )


@pytest.mark.parametrize(
    "name",
    ["tp2-ckpt-True", "tp2-ckpt-selective", "1f1b-ckpt-True", "1f1b-ckpt-selective", "llama-1f1b-ckpt-True"],
)
def test_split_models_equal_one_device(runs, name):
    """Tensor-parallel collectives repeated in the recompute; a stage's blocks recomputed in its backward;
    Hugging Face Llama blocks (keyword arguments, position embeddings) under a pipeline."""
    ref = "llama-ref" if name.startswith("llama") else "ref"
    assert_params_close(runs[name][0]["full"], runs[ref][0]["full"], 1e-10)


def test_async_recomputes_with_the_forward_weights(runs):
    assert_params_close(runs["async-ckpt-True"][0]["full"], runs["async-emulation"][0]["state_dict"], 1e-10)


@pytest.mark.parametrize("name", ["mem", "mem-pp2"])
def test_peak_saved_activations_of_8_blocks_drop_to_a_third(runs, name):
    """8 blocks on one process, and a 1F1B stage of 8 blocks (16 in 2 stages, 2 micro-batches)."""
    for rank, result in enumerate(runs[f"{name}-ckpt-True"]):
        without = runs[f"{name}-ckpt-False"][rank]["probe"]["tables"]["end_of_fit"][rank]["activations"]
        with_ = result["probe"]["tables"]["end_of_fit"][rank]["activations"]
        print(f"{name} rank {rank}: peak saved activations {without} B without, {with_} B with checkpointing")
        assert 0 < with_ <= without / 3
