"""One rank that reports what a process derives from its environment: ``python -m tests.helpers.rank_state_probe OUT``.

Written to ``OUT/rank<RANK>.json`` before anything but the imports has run: the rank ``rank_zero_only`` holds,
a draw from each global random generator, the hash of a string, the thread count, torch's distributed debug
level and the backend it wraps the default process group in, the temporary directory, the environment after
the imports and the parent process. ``tests/test_fork_server.py`` compares forked ranks with fresh interpreters.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torchmetrics.utilities.prints import rank_zero_only as metrics_rank_zero_only

__all__ = ["observe", "PER_RUN"]

PER_RUN = ("MASTER_PORT",)  # the one variable that differs between two runs of the same ranks


def observe() -> dict:
    """This process's observables (read before any collective: the rank guards first)."""
    seen = {
        "rank_zero_only": rank_zero_only.rank,
        "torchmetrics_rank_zero_only": metrics_rank_zero_only.rank,
        "numpy": numpy.random.random(),
        "random": random.random(),
        "torch_seed": torch.initial_seed(),
        "torch": torch.rand(1).item(),
        "hash": hash("lightning_parallel"),
        "hash_randomization": sys.flags.hash_randomization,
        "threads": torch.get_num_threads(),
        "debug_level": str(dist.get_debug_level()),
        "tempdir": tempfile.gettempdir(),
        "parent": os.getppid(),
        "environ": {k: v for k, v in os.environ.items() if k not in PER_RUN},
    }
    dist.init_process_group("gloo")
    seen["backend"] = type(
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    ).__name__
    dist.destroy_process_group()
    return seen


if __name__ == "__main__":
    seen = observe()
    Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
