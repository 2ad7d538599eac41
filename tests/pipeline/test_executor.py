"""``merge_microbatches`` gives back, as one batch's, what a step returned per micro-batch;
``weights_snapshot`` makes a backward use the weights its forward ran with."""

from collections import namedtuple

import pytest
import torch
from torch import Tensor, nn

from lightning_parallel.pipeline.executor import merge_microbatches, split_microbatches, weights_snapshot

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


def _views_of_one_buffer() -> list[nn.Parameter]:
    """Three parameters in one flat storage: at offset 0, at offset 6, and a transposed (strided) view."""
    flat = torch.randn(24, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return [
        nn.Parameter(flat[0:6].view(2, 3)),
        nn.Parameter(flat[6:12].view(3, 2)),
        nn.Parameter(flat[12:24].view(4, 3).t()),
    ]


def _every_view_saved(x: Tensor, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    h = torch.tanh(torch.tanh(x @ a) @ b)
    return ((h @ a) @ c).square().sum()


def _only_the_first_view_saved(x: Tensor, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a`` is saved (by its second product), ``b`` and ``c`` only added (not saved)."""
    return ((x @ a) @ a.t() + b[0, 0] + c[0, 0]).square().sum()


@pytest.mark.parametrize("loss_fn", [_every_view_saved, _only_the_first_view_saved])
def test_the_snapshot_keeps_the_entry_values_of_parameters_that_share_a_storage(loss_fn):
    params = _views_of_one_buffer()
    assert params[1].storage_offset() == 6 and params[2].stride() == (1, 3)
    entry = [p.detach().clone().requires_grad_() for p in params]
    x = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with weights_snapshot(params):
        loss = loss_fn(x, *params)
    with torch.no_grad():  # the optimizer's in-place update, between the forward and the backward
        for p in params:
            p.add_(1.0)
    loss.backward()
    loss_fn(x, *entry).backward()
    for p, e in zip(params, entry):
        assert torch.equal(p.grad, e.grad)
