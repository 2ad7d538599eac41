import pytest
import torch
from torch import nn

from lightning_parallel.models import CharGPT
from lightning_parallel.pipeline.executor import split_microbatches
from lightning_parallel.pipeline.partition import (
    StageOutput, _Skip, balance, find_block_stack, partition, stage_bounds)


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
    with pytest.raises(ValueError, match="split point 'model.block.1' names no block of the stack; candidates: model.blocks.0"):
        stage_bounds(name, stack, 2, ["model.block.1"])
    with pytest.raises(ValueError, match=r"5 pipeline stages need at least 5 blocks, but 'model.blocks' has 4"):
        stage_bounds(name, stack, 5)
    with pytest.raises(ValueError, match="as block counts must be 2 positive numbers summing to 4"):
        stage_bounds(name, stack, 2, [2, 1])


def test_a_stage_keeps_only_its_blocks_under_their_names_and_stops_at_its_end():
    torch.manual_seed(0)
    gpt = CharGPT(n_layer=4, vocab_size=16, block_size=8, n_embd=16)
    x = torch.randint(0, 16, (2, 8))
    part = partition(gpt, num_stages=2, stage=0)
    assert isinstance(gpt.model.blocks[2], _Skip) and not isinstance(gpt.model.blocks[1], _Skip)
    assert all(n.startswith(("model.blocks.0.", "model.blocks.1.")) for n in part.owned)
    with pytest.raises(StageOutput) as out:
        gpt(x)
    assert out.value.tensor.shape == (2, 8, 16)


def test_split_microbatches_is_even_when_it_can_be_and_refuses_too_small_batches():
    batch = (torch.arange(10), {"y": torch.arange(10) * 2}, "meta")
    parts = split_microbatches(batch, 4)
    assert [len(p[0]) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), batch[1]["y"]) and parts[0][2] == "meta"
    with pytest.raises(ValueError, match="a batch of 10 samples cannot be split into num_microbatches=16"):
        split_microbatches(batch, 16)
