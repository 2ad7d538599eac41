"""Checkpoints and exact resume, for every strategy and both storage formats.

- ``checkpointer.py``  what happens on save and on load, in order: the strategy hooks (one save path, one
                       load path; files and sharded directories are storage below them)
- ``contract.py``      what a strategy states: its full state, how it loads one, the shards it owns
                       (``ShardLayout``), optimizer state included, and extra resume state
- ``atomic.py``        files written to a temporary name, fsynced and renamed (``AtomicCheckpointIO``)
- ``sharded.py``       DCP directories, one shard per rank, loaded in any layout; ``consolidate``
- ``trust.py``         every read with the caller's ``weights_only`` (files, DCP's index and stored objects)
- ``resume_state.py``  the resumable sampler, every rank's RNG, what a loaded checkpoint still has to restore
- ``loop_state.py``    repairs of Lightning's loop state on load (epoch-end saves, the resumed step)
- ``preemption.py``    SIGTERM -> a resumable ``last.ckpt`` and a clean stop
- ``loss_check.py``    a NaN/inf training loss stops the run before the optimizer step
"""

from lightning_parallel.checkpointing.atomic import AtomicCheckpointIO, atomic_torch_save
from lightning_parallel.checkpointing.checkpointer import Checkpointer
from lightning_parallel.checkpointing.contract import CheckpointContract, ShardLayout
from lightning_parallel.checkpointing.loss_check import NonFiniteLossError, check_finite_loss, training_loss
from lightning_parallel.checkpointing.preemption import PreemptionCheckpoint
from lightning_parallel.checkpointing.resume_state import RESUME_KEY, ResumableBatchSampler
from lightning_parallel.checkpointing.sharded import META_FILE, consolidate, is_sharded_checkpoint

__all__ = [
    "META_FILE",
    "RESUME_KEY",
    "AtomicCheckpointIO",
    "CheckpointContract",
    "Checkpointer",
    "NonFiniteLossError",
    "PreemptionCheckpoint",
    "ResumableBatchSampler",
    "ShardLayout",
    "atomic_torch_save",
    "check_finite_loss",
    "consolidate",
    "is_sharded_checkpoint",
    "training_loss",
]
