"""Lightning callbacks of ``lp-train``: what a run reports while it trains and in ``summary.json``.

``RunRecorder`` reads the world size from ``torch.distributed`` *inside* training (not from the
config), so a sweep can prove each job got the processes it asked for. Throughput excludes the first
step (process warm-up) and validation time, and counts samples of distinct data-parallel replicas only
(tensor- or pipeline-parallel peers share a batch). The memory report's tables (every rank, after set-up
and at the end of fit) land under ``memory``, and the largest rank's figures as ``memory_*_mib``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_parallel.checkpointing import PreemptionCheckpoint
from lightning_parallel.cli.json_file import write_json
from lightning_parallel.memory import headline, report_of

__all__ = [
    "RunRecorder",
    "ProgressPrinter",
    "SamplesProgressBar",
    "batch_size_of",
    "memory_summary",
    "pick_metric",
    "preemption_checkpoint",
]

log = logging.getLogger("lp-train")

TRAIN_LOSS_KEYS = ("train_loss", "train/loss", "loss", "train_loss_step", "train_loss_epoch")
VAL_LOSS_KEYS = ("val_loss", "val/loss", "valid_loss", "validation_loss", "val_loss_epoch")


def batch_size_of(batch: Any) -> int:
    """Samples in a batch of any usual shape (tensor, tuple/list, dict), the first tensor's length."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    return 0


def pick_metric(metrics: dict[str, Any], preferred: tuple[str, ...], word: str) -> Optional[float]:
    """The loss a user module logged: a usual name first, else any key with ``word`` and "loss" in it."""
    keys = [k for k in preferred if k in metrics]
    keys += sorted(
        k
        for k in metrics
        if word in k.lower()
        and k not in keys
        and any(w in k.lower() for w in ("loss", "mse", "mae", "nll", "error"))
    )
    for key in keys:
        value = metrics[key]
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            return value
    return None


class RunRecorder(Callback):
    """Collects world size, losses and samples/s; ``results()`` is the body of ``summary.json``."""

    def __init__(self, results_file: Optional[Path] = None) -> None:
        # rank 0 also writes its results here: with start_method="spawn" training runs in other processes
        self.results_file = results_file
        self.world_size: Optional[int] = None
        self.dp_size: Optional[int] = None
        self.backend: Optional[str] = None
        self.local_samples = 0
        self.train_time = 0.0
        self._t0: Optional[float] = None
        self._batches = 0
        self.batch_seconds: list[float] = []  # each training batch's time after the first, validation excluded
        self.val_history: list[dict[str, float]] = []
        self.train_history: list[dict[str, float]] = []

    # ------------------------------------------------------------------ timing
    def _pause(self) -> None:
        if self._t0 is not None:
            self.train_time += time.perf_counter() - self._t0
            self._t0 = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size()
            self.backend = str(dist.get_backend())
        else:
            self.world_size = 1
        sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.dp_size = int(sampler.get("num_replicas", self.world_size))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches > 1:  # the first batch (warm-up) is not timed
            self.local_samples += batch_size_of(batch)
            if self._t0 is not None:
                self.batch_seconds.append(time.perf_counter() - self._t0)
        self._pause()
        self._t0 = time.perf_counter()
        if trainer.is_global_zero:
            loss = pick_metric(trainer.callback_metrics, TRAIN_LOSS_KEYS, "train")
            if loss is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
                self.train_history.append(
                    {
                        "step": trainer.global_step,
                        "train_loss": loss,
                        "samples_per_second": self.samples_per_second,
                    }
                )

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self._batches:  # validation inside fit: training time resumes now
            self._t0 = time.perf_counter()
        loss = pick_metric(trainer.callback_metrics, VAL_LOSS_KEYS, "val")
        if loss is not None:
            self.val_history.append({"step": trainer.global_step, "val_loss": loss})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()
        if self.results_file is not None and trainer.is_global_zero:
            write_json(self.results_file, self.results(trainer), indent=None)

    def load_results(self) -> Optional[dict[str, Any]]:
        """What rank 0 wrote at the end of training, if this process did not train itself (spawn)."""
        if self.world_size is None and self.results_file is not None and self.results_file.is_file():
            return json.loads(self.results_file.read_text())
        return None

    # ------------------------------------------------------------------ results
    @property
    def samples_per_second(self) -> Optional[float]:
        if self.train_time <= 0 or not self.local_samples:
            return None
        return self.local_samples * (self.dp_size or 1) / self.train_time

    def median_step_seconds(self, accumulate: int = 1) -> Optional[float]:
        """The median batch's seconds after the first (validation excluded) times the batches of a step."""
        return round(statistics.median(self.batch_seconds) * accumulate, 5) if self.batch_seconds else None

    def results(self, trainer: Trainer) -> dict[str, Any]:
        metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        }
        preempted = preemption_checkpoint(trainer)
        checkpoint = preempted
        if checkpoint is None and trainer.checkpoint_callback is not None:
            checkpoint = (
                trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
            )
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.dp_size,
            "backend": self.backend,
            "global_step": trainer.global_step,
            "train_loss": pick_metric(metrics, TRAIN_LOSS_KEYS, "train"),
            "val_loss": pick_metric(metrics, VAL_LOSS_KEYS, "val"),
            "samples_per_second": self.samples_per_second,
            "train_seconds": round(self.train_time, 3),
            "seconds_per_step": round(self.train_time / trainer.global_step, 4)
            if trainer.global_step
            else None,
            "median_step_seconds": self.median_step_seconds(trainer.accumulate_grad_batches),
            "checkpoint": checkpoint or None,
            "preempted_at": preempted,
            "metrics": metrics,
            "val_history": self.val_history,
            "train_history": self.train_history,
            **memory_summary(trainer),
        }


