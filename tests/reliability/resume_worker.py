"""One rank of a resume test: ``python -m tests.reliability.resume_worker SPEC.json``.

Each case fits ``DropoutMLP`` with a checkpoint every ``every`` steps; optionally kills its own process
(``kill: [step, rank, "SIGKILL"|"SIGTERM"]``; under Lightning's own launcher rank 0 is the launcher) after
that step, or resumes with ``ckpt_path="last"``. A case may name a registered strategy with extra init
arguments (``strategy_kwargs``), ``sharded`` (``save_distributed=True``), ``model_kwargs``, the per-replica
``batch_size``, ``every: "epoch"`` (checkpoints in ``on_train_epoch_end``) or ``"validation"`` (in
``on_validation_end``), ``epochs`` (``max_epochs`` instead of ``max_steps``), ``val_batches``,
``save_at_batch`` (a ``trainer.save_checkpoint`` after that batch, its warnings recorded), ``full_state``
(the gathered single-device state at the end of training), ``save_last`` (``ModelCheckpoint``'s, default
True) and ``die_in_save`` (a point of ``save_faults``: the ``kill`` rank fails there, inside the ``kill``
step's save of ``last.ckpt``, instead of after the step).
Writes {global step: loss of its last micro-batch}, the trace of every batch [(global step after it, loss)],
and the final parameters (this rank's shard or stage).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

import lightning_parallel  # noqa: F401
from lightning_parallel.checkpointing.trust import FIT_TAKES_WEIGHTS_ONLY
from tests.reliability import save_faults
from tests.reliability.models import DropoutMLP, ShuffledData


class Recorder(Callback):
    def __init__(
        self,
        kill=None,
        out: Path | None = None,
        save_at_batch: int | None = None,
        full_state: bool = False,
        fault: str | None = None,
    ):
        self.fault = fault  # a point of tests.reliability.save_faults: the kill happens inside that save
        self.out = out
        self.save_at_batch = save_at_batch
        self.warned: list[str] = []
        self.full_state = {} if full_state else None
        self.losses: dict[int, float] = {}
        self.trace: list[tuple[int, float]] = []
        self.kill = kill  # [global step (or batch count, with a 4th item "batch"), rank, signal name]
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])
        self.trace.append((trainer.global_step, float(outputs["loss"])))
        self.batches += 1
        if self.batches == self.save_at_batch:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.save_checkpoint(self.out / "ckpt" / "at_batch.ckpt")
            self.warned = [str(w.message) for w in caught]
        when = self.batches if self.kill and self.kill[3:] == ["batch"] else trainer.global_step
        if self.kill and not self.fault and when == self.kill[0] and trainer.global_rank == self.kill[1]:
            # evidence for the test that the kill came from here, at this point
            (self.out / f"killed_rank{trainer.global_rank}.json").write_text(
                json.dumps({"global_step": trainer.global_step, "batches": self.batches})
            )
            os.kill(os.getpid(), getattr(signal, self.kill[2]))

    def on_train_start(self, trainer, pl_module):
        if self.fault:
            save_faults.install(trainer, self.kill[0], self.kill[1], self.fault, self.out)

    def on_train_end(self, trainer, pl_module):
        if self.full_state is not None:  # every rank takes part (the gather is a collective)
            self.full_state = {k: v.detach().clone() for k, v in trainer.strategy.full_model_state().items()}


def run_case(case: dict, out: Path, world_size: int) -> None:
    seed_everything(0, workers=True)
    recorder = Recorder(
        case.get("kill"),
        out,
        case.get("save_at_batch"),
        case.get("full_state", False),
        case.get("die_in_save"),
    )
    every = {
        "epoch": {"every_n_epochs": 1},
        "validation": {"every_n_epochs": 1, "save_on_train_epoch_end": False},
    }.get(case["every"], {"every_n_train_steps": case["every"]})
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", save_last=case.get("save_last", True), save_top_k=-1, **every
    )
    strategy = case["strategy"]
    kwargs = {
        **case.get("strategy_kwargs", {}),
        **({"save_distributed": True} if case.get("sharded") else {}),
    }
    if kwargs:
        entry = StrategyRegistry[strategy]  # the registered name's class and fixed arguments, plus the case's
        strategy = entry["strategy"](**{**entry["init_params"], **kwargs})
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        precision="64-true",
        max_steps=case["steps"] if "epochs" not in case else -1,
        max_epochs=case.get("epochs"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, checkpoint],
        limit_val_batches=case.get("val_batches", 0),
        accumulate_grad_batches=case.get("accumulate", 1),
        default_root_dir=out,
    )
    model = DropoutMLP(**case.get("model_kwargs", {}))
    data = ShuffledData(batch_size=case.get("batch_size", 4))
    # a resume trusts nothing but tensors and plain types where Lightning can say so (>= 2.6): every
    # checkpoint the package writes must load that way, as Lightning's own single file of this module does
    untrusted = {"weights_only": True} if case.get("resume") and FIT_TAKES_WEIGHTS_ONLY else {}
    trainer.fit(model, datamodule=data, ckpt_path="last" if case.get("resume") else None, **untrusted)
    torch.save(
        {
            "losses": recorder.losses,
            "trace": recorder.trace,
            "state_dict": model.state_dict(),
            "global_step": trainer.global_step,
            "interrupted": trainer.interrupted,
            "warned": recorder.warned,
            "full_state": recorder.full_state,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    # WORLD_SIZE is set by an external launcher (Lightning may unset it later); without it Lightning's
    # own launcher starts the other ranks from this process, which is then rank 0 and the launcher
    world_size = int(os.environ.get("WORLD_SIZE", spec.get("devices", 2)))
    for case in spec["cases"]:
        out = Path(case["dir"])
        out.mkdir(parents=True, exist_ok=True)
        run_case(case, out, world_size)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
