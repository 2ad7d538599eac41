"""Activation checkpointing on one process: what is wrapped, that names and values are unchanged, that
dropout, BatchNorm and the async weight snapshot recompute exactly, and the refusals."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel import DDPStrategy
from lightning_parallel.memory.saved import SavedHooks, SavedTensorCounter, can_stack
from lightning_parallel.models.gpt import GPT
from lightning_parallel.pipeline.deferred_batchnorm import DeferredBatchNorm
from lightning_parallel.pipeline.executor import weights_snapshot
from lightning_parallel.recompute import (
    apply_activation_checkpointing,
    checkpoint_targets,
    remove_activation_checkpointing,
    spec_problem,
)
from tests.helpers.zoo import ARCHITECTURES, ZooLM, build
from tests.helpers.zoo_more import MORE


def _gpt(dropout: float = 0.1, layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=16, block_size=8, n_layer=layers, n_head=2, n_embd=8, dropout=dropout).double()


def _grads(model: nn.Module, idx: torch.Tensor, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model.zero_grad()
    model(idx).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


IDX = torch.arange(16).reshape(2, 8) % 16


@pytest.mark.parametrize("spec", [True, "selective", ["blocks.*.mlp", "head"]])
def test_same_names_and_gradients_with_dropout(spec):
    plain = _gpt()
    wrapped = copy.deepcopy(plain)
    names = apply_activation_checkpointing(wrapped, spec)
    assert names and list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    expected, got = _grads(plain, IDX), _grads(wrapped, IDX)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_targets():
    model = _gpt()
    assert checkpoint_targets(model, True) == ["blocks.0", "blocks.1"]
    assert checkpoint_targets(model, "selective") == ["blocks.0.attn", "blocks.1.attn"]
    assert checkpoint_targets(model, ["blocks.*.mlp"]) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert checkpoint_targets(model, False) == []


@pytest.mark.parametrize(
    "arch, core",
    [
        ("hf_llama", "self_attn"),
        ("hf_gpt2", "attn"),
        ("hf_bert", "attention.self"),  # the core without the output projection
        ("torch_encoder", "self_attn"),
        ("nanogpt", "attn"),
        ("mixtral", "self_attn"),  # not the router (mlp.gate): its softmax feeds a top-k
    ],
)
def test_selective_finds_the_attention_of_each_block(arch, core):
    names = checkpoint_targets(build(arch), "selective")
    assert len(names) == 2 and all(n.endswith(f".{core}") for n in names), names


class _Attention(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    @torch.no_grad()  # a decorator's @ is no product
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


class _SparseMoE(nn.Module):
    """A mixture of experts that routes in its own forward (transformers 4's Mixtral block): a softmax of
    its gate's logits, then top-k."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-2)
        picked = outputs.gather(-2, chosen[..., None].expand(*chosen.shape, x.shape[-1]))
        return (weights[..., None] * picked).sum(-2)


class _Scores(nn.Module):
    """A softmax with no product of activations (a classifier's head, a router without top-k)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x), dim=-1)


def test_selective_takes_a_softmax_of_scores_and_not_a_router():
    block = lambda: nn.ModuleDict({"attn": _Attention(), "moe": _SparseMoE(), "head": _Scores()})  # noqa: E731
    model = nn.ModuleDict({"blocks": nn.ModuleList([block(), block()])})
    assert checkpoint_targets(model, "selective") == ["blocks.0.attn", "blocks.1.attn"]


class _OpCounter(TorchDispatchMode):
    """Counts the operators that run (a cached output of a selective recompute does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


_CORE_OPS = ("_softmax", "_safe_softmax", "_scaled_dot_product_flash_attention_for_cpu")
_PRODUCTS = ("mm", "addmm")


@pytest.mark.parametrize(
    "arch, unfused",
    [
        ("gpt", True),  # scaled_dot_product_attention with dropout: torch's math kernel, unfused
        ("nanogpt", False),  # scaled_dot_product_attention without dropout: the fused CPU kernel
        ("hf_llama", False),  # the same, through Hugging Face's attention_interface
    ],
)
def test_selective_recomputes_the_attention_core_and_not_the_projections(arch, unfused):
    """Backward: "selective" reruns an unfused core once per block (a fused kernel is kept) and no matrix
    product beyond the gradients' own (as without checkpointing); True reruns the projections and the core.
    Gradients stay equal."""
    counts, grads = {}, {}
    for spec in (False, "selective", True):
        torch.manual_seed(0)
        model = _gpt(dropout=0.1) if arch == "gpt" else build(arch).double()
        apply_activation_checkpointing(model, spec)
        torch.manual_seed(1)
        out = model(IDX) if arch == "gpt" else model(input_ids=IDX) if arch == "hf_llama" else model(IDX)
        loss = (out if isinstance(out, torch.Tensor) else out.logits).pow(2).mean()
        with _OpCounter() as counter:
            loss.backward()
        counts[spec] = counter.counts
        grads[spec] = [p.grad for p in model.parameters()]
    core = {spec: sum(c[op] for op in _CORE_OPS) for spec, c in counts.items()}
    products = {spec: sum(c[op] for op in _PRODUCTS) for spec, c in counts.items()}
    assert core[False] == 0 and core[True] == 2 and core["selective"] == (2 if unfused else 0), core
    assert products["selective"] == products[False] < products[True], products
    for spec in ("selective", True):
        assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[spec])), spec


