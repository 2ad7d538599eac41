import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_parallel.models import CharGPT
from lightning_parallel.module_names import find_block_stack, other_stacks
from lightning_parallel.pipeline.executor import split_microbatches
from lightning_parallel.pipeline.partition import (
    StageOutput,
    balance,
    hold_elsewhere,
    partition,
    stage_bounds,
)


def test_finds_the_modulelist_of_a_gpt_and_the_sequential_of_an_mlp():
    assert find_block_stack(CharGPT(n_layer=3))[0] == "model.blocks"
    assert find_block_stack(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))[0] == ""


def test_no_block_stack_says_what_was_looked_for():
    with pytest.raises(ValueError, match="no block stack to pipeline: looked for an nn.ModuleList"):
        find_block_stack(nn.Linear(2, 2))


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([8, 1, 1, 1, 1], 2) == [1, 4]
    assert sum(balance([3, 1, 4, 1, 5, 9, 2, 6], 3)) == 8


def test_split_points_by_name_and_by_count_and_their_errors():
    gpt = CharGPT(n_layer=4)
    name, stack = find_block_stack(gpt)
    assert stage_bounds(name, stack, 2, ["model.blocks.1"]) == [(0, 1), (1, 4)]
    assert stage_bounds(name, stack, 2, [3, 1]) == [(0, 3), (3, 4)]
    with pytest.raises(
        ValueError,
        match="split point 'model.block.1' names no block of the stack; candidates: model.blocks.0",
    ):
        stage_bounds(name, stack, 2, ["model.block.1"])
    with pytest.raises(
        ValueError, match=r"5 pipeline stages need at least 5 blocks, but 'model.blocks' has 4"
    ):
        stage_bounds(name, stack, 5)
    with pytest.raises(ValueError, match="as block counts must be 2 positive numbers summing to 4"):
        stage_bounds(name, stack, 2, [2, 1])


def test_a_stage_keeps_only_its_blocks_under_their_names_and_stops_at_its_end():
    torch.manual_seed(0)
    gpt = CharGPT(n_layer=4, vocab_size=16, block_size=8, n_embd=16)
    x = torch.randint(0, 16, (2, 8))
    part = partition(gpt, num_stages=2, stage=0)
    assert not any(n.startswith("model.blocks.2.") for n in gpt.state_dict())
    assert any(n.startswith("model.blocks.1.") for n, _ in gpt.named_parameters())
    assert all(n.startswith(("model.blocks.0.", "model.blocks.1.")) for n in part.owned)
    with pytest.raises(StageOutput) as out:
        gpt(x)
    assert out.value.tensor.shape == (2, 8, 16)


def _encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_a_block_held_elsewhere_keeps_its_class_and_attributes_and_frees_its_tensors():
    """nn.TransformerEncoder.forward reads layers[0].self_attn (and, in eval mode, its tensors) on every
    stage: the block stays, and its parameters become meta tensors outside the registry."""
    torch.manual_seed(0)
    encoder, x = _encoder(), torch.randn(2, 5, 16)
    full = encoder(x).detach()
    first = encoder.layers[0]
    weight = weakref.ref(first.self_attn.in_proj_weight)
    received = first(x).detach()
    part = partition(encoder, num_stages=2, stage=1)
    gc.collect()
    assert weight() is None  # the stage holds no memory of the block it does not run
    assert encoder.layers[0] is first and type(first) is nn.TransformerEncoderLayer
    assert first.self_attn.batch_first and first.self_attn.in_proj_weight.is_meta
    assert first.self_attn.in_proj_weight.shape == (48, 16) and isinstance(first.linear1.weight, nn.Parameter)
    assert [n for n, _ in encoder.named_parameters()] == part.owned and all(
        n.startswith("layers.1.") for n in part.owned
    )
    assert set(encoder.state_dict()) == set(part.owned)
    for mode in (encoder.train, encoder.eval):  # eval: the fast-path checks read layers[0]'s tensors
        mode()
        part.io.pending = received
        with torch.no_grad():
            torch.testing.assert_close(encoder(x), full, atol=1e-5, rtol=0)


def test_a_submodule_shared_with_the_stage_keeps_its_tensors_and_a_shared_block_is_refused():
    shared = nn.Linear(2, 2)
    root = nn.ModuleDict({"blocks": nn.ModuleList([nn.Sequential(shared), nn.Linear(2, 2)]), "head": shared})
    hold_elsewhere(root, root["blocks"], [0])
    assert not shared.weight.is_meta and "head.weight" in root.state_dict()
    same = nn.Linear(2, 2)
    stack = nn.ModuleList([same, same])
    with pytest.raises(ValueError, match="block 1 of the stack, a Linear, is also used by another block"):
        hold_elsewhere(stack, stack, [1])


def test_a_two_stack_model_names_its_chosen_stack_and_the_other():
    model = nn.Transformer(16, 4, 2, 2, 32, batch_first=True)
    assert find_block_stack(model)[0] == "decoder.layers"  # larger: cross-attention
    assert other_stacks(model, "decoder.layers") == ["encoder.layers"]
    part = partition(model, num_stages=2, stage=0)
    assert part.stack_name == "decoder.layers" and part.unpipelined == ["encoder.layers"]
    text = part.describe_stack()
    assert (
        "'decoder.layers' (2 blocks) is pipelined" in text
        and "'encoder.layers'" in text
        and "block_stack=" in text
    )
    assert "other stacks" not in partition(_encoder(), 2, 0).describe_stack()
    assert other_stacks(CharGPT(n_layer=2), "model.blocks") == []  # stacks inside the blocks are not others


def test_split_microbatches_is_even_when_it_can_be_and_refuses_too_small_batches():
    batch = (torch.arange(10), {"y": torch.arange(10) * 2}, "meta")
    parts = split_microbatches(batch, 4)
    assert [len(p[0]) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), batch[1]["y"]) and parts[0][2] == "meta"
    with pytest.raises(ValueError, match="a batch of 10 samples cannot be split into num_microbatches=16"):
        split_microbatches(batch, 16)


def test_a_tensor_shared_by_blocks_of_two_stages_is_refused_and_one_stage_may_share():
    stack = nn.ModuleList([nn.Linear(2, 2) for _ in range(4)])
    stack[3].weight = stack[0].weight
    same = r"blocks\.3\.weight is the same tensor as blocks\.0\.weight, and blocks 0 and 3 fall"
    with pytest.raises(ValueError, match=same):
        partition(nn.ModuleDict({"blocks": stack}), num_stages=2, stage=1)
    stack[3].weight = nn.Parameter(torch.randn(2, 2))
    stack[1].weight = stack[0].weight  # blocks 0 and 1: both in stage 0
    part = partition(nn.ModuleDict({"blocks": stack}), num_stages=2, stage=0)
    assert "blocks.0.weight" in part.owned
