"""SyncBatchNorm's statistics under mixed precision, through ``Trainer(sync_batchnorm=True)`` on 2 real
gloo processes: computed in float32 (as torch's SyncBatchNorm does), a half-precision input still
gives the group's variance. In bf16, E[x^2] - mean^2 at a mean of 10 cancels (bf16 resolves 0.5 at
100, the variance is 0.01); in fp16, a sum of squares of values near 100 overflows (65504)."""

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.harness import run_distributed

FEATURES, STEPS, GLOBAL_BATCH = 4, 40, 16


class Normalised(LightningModule):
    """A frozen identity Linear (its output is half precision under autocast), then BatchNorm with the
    cumulative average of the batches' statistics (momentum=None)."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(FEATURES, FEATURES, bias=False)
        with torch.no_grad():
            self.project.weight.copy_(torch.eye(FEATURES))
        self.project.requires_grad_(False)
        self.norm = nn.BatchNorm1d(FEATURES, momentum=None)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.norm(self.project(x)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def normalised() -> Normalised:
    return Normalised()


class Shifted(LightningDataModule):
    """``STEPS`` global batches of values with mean ``mean`` and standard deviation ``std``."""

    def __init__(self, batch_size: int, mean: float = 10.0, std: float = 0.1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x = mean + std * torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=g)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x), batch_size=self.batch_size)


def case(name: str, trainer: dict, mean: float, std: float, **extra) -> dict:
    return {
        "name": name,
        "model": "tests.distributed.test_sync_batchnorm:normalised",
        "data": "tests.distributed.test_sync_batchnorm:Shifted",
        "data_kwargs": {"global_batch_size": GLOBAL_BATCH, "mean": mean, "std": std},
        "strategy": "lp_ddp",
        "trainer": {"max_epochs": 1, "sync_batchnorm": True, **trainer},
        **extra,
    }


CASES = {
    "bf16-mixed": (case("bf16", {"precision": "bf16-mixed"}, mean=10.0, std=0.1), 10.0, 0.01),
    # Lightning turns 16-mixed into bf16 on CPU: fp16_cpu keeps float16 autocast
    "16-mixed": (case("fp16", {}, mean=100.0, std=1.0, fp16_cpu=True), 100.0, 1.0),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = [c for c, _, _ in CASES.values()]
    return run_distributed(cases, world_size=2, tmp_path=tmp_path_factory.mktemp("sync_bn_half"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", list(CASES))
def test_running_variance_tracks_the_data_under_mixed_precision(runs, precision):
    spec, mean, var = CASES[precision]
    for rank, result in enumerate(runs[spec["name"]]):
        state = result["state_dict"]
        assert int(state["norm.num_batches_tracked"]) == STEPS
        running_mean, running_var = state["norm.running_mean"], state["norm.running_var"]
        assert torch.isfinite(running_var).all(), (rank, running_var)
        assert ((running_mean - mean).abs() < 0.05 * var**0.5 * 10).all(), (rank, running_mean)
        assert ((running_var / var - 1).abs() < 0.2).all(), (rank, precision, running_var)