#: zoo models whose attention "selective" cannot find (refused, naming the block) or with no block stack
_NO_SELECTIVE = {"inline_mlp", "gpt_neo", "albert"}


@pytest.mark.parametrize("arch", sorted((set(ARCHITECTURES) | set(MORE)) - _NO_SELECTIVE))
def test_selective_gives_the_same_gradients_on_the_zoo(arch):
    """Every family of the zoo (Hugging Face decoders, Mixtral's experts, encoders, encoder-decoders, ViT,
    nn.Transformer), called as users call them: the same gradients with the attention core recomputed."""
    grads = []
    for spec in (False, "selective"):
        torch.manual_seed(0)
        lm = ZooLM(arch=arch).double()
        apply_activation_checkpointing(lm, spec)
        torch.manual_seed(1)
        lm(IDX).pow(2).mean().backward()
        grads.append([p.grad for p in lm.parameters()])
    for plain, recomputed in zip(*grads):
        assert (plain is None) == (recomputed is None)
        assert plain is None or torch.equal(plain, recomputed)


def test_selective_names_a_block_whose_attention_is_inline():
    with pytest.raises(ValueError, match=r"no attention core in blocks\.0 \(InlineBlock\)"):
        checkpoint_targets(build("inline_mlp"), "selective")


def test_wrapper_is_removable_and_copies_call_their_copy():
    model = _gpt(dropout=0.0)
    apply_activation_checkpointing(model, True)
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    remove_activation_checkpointing(model)
    assert "forward" not in model.blocks[0].__dict__


@pytest.mark.parametrize("value", [None, "all", [], [""], 3])
def test_bad_values_are_named(value):
    problem = spec_problem(value)
    assert problem is not None and repr(value) in problem and '"selective"' in problem


def test_refusals():
    with pytest.raises(ValueError, match="no attention core"):
        checkpoint_targets(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "selective")
    with pytest.raises(ValueError, match="match no module"):
        checkpoint_targets(_gpt(), ["blockz.*"])


def test_batchnorm_statistics_updated_once():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, True)
    x = torch.randn(8, 3, dtype=torch.float64)
    for model in (plain, wrapped):
        for _ in range(2):
            model(x).sum().backward()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, wrapped.state_dict()[name]), name


def test_recompute_uses_the_snapshot_weights():
    """Under ``weights_snapshot`` (the async pipeline), a parameter updated after the forward: the backward
    computes with the forward's weights, as without checkpointing."""
    results = []
    for spec in (False, True):
        model = _gpt(dropout=0.0)
        apply_activation_checkpointing(model, spec)
        with weights_snapshot(list(model.parameters())):
            loss = model(IDX).pow(2).mean()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        loss.backward()
        results.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_peak_saved_activations_of_8_blocks():
    peaks = []
    for spec in (False, True):
        model = _gpt(dropout=0.0, layers=8)
        apply_activation_checkpointing(model, spec)
        counter = SavedTensorCounter()
        counter.ignore(list(model.parameters()) + list(model.buffers()))
        counter.start()
        model(IDX).pow(2).mean().backward()
        counter.stop()
        peaks.append(counter.peak)
    assert 0 < peaks[1] <= peaks[0] / 3, peaks


def test_deferred_batchnorm_records_the_forward_only():
    """A pipeline stage's ``DeferredBatchNorm`` records each micro-batch's statistics once, not again when
    the backward recomputes the layer."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()), nn.Linear(4, 1)
    ).double()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, ["0"])  # the layer's hooks run inside the recomputed forward
    x = torch.randn(8, 3, dtype=torch.float64)
    for model in (plain, wrapped):
        with DeferredBatchNorm(model).mini_batch(2):
            for part in x.chunk(2):
                model(part).sum().backward()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, wrapped.state_dict()[name]), name


def test_strategies_refuse_a_bad_value_before_training():
    with pytest.raises(ValueError, match="activation_checkpointing='all' is not valid"):
        DDPStrategy(activation_checkpointing="all")


class _HooksSeen(nn.Module):
    """Records the innermost saved-tensor hooks' owner each time its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.owners: list[object] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.owners.append(None if hooks is None else getattr(hooks[0], "__self__", None) or hooks[0])
        return torch.tanh(self.layer(x))


@pytest.mark.skipif(not can_stack(), reason="this torch cannot read the saved-tensor hooks")
@pytest.mark.parametrize("counted", [False, True])
def test_the_recompute_reports_to_the_counter_only_while_one_counts(counted) -> None:
    """Counting, a package hook is stacked on torch's recompute hook; otherwise nothing is installed."""
    model = nn.Sequential(_HooksSeen())
    apply_activation_checkpointing(model, ["0"])
    counter = SavedTensorCounter()
    if counted:
        counter.start()
    try:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        counter.stop()
    forward, recompute = model[0].owners
    if counted:
        assert isinstance(recompute, SavedHooks), recompute
    else:  # torch's own recompute hook runs innermost
        assert "_recomputation_hook" in getattr(recompute, "__qualname__", ""), recompute
