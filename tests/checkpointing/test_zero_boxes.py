"""ZeRO's pieces in a sharded checkpoint, as pure data: a flat range of a tensor as the boxes DCP writes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_parallel.checkpointing.sharded import _boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)])
def test_every_flat_range_is_at_most_2n_minus_1_boxes_of_consecutive_elements(shape):
    numel = math.prod(shape)
    tensor = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = _boxes(start, stop, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offsets, sizes, first in boxes:
            box = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
            assert box == list(range(first, first + len(box))), (start, stop, offsets, sizes)
            covered += box
        assert covered == list(range(start, stop))


def test_an_empty_range_is_no_box():
    assert _boxes(5, 5, (3, 4)) == []
