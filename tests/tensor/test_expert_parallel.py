"""The experts module of expert parallelism on one rank (no communication): it finds Hugging Face experts
modules, and its sort, renumbering and combine around the module's own forward give the forward and the
gradients of the unmodified block, for every ``experts_implementation``. Several ranks:
tests/strategies/test_expert_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.tensor.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    expert_pieces,
    find_experts,
    is_experts_module,
)


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


def test_hugging_face_experts_modules_are_recognised():
    moe = block("eager", torch.float64)
    assert is_experts_module(moe.experts)
    assert not is_experts_module(moe.gate) and not is_experts_module(moe)
    assert not is_experts_module(nn.Linear(4, 4))
    assert list(find_experts(moe)) == ["experts"]


def test_each_rank_keeps_its_experts_under_the_same_names():
    whole = block("eager", torch.float64)
    split = copy.deepcopy(whole)
    apply_expert_parallel(split, None, 2, 1)  # rank 1 of 2 (no collective until a forward)
    pieces = expert_pieces(split)
    assert set(pieces) == {"experts.gate_up_proj", "experts.down_proj"}
    for key, (local, spec, part) in pieces.items():
        assert (spec.dim, part.tp_size, part.tp_rank) == (0, 2, 1)
        assert torch.equal(local, whole.state_dict()[key][2:4])
    assert "experts 2..3 of 4, ep=2" in repr(split.experts)
