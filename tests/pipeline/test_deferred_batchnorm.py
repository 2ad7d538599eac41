"""Deferred BatchNorm statistics: micro-batches run one by one give the running statistics of one
BatchNorm call on the whole batch (float64), while each micro-batch is still normalised with its own.

The SyncBatchNorm case runs on 2 real gloo processes (``python -m tests.pipeline.test_deferred_batchnorm
OUT``): the statistics of both ranks' micro-batches equal one device's on the global batch."""

from __future__ import annotations

import copy
import io
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.pipeline.deferred_batchnorm import DeferredBatchNorm, batchnorm_warning
from tests.helpers.harness import REPO, run_program

ATOL = 1e-12


def buffers(layer: nn.Module) -> dict:
    return {k: v.clone() for k, v in layer.named_buffers()}


def assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    got, want = buffers(a), buffers(b)
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=0, msg=k)


def batches(shape: tuple, count: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1 for _ in range(count)]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda m: nn.BatchNorm1d(5, momentum=m), (10, 5)),  # 10 = 3 + 3 + 2 + 2: micro-batches of two sizes
        (lambda m: nn.BatchNorm1d(5, momentum=m), (8, 5, 7)),
        (lambda m: nn.BatchNorm2d(3, momentum=m), (8, 3, 4, 5)),
    ],
)
def test_running_statistics_equal_one_call_on_the_whole_batch(make, shape, momentum):
    layer, whole = make(momentum).double(), make(momentum).double()
    deferred = DeferredBatchNorm(layer)
    for x in batches(shape):
        with deferred.mini_batch(4):  # called as layer(input=...) too
            outputs = [
                layer(input=part) if i else layer(part) for i, part in enumerate(torch.tensor_split(x, 4))
            ]
        whole(x)
        assert_same_buffers(layer, whole)
        for part, out in zip(torch.tensor_split(x, 4), outputs):  # normalised with its own statistics
            torch.testing.assert_close(out, nn.functional.batch_norm(part, None, None, training=True))
    assert int(layer.num_batches_tracked) == 3


def test_without_it_each_micro_batch_updates_the_statistics():
    """What the deferral prevents (the test above would fail without it)."""
    layer, whole = nn.BatchNorm1d(5).double(), nn.BatchNorm1d(5).double()
    x = batches((16, 5), 1)[0]
    for part in x.chunk(4):
        layer(part)
    whole(x)
    assert int(layer.num_batches_tracked) == 4
    assert (layer.running_mean - whole.running_mean).abs().max() > 1e-3


def test_graphs_of_every_micro_batch_backward_after_all_forwards():
    """gpipe order: every forward, then every backward (the layers' running buffers are not what autograd
    saved, so the commit in between breaks no graph); gradients equal plain per-micro-batch BatchNorm's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    plain = copy.deepcopy(model)
    x = batches((16, 4), 1)[0]
    deferred = DeferredBatchNorm(model)
    with deferred.mini_batch(4):
        outs = [model(part) for part in x.chunk(4)]
    for out in outs:
        out.square().sum().backward()
    for part in x.chunk(4):
        plain(part).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)


def test_hooks_are_gone_after_a_mini_batch_and_the_module_pickles():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double()
    keys = list(model.state_dict())
    with DeferredBatchNorm(model).mini_batch(2):
        model(batches((8, 4), 1)[0].chunk(2)[0])
        model(batches((8, 4), 1)[0].chunk(2)[1])
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks
    assert list(model.state_dict()) == keys
    torch.save(model, io.BytesIO())


def test_eval_mode_is_untouched():
    layer = nn.BatchNorm1d(5).double()
    layer.running_mean.fill_(0.5)
    layer.eval()
    before = buffers(layer)
    x = batches((8, 5), 1)[0]
    with DeferredBatchNorm(layer).mini_batch(2):
        out = layer(x)
    torch.testing.assert_close(out, (x - 0.5) / torch.sqrt(torch.tensor(1 + layer.eps, dtype=torch.float64)))
    assert all(torch.equal(v, before[k]) for k, v in layer.named_buffers())


class Twice(nn.Module):
    """One BatchNorm called twice per forward: one device updates its statistics twice per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 5)

    def forward(self, x):
        return self.bn(self.lin(self.bn(x)))


