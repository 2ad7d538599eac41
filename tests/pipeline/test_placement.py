"""Placements of virtual stages on ranks: looping (interleaved 1F1B) and V (zbv), their inverse, and
each chunk's neighbours in model order."""

import pytest

from lightning_parallel.pipeline.placement import (
    global_stage,
    next_stage,
    previous_stage,
    rank_and_chunk,
    stage_ranks,
)


def table(name: str, p: int, v: int) -> list[list[int]]:
    return [[global_stage(name, p, r, c, v) for c in range(v)] for r in range(p)]


def test_the_docstring_tables():
    assert table("interleaved_1f1b", 3, 2) == [[0, 3], [1, 4], [2, 5]]
    assert table("zbv", 3, 2) == [[0, 5], [1, 4], [2, 3]]
    assert table("1f1b", 4, 1) == [[0], [1], [2], [3]]
    assert table("interleaved_1f1b", 2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert stage_ranks("interleaved_1f1b", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]  # rank 0 runs the loss


@pytest.mark.parametrize(
    "name,p,v", [("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 3, 4), ("zbv", 4, 2), ("gpipe", 3, 1)]
)
def test_every_virtual_stage_is_held_once_and_the_inverse_finds_it(name, p, v):
    held = sorted(g for row in table(name, p, v) for g in row)
    assert held == list(range(p * v))
    for r in range(p):
        for c in range(v):
            assert rank_and_chunk(name, p, global_stage(name, p, r, c, v), v) == (r, c)


def test_neighbours_follow_model_order():
    # looping, p=2, v=2: 0=(0,0) 1=(1,0) 2=(0,1) 3=(1,1); rank 1 sends to rank 0 between rounds
    assert previous_stage("interleaved_1f1b", 2, 0, 0, 2) is None
    assert next_stage("interleaved_1f1b", 2, 1, 0, 2) == (0, 1)
    assert previous_stage("interleaved_1f1b", 2, 0, 1, 2) == (1, 0)
    assert next_stage("interleaved_1f1b", 2, 1, 1, 2) is None
    # V, p=3: the last rank hands chunk 0 to its own chunk 1; rank 0's chunk 1 ends the model
    assert next_stage("zbv", 3, 2, 0, 2) == (2, 1)
    assert previous_stage("zbv", 3, 2, 1, 2) == (2, 0)
    assert next_stage("zbv", 3, 1, 1, 2) == (0, 1)
    assert next_stage("zbv", 3, 0, 1, 2) is None
    assert previous_stage("zbv", 3, 0, 0, 2) is None


def test_bad_placements_raise():
    with pytest.raises(ValueError, match="bad placement: stages=2, virtual_stages=2, rank=0, chunk=2"):
        global_stage("interleaved_1f1b", 2, 0, 2, 2)
    with pytest.raises(ValueError, match="virtual stage 4 is outside 0..3"):
        rank_and_chunk("zbv", 2, 4, 2)
