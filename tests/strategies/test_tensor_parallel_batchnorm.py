"""lp_tensor_parallel on a dense net with BatchNorm (and a per-feature scale) inside its column -> row
pairs: the per-feature layers are cut with the features, and 2 (tp=2) and 4 (dp=2 x tp=2, sync_batchnorm)
real processes equal one device in float64, parameters and running statistics after several steps,
validation included; full checkpoints hold the whole running statistics under single-device names."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from tests.helpers.harness import assert_params_close, max_param_diff, run_distributed, run_single

TP = "lightning_parallel:TensorParallelStrategy"
MODEL = "tests.strategies.test_tensor_parallel_batchnorm:DenseBatchNorm"
HELD = "tests.strategies.test_tensor_parallel_batchnorm:HeldDenseBatchNorm"
CHECKPOINTS = {
    "class": "lightning.pytorch.callbacks:ModelCheckpoint",
    "kwargs": {"dirpath": "checkpoints", "every_n_train_steps": 3, "save_top_k": -1},
}
DATA = "tests.helpers.models:RegressionData"
DATA_KWARGS = {"global_batch_size": 16, "in_dim": 48, "out_dim": 8}
TRAINER = {"precision": "64-true", "max_steps": 6, "limit_val_batches": 2, "val_check_interval": 3}
WRITTEN = {
    "net.0": "colwise",
    "net.3": "rowwise",
    "net.6": "colwise",
    "net.7": "per_feature",
    "net.9": "rowwise",
}


class FeatureAffine(nn.Module):
    """A per-feature scale and shift (no statistics): ``x * scale + shift``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.shift = nn.Parameter(torch.linspace(-0.1, 0.1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def dense_net(in_dim: int = 48, h: int = 32, out_dim: int = 8) -> nn.Sequential:
    """in -> h -> BN -> ReLU -> h -> BN -> ReLU -> h -> per-feature affine -> ReLU -> out: two column -> row
    pairs, each with a per-feature layer inside; the BatchNorm between the pairs stays whole."""
    return nn.Sequential(
        nn.Linear(in_dim, h),
        nn.BatchNorm1d(h),
        nn.ReLU(),
        nn.Linear(h, h),
        nn.BatchNorm1d(h),
        nn.ReLU(),
        nn.Linear(h, h),
        FeatureAffine(h),
        nn.ReLU(),
        nn.Linear(h, out_dim),
    )


class DenseBatchNorm(LightningModule):
    def __init__(self, in_dim: int = 48, hidden: int = 32, out_dim: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = dense_net(in_dim, hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("val_loss", nn.functional.mse_loss(out, y), sync_dist=True)
        self.log("val_out", out.abs().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class HeldDenseBatchNorm(DenseBatchNorm):
    """The network built outside and held in the hyperparameters, as the Lightning + Hydra templates do."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        LightningModule.__init__(self)
        net = net if net is not None else dense_net()
        self.save_hyperparameters({"net": net, "lr": lr})
        self.net = net


def case(name, plan="auto", dp=1, trainer=None, **extra):
    return {
        "name": name,
        "model": MODEL,
        "data": DATA,
        "dp_size": dp,
        "data_kwargs": DATA_KWARGS,
        "trainer": {**TRAINER, **(trainer or {})},
        "strategy": {"class": TP, "kwargs": {"plan": plan, "data_parallel_size": dp}},
        "save_checkpoint": True,
        "validate_after_fit": True,
        "probe": "tests.helpers.probes:split_state_shapes",
        **extra,
    }


def single(tmp, name, trainer=None, **extra):
    c = {
        "name": name,
        "model": MODEL,
        "data": DATA,
        "data_kwargs": DATA_KWARGS,
        "trainer": {**TRAINER, **(trainer or {})},
        "validate_after_fit": True,
        "save_checkpoint": True,
        **extra,
    }
    return run_single(c, tmp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_bn")
    ref = single(tmp, "single")
    first = single(tmp, "single-3", trainer={"max_steps": 3})
    assert first["state_dict"]
    resume = case("auto-resume", ckpt_path=str(tmp / "single" / "single-3" / "last.ckpt"))
    held = case("held", model=HELD)
    sharded = case("sharded-save", trainer={"max_steps": 3})  # each rank writes its own slices
    sharded["strategy"]["kwargs"]["save_distributed"] = True
    sharded.update(
        save_checkpoint="split", validate_after_fit=False
    )  # as fit ends, while each rank holds its shard
    two = run_distributed(
        [case("auto"), case("written", plan=WRITTEN), resume, held, sharded],
        world_size=2,
        tmp_path=tmp,
        timeout=400,
    )
    sync = case("auto-dp2-sync", dp=2, trainer={"sync_batchnorm": True})
    held_sync = case(
        "held-dp2-sync", dp=2, trainer={"sync_batchnorm": True}, model=HELD, callbacks=[CHECKPOINTS]
    )
    four = run_distributed([sync, held_sync], world_size=4, tmp_path=tmp, timeout=400)
    initial = single(tmp, "single-0", trainer={"max_steps": 0})
    resumed = single(tmp, "single-resume", ckpt_path=resume["ckpt_path"])  # the same resume on one device
    from_shards = single(
        tmp, "single-from-shards", ckpt_path=str(tmp / "dist2" / "sharded-save" / "last.ckpt")
    )
    single(tmp, "single-3-fit", trainer={"max_steps": 3}, validate_after_fit=False)  # saved as fit ends, too
    resumed_fit = single(
        tmp, "single-resume-fit", ckpt_path=str(tmp / "single" / "single-3-fit" / "last.ckpt")
    )
    refs = {
        "auto": ref,
        "written": ref,
        "auto-dp2-sync": ref,
        "auto-resume": resumed,
        "held": ref,
        "held-dp2-sync": ref,
        "from-shards": from_shards,
        "resumed-fit": resumed_fit,
    }
    return tmp, refs, initial, {**two, **four}


def _full(tmp, world, name):
    return torch.load(tmp / f"dist{world}" / name / "last.ckpt", weights_only=False)["state_dict"]


CASES = [
    (2, "auto"),
    (2, "written"),
    (2, "auto-resume"),
    (4, "auto-dp2-sync"),
    (2, "held"),
    (4, "held-dp2-sync"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, name", CASES)
def test_equals_one_device_parameters_running_statistics_and_validation(runs, world, name):
    tmp, refs, initial, results = runs
    ref = refs[name]
    full = _full(tmp, world, name)
    print(f"{name}: largest difference from one device {max_param_diff(full, ref['state_dict']):.3e}")
    assert_params_close(full, ref["state_dict"], atol=1e-10)  # parameters and BatchNorm buffers, full size
    for key in ("net.1.running_mean", "net.1.running_var", "net.7.scale", "net.4.running_var"):
        assert max_param_diff({key: initial["state_dict"][key]}, {key: ref["state_dict"][key]}) > 1e-3, key
    assert full["net.1.num_batches_tracked"] == ref["state_dict"]["net.1.num_batches_tracked"] == 6
    for rank in results[name]:
        for metric in ("val_loss", "val_out"):  # eval mode: every rank normalizes with its running stats
            assert abs(rank["metrics"][metric] - ref["metrics"][metric]) <= 1e-10, metric


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, name", CASES)
def test_per_feature_tensors_are_split_and_each_rank_holds_at_most_55_percent(runs, world, name):
    tmp, _, _, results = runs
    full = _full(tmp, world, name)
    parameters = {n for n, _ in DenseBatchNorm().named_parameters()}
    total = sum(full[n].numel() for n in parameters)
    for rank in results[name]:
        local = rank["probe"]  # the shapes this rank held at the end of fit
        for key in ("net.1.weight", "net.1.running_mean", "net.1.running_var", "net.7.scale", "net.7.shift"):
            assert local[key][0] * 2 == full[key].shape[0], key
        assert local["net.4.running_mean"] == full["net.4.running_mean"].shape  # between the pairs
        assert local["net.1.num_batches_tracked"] == ()
        held = sum(math.prod(local[n]) for n in parameters)
        assert held / total <= 0.55, f"{held} of {total}"
        # after fit and validate the module is whole, per-feature tensors included
        assert list(rank["state_dict"]) == list(full) and max_param_diff(rank["state_dict"], full) == 0


@pytest.mark.timeout(900)
def test_full_checkpoint_loads_into_the_plain_module(runs):
    tmp, refs, _, _ = runs
    plain = DenseBatchNorm().double()
    plain.load_state_dict(_full(tmp, 2, "auto"))  # strict: single-device names and shapes
    assert_params_close(plain.state_dict(), refs["auto"]["state_dict"], atol=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, name", [(2, "held"), (4, "held-dp2-sync")])
def test_a_network_held_in_the_hyperparameters_is_saved_as_on_one_device(runs, world, name):
    """No process group is pickled (dp=2 x tp=2 checkpoints while fitting, with SyncBatchNorm), and
    ``load_from_checkpoint`` rebuilds the single-device model from the hyperparameters."""
    tmp, refs, _, _ = runs
    path = tmp / f"dist{world}" / name / "last.ckpt"
    held = torch.load(path, weights_only=False)["hyper_parameters"]["net"]
    norms = nn.modules.batchnorm._BatchNorm  # after sync_batchnorm, Lightning's revert gives _BatchNormXd
    assert [type(m) for m in held if not isinstance(m, norms)] == [
        type(m) for m in dense_net() if not isinstance(m, norms)
    ]  # plain Linears, whole
    assert held[1].running_mean.shape == (32,) and held[0].weight.shape == (32, 48)
    model = HeldDenseBatchNorm.load_from_checkpoint(path, weights_only=False)
    assert_params_close(model.state_dict(), refs[name]["state_dict"], atol=1e-10)
    if world == 4:
        during_fit = sorted((tmp / f"dist{world}" / name / "checkpoints").glob("*.ckpt"))
        assert during_fit, "no checkpoint was written while fitting"
        net = torch.load(during_fit[0], weights_only=False)["hyper_parameters"]["net"]
        # the synchronised layer pickles as the user's own BatchNorm, without a process group
        assert type(net[1]) is nn.BatchNorm1d and "process_group" not in vars(net[1])
        assert isinstance(net[0], nn.Linear) and net[0].weight.shape == (32, 48)


@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_holds_each_ranks_running_statistics_and_resumes_on_one_device(runs):
    """``save_distributed=True``: each rank writes its slices of the per-feature tensors; one device
    resumed from the directory equals one device resumed from its own checkpoint at the same step."""
    _, refs, _, _ = runs
    assert_params_close(refs["from-shards"]["state_dict"], refs["resumed-fit"]["state_dict"], atol=1e-10)
