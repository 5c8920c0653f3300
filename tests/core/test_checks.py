"""``gradtape.checks``: a range's description and message, types, and the path checks
(which create nothing, and try for real rather than trust permission bits)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from gradtape import checks
from gradtape.errors import GradtapeError


@pytest.mark.parametrize("check, text", [
    (checks.count(1), ">= 1"),
    (checks.positive(), "> 0"),
    (checks.nonnegative(), ">= 0"),
    (checks.fraction(), "in [0, 1)"),
    (checks.Check(float, lo=0, hi=1, lo_open=True), "in (0, 1]"),
    (checks.Check(int, hi=9), "<= 9"),
    (checks.one_of("a", "b"), "one of a, b"),
])
def test_describe(check, text):
    assert check.describe() == text


def test_bounds_are_inclusive_or_open_as_declared():
    c = checks.Check(float, lo=0, hi=1, hi_open=True)
    assert c("--x", 0.0) == 0.0 and c("--x", 0.999) == 0.999
    with pytest.raises(GradtapeError, match=r"^--x must be in \[0, 1\), got 1$"):
        c("--x", 1)
    with pytest.raises(GradtapeError, match=r"^--x must be in \[0, 1\), got -1e-09$"):
        c("--x", -1e-9)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(GradtapeError, match=r"^--x must be a finite number in \[0, 1\)"):
            c("--x", bad)


def test_types():
    with pytest.raises(GradtapeError, match=r"^--n must be an integer, got 2.0$"):
        checks.count(1)("--n", 2.0)
    with pytest.raises(GradtapeError, match=r"^--n must be an integer, got False$"):
        checks.count(0)("--n", False)
    assert checks.positive()("--lr", 3) == 3  # an int is a number
    with pytest.raises(GradtapeError, match=r"^--lr must be a number, got '1e-3'$"):
        checks.positive()("--lr", "1e-3")
    with pytest.raises(GradtapeError, match=r"^--s must be one of a, b, got 'c'$"):
        checks.one_of("a", "b")("--s", "c")


def test_utf8_text():
    assert checks.utf8_text("--p", "héllo") == "héllo"
    with pytest.raises(GradtapeError, match=r"^--p is not valid UTF-8 text"):
        checks.utf8_text("--p", os.fsdecode(b"\xff"))


def test_input_paths(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert checks.input_path(f, "--data") == f
    assert checks.input_path(tmp_path, "--adapter", "folder") == tmp_path
    assert checks.input_path(str(f), "--model", "file or folder") == f
    with pytest.raises(GradtapeError, match=r": is a folder, not a file$"):
        checks.input_path(tmp_path, "--data")
    with pytest.raises(GradtapeError, match=r": is not a folder$"):
        checks.input_path(f, "--adapter", "folder")
    with pytest.raises(GradtapeError, match=r": does not exist$"):
        checks.input_path(tmp_path / "nope", "--data")
    with pytest.raises(GradtapeError, match=r"does not exist \(a parent is not a folder\)"):
        checks.input_path(f / "sub", "--data")
    with pytest.raises(GradtapeError, match=r"^--data /dev/null: is not a regular file$"):
        checks.input_path("/dev/null", "--data")
    with pytest.raises(GradtapeError, match=r"^--data: the path is empty$"):
        checks.input_path("", "--data")


def test_output_paths_create_nothing(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    assert checks.output_folder(deep, "--out") == deep
    assert checks.output_file(tmp_path / "x.gguf", "--out") == tmp_path / "x.gguf"
    assert checks.output_folder(tmp_path, "--out") == tmp_path
    assert list(tmp_path.iterdir()) == []  # the probes are gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(GradtapeError, match=r"exists and is not a folder$"):
        checks.output_folder(tmp_path / "f", "--out")
    with pytest.raises(GradtapeError, match=rf"cannot be created: {tmp_path / 'f'} is not a "):
        checks.output_folder(tmp_path / "f" / "g", "--out")
    with pytest.raises(GradtapeError, match=r"is a folder; give a file name$"):
        checks.output_file(tmp_path, "--out")
    with pytest.raises(GradtapeError, match=r"folder .* does not exist$"):
        checks.output_file(tmp_path / "none" / "x.gguf", "--out")
    with pytest.raises(GradtapeError, match=r"^--out /dev/null: exists and is not a regular"):
        checks.output_file("/dev/null", "--out")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
def test_unwritable_places_are_tried_not_guessed():
    # root passes every permission check; /proc still refuses new files and folders
    with pytest.raises(GradtapeError, match=r"^--out /proc/x: cannot be created in /proc \("):
        checks.output_folder("/proc/x", "--out")
    with pytest.raises(GradtapeError, match=r"^--out /proc/x.gguf: cannot write in /proc \("):
        checks.output_file("/proc/x.gguf", "--out")
