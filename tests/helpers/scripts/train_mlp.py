"""A user's ordinary training script; only ``strategy=`` names lightning_parallel.

    python train_mlp.py STRATEGY DEVICES NUM_NODES OUT.pt

Started directly (Lightning's launcher makes the other ranks), or by torchrun / srun. With
``LP_TEST_CHILD_EXIT_BEFORE_RENDEZVOUS=<code>``, a rank started by our launcher exits with that code after
its "ready" mark, where it would join the process group (a failing device set-up), and writes when it
did into ``child_exit_time`` in its working folder. With ``LP_TEST_LAUNCHER_LATE_S=<seconds>`` beside it, the
launching process reaches the rendezvous that much later (a slow device set-up): the child's exit is then
seen before this process has connected to the store it hosts.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_parallel  # noqa: F401  (registers the lp_* names)
from tests.helpers.models import MLP, RegressionData


class RecordWorld(Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.world_seen = dist.get_world_size()


def exit_before_rendezvous(code: int) -> None:
    """Make this process, if it is a rank our launcher started, exit where it would join the process group."""
    from lightning_parallel.strategies import base
    from lightning_parallel.strategies.launcher import is_launched_rank

    def exit_now(*args, **kwargs) -> None:
        Path("child_exit_time").write_text(str(time.time()))
        os._exit(code)

    late = float(os.environ.get("LP_TEST_LAUNCHER_LATE_S", "0"))
    join = base._init_dist_connection

    def join_late(*args, **kwargs) -> None:
        time.sleep(late)
        join(*args, **kwargs)

    if is_launched_rank():
        base._init_dist_connection = exit_now
    elif late:
        base._init_dist_connection = join_late


def main(strategy: str, devices: int, num_nodes: int, out: str) -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    model = MLP()
    data = RegressionData(batch_size=16 // (devices * num_nodes))
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=5,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[RecordWorld()],
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        world = getattr(model, "world_seen", None)  # None in the spawn parent: training ran in children
        torch.save({"state_dict": model.state_dict(), "world_size": world}, out)


if __name__ == "__main__":
    if os.environ.get("LP_TEST_CHILD_EXIT_BEFORE_RENDEZVOUS"):
        exit_before_rendezvous(int(os.environ["LP_TEST_CHILD_EXIT_BEFORE_RENDEZVOUS"]))
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
