"""``tensor.gradient_sums`` in one process, its all-reduce replaced by one over two identical ranks (the
sum doubles): one collective per backward, each backward's fresh gradient summed once (two backwards before
a step accumulate two sums, as on one device), ``ready`` told of each gradient once it is complete, and
``torch.autograd.grad`` answered with the sum."""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.tensor import gradient_sums
from lightning_parallel.tensor.gradient_sums import GradientSums


def _doubling(calls: list):
    def all_reduce_sum(flat, group):
        calls.append(flat.numel())
        return flat.mul_(2)

    return all_reduce_sum


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()


def _grads(model: nn.Module, batches: list) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for x in batches:
        model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_each_backward_sums_its_own_gradient_in_one_collective(monkeypatch):
    calls: list = []
    monkeypatch.setattr(gradient_sums, "all_reduce_sum", _doubling(calls))
    batches = [torch.randn(5, 3, dtype=torch.float64) for _ in range(2)]
    plain = _grads(_model(), batches)
    model = _model()
    norm = model[1]
    sums = GradientSums(group=None)
    sums.add([norm.weight, norm.bias])
    seen: dict[str, torch.Tensor] = {}
    sums.report_to(lambda p: seen.__setitem__("weight" if p is norm.weight else "bias", p.grad.clone()))
    summed = _grads(model, batches)
    assert calls == [8, 8]  # one flat all-reduce per backward, of both parameters
    for name, g in summed.items():
        factor = 2 if name.startswith("1.") else 1  # the norm's gradients summed over the two ranks
        torch.testing.assert_close(g, factor * plain[name], rtol=0, atol=1e-12)
    torch.testing.assert_close(seen["weight"], summed["1.weight"], rtol=0, atol=0)  # complete when told


def test_a_parameter_not_summed_in_a_backward_is_told_at_once(monkeypatch):
    calls: list = []
    monkeypatch.setattr(gradient_sums, "all_reduce_sum", _doubling(calls))
    model = _model()
    norm, last = model[1], model[2]
    summing = [False]
    sums = GradientSums(group=None)
    sums.add([norm.weight], when=lambda: summing[0])
    order: list[str] = []
    sums.report_to(lambda p: order.append("norm"))
    last.weight.register_post_accumulate_grad_hook(lambda p: order.append("last"))
    model[0].weight.register_post_accumulate_grad_hook(lambda p: order.append("first"))
    x = torch.randn(5, 3, dtype=torch.float64)
    model(x).sum().backward()
    assert calls == [] and order == ["last", "norm", "first"]  # as its gradient arrives
    order.clear()
    summing[0] = True
    model(x).sum().backward()
    assert calls == [4] and order == ["last", "first", "norm"]  # after the sum, at the end of backward
    sums.report_to(None)
    order.clear()
    model(x).sum().backward()
    assert order == ["last", "first"]


def test_autograd_grad_gets_the_sum_and_leaves_grad_alone(monkeypatch):
    calls: list = []
    monkeypatch.setattr(gradient_sums, "all_reduce_sum", _doubling(calls))
    x = torch.randn(5, 3, dtype=torch.float64)
    plain = _model()
    (expected,) = torch.autograd.grad(plain(x).sum(), [plain[1].weight])
    model = _model()
    GradientSums(group=None).add([model[1].weight])
    (got,) = torch.autograd.grad(model(x).sum(), [model[1].weight])
    torch.testing.assert_close(got, 2 * expected, rtol=0, atol=1e-12)
    assert calls == [4] and model[1].weight.grad is None


def test_only_the_blocks_held_by_several_ranks_are_summed(monkeypatch):
    """A parameter cut in blocks (a split query block, a key-value block held by both ranks): the
    replicated block is placed at its slice of a zero tensor as wide as the block, summed, and taken back;
    the split block keeps its own gradient."""
    from lightning_parallel.tensor.layers import ShardSpec
    from lightning_parallel.tensor.replicated_blocks import Replicated

    calls: list = []
    monkeypatch.setattr(gradient_sums, "all_reduce_sum", _doubling(calls))
    weight = nn.Parameter(torch.randn(6, 3, dtype=torch.float64))  # local: 4 query rows, 2 kv rows
    sums = GradientSums(group=None)
    sums.add_blocks({weight: Replicated(ShardSpec(0, parts=((8, 1), (2, 2))), 2, 1)})
    x = torch.randn(5, 3, dtype=torch.float64)
    (x @ weight.t()).square().sum().backward()
    plain = 2 * (x @ weight.detach().t()).t() @ x
    assert calls == [6]  # the kv block only, as wide as the full block
    torch.testing.assert_close(weight.grad[:4], plain[:4], rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad[4:], 2 * plain[4:], rtol=0, atol=1e-12)