def preemption_checkpoint(trainer: Trainer) -> Optional[str]:
    """Where this fit saved before stopping because of a SIGTERM (a scheduler's preemption), or None."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint) and callback.saved_path:
            return str(callback.saved_path)
    return None


def memory_summary(trainer: Trainer) -> dict[str, Any]:
    """The memory report's tables (bytes per rank) and the largest rank's figures of the last table (MiB)."""
    report = report_of(trainer)
    if report is None or not report.tables:
        return {"memory": None}
    last = report.tables.get("end_of_fit") or report.tables["after_setup"]
    return {"memory": report.summary(), **headline(last)}


class SamplesProgressBar(TQDMProgressBar):
    """Lightning's progress bar with the training loss and samples/s: ``lp-train``'s progress on a terminal."""

    def __init__(self, recorder: RunRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if not any("loss" in str(key) for key in items):  # the module logged no loss to the bar
            loss = pick_metric(trainer.callback_metrics, TRAIN_LOSS_KEYS, "train")
            if loss is not None:
                items["loss"] = f"{loss:.4g}"
        if self.recorder.samples_per_second is not None:
            items["samples/s"] = f"{self.recorder.samples_per_second:.0f}"
        return items


class ProgressPrinter(Callback):
    """One line every ``every_n_steps`` steps and one per validation, on rank 0, through ``logging``:
    ``lp-train``'s progress where the output is not a terminal (Hydra's log files, CI)."""

    def __init__(self, recorder: RunRecorder, every_n_steps: int = 25) -> None:
        self.recorder = recorder
        self.every_n_steps = max(int(every_n_steps), 1)
        self._start = time.perf_counter()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        if trainer.is_global_zero:
            log.info(
                "training: world size %s (torch.distributed), %s data-parallel replica(s), max_steps=%s",
                self.recorder.world_size,
                self.recorder.dp_size,
                trainer.max_steps,
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every_n_steps:
            return
        loss = pick_metric(trainer.callback_metrics, TRAIN_LOSS_KEYS, "train")
        sps = self.recorder.samples_per_second
        log.info(
            "step %d/%s | train_loss %s | %s samples/s | %.1f s",
            step,
            trainer.max_steps,
            "n/a" if loss is None else f"{loss:.4f}",
            "n/a" if sps is None else f"{sps:.0f}",
            time.perf_counter() - self._start,
        )

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        loss = pick_metric(trainer.callback_metrics, VAL_LOSS_KEYS, "val")
        log.info(
            "validation at step %d | val_loss %s",
            trainer.global_step,
            "n/a" if loss is None else f"{loss:.4f}",
        )
