"""Every script in bench/ still runs against the package: each answers ``--help`` (its
imports resolve and its options parse), as a user would call it first.  A renamed or
removed function the scripts use fails here rather than in a later session's
measurement."""

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py"))


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"quant_bench.py", "profile_step.py", "long_kernels.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCH))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports_gradtape_before_numpy(script):
    """``import gradtape`` first: under ``$GRADTAPE_ISA`` it caps NumPy's OpenBLAS, which
    picks its kernels when NumPy loads; a script importing NumPy first would time the
    CPU's own kernels under the cap's name."""
    lines = script.read_text().splitlines()
    first = {name: next((i for i, line in enumerate(lines)
                         if line.startswith((f"import {name}", f"from {name}"))), None)
             for name in ("gradtape", "numpy")}
    if first["numpy"] is not None:
        assert first["gradtape"] is not None and first["gradtape"] < first["numpy"]
