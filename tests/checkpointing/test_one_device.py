"""A network split by a strategy, copied as one device holds it (``checkpointing.one_device``)."""

import torch

from lightning_parallel.checkpointing.one_device import one_device_copy
from lightning_parallel.models import CharGPT
from lightning_parallel.pipeline.partition import partition


def test_a_pipeline_stage_is_copied_whole_without_its_hooks():
    """Stage 1 of 2 holds blocks 2 and 3; blocks 0 and 1 are emptied, their forward replaced, and hooked
    to return what the previous stage sent. The copy, filled from the full state, is the whole model."""
    torch.manual_seed(0)
    gpt = CharGPT(n_layer=4, vocab_size=16, block_size=8, n_embd=16)
    x = torch.randint(0, 16, (2, 8))
    full = {k: v.clone() for k, v in gpt.state_dict().items()}
    with torch.no_grad():
        expected = gpt(x)
    partition(gpt, num_stages=2, stage=1)
    assert set(gpt.state_dict()) < set(full)
    whole = one_device_copy(gpt, gpt, full)
    assert list(whole.state_dict()) == list(full)
    assert not [
        m for m in whole.modules() if m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
    ]
    with torch.no_grad():
        torch.testing.assert_close(whole(x), expected, atol=0, rtol=0)
