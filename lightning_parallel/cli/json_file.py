"""JSON files that a reader never finds half-written: ``summary.json``, the run results rank 0 hands over.

A plain ``write_text`` killed (or out of disk) halfway leaves a truncated file, which then fails every
reader, the sweep summary included. ``write_json`` writes a temporary file beside the target and renames
it over the target, which is atomic within one file system: the target is the old file or the new one.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

__all__ = ["write_json"]


def write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    """``obj`` as JSON into ``path``, atomically; the file's mode follows the umask, as ``open`` would."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    text = json.dumps(obj, indent=indent, default=str) + "\n"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
