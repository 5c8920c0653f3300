"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A reader (or a resumed run) sees either the old file or the new one, never a torn one,
whenever the process is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path`` for a writer (ours or another library's);
    on success fsync it, give it a normal file mode and rename it over ``path``; on
    failure remove it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        chmod_as_new_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path, data: bytes):
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def chmod_as_new_file(path):
    """Give ``path`` the mode ``open()`` would have (0666 less the umask): mkstemp's
    files are 0600, which would leave written models and adapters unreadable to others."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write_json(path, obj):
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _fsync_dir(folder):
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