def test_a_layer_called_twice_per_forward_is_updated_twice_per_batch():
    torch.manual_seed(0)
    model = Twice().double()
    deferred = DeferredBatchNorm(model)
    x = batches((16, 5), 1)[0]
    with deferred.mini_batch(4):
        for part in x.chunk(4):
            model(part)
    # what the deferral does by hand: the statistics of each call site's inputs, the whole batch each
    whole = Twice().double()
    whole.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("lin")}, strict=False)
    first = x
    second = torch.cat(
        [model.lin(nn.functional.batch_norm(p, None, None, training=True)) for p in x.chunk(4)]
    )
    with torch.no_grad():
        whole.bn(first)
        whole.bn(second.detach())
    assert int(model.bn.num_batches_tracked) == 2
    assert_same_buffers(model.bn, whole.bn)


def test_an_error_in_the_mini_batch_restores_the_buffers_and_commits_nothing():
    layer = nn.BatchNorm1d(5).double()
    own = dict(layer._buffers)
    before = buffers(layer)

    def fail(module, args, output):
        raise KeyError("boom")

    layer.register_forward_hook(fail)  # runs after the deferral's own hook (a stage boundary's hook does)
    with pytest.raises(KeyError), DeferredBatchNorm(layer).mini_batch(2):
        layer(batches((8, 5), 1)[0])
    assert all(layer._buffers[k] is own[k] for k in own)
    assert layer.momentum == 0.1
    assert all(torch.equal(v, before[k]) for k, v in layer.named_buffers())


def test_a_stage_boundary_hook_after_the_layer_still_sees_its_statistics_recorded():
    """The stage's last block may be a BatchNorm: the boundary hook raises after the deferral's hook."""

    class Boundary(BaseException):
        pass

    layer, whole = nn.BatchNorm1d(5).double(), nn.BatchNorm1d(5).double()

    def boundary(module, args, output):
        raise Boundary()

    layer.register_forward_hook(boundary)
    x = batches((8, 5), 1)[0]
    with DeferredBatchNorm(layer).mini_batch(2):
        for part in x.chunk(2):
            with pytest.raises(Boundary):
                layer(part)
    whole(x)
    assert_same_buffers(layer, whole)


def test_a_lazy_batchnorm_is_materialised_before_its_buffers_are_set_aside():
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d()).double()
    x = batches((8, 3), 1)[0]
    with DeferredBatchNorm(lazy).mini_batch(2):
        for part in x.chunk(2):
            lazy(part)
    whole = nn.BatchNorm1d(4).double()
    with torch.no_grad():
        whole(lazy[0](x))
    assert_same_buffers(lazy[1], whole)


def test_warning_names_the_layers_and_what_would_be_exact():
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.BatchNorm1d(6, affine=False)
    )
    text = batchnorm_warning(model, 4)
    assert "BatchNorm layers 1, 3 " in text and "4 micro-batches" in text
    assert "num_microbatches=1" in text and "nn.LayerNorm" in text and "nn.GroupNorm" in text
    assert batchnorm_warning(model, 1) is None
    assert batchnorm_warning(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 4) is None
    many = nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(13)])
    assert "0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 3 more" in batchnorm_warning(many, 2)


# ----------------------------------------------------------------------------- SyncBatchNorm, 2 ranks
def rank_program(out: Path) -> None:
    from lightning_parallel.distributed.sync_batchnorm import SyncBatchNorm
    from lightning_parallel.every_rank import training_step_scope

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layer = SyncBatchNorm(5, momentum=0.1).double()
    whole = nn.BatchNorm1d(5, momentum=0.1).double()
    deferred = DeferredBatchNorm(layer)
    for x in batches((16, 5), 3, seed=1):  # the global batch; each rank holds half, in 4 micro-batches
        with deferred.mini_batch(4), training_step_scope():  # as inside a strategy's step: it syncs
            for part in x.chunk(2)[rank].chunk(4):
                layer(part)
        whole(x)
        assert_same_buffers(layer, whole)
    assert int(layer.num_batches_tracked) == 3
    (out / f"ok{rank}").write_text("ok")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_sync_batchnorm_statistics_cover_every_rank_of_its_group(tmp_path):
    command = [sys.executable, "-m", "tests.pipeline.test_deferred_batchnorm", str(tmp_path)]
    run_program(command, tmp_path, timeout=100)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


if __name__ == "__main__":
    os.chdir(REPO)
    rank_program(Path(sys.argv[1]))
