"""Expert parallelism (``expert_parallel_size`` of ``lp_parallel``) on Hugging Face mixture-of-experts models,
real processes: equal to single-device training on the global batch (float64, 5 SGD steps, 1e-10), the
checkpoint holding every expert under its single-device name, each rank holding num_experts / ep experts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import max_param_diff, run_distributed, run_single

PARALLEL = "lightning_parallel:ParallelStrategy"
F64 = {"precision": "64-true", "max_steps": 5}
ARCHS = ("mixtral", "qwen2_moe")
EXPERTS = 4  # both tiny configs (tests/helpers/zoo_more.py)


def case(arch: str, ep: int, dp: int, momentum: float = 0.0) -> dict:
    return {
        "name": f"{arch}-ep{ep}-dp{dp}" + ("-momentum" if momentum else ""),
        "model": "tests.helpers.zoo:ZooLM",
        "model_kwargs": {"arch": arch, "momentum": momentum},
        "data": "tests.helpers.tp_models:TokenData",
        "data_kwargs": {"global_batch_size": 16},
        "dp_size": dp,
        "trainer": F64,
        "save_checkpoint": True,
        "probe": "tests.helpers.probes:expert_parallel",
        "strategy": {"class": PARALLEL, "kwargs": {"data_parallel_size": dp, "expert_parallel_size": ep}},
    }


CASES_2 = [case(a, 2, 2) for a in ARCHS] + [case("mixtral", 2, 2, momentum=0.9)]
CASES_4 = [case(a, ep, 4) for a in ARCHS for ep in (2, 4)]


def single(arch: str, tmp, momentum: float = 0.0) -> dict:
    c = case(arch, 1, 1, momentum)
    return run_single({**c, "name": f"single-{c['name']}", "strategy": "auto", "probe": None}, tmp)


def check(tmp, world: int, c: dict, results: dict, reference: dict) -> None:
    ep, dp = c["strategy"]["kwargs"]["expert_parallel_size"], c["dp_size"]
    full = torch.load(tmp / f"dist{world}" / c["name"] / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(full, reference["state_dict"])
    assert diff < 1e-10, f"{c['name']}: parameters differ from single-device training by {diff:.3e}"
    for rank, result in enumerate(results[c["name"]]):
        held = result["probe"]["held"]
        assert len(held) == 2, held  # one experts module per layer
        first = (rank % ep) * (EXPERTS // ep)
        assert {v[:2] for v in held.values()} == {(first, EXPERTS // ep)}, (rank, held)
        assert (result["probe"]["expert_reducer"] is None) == (dp == ep), result["probe"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_2_processes(tmp_path):
    results = run_distributed(CASES_2, world_size=2, tmp_path=tmp_path, timeout=600)
    for c in CASES_2:
        momentum = c["model_kwargs"]["momentum"]
        check(tmp_path, 2, c, results, single(c["model_kwargs"]["arch"], tmp_path, momentum))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_4_processes(tmp_path):
    results = run_distributed(CASES_4, world_size=4, tmp_path=tmp_path, timeout=800)
    references = {a: single(a, tmp_path) for a in ARCHS}
    for c in CASES_4:
        check(tmp_path, 4, c, results, references[c["model_kwargs"]["arch"]])
