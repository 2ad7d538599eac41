"""What happens when a checkpoint is saved and when it is loaded: one path each, for every storage format.

**Save** (Lightning's ``trainer.save_checkpoint`` asks, in this order):

1. ``lightning_module_state_dict``: ``prepare_checkpoint`` (a pipeline drains), then the model state: full
   (``full_model_state``, gathered) for a file, this rank's own tensors for a sharded directory;
2. ``optimizer_state``, per optimizer: likewise ``full_optimizer_state`` or ``local_optimizer_state``;
3. ``save_checkpoint``: a network held in the hyperparameters of a split model becomes its one-device
   copy (``one_device_copy``); a save between the micro-batches of an accumulated step warns (their gradients are
   in no checkpoint); the resume state (every rank's RNG, the sampler's epoch and position, the strategy's
   ``extra_resume_state``) goes under ``RESUME_KEY``; then the storage writes it: one file on rank 0
   (the ``CheckpointIO``, atomic by default) or one DCP shard per rank (``sharded.write_sharded``).

**Load** (``fit(ckpt_path=...)``):

0. ``recover_interrupted_saves`` (every process, from the launcher, before Lightning looks for
   ``ckpt_path="last"``): a checkpoint that a kill between a sharded save's two renames left under a hidden
   name is put back (``interrupted_saves``);
1. ``load_checkpoint``: the storage reads the checkpoint (a directory: ``meta.pt`` and DCP's index only,
   its tensors stay on disk), with the caller's ``weights_only`` (``trust.py``: a file that would run code
   is refused here, before set-up); Lightning's loop state of an ``on_train_epoch_end`` save is rewritten
   (``loop_state``); the resume state becomes a ``PendingResume``;
2. ``load_model_state_dict`` / ``load_optimizer_state_dict``: a file's full state through
   ``load_full_model_state`` / ``load_full_optimizer_state``; a directory's tensors are read at
   ``restore_after_setup``, once the module has this strategy's layout and the optimizers exist;
3. ``on_train_start``: the sampler's epoch and position; the RNG (or at the first batch, for an
   ``on_train_epoch_end`` save); the resumed step marked as saved for ``ModelCheckpoint``;
4. ``on_train_batch_start``: the sampler counts the batch; a pending RNG restore and the epoch's loader
   seed draw.

A strategy takes part through ``CheckpointContract`` only; its ``setup`` calls ``restore_after_setup``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_parallel.checkpointing.contract import CheckpointContract
from lightning_parallel.checkpointing.interrupted_saves import recover
from lightning_parallel.checkpointing.loop_state import mark_step_saved, normalize_epoch_end
from lightning_parallel.checkpointing.preemption import PreemptionCheckpoint
from lightning_parallel.checkpointing.resume_state import (
    RESUME_KEY,
    PendingResume,
    capture_resume_state,
    install_resumable_sampler,
    train_batch_sampler,
)
from lightning_parallel.checkpointing.sharded import (
    SHARDED_KEY,
    is_sharded_checkpoint,
    load_sharded,
    read_sharded_meta,
    write_sharded,
)
from lightning_parallel.checkpointing.trust import read_with

__all__ = ["Checkpointer"]


def _trainer(strategy: Any) -> Any:
    module = strategy.lightning_module
    return getattr(module, "_trainer", None) if module is not None else None


def _fitting(trainer: Any) -> bool:
    return trainer is not None and trainer.state.fn == "fit"


def _is_remote(path: _PATH) -> bool:
    return "://" in str(path)


class Checkpointer(CheckpointContract):
    """The Lightning strategy hooks of checkpoints and exact resume; mixed in before Lightning's strategy.

    ``save_distributed`` picks the storage of saves; loads follow what the path holds (a file or a
    directory), so every layout loads both.
    """

    save_distributed: bool = False

    def _pending(self) -> PendingResume:
        if not hasattr(self, "_pending_resume"):
            self._pending_resume = PendingResume()
        return self._pending_resume

    # ------------------------------------------------------------------ save
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.prepare_checkpoint()
        return self.local_model_state() if self.save_distributed else self.full_model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return (
            self.local_optimizer_state(optimizer)
            if self.save_distributed
            else self.full_optimizer_state(optimizer)
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        self._warn_if_accumulating(filepath)
        self._held_networks_as_on_one_device(checkpoint)
        checkpoint[RESUME_KEY] = {**capture_resume_state(_trainer(self)), **self.extra_resume_state()}
        if not self.save_distributed:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None or _is_remote(filepath):
            raise ValueError(
                f"save_distributed=True writes to a local or shared file system path; got {filepath!r} "
                f"with storage_options={storage_options!r}. Use a path, or save_distributed=False."
            )
        write_sharded(self, checkpoint, Path(self.broadcast(str(filepath))))

    def _held_networks_as_on_one_device(self, checkpoint: dict[str, Any]) -> None:
        """A network held in the hyperparameters (``save_hyperparameters()`` with a module argument) of a
        split model is saved as one device holds it, like the state dict (``one_device_copy``)."""
        hparams = checkpoint.get("hyper_parameters")
        if not isinstance(hparams, dict) or not self.is_global_zero or self.save_distributed:
            return
        if not self.model_is_split():
            return
        state = checkpoint["state_dict"]
        checkpoint["hyper_parameters"] = {
            k: self.one_device_copy(v, state) if isinstance(v, nn.Module) else v for k, v in hparams.items()
        }

    def _warn_if_accumulating(self, filepath: _PATH) -> None:
        trainer = _trainer(self)
        if _fitting(trainer) and trainer.fit_loop.epoch_loop._should_accumulate():
            rank_zero_warn(
                f"{filepath}: saved between the micro-batches of an accumulated step (global "
                f"step {trainer.global_step}); their gradients are not saved, so resuming from it "
                "is not exact."
            )

    # ------------------------------------------------------------------ load
    def recover_interrupted_saves(self, trainer: Any) -> None:
        """Put back, in the checkpoint folders of ``trainer``, what interrupted sharded saves hid, and remove
        their stale leftovers; in every process, before ``ckpt_path="last"`` is looked for."""
        folders = {Path(trainer.default_root_dir)}
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
                folder = callback.dirpath or (resolve(trainer) if resolve is not None else None)
                if folder is not None and not _is_remote(folder):
                    folders.add(Path(folder))
        for folder in sorted(folders):
            for message in recover(folder, is_sharded_checkpoint):  # by whichever process of the run did it
                warnings.warn(message, stacklevel=2)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = self._read(checkpoint_path, weights_only)
        epoch_end = normalize_epoch_end(checkpoint)  # before Lightning restores its loops from it
        step = int(checkpoint["global_step"]) if "global_step" in checkpoint else None
        state = checkpoint.get(RESUME_KEY, {})
        self._pending_resume = PendingResume.from_state(state, self.world_size, epoch_end, step)
        self.load_extra_resume_state(state)
        return checkpoint

    def _read(self, checkpoint_path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        """The checkpoint from a file, or a sharded directory's ``meta.pt`` (its tensors read after setup),
        every read with the caller's ``weights_only`` (``trust.py``)."""
        self._sharded_source = None
        path = None if _is_remote(checkpoint_path) else Path(self.broadcast(str(checkpoint_path)))
        if path is None or not path.is_dir():
            return read_with(self.checkpoint_io, checkpoint_path, weights_only)
        meta = read_sharded_meta(path, weights_only)
        self._sharded_source = (path, meta, True, weights_only)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning restores weights before the precision plugin converts the module, so a float64
        # checkpoint would be rounded into float32 parameters; convert first ("64-true": .double())
        if self.lightning_module is not None and self.precision_plugin is not None:
            self.precision_plugin.convert_module(self.lightning_module)
        if SHARDED_KEY in checkpoint:  # read at restore_after_setup, in this strategy's layout
            path, meta, _, weights_only = self._sharded_source
            self._sharded_source = (path, meta, strict, weights_only)
            return
        self.load_full_model_state(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if SHARDED_KEY not in checkpoint:  # a directory's: read with the weights at restore_after_setup
            self.load_full_optimizer_state(checkpoint)

    def restore_after_setup(self, trainer: Any) -> None:
        """The end of the strategy's ``setup``: the preemption callback, and a sharded checkpoint's tensors."""
        if _fitting(trainer) and not any(isinstance(cb, PreemptionCheckpoint) for cb in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())
        source, self._sharded_source = getattr(self, "_sharded_source", None), None
        if source is not None:
            load_sharded(self, *source)

    # ------------------------------------------------------------------ resume
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        return install_resumable_sampler(dataloader) if _fitting(_trainer(self)) else dataloader

    def on_train_start(self) -> None:
        # after the fit loop built its loader and iterator, before the first batch is fetched
        trainer, pending = self.lightning_module.trainer, self._pending()
        pending.load_sampler(trainer)
        if not pending.rng_at_first_batch:
            # the RNG comes back where it was saved: before what Lightning's restart replays of what followed
            # the save (a validation due after the saved batch creates the validation loader's iterator)
            pending.restore_rng(trainer, self.global_rank)
        if pending.resumed_step is not None:
            mark_step_saved(trainer, pending.resumed_step)
            pending.resumed_step = None
        super().on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer, pending = self.lightning_module.trainer, self._pending()
        sampler = train_batch_sampler(trainer)
        if sampler is not None:
            sampler.consumed += 1
        pending.restore_rng(trainer, self.global_rank)
        pending.replay_epoch_seed(trainer)
        super().on_train_batch_start(batch, batch_idx)
