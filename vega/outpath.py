"""A command's output path, checked before the work that fills it: a typo found only after
minutes of measuring, loading or compiling would lose them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable(path: Path, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (a file, or a ``directory`` of files), or None."""
    if directory:
        if path.exists() and not path.is_dir():
            return f"{path} exists and is not a directory"
        existing = next(p for p in (path, *path.parents) if p.exists())  # made if missing
    else:
        if path.is_dir():
            return f"{path} is a directory"
        if path.exists():
            return None if os.access(path, os.W_OK) else f"cannot write {path}"
        existing = path.parent
        if not existing.exists():
            return f"{existing} does not exist"
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not _can_create_in(existing):
        return f"cannot write in {existing}"
    return None


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in ``directory``, tried: permission bits say yes to
    root everywhere, /proc and read-only mounts included."""
    try:
        handle, name = tempfile.mkstemp(dir=directory, prefix=".vega-probe-")
    except OSError:
        return False
    os.close(handle)
    os.unlink(name)
    return True
