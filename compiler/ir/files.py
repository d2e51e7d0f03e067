"""Writing files atomically: a reader (another process, a crashed run's successor) sees the old
file or the whole new one, never half of one.

Rule: the text goes to a temporary file in the target's own directory (so the rename stays on
one file system), is flushed to disk, and is renamed over the target (`os.replace`, atomic on
POSIX and Windows). The temporary name is unique, so two writers of one path never share it.
It lives in the lowest layer so that every layer (plan files, launcher reports, study results)
writes through the same function.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` atomically (see the module docstring); returns the path."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_json_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = None) -> Path:
    """`data` as JSON at `path`, atomically."""
    return write_text_atomic(path, json.dumps(data, indent=indent))
