"""What a checkpoint load trusts: the caller's ``weights_only``, honoured by every read of a checkpoint.

``Trainer.fit(ckpt_path=..., weights_only=True)`` (Lightning >= 2.6) says that the checkpoint may come from
someone else: nothing in it may run code. Every read below takes the caller's value:

- a torch file (a ``.ckpt``, a sharded directory's ``meta.pt``): ``torch.load`` with Lightning's value for
  a single file (``lightning_weights_only``);
- a sharded directory's ``.metadata``, which ``torch.distributed.checkpoint`` (DCP) writes with plain
  ``pickle``: under weights-only, unpickled with DCP's metadata classes, torch's sizes, dtypes and layouts
  and ``pathlib`` paths allowed, nothing else (``MetadataReader``);
- the objects DCP stores among the tensors (non-tensor optimizer state): ``torch.load`` with the same value
  (``ObjectPlanner``; DCP's own loader reads them with ``weights_only=False``).

A refused load raises ``pickle.UnpicklingError`` ("Weights only load failed") naming the file.
``weights_only=None`` means what it means to Lightning for one file at the installed versions: Lightning
>= 2.6 hands it to ``torch.load`` (torch's default, True from torch 2.6), Lightning < 2.6 loads with
``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import io
import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, load

from lightning_parallel.compat import torch_load_weights_only

__all__ = [
    "FIT_TAKES_WEIGHTS_ONLY",
    "METADATA_FILE",
    "MetadataReader",
    "ObjectPlanner",
    "lightning_weights_only",
    "load_dcp",
    "load_file",
    "naming",
    "read_with",
    "resolved",
]

METADATA_FILE = ".metadata"  # DCP's index of a directory: which file holds which slice of which tensor
#: Lightning >= 2.6: ``fit/validate/test(weights_only=...)``, passed on to ``torch.load``; older Lightning has
#: no such argument and loads a local file with ``weights_only=False`` (``cloud_io._load``'s default)
FIT_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(Trainer.fit).parameters


def lightning_weights_only(weights_only: Optional[bool]) -> Optional[bool]:
    """What Lightning hands ``torch.load`` for a single local file when the caller says ``weights_only``."""
    if weights_only is None and not FIT_TAKES_WEIGHTS_ONLY:
        return False
    return weights_only


def resolved(weights_only: Optional[bool]) -> bool:
    """True when a load of a single file with this ``weights_only`` refuses code: Lightning's value, then
    torch's default and environment."""
    return torch_load_weights_only(lightning_weights_only(weights_only))


@contextlib.contextmanager
def naming(path: Any) -> Iterator[None]:
    """A weights-only refusal raised inside says which file it refused."""
    try:
        yield
    except pickle.UnpicklingError as error:
        if str(path) in str(error):
            raise
        raise pickle.UnpicklingError(f"{path}: {error}") from error


def load_file(path: _PATH, weights_only: Optional[bool], map_location: Any = "cpu") -> Any:
    """A torch file (local or remote), read as Lightning reads a single-file checkpoint."""
    with naming(path):
        return lightning_load(
            path, map_location=map_location, weights_only=lightning_weights_only(weights_only)
        )


def read_with(checkpoint_io: Any, path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
    """``checkpoint_io.load_checkpoint`` with the caller's ``weights_only``; a ``CheckpointIO`` that takes no
    such argument (Lightning < 2.6) decides by itself, which only a ``weights_only=True`` cannot accept."""
    if "weights_only" in inspect.signature(checkpoint_io.load_checkpoint).parameters:
        with naming(path):
            return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    if weights_only:
        raise ValueError(
            f"weights_only=True for {path}, but {type(checkpoint_io).__name__}.load_checkpoint takes no "
            "weights_only argument (Lightning < 2.6); use a CheckpointIO that does, or lightning_parallel's "
            "default (AtomicCheckpointIO)."
        )
    return checkpoint_io.load_checkpoint(path)


# ---------------------------------------------------------------------------------------------- DCP
#: where the classes of DCP's index live (a ShardedTensor's properties are written as DCP's own)
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


def _allowed(module: str, name: str) -> Any:
    """The object a DCP ``.metadata`` may name, or None: DCP's metadata dataclasses and enums, torch's
    ``Size``, dtypes and layouts, ``pathlib`` paths and ``OrderedDict``. None of them runs code of the file's
    choosing when called or filled."""
    if module in _DCP_METADATA_MODULES:
        found = getattr(__import__(module, fromlist=[name]), name, None)
        is_class = isinstance(found, type)
        if is_class and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found
    if module == "torch":
        found = getattr(torch, name, None)
        if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
            return found
    if module == "torch.serialization" and name == "_get_layout":  # how torch pickles a layout, by name
        return _layout
    if module == "pathlib":
        found = getattr(pathlib, name, None)
        if isinstance(found, type) and issubclass(found, pathlib.PurePath):
            return found
    if (module, name) == ("collections", "OrderedDict"):
        from collections import OrderedDict

        return OrderedDict
    return None


def _layout(name: str) -> torch.layout:
    found = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(found, torch.layout):
        raise pickle.UnpicklingError(f"Weights only load failed: {name!r} is not a torch layout")
    return found


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"Weights only load failed: GLOBAL {module}.{name} is not a class of "
                "torch.distributed.checkpoint's metadata, so it is not loaded under weights_only=True. "
                "Load with weights_only=False only if the checkpoint comes from a trusted source."
            )
        return found


class MetadataReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is unpickled with ``_allowed`` names only when
    ``weights_only`` resolves to True (``resolved``)."""

    def __init__(self, path: _PATH, weights_only: Optional[bool]) -> None:
        super().__init__(str(path))
        self.weights_only = resolved(weights_only)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if not self.weights_only:
            return super().read_metadata(*args, **kwargs)
        if kwargs.get("rank") is not None:  # a rank's own metadata: never written by this package
            raise FileNotFoundError(f"{self.path}: no rank-local metadata is read under weights_only=True")
        path = Path(self.path) / METADATA_FILE
        with open(path, "rb") as f, naming(path):
            metadata = _MetadataUnpickler(f).load()
        if hasattr(self, "load_id"):  # what FileSystemReader.read_metadata does after unpickling
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata


def load_dcp(dest: dict[str, Any], path: _PATH, weights_only: Optional[bool], **kwargs: Any) -> None:
    """DCP's load of the directory ``path`` into ``dest`` (flat), its index and stored objects read with the
    caller's ``weights_only``. A refusal on any rank is raised as itself (DCP gathers every rank's failure
    into a ``CheckpointException``, a ``BaseException`` that an ``except Exception`` would not see)."""
    reader, planner = MetadataReader(path, weights_only), ObjectPlanner(path, weights_only)
    try:
        load(dest, checkpoint_id=str(path), storage_reader=reader, planner=planner, **kwargs)
    except CheckpointException as error:
        refused = [exc for exc, _ in error.failures.values() if isinstance(exc, pickle.UnpicklingError)]
        if refused:
            raise refused[0] from error
        raise


class ObjectPlanner(DefaultLoadPlanner):
    """DCP's load planner whose stored objects are read with the caller's ``weights_only``. The state dict
    it loads into is flat (one level of names), as ``sharded.py`` builds it."""

    def __init__(self, path: _PATH, weights_only: Optional[bool]) -> None:
        super().__init__(flatten_state_dict=False)
        self.path = path
        self.weights_only = resolved(weights_only)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        with naming(f"{self.path} ({fqn})"):
            self.state_dict[fqn] = torch.load(value, weights_only=self.weights_only)
