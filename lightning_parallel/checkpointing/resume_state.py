"""Exact resume: the data position and every rank's random state, saved and put back.

Lightning restores the model, optimizers, schedulers and its loop counters, but not where the data was: a
plain ``DataLoader`` starts a resumed epoch's data again, and after an epoch-end checkpoint the sampler's
epoch (hence the shuffle order) can be off by one. The training loader gets a ``ResumableBatchSampler``,
which keeps its own epoch and the number of batches the trainer has consumed. Both, and every rank's RNG
states, are saved under ``checkpoint[RESUME_KEY]``; ``PendingResume`` holds what was loaded until the data
and the first batch arrive, and puts it back then.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = [
    "RESUME_KEY",
    "PendingResume",
    "ResumableBatchSampler",
    "all_gather_objects",
    "capture_resume_state",
    "install_resumable_sampler",
    "train_batch_sampler",
]

RESUME_KEY = "lightning_parallel"


class ResumableBatchSampler:
    """Wraps a batch sampler; counts epochs itself and can start an epoch part-way through.

    The epoch is the wrapper's own: the first pass is epoch 0, each later pass the next one, and a
    resumed pass the saved one. It is pushed into the inner sampler (``DistributedSampler.set_epoch``)
    when a pass starts, which overrides whatever the loop set. ``consumed`` is advanced when the trainer
    starts a batch, not when the loader yields one: the loader is read ahead.
    """

    def __init__(self, batch_sampler: Any, sampler: Any = None) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = sampler if sampler is not None else getattr(batch_sampler, "sampler", None)
        self.epoch = 0
        self.consumed = 0
        self._next_epoch = 0
        self._pending: tuple[int, int] | None = None
        self._pass_start: int | None = None
        self.iterators = 0

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return getattr(self.batch_sampler, "drop_last", False)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        # once per DataLoader iterator, which draws its seed from the global RNG when it is created:
        # counted, so exact resume knows whether that draw happened before or after its restore
        self.iterators += 1
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        # a generator: nothing runs until the first batch is requested, so creating a DataLoader iterator
        # (Lightning does so to check loaders) does not count as an epoch
        if self._pending is not None:
            epoch, skip = self._pending
        elif self._pass_start is not None and self.consumed == self._pass_start:
            # the previous pass ended before the trainer took a batch (Lightning's restart from an
            # epoch-end checkpoint does this): it does not count as an epoch
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
    # (same batches, same length), so bypass the guard instead of re-creating a user's loader
    object.__setattr__(dataloader, "batch_sampler", wrapper)
    return dataloader


def _train_loader(trainer: Any) -> DataLoader | None:
    """The fit loop's one training loader, or None (none yet, or several)."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    if combined is None or len(combined.flattened) != 1:
        return None
    return combined.flattened[0]


def train_batch_sampler(trainer: Any) -> ResumableBatchSampler | None:
    """The fit loop's resumable sampler (one training loader only), or None."""
    sampler = getattr(_train_loader(trainer), "batch_sampler", None)
    return sampler if isinstance(sampler, ResumableBatchSampler) else None


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


def all_gather_objects(obj: Any) -> list[Any]:
    """``obj`` from every rank (``[obj]`` without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def capture_resume_state(trainer: Any) -> dict[str, Any]:
    """Every rank's RNG states and the training sampler's position; a collective (all ranks call it)."""
    state: dict[str, Any] = {"rng": all_gather_objects(_rng_state())}
    sampler = train_batch_sampler(trainer)
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    return state


@dataclass
class PendingResume:
    """What a loaded checkpoint still has to put back, and when.

    ``rng`` is one state per global rank (dropped when the world size changed: the random streams cannot
    continue exactly). ``rng_at_first_batch``: the checkpoint was saved in ``on_train_epoch_end``, whose
    restart replays the epoch's validation (another RNG draw), so the RNG comes back at the first batch
    instead of at ``on_train_start``. ``resumed_step``: the step the checkpoint holds, marked as saved.
    """

    sampler: dict[str, int] | None = None
    rng: list[Any] | None = None
    rng_at_first_batch: bool = False
    resumed_step: int | None = None
    saved_sampler: dict[str, int] | None = None
    iterators_at_restore: int | None = None

    @classmethod
    def from_state(
        cls, state: dict[str, Any], world_size: int, rng_at_first_batch: bool, resumed_step: int | None
    ) -> PendingResume:
        rng = state.get("rng")
        return cls(
            sampler=state.get("sampler"),
            rng=rng if rng is not None and len(rng) == world_size else None,
            rng_at_first_batch=rng_at_first_batch,
            resumed_step=resumed_step,
            saved_sampler=dict(state["sampler"]) if "sampler" in state else None,
        )

    def load_sampler(self, trainer: Any) -> None:
        """At ``on_train_start``: the saved epoch and position go into the fit loop's sampler."""
        sampler = train_batch_sampler(trainer)
        if self.sampler is not None and sampler is not None:
            sampler.load_state_dict(self.sampler)
        self.sampler = None

    def restore_rng(self, trainer: Any, global_rank: int) -> None:
        """This rank's saved RNG states, once."""
        if self.rng is None:
            return
        _set_rng_state(self.rng[global_rank])
        self.rng = None
        sampler = train_batch_sampler(trainer)
        self.iterators_at_restore = sampler.iterators if sampler is not None else None

    def replay_epoch_seed(self, trainer: Any) -> None:
        """Saved at an epoch's end, the original run then drew the next epoch's DataLoader seed from the
        global RNG (``_BaseDataLoaderIter.__init__``). If this run created the iterator of its first batch
        before the RNG came back, that draw was overwritten: draw it again."""
        created, saved = self.iterators_at_restore, self.saved_sampler
        self.iterators_at_restore = self.saved_sampler = None
        sampler, loader = train_batch_sampler(trainer), _train_loader(trainer)
        if created is None or not saved or sampler is None or loader is None or loader.generator is not None:
            return
        if saved["position"] >= saved["length"] and sampler.iterators == created:
            torch.empty((), dtype=torch.int64).random_()
