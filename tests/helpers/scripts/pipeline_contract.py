"""A user's script whose steps make collectives, run as one rank of a pipeline run:

    python pipeline_contract.py SPEC.json

SPEC: {"out": folder, "dp": replicas, "schedules": [...], "manual": false, "zero_stage": 0}. The test starts one process
per rank with RANK/WORLD_SIZE/... set (processes created externally, as under torchrun). Per schedule:
validate, test and predict (with two prediction writers) on the initial weights, then a short fit with
validation. Each rank saves what its steps saw to OUT/<schedule>/rank<r>.pt, with the plain module's
outputs on the whole data set (one device, before any Trainer) to compare with.
"""

import copy
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torchmetrics
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineParallelStrategy
from tests.helpers.pp_models import SequentialNet

GLOBAL_BATCH, SAMPLES, MICROBATCHES = 8, 32, 2


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 16, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64))


class CollectiveNet(SequentialNet):
    """Every step gathers its outputs, reduces and broadcasts its loss, waits at a barrier, computes a
    metric (a collective in torchmetrics) and logs with sync_dist, as a user writing for ``ddp`` would."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.mse = torchmetrics.MeanSquaredError().set_dtype(torch.float64)
        self.records: dict[str, list] = defaultdict(list)

    def _step(self, kind: str, batch) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y)
        strategy = self.trainer.strategy
        self.mse.update(out.detach(), y)
        record = {
            "own": out.detach().cpu(),
            "gathered": self.all_gather(out.detach()).cpu(),
            "summed": strategy.reduce(loss.detach().clone(), reduce_op="sum").cpu(),  # reduce is in place
            "broadcast": strategy.broadcast(float(loss), src=0),
            "running_mse": float(self.mse.compute()),
        }
        strategy.barrier()
        self.records[kind].append(record)
        self.log(f"{kind}_loss", loss, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._step("train", batch)
        if not self.automatic_optimization:
            self.manual_backward(loss)
            self.optimizers().step()
        return loss

    def validation_step(self, batch, batch_idx):
        return {"loss": self._step("val", batch), "x": batch[0]}

    def test_step(self, batch, batch_idx):
        self._step("test", batch)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return {"out": self(x), "y": y}

    def _restart(self, kind: str) -> None:
        self.mse.reset()
        self.records[kind] = []

    def on_train_epoch_start(self):
        self._restart("train")

    def on_validation_epoch_start(self):
        self._restart("val")

    def on_test_epoch_start(self):
        self._restart("test")


class Writer(BasePredictionWriter):
    """Keeps what Lightning hands it, on the CPU."""

    def __init__(self, interval: str) -> None:
        super().__init__(interval)
        self.calls: list = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dl_idx):
        self.calls.append({"prediction": _cpu(prediction), "indices": list(batch_indices), "idx": batch_idx})

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.calls.append({"predictions": _cpu(predictions), "indices": _cpu(batch_indices)})


class KeepValidationOutputs(Callback):
    """Keeps what ``on_validation_batch_end`` receives as the step's outputs."""

    def __init__(self) -> None:
        self.outputs: list = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append({"outputs": _cpu(outputs), "x": batch[0].cpu()})


def _cpu(value):
    return move_data_to_device(value, torch.device("cpu"))


def run(schedule: str, dp: int, world: int, manual: bool, out: Path, zero_stage: int = 0) -> dict:
    seed_everything(0)
    model = CollectiveNet(manual=manual)
    dataset = data()
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(dataset.tensors[0])
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
    writers = [Writer("batch"), Writer("epoch")]
    kept = KeepValidationOutputs()
    strategy = PipelineParallelStrategy(
        schedule=schedule,
        num_microbatches=MICROBATCHES,
        data_parallel_size=dp,
        timeline_step=None,
        zero_stage=zero_stage,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=1,
        limit_train_batches=2,
        default_root_dir=str(out),
        callbacks=[*writers, kept],
    )
    result: dict = {"expected": expected, "y": dataset.tensors[1], "manual": manual}
    if not manual:
        trainer.validate(model, loader, verbose=False)
        result["val"] = {"records": model.records["val"], "metrics": _metrics(trainer)}
        result["val_outputs"] = list(kept.outputs)
        trainer.test(model, loader, verbose=False)
        result["test"] = {"records": model.records["test"], "metrics": _metrics(trainer)}
        returned = trainer.predict(model, loader, return_predictions=True)
        result["predict"] = {"returned": _cpu(returned), "writers": [w.calls for w in writers]}
    trainer.fit(model, loader, loader)
    result["fit"] = {
        "train": model.records["train"],
        "val": model.records["val"],
        "metrics": _metrics(trainer),
    }
    result["votes"] = [  # ModelCheckpoint's and EarlyStopping's vote, outside the steps
        strategy.reduce_boolean_decision(True),
        strategy.reduce_boolean_decision(True, all=False),
        strategy.reduce_boolean_decision(False, all=False),
    ]
    result["rank"], result["pp_rank"], result["dp_rank"] = (
        trainer.global_rank,
        strategy.mesh.pp_rank,
        strategy.mesh.dp_rank,
    )
    return result


def _metrics(trainer: Trainer) -> dict:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for schedule in spec["schedules"]:
        out = Path(spec["out"]) / schedule
        out.mkdir(parents=True, exist_ok=True)
        result = run(schedule, spec["dp"], world, spec.get("manual", False), out, spec.get("zero_stage", 0))
        torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
