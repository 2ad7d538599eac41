"""Checkpoint files that are never half-written.

Lightning's ``TorchCheckpointIO`` serialises into memory and then writes straight over the target
path, so a process killed (or a disk that fills up) during the write leaves a truncated ``last.ckpt``
and the run cannot resume. ``AtomicCheckpointIO`` writes to a temporary file in the same folder,
flushes it to disk, and renames it over the target: a rename inside one file system is atomic, so the
target is always either the previous complete checkpoint or the new complete one. The file gets the
permissions a plain ``open()`` gives (0666 less the umask, as Lightning's own checkpoints), not
``tempfile``'s private 0600.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_parallel.checkpointing.interrupted_saves import hidden_path, new_token, sync_folder
from lightning_parallel.checkpointing.trust import lightning_weights_only, load_file, naming

__all__ = ["AtomicCheckpointIO", "atomic_torch_save"]


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """``torch.save`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_path(path, "tmp", new_token())  # a kill leaves it, and the next start removes it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as in open()
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    sync_folder(path.parent)  # make the rename itself durable


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with write-to-temporary-then-rename, and reads that map a local file instead of
    copying it into memory (a rank touches only the pages of the tensors it takes); remote URLs fall back."""

    def load_checkpoint(
        self, path: _PATH, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``weights_only`` as Lightning means it for a single file (``trust.lightning_weights_only``); a
        refusal names the file."""
        if "://" in str(path) or not Path(path).is_file():
            return load_file(path, weights_only, map_location=map_location)
        try:
            with naming(path):
                return torch.load(
                    path,
                    map_location=map_location,
                    weights_only=lightning_weights_only(weights_only),
                    mmap=True,
                )
        except RuntimeError as error:  # a legacy (non-zip) file cannot be mapped
            if "mmap" not in str(error):
                raise
            return load_file(path, weights_only, map_location=map_location)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_torch_save(checkpoint, path)
