"""The package imports only downward, with no cycle hidden by a function-level import,
and every module imports alone in a fresh interpreter.

The layers, lowest first (a module may import its own layer's modules and lower ones):
the primitive table, its tiled forwards and the Var it records (``ops``, ``tiled``,
``var``: with ``errors``, ``blocks`` and the option checks below them), ``compile`` (the
passes and the pipeline), ``backends`` (each receives a compiled schedule), the tape and
the layers on it (``tape``, ``nn``, ``optim``), ``formats`` (file readers), ``models``,
``train``, and the entry points (``cli``, ``llama``, the package itself).  Every import
counts, module-level or inside a function: a lazy import may keep an optional dependency
cheap, never hide a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gradtape

ROOT = Path(gradtape.__file__).parent
LAYERS = [
    {"errors", "io", "checks", "blocks"},
    {"ops", "var", "tiled"},
    {"compile"},
    {"backends"},
    {"tape", "nn", "optim"},
    {"formats"},
    {"models"},
    {"train"},
    {"cli", "llama", ""},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _layer(module):
    parts = module.split(".")
    return LAYER[parts[1] if len(parts) > 1 else ""]


def _imports(module, path):
    """The gradtape modules ``module`` imports (every import statement, at any depth)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - (not is_pkg)]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            found.update(n for n in names if n in MODULES)
            if target in MODULES and not any(n in MODULES for n in names):
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    return found - {module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    assert all(_layer(m) is not None for m in MODULES)


def test_imports_go_downward():
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, targets in GRAPH.items() for t in sorted(targets) if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_function_level_imports():
    # tape.compile hands the pipeline a backend class: resolved by name, imported at the top
    assert "gradtape.backends" in GRAPH["gradtape.tape"]
    assert "gradtape.formats.gguf_reader" in GRAPH["gradtape.models.memory"]  # in a function


@pytest.mark.slow  # a fresh interpreter per module
@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_module_imports_alone(module):
    """In a fresh interpreter, with nothing imported before it (cuda needs CuPy only when
    its backend is built, so it imports everywhere; ``__main__`` runs the CLI instead)."""
    res = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
