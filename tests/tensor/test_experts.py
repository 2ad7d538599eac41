"""A mixture of experts' experts module: recognised (moe.experts), planned by plan="auto" traced or
structural, split by ParallelExperts (each rank's output a partial sum of the experts' output, with every
implementation), shown in the plan table, and refused where its layout cannot split."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_parallel.distributed.collectives import SimulatedGroup
from lightning_parallel.moe.experts import experts_layout, find_hf_experts, is_experts
from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.expert_layer import ParallelExperts, experts_shards, split_refusal
from lightning_parallel.tensor.layers import ShardSpec, full_tensor
from lightning_parallel.tensor.plan import PlanError, resolve_plan
from lightning_parallel.tensor.table import format_table, params_per_rank
from tests.helpers.zoo import build

FAMILIES = ("mixtral", "qwen2_moe", "olmoe")


def routed(experts: nn.Module, tokens: int = 12, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states, the top-2 of the experts for each token and their weights (float32, as a router's)."""
    g = torch.Generator().manual_seed(seed)
    layout = experts_layout(experts)
    hidden = torch.randn(tokens, layout.hidden, generator=g, dtype=experts.down_proj.dtype)
    logits = torch.randn(tokens, layout.num_experts, generator=g)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    return hidden, index, weights


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_experts_of_each_family_are_recognised_and_cut_per_part(arch):
    found = find_hf_experts(build(arch))
    assert list(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = found["model.layers.0.mlp.experts"]
    assert split_refusal(experts, 2) is None
    assert experts_shards(experts) == {"gate_up_proj": ShardSpec(1, 2), "down_proj": ShardSpec(2)}
    assert "intermediate size 48 is not divisible by tp=5" in split_refusal(experts, 5)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_the_partial_outputs_of_the_ranks_sum_to_the_experts_output(implementation):
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64  # no float64 grouped kernel
    model = build("mixtral").to(dtype)
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    hidden, index, weights = routed(experts)
    whole = experts(hidden, index, weights)
    ranks = [ParallelExperts(experts, SimulatedGroup(2, r), 2, r) for r in range(2)]
    partial = [r(hidden, index, weights) for r in ranks]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(partial[0] + partial[1], whole, atol=tol, rtol=tol)
    assert not torch.allclose(partial[0], whole)  # each rank computed half of it
    for name, spec in ranks[0].SHARDS.items():
        assert torch.equal(full_tensor([getattr(r, name) for r in ranks], spec), getattr(experts, name))
    assert ranks[0].intermediate_dim == experts.intermediate_dim // 2 and ranks[0].act_fn is experts.act_fn


def _synthetic(transposed: bool, gated: bool) -> nn.Module:
    """An experts class as a model file writes one, in a layout the zoo's families do not use."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_transposed=transposed, has_gate=gated)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, up = 4, 2 * 12 if gated else 12
            shapes = ((4, 8, up), (4, 12, 8)) if transposed else ((4, up, 8), (4, 8, 12))
            setattr(
                self, "gate_up_proj" if gated else "up_proj", nn.Parameter(torch.randn(*shapes[0]).double())
            )
            self.down_proj = nn.Parameter(torch.randn(*shapes[1]).double())
            self.act_fn = nn.SiLU()

    return Experts(SimpleNamespace(_experts_implementation="batched_mm"))


@pytest.mark.parametrize("transposed, gated", [(True, True), (False, False), (True, False)])
def test_transposed_and_ungated_experts_split_too(transposed, gated):
    experts = _synthetic(transposed, gated)
    assert is_experts(experts) and split_refusal(experts, 2) is None
    up = "gate_up_proj" if gated else "up_proj"
    assert experts_shards(experts) == {
        up: ShardSpec(2 if transposed else 1, 2 if gated else 1),
        "down_proj": ShardSpec(1 if transposed else 2),
    }
    hidden, index, weights = routed(experts)
    ranks = [ParallelExperts(experts, SimulatedGroup(2, r), 2, r) for r in range(2)]
    torch.testing.assert_close(sum(r(hidden, index, weights) for r in ranks), experts(hidden, index, weights))


def test_the_routing_weights_gradient_is_a_partial_sum_in_their_combined_dtype():
    model = build("mixtral").double()
    experts = model.model.layers[0].mlp.experts
    hidden, index, weights = routed(experts)
    weights.requires_grad_(True)
    experts(hidden, index, weights).square().sum().backward()
    whole = weights.grad
    grads = []
    for r in range(2):
        w = weights.detach().clone().requires_grad_(True)
        layer = ParallelExperts(experts, SimulatedGroup(2, r), 2, r)
        total = experts(hidden, index, weights.detach())  # the whole output's gradient, as after the sum
        (layer(hidden, index, w) * 2 * total.detach()).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0] + grads[1], whole, atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", FAMILIES)
def test_auto_splits_every_layers_experts_and_keeps_about_half(arch):
    model = build(arch).double()
    idx = torch.randint(0, 32, (2, 8))
    resolved = resolve(model, "auto", 2, lambda: model(input_ids=idx))
    styles = resolved.styles()
    assert [n for n, s in styles.items() if s == "experts"] == list(find_hf_experts(model))
    share = params_per_rank(model, resolved) / sum(p.numel() for p in model.parameters())
    assert share <= 0.55, format_table(model, resolved)
    assert not any("own plan" in why for name, why in resolved.report if "experts" in name)
    row = next(line for line in format_table(model, resolved).splitlines() if ".mlp.experts" in line)
    assert "[4, 48, 16]+[4, 16, 24]" in row and "all-reduce 16/tok" in row and "all-reduce 16+2/tok" in row
    structural = resolve(model, "auto", 2).styles()
    assert [n for n, s in structural.items() if s == "experts"] == list(find_hf_experts(model))


def test_the_shared_expert_of_qwen2_moe_is_a_pair_beside_the_routed_experts():
    model = build("qwen2_moe")
    idx = torch.randint(0, 32, (2, 8))
    styles = resolve(model, "auto", 2, lambda: model(input_ids=idx)).styles()
    shared = "model.layers.0.mlp.shared_expert"
    assert [styles[f"{shared}.{n}"] for n in ("gate_proj", "up_proj", "down_proj")] == [
        "colwise",
        "colwise",
        "rowwise",
    ]


def test_experts_that_cannot_split_are_refused_or_left_whole():
    model = build("mixtral")
    experts = model.model.layers[0].mlp.experts
    biased = copy.deepcopy(experts)
    biased.has_bias = True
    assert "biases" in split_refusal(biased, 2)
    model.model.layers[0].mlp.experts = biased
    with pytest.raises(PlanError, match=r"'model.layers.0.mlp.experts' \(experts\): experts with biases"):
        resolve_plan(model, {"model.layers.*.mlp.experts": "experts"}, 2)
    with pytest.raises(PlanError, match="style 'experts' applies to Experts, but 'model.layers.0.mlp.gate'"):
        resolve_plan(model, {"model.layers.0.mlp.gate": "experts"}, 2)
    report = dict(resolve(model, "auto", 2).report)
    assert report["model.layers.0.mlp.experts"].startswith("experts stay whole: experts with biases")
    assert resolve(model, "auto", 2).styles()["model.layers.1.mlp.experts"] == "experts"


def test_experts_whose_split_fails_on_a_rank_stay_whole_in_every_block(monkeypatch):
    def fails(self, *args):
        raise RuntimeError("reads the whole intermediate size")

    monkeypatch.setattr(ParallelExperts, "forward", fails)
    model = build("mixtral")
    idx = torch.randint(0, 32, (2, 8))
    resolved = resolve(model, "auto", 2, lambda: model(input_ids=idx))
    assert "experts" not in resolved.styles().values()
    report = dict(resolved.report)
    for name in find_hf_experts(model):
        assert "fails on a rank in 'model.layers.0.mlp.experts'" in report[name], report[name]
        assert "reads the whole intermediate size" in report[name]
    assert resolved.styles()["model.layers.1.self_attn.o_proj"] == "rowwise"
