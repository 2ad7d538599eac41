"""SIGTERM (what SLURM and Kubernetes send before preempting a job) becomes a resumable checkpoint.

Lightning's own SIGTERM handler runs a ``broadcast`` inside the signal handler, i.e. in the middle of
whatever collective the rank was in, and only honours rank 0's signal. Here the handler only sets a
flag. At the end of each optimizer step the ranks vote (one tiny all-gather: did any rank get the
signal?) and read the vote one step later; if it says so, all of them save a checkpoint where
``fit(ckpt_path="last")`` finds it (the ``ModelCheckpoint`` folder's ``last.ckpt``; without one,
``default_root_dir/hpc_ckpt_N.ckpt`` for ``ckpt_path="hpc"``) and stop training cleanly.

Why a step late: a vote read at once would make every rank wait there for the slowest, at every step.
Lockstep strategies hardly notice, but the asynchronous pipeline would be flushed in all but name (stage 0
could not start the next batch until the last stage had finished this one). Reading the vote a step later
costs one step of the grace period a scheduler gives before its SIGKILL (usually tens of seconds).

Neither the vote nor the save may wait on a group that is stuck: a rank blocked in a collective runs no
Python handler at all. The failure watchdog (``distributed/watchdog.py``) also receives the signal; if
the rank is then blocked in a collective for a few seconds while no peer computes (the vote, the save's
own collectives or the user's), it ends the rank at once, saying that no checkpoint was written.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.checkpointing.loop_state import mark_step_saved
from lightning_parallel.distributed.collectives import start_gather_numbers

__all__ = ["PreemptionCheckpoint", "start_vote"]


def start_vote(flag: bool) -> Callable[[], bool]:
    """Start asking every rank whether ``flag`` is set on any of them; call the result to wait for the
    answer. Every rank must start the same votes in the same order (they pair up like collectives)."""
    flags = start_gather_numbers(float(flag))
    return lambda: any(flags())


class PreemptionCheckpoint(Callback):
    """Added by every lightning_parallel strategy; saves and stops at the optimizer step after the one a
    SIGTERM arrived in (see the module docstring for why a step late)."""

    def __init__(self) -> None:
        self.requested = False
        self.saved_path: str | None = None
        self._previous: Any = None
        self._vote: Callable[[], bool] | None = None  # started at the last optimizer step, read at this one

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._vote = None  # a fit that ended in an exception may have left one, on a group now gone
        # replaces Lightning's handler for this fit; Lightning restores the original ones at teardown
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._vote is not None:  # training is over: nothing left to resume, but the vote must finish
            self._vote()
            self._vote = None
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if getattr(epoch_loop, "_should_accumulate", lambda: False)():
            return  # mid-accumulation the gradients are not in the checkpoint: wait for the optimizer step
        vote, self._vote = self._vote, None
        if vote is None or not vote():
            self._vote = start_vote(self.requested)
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        mark_step_saved(trainer, trainer.global_step, path)  # or ModelCheckpoint saves another 'last'
        self.saved_path = path
        trainer.should_stop = True
        rank_zero_info(
            f"SIGTERM received: saved {path} at step {trainer.global_step}; stopping. "
            "Resume with fit(..., ckpt_path='last')."
        )

    @staticmethod
    def checkpoint_path(trainer: Any) -> str:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
                return os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

        return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)
