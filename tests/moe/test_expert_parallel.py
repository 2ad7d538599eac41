"""The experts module of expert parallelism on one rank (no communication): it finds Hugging Face experts
modules, and its sort, renumbering and combine around the module's own forward give the forward and the
gradients of the unmodified block, for every ``experts_implementation``. Several ranks:
tests/strategies/test_expert_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.moe.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    describe_expert_parallel,
    find_experts_whole_or_placed,
)
from lightning_parallel.moe.experts import is_experts
from lightning_parallel.tensor.full_state import expert_pieces


def block(implementation: str, dtype: torch.dtype) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=16,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation=implementation,
    )
    torch.manual_seed(0)
    moe = MixtralSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize(
    "implementation, dtype, tolerance",
    [
        ("eager", torch.float64, 1e-12),
        ("batched_mm", torch.float32, 1e-5),
        ("grouped_mm", torch.float32, 1e-5),
    ],
    ids=["eager-float64", "batched_mm-float32", "grouped_mm-float32"],
)
def test_one_rank_equals_the_hugging_face_block(implementation, dtype, tolerance):
    whole = block(implementation, dtype)
    split = copy.deepcopy(whole)
    placed = apply_expert_parallel(split, None, 1, 0)
    assert list(placed) == ["experts"] and isinstance(split.experts, ExpertParallelExperts)
    assert split.state_dict().keys() == whole.state_dict().keys()
    x = torch.randn(3, 5, 16, dtype=dtype)
    outputs = [m(x.clone().requires_grad_()) for m in (whole, split)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=tolerance, atol=tolerance)
    for out in outputs:
        (out**2).sum().backward()
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize(
    "family, config",
    [
        ("gpt_oss", {"num_local_experts": 4}),
        ("olmoe", {"num_experts": 4}),
        ("qwen3_moe", {"num_experts": 4}),
        (
            "deepseek_v3",
            {"n_routed_experts": 4, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}
            | {
                "kv_lora_rank": 8,
                "q_lora_rank": 8,
                "qk_rope_head_dim": 4,
                "qk_nope_head_dim": 4,
                "v_head_dim": 8,
            },
        ),
    ],
)
def test_other_families_run_as_on_one_device(family, config):
    """Each layer's experts module found and replaced; the model's forward and gradients unchanged."""
    import transformers

    names = {"gpt_oss": "GptOss", "olmoe": "Olmoe", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
    settings = dict(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=16)
    settings.update(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2)
    settings.update(eos_token_id=0, bos_token_id=0, pad_token_id=0, experts_implementation="eager", **config)
    torch.manual_seed(0)
    model = getattr(transformers, f"{names[family]}ForCausalLM")(
        getattr(transformers, f"{names[family]}Config")(**settings)
    ).double()
    split = copy.deepcopy(model)
    assert len(apply_expert_parallel(split, None, 1, 0)) == 2
    tokens = torch.randint(0, 32, (2, 6))
    outputs = [m(input_ids=tokens).logits for m in (model, split)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
    for out in outputs:
        out.square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_hugging_face_experts_modules_are_recognised():
    moe = block("eager", torch.float64)
    assert is_experts(moe.experts)
    assert not is_experts(moe.gate) and not is_experts(moe)
    assert not is_experts(nn.Linear(4, 4))
    assert list(find_experts_whole_or_placed(moe)) == ["experts"]


def test_each_rank_keeps_its_experts_under_the_same_names():
    whole = block("eager", torch.float64)
    split = copy.deepcopy(whole)
    apply_expert_parallel(split, None, 2, 1)  # rank 1 of 2 (no collective until a forward)
    pieces = expert_pieces(split)
    assert set(pieces) == {"experts.gate_up_proj", "experts.down_proj"}
    for key, (local, spec, part) in pieces.items():
        assert (spec.dim, part.ep_size, part.ep_rank) == (0, 2, 1)
        assert torch.equal(local, whole.state_dict()[key][2:4])
    assert "experts 2..3 of 4, ep=2" in repr(split.experts)
    said = describe_expert_parallel({"experts": split.experts}, replicas=2)
    assert "1 experts module(s) (experts), 2 of 4 experts per rank (ep=2)" in said and "2 replica(s)" in said


def test_coverage_counts_the_experts_expert_parallelism_places():
    """Under tp x ep the experts stay whole under tp but each rank holds ``1/ep`` of them: the start-up
    coverage counts them as split (Mixtral: the attention split over tp and the experts placed, 99%, where
    the experts counted whole left 12%, under require_sharded=0.2); a plan that still splits almost nothing
    (a model whose experts are 8% of it, only its router split over tp) is still refused."""
    from lightning_parallel.moe.expert_parallel import experts_left_to_expert_parallel
    from lightning_parallel.moe.expert_traffic import ExpertPlacement
    from lightning_parallel.tensor import PlanError, resolve
    from lightning_parallel.tensor.coverage import check_coverage, sharded_share
    from lightning_parallel.tensor.sample import forward_on
    from tests.helpers.moe_models import FirstExpertsMoE
    from tests.helpers.zoo import ZooLM

    mixtral = ZooLM(arch="mixtral").double()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    resolved = resolve(mixtral, "auto", 2, run=forward_on(mixtral, batch=(ids, ids)))
    experts_left_to_expert_parallel(resolved, ExpertPlacement(2))
    assert [n for n, why in resolved.report if "expert_parallel_size > 1 places them" in why]
    assert sharded_share(mixtral, resolved) > 0.9
    check_coverage(mixtral, resolved, 0.2)

    small = FirstExpertsMoE(vocab=2048).double()
    resolved = resolve(small, {"layers": {"router": {"style": "colwise", "gather_output": True}}}, 2)
    experts_left_to_expert_parallel(resolved, ExpertPlacement(2))
    assert 0.05 < sharded_share(small, resolved) < 0.1
    with pytest.raises(PlanError, match=r"splits only 8% .*require_sharded=0.2"):
        check_coverage(small, resolved, 0.2)
