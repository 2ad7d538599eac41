"""The channels that keep a pipeline's streams of messages apart without tags: every ordered pair of ranks
carries at most one stream per channel, for every schedule and placement; one chunk per rank needs no new
group; and the set-up no longer refuses several chunks per rank on NCCL (the channels, not tags, keep them
apart). The channels really separate messages on 2 gloo processes: tests/distributed/test_p2p.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer

import lightning_parallel as lp
from lightning_parallel.pipeline.channels import channel_members, stream_channels, stream_id
from lightning_parallel.pipeline.placement import stage_ranks

LAYOUTS = [
    (name, p, v)
    for name, v in (("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zbv", 2), ("1f1b", 1), ("zb_h1", 1))
    for p in (2, 3, 4)
]


def crossing(name: str, p: int, v: int) -> list[tuple[int, int, int]]:
    """(stream, sender, receiver) of every message stream between two different ranks, from the placement."""
    ranks = stage_ranks(name, p, v)
    out = []
    for g in range(p * v - 1):
        if ranks[g] != ranks[g + 1]:
            out += [
                (stream_id(g, False), ranks[g], ranks[g + 1]),
                (stream_id(g, True), ranks[g + 1], ranks[g]),
            ]
    return out


@pytest.mark.parametrize("name,p,v", LAYOUTS)
def test_each_channel_carries_at_most_one_stream_per_ordered_pair(name, p, v):
    streams, channels = crossing(name, p, v), stream_channels(name, p, v)
    assert set(channels) == {s for s, _, _ in streams}
    per_pair = Counter((channels[s], sender, receiver) for s, sender, receiver in streams)
    assert max(per_pair.values()) == 1
    members = channel_members(name, p, v)
    assert len(members) == max(channels.values())  # channel 0 is the default group, not created
    for c, pp_indices in enumerate(members, start=1):
        assert {r for s, a, b in streams if channels[s] == c for r in (a, b)} == set(pp_indices)


def test_new_groups_only_where_a_pair_carries_several_streams():
    for name in ("1f1b", "zb_h1", "gpipe", "async"):
        assert channel_members(name, 4, 1) == []
    assert len(channel_members("interleaved_1f1b", 2, 2)) == 2  # 2v - 1 channels at p = 2
    assert len(channel_members("interleaved_1f1b", 2, 3)) == 4
    assert len(channel_members("interleaved_1f1b", 4, 2)) == 1  # v channels at p > 2
    assert len(channel_members("zbv", 2, 2)) == 1 and len(channel_members("zbv", 4, 2)) == 1
    # p = 2, v = 2: rank 0 sends rank 1 the activations of boundaries 0 and 2 and the gradients of boundary 1
    channels = stream_channels("interleaved_1f1b", 2, 2)
    assert sorted(channels[s] for s in (stream_id(0, False), stream_id(1, True), stream_id(2, False))) == [
        0,
        1,
        2,
    ]


class _Module(LightningModule):
    pass


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_several_chunks_per_rank_are_not_refused_on_nccl(monkeypatch, schedule):
    """The set-up's schedule check for a 2-stage pipeline with 2 chunks per rank, the backend reading
    "nccl": it used to refuse (tags kept the chunks' messages apart); it passes now."""
    strategy = lp.PipelineParallelStrategy(schedule=schedule, num_microbatches=4, pipeline_parallel_size=2)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False
    )
    module = _Module()
    module.trainer = trainer
    strategy._lightning_module = module
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert strategy.virtual_stages == 2
    strategy.check_schedule(2)
