"""Checks of user-given values, declared once and run before any work starts.

``Check`` is an option's valid range or choices, kept with the option's definition (a
config dataclass field, or a command's argument) and run alike for the Python API and the
command line; the ``*_path`` functions check that an input exists and is a readable file
or folder, and that an output can be created and written, without creating anything.
Messages name the option as the command line spells it (``--seq-len must be >= 2, got
0``); the CLI prefixes ``gradtape COMMAND: error:``.  File *contents* are checked by their
readers (``formats``, ``train.data``), not here.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import GradtapeError

_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Check:
    """A value's type and valid range (``lo``/``hi``, each inclusive unless ``*_open``) or
    ``choices``.  ``check(name, value)`` raises ``GradtapeError`` naming ``name``."""

    kind: type | None = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                    f"{self.hi:g}{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return ""

    def check(self, name, value):
        check_type(name, value, self.kind)
        if self.choices:
            if value not in self.choices:
                raise GradtapeError(f"{name} must be {self.describe()}, got {value!r}")
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise GradtapeError(f"{name} must be a finite number"
                                + (f" {self.describe()}" if self.describe() else "")
                                + f", got {value!r}")
        ok = ((self.lo is None or (value > self.lo if self.lo_open else value >= self.lo))
              and (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)))
        if not ok:
            raise GradtapeError(f"{name} must be {self.describe()}, got {value!r}")
        return value

    __call__ = check


def check_type(name, value, kind):
    """``kind`` (a type, or its name as a dataclass field's annotation string): an int
    must be an int (not a bool), a float an int or a float, a str a str."""
    kind = _KINDS.get(kind, kind) if isinstance(kind, str) else kind
    if kind is None:
        return
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        what = {int: "an integer", float: "a number", str: "a string",
                bool: "True or False"}.get(kind, kind.__name__)
        raise GradtapeError(f"{name} must be {what}, got {value!r}")


def count(lo=1):
    """An integer >= ``lo`` (a number of steps, sequences, ...)."""
    return Check(int, lo=lo)


def positive():
    """A finite number > 0 (a learning rate, a LoRA alpha)."""
    return Check(float, lo=0, lo_open=True)


def nonnegative(kind=float):
    return Check(kind, lo=0)


def fraction():
    """A number in [0, 1) (a share of the data held out)."""
    return Check(float, lo=0, hi=1, hi_open=True)


def one_of(*choices):
    return Check(type(choices[0]), choices=tuple(choices))


def utf8_text(name, value):
    """Text from the command line may carry bytes that are not UTF-8 (Python keeps them
    as lone surrogates); nothing downstream can encode those."""
    check_type(name, value, str)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GradtapeError(f"{name} is not valid UTF-8 text (character {e.start} is a "
                            "byte that is not UTF-8)") from None
    return value


# --- paths ------------------------------------------------------------------------------

def input_path(path, name, kind="file") -> Path:
    """An input: it exists, is a ``kind`` ("file", "folder" or "file or folder"; a file
    is a regular file, not a device or a pipe) and is readable."""
    p = as_path(path, name)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise GradtapeError(f"{name} {p}: does not exist") from None
    except NotADirectoryError:
        raise GradtapeError(f"{name} {p}: does not exist (a parent is not a folder)") from None
    except OSError as e:
        raise GradtapeError(f"{name} {p}: cannot be read ({e.strerror})") from None
    is_dir, is_file = stat.S_ISDIR(st.st_mode), stat.S_ISREG(st.st_mode)
    if kind == "file" and is_dir:
        raise GradtapeError(f"{name} {p}: is a folder, not a file")
    if kind == "folder" and not is_dir:
        raise GradtapeError(f"{name} {p}: is not a folder")
    if not (is_dir or is_file):
        raise GradtapeError(f"{name} {p}: is not a regular file")
    if not os.access(p, os.R_OK | (os.X_OK if is_dir else 0)):
        raise GradtapeError(f"{name} {p}: is not readable (permission denied)")
    return p


def output_folder(path, name) -> Path:
    """A folder to write into: an existing folder we can write in, or one we can create
    (its nearest existing ancestor is a folder we can create folders in).  Creates
    nothing: the probe is a temporary folder or file, removed at once."""
    p = as_path(path, name)
    if p.exists():
        if not p.is_dir():
            raise GradtapeError(f"{name} {p}: exists and is not a folder")
        _probe(p, name, p, "cannot write in this folder", folder=False)
        return p
    base = _existing_ancestor(p)
    if not base.is_dir():
        raise GradtapeError(f"{name} {p}: cannot be created: {base} is not a folder")
    _probe(p, name, base, f"cannot be created in {base}", folder=True)
    return p


def output_file(path, name) -> Path:
    """A file to write (replace atomically): not a folder, not a device or another special
    file, in an existing folder we can write in."""
    p = as_path(path, name)
    if p.is_dir():
        raise GradtapeError(f"{name} {p}: is a folder; give a file name")
    if p.exists() and not p.is_file():  # never replace /dev/null and the like
        raise GradtapeError(f"{name} {p}: exists and is not a regular file")
    parent = p.absolute().parent
    if not parent.exists():
        raise GradtapeError(f"{name} {p}: folder {parent} does not exist")
    if not parent.is_dir():
        raise GradtapeError(f"{name} {p}: {parent} is not a folder")
    _probe(p, name, parent, f"cannot write in {parent}", folder=False)
    return p


def as_path(path, name) -> Path:
    """``path`` as a ``Path`` (``~`` expanded), refusing an empty one: ``Path("")`` is
    ".", and an empty argument would quietly mean the current folder."""
    if not str(path):
        raise GradtapeError(f"{name}: the path is empty")
    return Path(path).expanduser()


def _existing_ancestor(p: Path) -> Path:
    for a in p.absolute().parents:
        if a.exists():
            return a
    return Path(p.absolute().anchor)


def _probe(p, name, where, what, folder):
    # os.access says yes to root everywhere, even in /proc: try for real
    try:
        if folder:
            os.rmdir(tempfile.mkdtemp(dir=where, prefix=".gradtape-probe-"))
        else:
            fd, tmp = tempfile.mkstemp(dir=where, prefix=".gradtape-probe-")
            os.close(fd)
            os.unlink(tmp)
    except OSError as e:
        raise GradtapeError(f"{name} {p}: {what} ({e.strerror or e})") from None
