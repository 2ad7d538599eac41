"""plan="auto" with fewer key-value heads than tensor-parallel ranks, on real processes: the Llama zoo model
(4 query and 2 key-value heads) at tp=4 holds each key-value head on the 2 ranks whose query heads read it
(their gradients summed over those ranks), splits the rest, and equals single-device training (float64,
5 SGD steps, 1e-10), built normally and on meta under ``init_module()`` (as are Phi-3, Falcon and
GPT-BigCode at tp=2, whose fused q|k|v is cut per block); clipping by norm counts a block
held by several ranks once (the Llama at tp=4, and Falcon's fused q|k|v with its one key-value head held
by both ranks at tp=2). Multi-query Falcon at tp=4 holds its one key-value head on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import max_param_diff, run_distributed, run_single
from tests.helpers.zoo import ZooLM
from tests.strategies.test_tensor_parallel_families import case as family_case

DDP = "lightning_parallel:DDPStrategy"
F64 = {"precision": "64-true", "max_steps": 5}


CLIP = {**F64, "gradient_clip_val": 0.05}
TP4 = {  # family at tp=4 -> a projection of its key-value heads, held by several ranks
    "hf_llama": "model.model.layers.0.self_attn.k_proj",
    "falcon": "model.transformer.h.0.self_attention.query_key_value",
}
ON_META = [("hf_llama", 4), ("phi3", 2), ("falcon", 2), ("gpt_bigcode", 2)]  # (family, tp) built on meta


def case(name: str, arch: str = "hf_llama", **extra) -> dict:
    return {**family_case(arch), "name": name, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-heads")
    alone = {"strategy": "auto", "probe": None}
    single = {
        "hf_llama": run_single({**case("single"), **alone}, tmp),
        "llama-clip": run_single({**case("single-llama-clip", trainer=CLIP), **alone}, tmp),
        "falcon-clip": run_single({**case("single-falcon-clip", "falcon", trainer=CLIP), **alone}, tmp),
        "falcon": run_single({**case("single-falcon", "falcon"), **alone}, tmp),
    }
    meta = {"empty_init": True}
    ddp = {"strategy": {"class": DDP, "kwargs": {}}, "probe": None, **meta}
    one = [case(f"ddp1-meta-{arch}", arch, **ddp) for arch, _ in ON_META]
    results = run_distributed(one, world_size=1, tmp_path=tmp, timeout=500)
    four = [case(f"{arch}-tp4", arch) for arch in TP4]
    four += [case("hf_llama-meta", **meta), case("llama-clip", trainer=CLIP)]
    results.update(run_distributed(four, world_size=4, tmp_path=tmp, timeout=500))
    two = [case("falcon-clip", "falcon", trainer=CLIP)]
    two += [case(f"{arch}-meta", arch, **meta) for arch, world in ON_META if world == 2]
    results.update(run_distributed(two, world_size=2, tmp_path=tmp, timeout=500))
    return tmp, single, results


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch, key_value", TP4.items())
def test_tp4_holds_each_key_value_head_on_the_ranks_that_read_it_and_equals_one_device(runs, arch, key_value):
    """The Llama's 2 key-value heads each on 2 ranks; multi-query Falcon's one on all 4."""
    tmp, single, results = runs
    full = torch.load(tmp / "dist4" / f"{arch}-tp4" / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(full, single[arch]["state_dict"])
    assert diff < 1e-10, f"{arch}: parameters differ from single-device training by {diff:.3e}"
    total = sum(p.numel() for p in ZooLM(arch=arch).parameters())
    for rank in range(4):
        plan = results[f"{arch}-tp4"][rank]["probe"]
        assert plan["local_parameters"] / total <= 0.30, (plan["local_parameters"] / total, plan["report"])
        assert plan["styles"][key_value] == "colwise"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch, world", ON_META)
def test_built_on_meta_equals_one_process_built_on_meta(runs, arch, world):
    """Built on meta, each rank materializes its share (its key-value heads and blocks included) as one
    process materializes the whole model from the same seed (tests/strategies/test_deferred_init.py)."""
    tmp, _, _ = runs
    one = torch.load(tmp / "dist1" / f"ddp1-meta-{arch}" / "last.ckpt", weights_only=False)["state_dict"]
    meta = torch.load(tmp / f"dist{world}" / f"{arch}-meta" / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(meta, one)
    assert diff < 1e-10, f"{arch} at tp={world} built on meta differs from one process by {diff:.3e}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, world", [("llama-clip", 4), ("falcon-clip", 2)])
def test_clipping_by_norm_counts_each_key_value_block_once(runs, name, world):
    tmp, single, _ = runs
    full = torch.load(tmp / f"dist{world}" / name / "last.ckpt", weights_only=False)["state_dict"]
    diff = max_param_diff(full, single[name]["state_dict"])
    assert diff < 1e-10, f"{name}: parameters differ from single-device training by {diff:.3e}"
