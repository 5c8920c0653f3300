"""``settings`` is the one reader of the environment, and the README's table lists what it
reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradtape
from gradtape import settings
from gradtape.errors import GradtapeError

SRC = Path(gradtape.__file__).parent
README = SRC.parents[1] / "README.md"


def _reads_environment(path):
    """The lines of ``path`` that name ``os.environ`` or ``os.getenv``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append(node.lineno)
    return found


def test_only_settings_reads_the_environment():
    readers = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
               if p.name != "settings.py" and (lines := _reads_environment(p))}
    assert not readers, readers


def test_the_readme_lists_every_setting():
    text = README.read_text()
    assert [name for name in settings.SETTINGS if f"`{name}`" not in text] == []


def test_an_unknown_name_and_a_bad_number_are_errors(monkeypatch):
    with pytest.raises(KeyError, match="GRADTAPE_NOPE is not a gradtape setting"):
        settings.get("GRADTAPE_NOPE")
    monkeypatch.setenv("GRADTAPE_THREADS", "many")
    with pytest.raises(GradtapeError, match=r"\$GRADTAPE_THREADS must be a whole number"):
        settings.integer("GRADTAPE_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # libgomp's nested form: the first level
    assert settings.omp_threads() == 3
