"""SIGTERM (what SLURM and Kubernetes send before preempting a job) becomes a resumable checkpoint.

Lightning's own SIGTERM handler runs a ``broadcast`` inside the signal handler, i.e. in the middle of
whatever collective the rank was in, and only honours rank 0's signal. Here the handler only sets a
flag; at the end of each training batch the ranks agree (one tiny all-reduce: any rank signalled)
and, if so, all of them save a checkpoint where ``fit(ckpt_path="last")`` finds it (the
``ModelCheckpoint`` folder's ``last.ckpt``; without one, ``default_root_dir/hpc_ckpt_N.ckpt`` for
``ckpt_path="hpc"``) and stop training cleanly.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["PreemptionCheckpoint"]


def _any_rank(flag: bool) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([int(flag)], device=device)  # NCCL reduces only device tensors
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


class PreemptionCheckpoint(Callback):
    """Added by every lightning_parallel strategy; saves and stops after the batch a SIGTERM arrived in."""

    def __init__(self) -> None:
        self.requested = False
        self.saved_path: Optional[str] = None
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # replaces Lightning's handler for this fit; Lightning restores the original ones at teardown
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if getattr(epoch_loop, "_should_accumulate", lambda: False)():
            return  # mid-accumulation the gradients are not in the checkpoint: wait for the optimizer step
        if not _any_rank(self.requested):
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path
        trainer.should_stop = True
        rank_zero_info(f"SIGTERM received: saved {path} at step {trainer.global_step}; stopping. "
                       "Resume with fit(..., ckpt_path='last').")

    @staticmethod
    def checkpoint_path(trainer: Any) -> str:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
                return os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

        return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)
