"""balance="time": block times measured on captured inputs, with nothing in training changed."""

import random
import time

import numpy as np
import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.partition import balance, block_parameters
from lightning_parallel.pipeline.profile import capture_block_inputs, time_block_passes, time_blocks
from lightning_parallel.step_effects import untouched
from tests.helpers.pp_models import UnevenTimeNet


def test_the_slow_block_is_measured_slow_and_moves_the_cut():
    torch.manual_seed(0)
    model = UnevenTimeNet().double()
    x = torch.randn(4, 16, dtype=torch.float64)
    blocks = list(model.net)
    inputs = capture_block_inputs(blocks, lambda: model(x))
    assert torch.equal(inputs[0][0][0], x)
    times = time_blocks(blocks, inputs, repeats=7, pick=min)  # the fastest: another process's load only adds
    assert times[3] > 3 * times[1] and times[3] > 3 * times[2]  # 20x the work; fixed costs blur the ratio
    assert balance(block_parameters(model.net), 2) == [2, 3]
    assert balance(times, 2) == [3, 2]
    assert all(
        p.grad is not None for p in model.net[3].parameters()
    )  # the caller's `untouched` restores them


def test_the_forward_and_the_backward_are_timed_apart():
    """The slow block is slow in both passes (the planner's calibration reads them apart)."""
    torch.manual_seed(0)
    model = UnevenTimeNet().double()
    x = torch.randn(4, 16, dtype=torch.float64)
    blocks = list(model.net)
    passes = time_block_passes(blocks, capture_block_inputs(blocks, lambda: model(x)), repeats=9)
    assert len(passes) == len(blocks) and all(f > 0 and b > 0 for f, b in passes)
    (f1, b1), (f3, b3) = passes[1], passes[3]
    assert f3 > 3 * f1 and b3 > 3 * b1  # 20x the work in each


def test_extra_block_arguments_are_captured_with_their_keywords():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            return self.lin(x) * mask

    blocks = nn.ModuleList([Block(), Block()])
    mask = torch.ones(2, 4)

    def run():
        h = torch.randn(2, 4)
        for b in blocks:
            h = b(h, mask=mask)

    inputs = capture_block_inputs(list(blocks), run)
    assert all(torch.equal(kwargs["mask"], mask) for _, kwargs in inputs)
    assert len(time_blocks(list(blocks), inputs, repeats=1)) == 2


def test_untouched_restores_random_states_buffers_and_gradients():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    stats = model[1].running_mean.clone()
    with untouched(model):
        model(torch.randn(8, 3)).sum().backward()  # draws random numbers, moves BatchNorm statistics
        torch.rand(5), random.random(), np.random.rand()
    assert torch.equal(model[1].running_mean, stats)
    assert all(p.grad is None for p in model.parameters())
    assert (
        torch.equal(torch.rand(3), expected[0])
        and random.random() == expected[1]
        and np.random.rand() == expected[2]
    )


def test_a_block_that_never_runs_is_named():
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(RuntimeError, match=r"blocks \[1\] of the stack did not run"):
        capture_block_inputs(blocks, lambda: blocks[0](torch.ones(1, 2)))


def test_untouched_restores_metrics_updated_in_place():
    import torchmetrics

    module = nn.Module()
    module.seen = torchmetrics.SumMetric()
    module.seen.update(torch.tensor(3.0))
    with untouched(module):
        module.seen.update(torch.tensor(16.0))  # SumMetric adds in place
    assert float(module.seen.compute()) == 3.0


def test_a_split_backward_is_timed_against_the_whole() -> None:
    """The planner's ratio of a split backward (input gradients, then weights') to one backward, on real
    blocks: positive, and the blocks' parameters hold no gradient after it."""
    from lightning_parallel.planner.measure import split_backward_ratio

    blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2)]
    inputs = [((torch.randn(8, 16),), {}) for _ in blocks]
    ratio = split_backward_ratio(blocks, inputs, repeats=3, clock=time.perf_counter)
    assert ratio > 0
    assert all(p.grad is None for block in blocks for p in block.parameters())


def test_a_block_the_split_refuses_gives_a_ratio_of_one() -> None:
    """A block under a reentrant checkpoint, whose backward the split refuses (``ValueError``): the planner's
    measurement reports no split cost rather than failing the whole plan."""
    from torch.utils.checkpoint import checkpoint

    from lightning_parallel.planner.measure import split_backward_ratio

    class Reentrant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(16, 16)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True)

    blocks = [Reentrant(), Reentrant()]
    inputs = [((torch.randn(8, 16),), {}) for _ in blocks]
    assert split_backward_ratio(blocks, inputs, repeats=2, clock=time.perf_counter) == 1.0


def test_a_hugging_face_models_blocks_are_timed_with_its_cache_off_and_on_again_after():
    """A Llama whose config has use_cache=True: captured with its cache on, each decoder layer would get the
    step's cache object, which every timed call grows (and the second backward fails); with the model given,
    the cache is off while the step runs and on again after."""
    from tests.helpers.tp_models import TokenData
    from tests.helpers.zoo import ZooLM

    torch.manual_seed(0)
    model = ZooLM(arch="hf_llama", width=16, layers=2)
    x, y = next(iter(TokenData().train_dataloader()))
    blocks = list(model.model.model.layers)
    assert model.model.config.use_cache is True
    inputs = capture_block_inputs(blocks, lambda: model.loss((x, y)), model)
    assert model.model.config.use_cache is True
    times = time_blocks(blocks, inputs, repeats=3)
    assert len(times) == 2 and all(t > 0 for t in times)
