"""The hidden names of a save, and what a start or the next save does with those a kill left.

A file checkpoint is written to ``.NAME.tmp-<token>`` and renamed over ``NAME`` (``atomic.py``). A
directory cannot be renamed over another, so rank 0 moves a finished sharded checkpoint into place in two
renames (``move_into_place``): the previous checkpoint ``NAME`` aside to ``.NAME.old-<token>``, then the
finished ``.NAME.tmp-<token>`` to ``NAME``; then the old one is removed. The ``<token>`` is
``<hex>-<pid>@<host>`` of the process that saves, so a hidden entry says who made it.

A kill leaves, by where it struck (P: the previous checkpoint, N: the new one):

- while the shards or ``meta.pt`` are written: ``NAME`` = P, and an unfinished ``.tmp`` (no ``meta.pt``);
- after ``meta.pt``, before the first rename: ``NAME`` = P, and a finished ``.tmp`` = N;
- between the renames: no ``NAME``; ``.old`` = P and a finished ``.tmp`` = N;
- after the second rename: ``NAME`` = N, and ``.old`` = P.

(A file's kill leaves ``NAME`` = P and the ``.tmp`` file, which is never put back.)

``recover`` runs in every process of a run before Lightning looks for ``ckpt_path="last"``, and on rank 0
before each sharded save of that name. Where ``NAME`` is missing it renames the newest finished ``.tmp``
to ``NAME``, else the ``.old`` back (both are complete checkpoints); the processes of one run may race
there, and the loser of a rename finds the work done. Then it removes the hidden entries that are
stale: made on this host by a process that no longer runs (or by this process, which saves nothing
while it recovers). An entry made on another host, or without an owner in its name, may belong to a
live save of another run and is left in place. Two runs writing checkpoints into one folder at the same
time are not supported (they overwrite each other's checkpoints anyway).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

__all__ = ["InterruptedSaveError", "hidden_path", "move_into_place", "new_token", "recover", "sync_folder"]

# ours: <12 hex>-<pid>@<host>; without an owner, as older versions named them: 12 hex (tmp), 8 hex (old)
_ENTRY = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:[0-9a-f]{12}-(?P<pid>\d+)@(?P<host>.+)|[0-9a-f]{12}|[0-9a-f]{8})$"
)


class InterruptedSaveError(RuntimeError):
    """A checkpoint lost by an interrupted save could not be put back; the message says what to do."""


@dataclass
class _Entry:
    path: Path
    name: str
    kind: str  # "tmp" or "old"
    pid: Optional[int]
    host: Optional[str]


def new_token() -> str:
    """A save's token: unique, and naming the process that saves (``<hex>-<pid>@<host>``)."""
    return f"{uuid.uuid4().hex[:12]}-{os.getpid()}@{socket.gethostname()}"


def hidden_path(path: Path, kind: str, token: str) -> Path:
    """``.NAME.tmp-<token>`` (the save being written) or ``.NAME.old-<token>`` (the checkpoint it replaces)."""
    return path.parent / f".{path.name}.{kind}-{token}"


def _remove(path: Path) -> None:
    """A file, a link (never what it points to) or a directory; gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sync_folder(folder: Path) -> None:
    """Write the folder's entries (the renames in it) to disk, where the file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def move_into_place(tmp: Path, path: Path, token: str) -> None:
    """Rename the finished directory ``tmp`` over ``path`` (a previous checkpoint file, directory or link)."""
    old = None
    if path.exists() or path.is_symlink():
        old = hidden_path(path, "old", token)
        os.replace(path, old)
    os.replace(tmp, path)
    sync_folder(path.parent)
    if old is not None:
        _remove(old)


def _entries(folder: Path, only: Optional[str]) -> dict[str, list[_Entry]]:
    found: dict[str, list[_Entry]] = {}
    try:
        children = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return found
    for child in children:
        match = _ENTRY.match(child.name)
        if match is None or (only is not None and match["name"] != only):
            continue
        pid = int(match["pid"]) if match["pid"] else None
        found.setdefault(match["name"], []).append(
            _Entry(child, match["name"], match["kind"], pid, match["host"])
        )
    return found


def _stale(entry: _Entry) -> bool:
    """Its owner is known to be gone: a process of this host that no longer runs, or this very process."""
    if entry.pid is None or entry.host != socket.gethostname():
        return False
    if entry.pid == os.getpid():
        return True
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _restore(target: Path, entries: list[_Entry], finished: Callable[[Path], bool]) -> Optional[str]:
    """Put the newest complete hidden checkpoint back at ``target``; says what it did."""
    done = [e for e in entries if e.kind == "tmp" and finished(e.path)]
    candidates = done or [e for e in entries if e.kind == "old"]
    if not candidates:
        return None
    source = max(candidates, key=lambda e: _mtime(e.path))  # a directory's: when its last file came
    try:
        os.replace(source.path, target)
    except OSError as err:
        if isinstance(err, FileNotFoundError) or target.exists() or target.is_symlink():
            return (
                None  # another process of this run put one back first (the .tmp, while this one saw the .old)
            )
        raise InterruptedSaveError(
            f"{target} is missing: a save was interrupted between its two renames, and the complete "
            f"checkpoint {source.path} could not be renamed back ({err}). Rename it to {target.name} by "
            "hand to resume from it, or remove it to start from scratch."
        ) from err
    entries.remove(source)
    which = "the save that was interrupted" if source.kind == "tmp" else "the checkpoint it was replacing"
    return f"{target}: put back from {source.path.name} ({which}; a save was killed between its renames)"


def recover(folder: Path, finished: Callable[[Path], bool], only: Optional[str] = None) -> list[str]:
    """Undo what interrupted saves left in ``folder`` (of the checkpoint ``only``, or of all): a missing
    checkpoint put back from its hidden complete copy (a ``.tmp`` for which ``finished`` is true, or the
    ``.old``), stale hidden entries removed. Returns what it put back (for the log); raises
    ``InterruptedSaveError`` when it cannot."""
    done = []
    for name, entries in _entries(Path(folder), only).items():
        target = Path(folder) / name
        if not (target.exists() or target.is_symlink()):
            message = _restore(target, entries, finished)
            if message:
                done.append(message)
        for entry in entries:
            if _stale(entry):
                _remove(entry.path)
    return done
