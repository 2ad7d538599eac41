"""A user's script whose ``validation_step`` calls ``self.all_gather`` on rank 0 only: the run gets stuck.

    python stuck_fit.py PID_DIR FAILURE_TIMEOUT

Started directly: Lightning's launcher (ours, popen) starts rank 1. Each rank writes its pid to
``PID_DIR/<rank>.pid``; rank 0 creates ``PID_DIR/stuck`` just before the one-sided call.
"""

import os
import sys

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_parallel import DDPStrategy
from tests.helpers.models import RegressionData
from tests.helpers.one_sided import STUCK_MARKER_ENV, OneSidedMLP


class WritePid(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer, pl_module):
        with open(os.path.join(self.folder, f"{trainer.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))


def main(folder: str, failure_timeout: float) -> None:
    torch.set_num_threads(1)
    os.environ[STUCK_MARKER_ENV] = os.path.join(folder, "stuck")
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(failure_timeout=failure_timeout),
        max_steps=8,
        val_check_interval=4,
        limit_val_batches=3,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[WritePid(folder)],
    )
    trainer.fit(OneSidedMLP(action="all_gather", rank=0), datamodule=RegressionData(batch_size=8))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
