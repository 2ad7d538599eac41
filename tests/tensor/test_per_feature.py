"""Per-feature layers (BatchNorm, a per-feature scale) inside a column -> row pair: found by plan="auto"
(traced and structural), inferred or written in a plan, refused where they are not per feature, and cut
with the features. The multi-process equality with one device is in
tests/strategies/test_tensor_parallel_batchnorm.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.distributed.collectives import SimulatedGroup
from lightning_parallel.distributed.sync_batchnorm import convert_sync_batchnorm
from lightning_parallel.tensor import PlanError, apply_plan, resolve
from lightning_parallel.tensor.full_state import load_full_state_dict, sharded_parameters
from lightning_parallel.tensor.layers import ShardSpec
from lightning_parallel.tensor.sample import forward_on
from lightning_parallel.tensor.table import format_table, params_per_rank
from tests.helpers.models import RegressionData
from tests.strategies.test_tensor_parallel_batchnorm import DenseBatchNorm

BN = ("weight", "bias", "running_mean", "running_var")


def dense(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers).double()


def bn_net() -> nn.Sequential:
    """784 -> 64 -> BN -> ReLU -> 64 -> BN -> ReLU -> 10, as in a Lightning + Hydra template."""
    return dense(
        nn.Linear(784, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 10),
    )  # fmt: skip


def traced(module: nn.Module, x: torch.Tensor, tp: int = 2):
    return resolve(module, "auto", tp, run=lambda: module(x))


def test_auto_cuts_a_batchnorm_inside_its_pair_and_keeps_the_module_as_it_was():
    net = bn_net()
    before = {k: (id(v), v.shape) for k, v in [*net.named_parameters(), *net.named_buffers()]}
    plan = traced(net, torch.randn(8, 784, dtype=torch.float64))
    assert plan.styles() == {"0": "colwise", "3": "rowwise", "1": "per_feature"}
    assert plan.features == {f"1.{n}": ShardSpec(0) for n in BN}
    assert dict(plan.report) == {"6": "no row-parallel partner: its output is not reduced by a projection"}
    total = sum(p.numel() for p in net.parameters())
    assert params_per_rank(net, plan) / total <= 0.55
    after = {k: (id(v), v.shape) for k, v in [*net.named_parameters(), *net.named_buffers()]}
    assert after == before  # the one-rank dry run put every tensor back
    table = format_table(net, plan)
    assert "per_feature  weight [32], bias [32], running_mean [32], running_var [32]" in table


def test_the_strategys_sample_step_finds_batchnorm_and_a_per_feature_scale():
    """The trace of ``training_step`` (buffers restored afterwards by copies, inside the trace)."""
    module = DenseBatchNorm().double()
    batch = next(iter(RegressionData(batch_size=16, in_dim=48, out_dim=8).train_dataloader()))
    plan = resolve(module, "auto", 2, run=forward_on(module, batch))
    assert plan.styles() == {
        "net.0": "colwise",
        "net.3": "rowwise",
        "net.6": "colwise",
        "net.9": "rowwise",
        "net.1": "per_feature",
        "net.7": "per_feature",
    }
    assert set(plan.features) == {f"net.1.{n}" for n in BN} | {"net.7.scale", "net.7.shift"}
    assert plan.report == [] and plan.gradient_sums == []


def test_structural_rules_without_a_forward():
    plan = resolve(bn_net(), "auto", 2)
    assert plan.styles() == {"0": "colwise", "3": "rowwise", "1": "per_feature"}
    assert set(plan.features) == {f"1.{n}" for n in BN}


def test_sync_batchnorm_is_one_per_feature_step():
    """``SyncBatchNorm`` all-reduces its statistics inside (over the data-parallel group): the trace
    takes it whole, as a per-channel layer."""
    net = convert_sync_batchnorm(bn_net())
    plan = traced(net, torch.randn(8, 784, dtype=torch.float64))
    assert plan.styles()["1"] == "per_feature" and plan.styles()["0"] == "colwise"


class Channels(nn.Module):
    """Linear -> BatchNorm1d over the sequence positions (dimension 1), not over the split features."""

    def __init__(self):
        super().__init__()
        self.up, self.bn, self.down = nn.Linear(8, 16), nn.BatchNorm1d(4), nn.Linear(16, 8)

    def forward(self, x):  # x: (batch, 4 positions, 8)
        return self.down(torch.relu(self.bn(self.up(x))))


class Regularized(nn.Module):
    """A per-feature scale also read whole (a penalty on it): it cannot be cut."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.down(self.up(x) * self.scale).sum() + self.scale.square().sum()


def test_what_is_not_per_feature_keeps_the_pair_whole():
    plan = traced(Regularized(), torch.randn(3, 8))
    assert plan.styles() == {} and plan.features == {} and plan.full_width == []
    assert any("sum over the sharded dimension" in reason for _, reason in plan.report), plan.report


