"""Sequence parallelism (``sequence_parallel=True``) on 2 real processes (tp=2): equal to single-device
training in float64 (AdamW and SGD with momentum, written and automatic plans, the package's GPT, with
dropout on its residual branches too and with activation checkpointing of whole blocks and selective, and
the zoo's Hugging Face Llama), fewer saved activations per rank than tensor parallelism alone, and under
activation checkpointing no more than that checkpointing saves without it.

One ``run_distributed`` call holds every case (start-up is costly).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import REPO, assert_params_close, max_param_diff, run_distributed, run_single

TP = "lightning_parallel:TensorParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 4}
GPT = ("tests.helpers.tp_models:SmallGPT", {})
# dropout on the residual branches: each rank draws its part of one device's masks
DROPOUT = ("tests.helpers.tp_models:DropoutGPT", {"lr": 0.05, "residual_dropout": 0.2})
LLAMA = ("tests.helpers.zoo:ZooLM", {"arch": "hf_llama", "optimizer": "adamw", "lr": 0.01})
# long enough sequences that the activations outside the pairs show (memory cases)
WIDE = {"block_size": 32, "n_embd": 32}


def case(name, model, plan, sequence=True, model_kwargs=None, data_kwargs=None, steps=4, **strategy):
    target, defaults = model
    return {
        "name": name,
        "model": target,
        "data": "tests.helpers.tp_models:TokenData",
        "model_kwargs": {**defaults, **(model_kwargs or {})},
        "data_kwargs": {"global_batch_size": 16, **(data_kwargs or {})},
        "dp_size": 1,
        "trainer": {**F64, "max_steps": steps},
        "strategy": {"class": TP, "kwargs": {"plan": plan, "sequence_parallel": sequence, **strategy}},
        "save_checkpoint": True,
        "probe": "tests.helpers.probes:sequence_parallel",
    }


CHAR_GPT = str(REPO / "conf/plan/char_gpt.yaml")
EXACT = {
    "gpt-written-adamw": case("gpt-written-adamw", GPT, CHAR_GPT),
    "gpt-auto-dropout-momentum": case("gpt-auto-dropout-momentum", DROPOUT, "auto"),
    "llama-auto-adamw": case("llama-auto-adamw", LLAMA, "auto"),
    # each block's attention recomputed in backward: its gathers and reduce-scatter repeated there
    "gpt-written-selective": case(
        "gpt-written-selective", GPT, CHAR_GPT, activation_checkpointing="selective"
    ),
    # whole blocks recomputed: each block's regions gathered again in the recompute, dropout replayed
    "gpt-auto-dropout-recompute": case(
        "gpt-auto-dropout-recompute", DROPOUT, "auto", activation_checkpointing=True
    ),
}
RECOMPUTE = (False, True, "selective")
MEMORY = [
    case(
        f"memory-sp-{on}-ac-{ac}",
        GPT,
        CHAR_GPT,
        on,
        WIDE,
        {"block_size": 32},
        steps=2,
        activation_checkpointing=ac,
    )
    for ac in RECOMPUTE
    for on in (False, True)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    return tmp, run_distributed([*EXACT.values(), *MEMORY], world_size=2, tmp_path=tmp, timeout=300)


def _single(tmp, c):
    single = {k: v for k, v in c.items() if k not in ("strategy", "probe", "dp_size")}
    return run_single({**single, "name": f"single-{c['name']}"}, tmp)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(EXACT))
def test_sequence_parallel_equals_single_device(runs, name):
    tmp, results = runs
    ref = _single(tmp, EXACT[name])
    full = torch.load(tmp / "dist2" / name / "last.ckpt", weights_only=False)["state_dict"]
    assert_params_close(full, ref["state_dict"], atol=1e-10)
    for rank in results[name]:
        probe = rank["probe"]
        assert probe["plan"] is not None and probe["plan"]["dim"] == 1, probe
        assert any("norm" in n or "ln" in n for n in probe["summed"]), probe["summed"]
        for key, local in rank["state_dict"].items():  # replicated tensors stayed equal on every rank
            if local.shape == full[key].shape:
                assert max_param_diff({key: local}, {key: full[key]}) <= 1e-12, key
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), atol=1e-9, rtol=0
        )


def _peaks(results, ac):
    """Each rank's peak saved activations (without, with sequence parallel) under ``ac``."""
    return [
        tuple(results[f"memory-sp-{on}-ac-{ac}"][rank]["probe"]["activations"] for on in (False, True))
        for rank in range(2)
    ]


@pytest.mark.timeout(400)
def test_sequence_parallel_lowers_the_saved_activations_per_rank(runs):
    _, results = runs
    for rank, (without, with_sp) in enumerate(_peaks(results, False)):
        print(f"rank {rank}: peak saved activations {without} B without, {with_sp} B with sequence parallel")
        assert 0 < with_sp < without, (rank, with_sp, without)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ac", [True, "selective"])
def test_under_recompute_sequence_parallel_saves_no_more_than_recompute_alone(runs, ac):
    _, results = runs
    for rank, (without, with_sp) in enumerate(_peaks(results, ac)):
        print(
            f"activation_checkpointing={ac!r}, rank {rank}: peak saved activations {without} B without, "
            f"{with_sp} B with sequence parallel"
        )
        assert 0 < with_sp <= without, (rank, with_sp, without)
