"""How parameters are grouped into gradient buckets: pure data, no communication.

A bucket is one flat buffer that several parameters' gradients live in, so that one collective moves
them all. Which parameters share a bucket decides how early communication can start: the bucket whose
gradients arrive first in backward should be sent first. Before the first step we only know the
registration order, and backward roughly runs it in reverse; after the first step we know the real
order and regroup by it.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["assign_buckets", "MB"]

MB = 1024 * 1024


def assign_buckets(
    params: Sequence[torch.Tensor], bucket_cap_mb: float, first_bucket_cap_mb: float
) -> list[list[int]]:
    """Split ``params`` (in the order gradients are expected to arrive) into buckets.

    Returns lists of indices into ``params``. Parameters of a different dtype or device never share a
    bucket (a flat buffer has one of each). The first bucket is kept small so that communication can
    begin early in backward; the others are filled up to ``bucket_cap_mb``. A parameter larger than the
    cap gets a bucket of its own.
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}; torch DDP's default is 25.")
    caps = [first_bucket_cap_mb * MB, bucket_cap_mb * MB]
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for index, param in enumerate(params):
        key = (param.dtype, param.device)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(index)
        size += param.numel() * param.element_size()
        cap = caps[0] if not done else caps[1]
        if size >= cap:
            done.append(indices)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (indices, size)
    done.extend(indices for indices, _ in open_buckets.values())
    return done
