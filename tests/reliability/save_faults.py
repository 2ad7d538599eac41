"""Deterministic faults inside one save of ``last.ckpt``, installed by a rank of a resume test.

``install(trainer, step, rank, point, out)`` arms one fault on ``rank`` for the save of ``last.ckpt`` at
global step ``step``; every other save runs untouched. The points, in the order a save reaches them:

- ``file_write``: a file checkpoint (or a sharded directory's ``meta.pt``) half written, then SIGKILL;
- ``file_disk_full``: the same half write, then ENOSPC (an ``OSError``, not a kill);
- ``shard_written``: this rank has written its shard file (DCP's ``write_data``), then SIGKILL;
- ``disk_full``: this rank's shard write fails with ENOSPC (an ``OSError``, not a kill);
- ``renamed_aside``: the previous ``last.ckpt`` renamed to ``.last.ckpt.old-*``, then SIGKILL (between
  the two renames of a sharded save);
- ``renamed``: the new directory renamed to ``last.ckpt``, the old one not yet removed, then SIGKILL.

A rank that kills itself first writes ``killed_rank<r>.json`` into ``out`` (the test's evidence).
"""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter

from lightning_parallel.checkpointing import atomic

__all__ = ["install", "POINTS"]

POINTS = ("file_write", "file_disk_full", "shard_written", "disk_full", "renamed_aside", "renamed")


class _Torch:
    """``torch`` as ``checkpointing/atomic.py`` sees it, with ``save`` replaced."""

    def __init__(self, save: Any) -> None:
        self.save = save

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def install(trainer: Any, step: int, rank: int, point: str, out: Path) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; one of {POINTS}")
    if trainer.global_rank != rank:
        return
    strategy, saving = trainer.strategy, {"path": None}
    save_checkpoint = strategy.save_checkpoint

    def recording_save(checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        saving["path"] = Path(filepath)
        try:
            save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        finally:
            saving["path"] = None

    strategy.save_checkpoint = recording_save

    def armed() -> bool:
        path = saving["path"]
        return path is not None and path.name == "last.ckpt" and trainer.global_step == step

    def die() -> None:
        (out / f"killed_rank{rank}.json").write_text(json.dumps({"global_step": step, "point": point}))
        os.kill(os.getpid(), signal.SIGKILL)

    if point in ("file_write", "file_disk_full"):
        real_save = torch.save

        def half_written(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not armed():
                return real_save(obj, f, *args, **kwargs)
            buf = io.BytesIO()
            real_save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            if point == "file_disk_full":
                raise OSError(28, "No space left on device (injected)")
            die()

        atomic.torch = _Torch(half_written)  # the process ends with this run
    elif point in ("shard_written", "disk_full"):
        write_data = FileSystemWriter.write_data

        def write(self: Any, *args: Any, **kwargs: Any) -> Any:
            if armed() and point == "disk_full":
                raise OSError(28, "No space left on device (injected)")
            future = write_data(self, *args, **kwargs)
            if armed():
                future.wait()
                die()
            return future

        FileSystemWriter.write_data = write
    else:
        replace = os.replace

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            replace(src, dst, *args, **kwargs)
            if not armed():
                return
            if point == "renamed_aside" and ".last.ckpt.old-" in Path(dst).name:
                die()
            if point == "renamed" and Path(dst).name == "last.ckpt" and ".tmp-" in Path(src).name:
                die()

        os.replace = rename
