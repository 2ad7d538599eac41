"""A network split by a strategy, copied as one device holds it (``checkpointing.one_device``)."""

import torch
from torch import nn

from lightning_parallel.checkpointing.one_device import one_device_copy
from lightning_parallel.models import CharGPT
from lightning_parallel.pipeline.partition import keep_block_skeletons, partition


def test_a_pipeline_stage_is_copied_whole_without_its_hooks():
    """Stage 1 of 2 holds blocks 2 and 3; blocks 0 and 1 are emptied, their forward replaced, and hooked
    to return what the previous stage sent. The copy, filled from the full state, is the whole model."""
    torch.manual_seed(0)
    gpt = CharGPT(n_layer=4, vocab_size=16, block_size=8, n_embd=16)
    x = torch.randint(0, 16, (2, 8))
    full = {k: v.clone() for k, v in gpt.state_dict().items()}
    with torch.no_grad():
        expected = gpt(x)
    keep_block_skeletons(gpt)
    partition(gpt, num_stages=2, stage=1)
    assert set(gpt.state_dict()) < set(full)
    whole = one_device_copy(gpt, gpt, full)
    assert list(whole.state_dict()) == list(full)
    assert not [
        m for m in whole.modules() if m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
    ]
    with torch.no_grad():
        torch.testing.assert_close(whole(x), expected, atol=0, rtol=0)


class MaskedBlock(nn.Module):
    """A block with a non-persistent buffer, as GPT-Neo's attention holds its causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) @ self.mask


def test_non_persistent_buffers_of_the_blocks_of_other_stages_keep_their_values():
    """No state dict holds them: the skeletons, kept before the cut, do."""
    torch.manual_seed(0)
    net, x = nn.Sequential(MaskedBlock(), MaskedBlock(), MaskedBlock()), torch.randn(2, 4)
    full = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        expected = net(x)
    keep_block_skeletons(net)
    partition(net, num_stages=2, stage=0)
    assert net[2].mask.is_meta
    whole = one_device_copy(net, net, full)
    with torch.no_grad():
        torch.testing.assert_close(whole(x), expected, atol=0, rtol=0)