@pytest.mark.parametrize(
    "module, x, norm",
    [
        (Channels(), torch.randn(3, 4, 8), "bn"),
        (
            dense(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)),
            torch.randn(3, 8, dtype=torch.float64),
            "1",
        ),
    ],
)
def test_a_norm_right_on_a_column_output_runs_on_all_its_features(module, x, norm):
    """Statistics over the split features (a LayerNorm, a BatchNorm over the positions): the norm runs on
    all the features (tensor.full_width), its parameters whole, and the pair splits around it."""
    plan = traced(module, x)
    assert sorted(plan.styles().values()) == ["colwise", "full_width", "rowwise"] and plan.full_width == [
        norm
    ]
    assert plan.features == {} and plan.report == []


def test_a_written_plan_infers_batchnorm_in_a_sequential_and_names_other_per_feature_layers():
    plan = resolve(bn_net(), {"0": "colwise", "3": "rowwise"}, 2)
    assert plan.styles()["1"] == "per_feature" and "4" not in plan.styles()
    module = DenseBatchNorm()
    written = {
        "net.0": "colwise",
        "net.3": "rowwise",
        "net.6": "colwise",
        "net.7": "per_feature",
        "net.9": "rowwise",
    }
    assert set(resolve(module, written, 2).features) == {f"net.1.{n}" for n in BN} | {
        "net.7.scale",
        "net.7.shift",
    }
    with pytest.raises(PlanError, match="colwise layer 'net.6' leaves its output sharded"):
        resolve(module, {**written, "net.7": "replicate"}, 2)  # the scale is no BatchNorm: not inferred


@pytest.mark.parametrize(
    "plan, message",
    [
        (
            {"0": "per_feature"},
            r"style 'per_feature' applies to a module whose parameters and buffers are vectors",
        ),
        ({"4": "per_feature"}, r"per_feature module '4' is fed no split features: no colwise layer"),
        ({"0": "colwise", "1": "per_feature", "3": "rowwise"}, None),
        ({"0": "colwise", "3": "rowwise"}, None),
    ],
)
def test_per_feature_style_checks(plan, message):
    if message is None:
        assert resolve(bn_net(), plan, 2).styles()["1"] == "per_feature"
    else:
        with pytest.raises(PlanError, match=message):
            resolve(bn_net(), plan, 2)
    with pytest.raises(PlanError, match=r"'1' \(per_feature\): features=64 is not divisible .* 3"):
        resolve(bn_net(), {"1": "per_feature"}, 3)


@pytest.mark.parametrize("rank", [0, 1])
def test_applied_and_loaded_every_rank_holds_its_features(rank):
    net = bn_net()
    full = {k: v.clone() for k, v in net.state_dict().items()}
    plan = resolve(net, {"0": "colwise", "3": "rowwise"}, 2)
    apply_plan(net, plan, SimulatedGroup(2), rank)
    shards = sharded_parameters(net)
    assert {f"1.{n}" for n in BN} <= set(shards) and "1.num_batches_tracked" not in shards
    load_full_state_dict(net, full)
    mine = slice(32 * rank, 32 * (rank + 1))
    for n in BN:
        assert torch.equal(getattr(net[1], n), full[f"1.{n}"][mine])
    assert isinstance(net[1].weight, nn.Parameter) and net[1].running_mean.shape == (32,)


def test_a_sharded_network_pickles_as_on_one_device_and_deep_copies_as_itself():
    """A network held in the hyperparameters: Lightning drops what cannot be pickled (a process group),
    checkpoints save it whole (``unsharded_copy``, from the full state); a deep copy stays sharded."""
    import copy
    import pickle

    from lightning_parallel.tensor.full_state import unsharded_copy

    net = bn_net()
    full = {k: v.clone() for k, v in net.state_dict().items()}
    apply_plan(net, resolve(net, {"0": "colwise", "3": "rowwise"}, 2), SimulatedGroup(2), 1)
    pickled = pickle.loads(pickle.dumps(net))
    assert type(pickled[0]) is nn.Linear and pickled[0].weight.shape == (64, 784)
    whole = unsharded_copy(net, net, full)
    assert [type(m) for m in whole] == [type(m) for m in bn_net()]
    assert all(torch.equal(whole.state_dict()[k], full[k]) for k in full)
    assert net[1].running_mean.shape == (32,)  # the sharded network is unchanged
    copied = copy.deepcopy(net)
    assert type(copied[0]).__name__ == "ColumnParallelLinear" and copied[0].group is net[0].group
    assert copied[0].weight.shape == (32, 784) and copied[0].weight is not net[0].weight
