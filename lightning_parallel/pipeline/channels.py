"""Which process group carries each stream of pipeline messages, so that messages are matched per
(boundary, kind) without tags.

A stream is the activations crossing one boundary between virtual stages (from stage ``g`` to ``g + 1``)
or the gradients crossing it back; its id is ``2g`` or ``2g + 1`` (``stream_id``). Within a stream,
messages are received in the order they were sent, which is what the schedules need. Across streams
they are not: with several chunks per rank one ordered pair of ranks carries several streams at once
(looping, ``p = 2``, ``v = 2``: rank 0 sends rank 1 the activations of boundaries 0 and 2 and the
gradients of boundary 1). gloo could keep them apart by tag, but NCCL ignores tags: it matches a pair's
messages in the order they were posted on one communicator. So each stream of an ordered pair goes on a
group of its own: the ``c``-th stream of a pair (in boundary order) on channel ``c``. Channel 0 is the
pipeline's default group; channel ``c >= 1`` is a new group holding every rank (of every replica) at
the pp positions its streams join. A group holds at most one stream per ordered pair, so its messages
between two ranks, in one direction, are one stream's, in order, on gloo and NCCL alike, and gloo runs
exactly the path NCCL does (every message has the same tag).

One chunk per rank gives every ordered pair one stream (activations go down, gradients up): no new
group. Looping needs ``2v - 1`` channels with ``p = 2`` (each pair carries ``v`` streams one way and
``v - 1`` the other), ``v`` with ``p > 2``; the V placement needs 2.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch.distributed as dist

from lightning_parallel.distributed.mesh import MeshShape
from lightning_parallel.pipeline.placement import stage_ranks

__all__ = ["stream_id", "stream_channels", "channel_members", "new_channel_groups"]


def stream_id(boundary: int, gradient: bool) -> int:
    """The id of the activations (``gradient`` False) or gradients crossing ``boundary`` (between virtual
    stages ``boundary`` and ``boundary + 1``)."""
    return 2 * boundary + int(gradient)


def _streams(name: str, p: int, v: int) -> list[tuple[int, int, int]]:
    """(stream id, sending pp index, receiving pp index) of every stream that crosses ranks, in boundary
    order (a hand-off between two chunks of one rank crosses nothing)."""
    ranks = stage_ranks(name, p, v)
    out = []
    for g in range(len(ranks) - 1):
        before, after = ranks[g], ranks[g + 1]
        if before != after:
            out += [(stream_id(g, False), before, after), (stream_id(g, True), after, before)]
    return out


def stream_channels(name: str, p: int, v: int) -> dict[int, int]:
    """The channel of each stream that crosses ranks: its index among the streams of its ordered pair."""
    seen: dict[tuple[int, int], int] = defaultdict(int)
    channels = {}
    for stream, sender, receiver in _streams(name, p, v):
        channels[stream] = seen[(sender, receiver)]
        seen[(sender, receiver)] += 1
    return channels


def channel_members(name: str, p: int, v: int) -> list[list[int]]:
    """The pp indices that each channel from 1 on joins (channel 0 is the default group)."""
    members: dict[int, set[int]] = defaultdict(set)
    channels = stream_channels(name, p, v)
    for stream, sender, receiver in _streams(name, p, v):
        members[channels[stream]] |= {sender, receiver}
    return [sorted(members[c]) for c in range(1, len(members))]


def new_channel_groups(name: str, shape: MeshShape, rank: int, v: int) -> dict[int, dist.ProcessGroup]:
    """The group of each stream off channel 0, for ``rank`` (a ``PeerLink``'s ``channels``). Every rank
    calls this alike: each channel's group is created on every rank, in channel order, as ``new_group``
    requires; a channel holds the ranks at its pp indices in every replica."""
    groups: list[Optional[dist.ProcessGroup]] = [None]
    for pp_indices in channel_members(name, shape.pp, v):
        ranks = sorted(
            shape.rank(d, i, t) for d in range(shape.dp) for i in pp_indices for t in range(shape.tp)
        )
        group = dist.new_group(ranks)
        groups.append(group if rank in ranks else None)
    return {
        stream: groups[c]
        for stream, c in stream_channels(name, shape.pp, v).items()
        if c > 0 and groups[c] is not None
    }
