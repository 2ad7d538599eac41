"""Exact resume: the data position and the random state go into the checkpoint, and come back out.

Lightning restores the model, optimizers, schedulers and its loop counters, but not where the data
was: after a mid-epoch resume a plain ``DataLoader`` starts the epoch's data again, and after an
epoch-end checkpoint the sampler's epoch (hence the shuffle order) can be off by one (see
shared/LIGHTNING_NOTES.md). So the training dataloader gets a ``ResumableBatchSampler``, which keeps
its own epoch and the number of batches the trainer has consumed, independent of the loop counters.
Both are saved in the checkpoint under ``"lightning_parallel"`` together with every rank's RNG states,
and restored before the first resumed batch. Two slips of Lightning's own loop bookkeeping are repaired
on load (``loop_state``: checkpoints saved in ``on_train_epoch_end``, and the resumed step saved again
mid-accumulation). The mixin also adds ``preemption.PreemptionCheckpoint``
(SIGTERM -> checkpoint -> clean stop).

``ExactResumeMixin`` carries the strategy hooks; ``ParallelStrategyBase`` inherits it, so every
strategy gets exact resume for an unmodified LightningModule and DataModule. A strategy with more
state to resume (e.g. pipeline weight versions) extends ``resume_state_dict``/``load_resume_state_dict``.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Optional

import numpy as np
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_parallel.loop_state import mark_step_saved, normalize_epoch_end

__all__ = ["ResumableBatchSampler", "ExactResumeMixin", "CHECKPOINT_KEY"]

CHECKPOINT_KEY = "lightning_parallel"


class ResumableBatchSampler:
    """Wraps a batch sampler; counts epochs itself and can start an epoch part-way through.

    The epoch is the wrapper's own: the first pass is epoch 0, each later pass the next one, and a
    resumed pass the saved one. It is pushed into the inner sampler (``DistributedSampler.set_epoch``)
    when a pass starts, which overrides whatever the loop set. ``consumed`` is advanced by the strategy
    when the trainer starts a batch, not when the loader yields one: the loader is read ahead.
    """

    def __init__(self, batch_sampler: Any, sampler: Any = None) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = sampler if sampler is not None else getattr(batch_sampler, "sampler", None)
        self.epoch = 0
        self.consumed = 0
        self._next_epoch = 0
        self._pending: Optional[tuple[int, int]] = None
        self._pass_start: Optional[int] = None
        self.iterators = 0

    # BatchSampler look-alike (Lightning and DataLoader read these)
    @property
    def batch_size(self) -> Optional[int]:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return getattr(self.batch_sampler, "drop_last", False)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        # Called once per DataLoader iterator, which draws its seed from the global RNG when it is
        # created: counted, so exact resume knows whether a draw happened before or after its restore.
        self.iterators += 1
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        # A generator: nothing below runs until the first batch is requested, so merely creating a
        # DataLoader iterator (Lightning does so to check loaders) does not count as an epoch.
        if self._pending is not None:
            epoch, skip = self._pending
        elif self._pass_start is not None and self.consumed == self._pass_start:
            # the previous pass was abandoned before the trainer took a batch (Lightning does this
            # when it resumes from an epoch-end checkpoint): it does not count as an epoch
            epoch, skip = self.epoch, self.consumed
        else:
            epoch, skip = self._next_epoch, 0
        self._pending = None
        self.epoch, self.consumed, self._next_epoch, self._pass_start = epoch, skip, epoch + 1, skip
        if self.sampler is not None and callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)
        it = iter(self.batch_sampler)
        for _ in range(skip):
            if next(it, None) is None:
                return
        yield from it

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.consumed, "length": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if position >= len(self):  # saved at the end of an epoch: the next pass is the next epoch
            epoch, position = epoch + 1, 0
        self._pending = (epoch, position)
        self._next_epoch = epoch


def install_resumable_sampler(dataloader: Any) -> Any:
    """Put a ``ResumableBatchSampler`` into a map-style ``DataLoader`` (in place); others pass through."""
    if not isinstance(dataloader, DataLoader) or dataloader.batch_sampler is None:
        return dataloader
    if isinstance(dataloader.batch_sampler, ResumableBatchSampler):
        return dataloader
    wrapper = ResumableBatchSampler(dataloader.batch_sampler, dataloader.sampler)
    # DataLoader forbids re-assigning batch_sampler after construction; the wrapper is transparent
    # (same batches, same length), so bypass the guard instead of re-creating a user's loader.
    object.__setattr__(dataloader, "batch_sampler", wrapper)
    return dataloader


def _rng_state() -> dict[str, Any]:
    """Only tensors, numbers and tuples: the checkpoint must stay loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_gather_objects(obj: Any) -> list[Any]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class ExactResumeMixin:
    """Strategy hooks for exact resume; mix in before Lightning's strategy class.

    Saves ``checkpoint["lightning_parallel"] = {"sampler": ..., "rng": [per global rank], ...}``.
    A checkpoint without the key (e.g. from Lightning's own strategies) loads as before.
    """

    def _resume_pending(self) -> dict[str, Any]:
        # the loaded resume state (a strategy's own keys included) plus bookkeeping under "_" keys
        if not hasattr(self, "_lp_resume_pending"):
            self._lp_resume_pending: dict[str, Any] = {}
        return self._lp_resume_pending

    def train_batch_sampler(self) -> Optional[ResumableBatchSampler]:
        """The fit loop's resumable sampler (one training loader only), or None."""
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        if combined is None or len(combined.flattened) != 1:
            return None
        sampler = getattr(combined.flattened[0], "batch_sampler", None)
        return sampler if isinstance(sampler, ResumableBatchSampler) else None

    def _train_loader(self) -> Optional[DataLoader]:
        sampler = self.train_batch_sampler()
        combined = self.lightning_module._trainer.fit_loop._combined_loader if sampler is not None else None
        return combined.flattened[0] if combined is not None else None

    # ------------------------------------------------------------- hooks a strategy may extend
    def resume_state_dict(self) -> dict[str, Any]:
        """Extra state for exact resume, gathered on every rank; rank 0's copy is written."""
        state: dict[str, Any] = {"rng": _all_gather_objects(_rng_state())}
        sampler = self.train_batch_sampler()
        if sampler is not None:
            state["sampler"] = sampler.state_dict()
        return state

    def load_resume_state_dict(self, state: dict[str, Any]) -> None:
        """Stash the state; it is applied when the data and the first batch arrive."""
        pending = self._resume_pending()
        pending.clear()
        pending.update(state)
        if "sampler" in state:
            pending["_saved_sampler"] = dict(state["sampler"])
        rngs = state.get("rng")
        if rngs is not None and len(rngs) != self.world_size:
            pending.pop("rng")  # another world size: random streams cannot continue exactly

    # ------------------------------------------------------------- Lightning strategy hooks
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        from lightning_parallel.preemption import PreemptionCheckpoint

        if not any(isinstance(cb, PreemptionCheckpoint) for cb in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            return dataloader
        dataloader = install_resumable_sampler(dataloader)
        return dataloader

    def _restore_rng(self) -> None:
        pending = self._resume_pending()
        rngs = pending.pop("rng", None)
        if rngs is None:
            return
        _set_rng_state(rngs[self.global_rank])
        sampler = self.train_batch_sampler()
        pending["_iterators_at_restore"] = sampler.iterators if sampler is not None else None

    def _replay_epoch_seed(self) -> None:
        """Saved at an epoch end, the original run then drew the next epoch's DataLoader seed from the
        global RNG (``_BaseDataLoaderIter.__init__``). If this run created the iterator of its first batch
        before the RNG was restored, that draw was overwritten: draw it again."""
        pending = self._resume_pending()
        created, saved = pending.pop("_iterators_at_restore", None), pending.pop("_saved_sampler", None)
        sampler, loader = self.train_batch_sampler(), self._train_loader()
        if created is None or not saved or sampler is None or loader is None or loader.generator is not None:
            return
        if saved["position"] >= saved["length"] and sampler.iterators == created:
            torch.empty((), dtype=torch.int64).random_()

    def on_train_start(self) -> None:
        # after the fit loop built its loader and iterator, before the first batch is fetched
        pending = self._resume_pending()
        state = pending.pop("sampler", None)
        sampler = self.train_batch_sampler()
        if state is not None and sampler is not None:
            sampler.load_state_dict(state)
        if not pending.pop("_rng_at_first_batch", False):
            # The RNG comes back where it was saved: before whatever Lightning's restart replays of what
            # followed the save (a validation due after the saved batch is fast-forwarded, which creates
            # the validation loader's iterator: one draw, as the original run's validation made).
            self._restore_rng()
        if "_resumed_step" in pending:
            mark_step_saved(self.lightning_module.trainer, pending.pop("_resumed_step"))
        super().on_train_start()  # type: ignore[misc]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        sampler = self.train_batch_sampler()
        if sampler is not None:
            sampler.consumed += 1
        # saved in on_train_epoch_end (see loop_state): the epoch's validation ran before the save, but the
        # restart fast-forwards it again (another draw), so the RNG comes back only now
        self._restore_rng()
        self._replay_epoch_seed()
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Lightning restores weights before the precision plugin converts the module, so a float64
        # checkpoint would be rounded into float32 parameters; convert first ("64-true": .double()).
        if self.lightning_module is not None and self.precision_plugin is not None:
            self.precision_plugin.convert_module(self.lightning_module)
        self.load_full_model_state(checkpoint["state_dict"], strict=strict)

    def load_full_model_state(self, state_dict: Any, strict: bool = True) -> None:
        """Load a full (single-device) state dict; model-parallel strategies take their part of it."""
        self.lightning_module.load_state_dict(state_dict, strict=strict)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        checkpoint[CHECKPOINT_KEY] = self.resume_state_dict()
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == "fit"
        if fitting and trainer.fit_loop.epoch_loop._should_accumulate():
            rank_zero_warn(f"{filepath}: saved between the micro-batches of an accumulated step (global "
                           f"step {trainer.global_step}); their gradients are not saved, so resuming from it "
                           "is not exact.")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self.load_resume_state_dict(checkpoint.get(CHECKPOINT_KEY, {}))
        # before Lightning restores its loops from it
        self._resume_pending()["_rng_at_first_batch"] = normalize_epoch_end(checkpoint)
        if "global_step" in checkpoint:
            self._resume_pending()["_resumed_step"] = int(checkpoint["global_step"])
        return checkpoint
