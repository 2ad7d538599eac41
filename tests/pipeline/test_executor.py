"""``merge_microbatches`` gives back, as one batch's, what a step returned per micro-batch."""

from collections import namedtuple

import torch

from lightning_parallel.pipeline.executor import merge_microbatches, split_microbatches

Pair = namedtuple("Pair", "x y")


def test_merge_is_the_inverse_of_the_split_for_batch_shaped_values():
    batch = {"x": torch.arange(14.0).reshape(7, 2), "pair": Pair(torch.arange(7), [torch.ones(7, 3)])}
    merged = merge_microbatches(split_microbatches(batch, 3))  # uneven: parts of 3, 2, 2
    assert merged.keys() == batch.keys()
    assert torch.equal(merged["x"], batch["x"])
    assert isinstance(merged["pair"], Pair) and torch.equal(merged["pair"].x, batch["pair"].x)
    assert isinstance(merged["pair"].y, list) and torch.equal(merged["pair"].y[0], batch["pair"].y[0])


def test_values_without_a_batch_dimension_are_kept_once_when_equal_else_listed():
    parts = [
        {"name": "a", "step": torch.tensor(3), "loss": torch.tensor(float(i)), "none": None} for i in range(2)
    ]
    merged = merge_microbatches(parts)
    assert merged["name"] == "a" and merged["none"] is None and torch.equal(merged["step"], torch.tensor(3))
    assert [float(v) for v in merged["loss"]] == [0.0, 1.0]


def test_one_micro_batch_is_returned_as_it_is_and_different_shapes_are_listed():
    only = {"x": torch.zeros(2)}
    assert merge_microbatches([only]) is only
    ragged = [torch.zeros(2, 3), torch.zeros(2, 4)]
    assert merge_microbatches(ragged) == ragged
