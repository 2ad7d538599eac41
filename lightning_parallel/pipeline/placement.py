"""Which pieces of the model each rank holds when the block stack is cut into ``p * v`` virtual stages.

A pipeline of ``p`` ranks with ``v`` chunks per rank cuts the model into ``p * v`` virtual stages,
numbered 0.. in model order. Rank ``r`` holds ``v`` of them; its local chunk ``c`` is one of them. Two
placements (``p = 3``, ``v = 2``: virtual stages 0..5)::

    looping (interleaved_1f1b, Megatron)        V (zbv)
    rank 0: chunk 0 = 0, chunk 1 = 3            rank 0: chunk 0 = 0, chunk 1 = 5
    rank 1: chunk 0 = 1, chunk 1 = 4            rank 1: chunk 0 = 1, chunk 1 = 4
    rank 2: chunk 0 = 2, chunk 1 = 5            rank 2: chunk 0 = 2, chunk 1 = 3

Looping: a micro-batch goes down the ranks ``v`` times, and rank ``p - 1`` sends to rank 0 in between.
V: it goes down the ranks on chunk 0 and back up on chunk 1; the last rank hands its chunk 0's output to
its own chunk 1 (a local hand-off, no communication), and rank 0 computes both the first block and the
loss. Every other schedule has one chunk per rank (``v = 1``), where both placements are the identity.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["V_SHAPED", "global_stage", "rank_and_chunk", "stage_ranks", "previous_stage", "next_stage"]

V_SHAPED = ("zbv",)  # the schedules in the V placement; all others loop


def global_stage(name: str, num_stages: int, rank: int, chunk: int, virtual_stages: int = 1) -> int:
    """The virtual stage (0..p*v-1, in model order) that ``rank``'s local ``chunk`` holds."""
    _check_place(num_stages, virtual_stages, rank, chunk)
    if name in V_SHAPED and chunk % 2 == 1:
        return (chunk + 1) * num_stages - 1 - rank
    return chunk * num_stages + rank


def rank_and_chunk(name: str, num_stages: int, stage: int, virtual_stages: int = 1) -> tuple[int, int]:
    """The (rank, local chunk) that holds virtual ``stage``: the inverse of ``global_stage``."""
    if not 0 <= stage < num_stages * virtual_stages:
        raise ValueError(
            f"virtual stage {stage} is outside 0..{num_stages * virtual_stages - 1} "
            f"({num_stages} stages x {virtual_stages} virtual stages)"
        )
    chunk, offset = divmod(stage, num_stages)
    if name in V_SHAPED and chunk % 2 == 1:
        return num_stages - 1 - offset, chunk
    return offset, chunk


def stage_ranks(name: str, num_stages: int, virtual_stages: int = 1) -> list[int]:
    """The rank holding each virtual stage, in model order (its last entry runs the loss)."""
    return [
        rank_and_chunk(name, num_stages, g, virtual_stages)[0] for g in range(num_stages * virtual_stages)
    ]


def previous_stage(
    name: str, num_stages: int, rank: int, chunk: int, virtual_stages: int = 1
) -> Optional[tuple[int, int]]:
    """The (rank, chunk) whose output is this chunk's input; None for the model's first piece."""
    stage = global_stage(name, num_stages, rank, chunk, virtual_stages)
    return rank_and_chunk(name, num_stages, stage - 1, virtual_stages) if stage > 0 else None


def next_stage(
    name: str, num_stages: int, rank: int, chunk: int, virtual_stages: int = 1
) -> Optional[tuple[int, int]]:
    """The (rank, chunk) that takes this chunk's output; None for the model's last piece (the loss)."""
    stage = global_stage(name, num_stages, rank, chunk, virtual_stages)
    last = num_stages * virtual_stages - 1
    return rank_and_chunk(name, num_stages, stage + 1, virtual_stages) if stage < last else None


def _check_place(num_stages: int, virtual_stages: int, rank: int, chunk: int) -> None:
    """Refuse a rank or chunk outside the pipeline (a caller's bug, not a user's option)."""
    if num_stages < 1 or virtual_stages < 1 or not 0 <= rank < num_stages or not 0 <= chunk < virtual_stages:
        raise ValueError(
            f"bad placement: stages={num_stages}, virtual_stages={virtual_stages}, rank={rank}, chunk={chunk}"
        )
