"""The package imports only downward, with no cycle hidden by a function-level import,
and every module imports alone in a fresh interpreter.

The layers, lowest first (a module may import its own layer's modules and lower ones):
the core (``errors``, ``io``, ``checks``, ``blocks``, ``settings`` below the primitive
table ``ops`` with its tiled forwards and the Var it records, below the tape and the
layers on it: ``tape``, ``nn``, ``optim``), ``compile`` (the passes and the pipeline),
``backends`` (each receives a compiled schedule), ``plan`` (the execution plan, and the
door that compiles a tape), ``formats`` (file readers), ``models``, ``infer`` (inference
on a model), ``llama``
(the public facade), ``train``, and the entry points (``cli``, the package itself).
Every import counts, module-level or inside a function: a lazy import may keep an
optional dependency cheap, never hide a cycle.  One upward edge is allowed, by name
(``DOORS``): ``Tape.compile`` reaching the compiler.
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
    {"errors", "io", "checks", "blocks", "settings"},  # the core: plain helpers
    {"ops", "var", "tiled"},  # the core: the primitive table and the Var it records
    {"tape", "nn", "optim"},  # the core: recording, backward, the layers, the optimizer
    {"compile"},
    {"backends"},
    {"plan"},  # the execution plan: decides from the backends' measurements
    {"formats"},
    {"models"},
    {"infer"},
    {"llama"},  # the public facade
    {"train"},
    {"cli", ""},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# the upward edges allowed, each with its reason; no other
DOORS = {
    ("gradtape.tape", "gradtape.plan"):
        "Tape.compile imports plan.compile_tape in its body: the core's one door to "
        "compilation, so recording and backward load neither compile nor a backend",
}


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
              for m, targets in GRAPH.items() for t in sorted(targets)
              if _layer(t) > _layer(m) and (m, t) not in DOORS]
    assert not upward, "\n".join(upward)


def test_every_door_is_used():
    """An allowed upward edge that no longer exists is removed from ``DOORS``."""
    unused = [f"{m} -> {t}" for m, t in DOORS if t not in GRAPH.get(m, ())]
    assert not unused, unused


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
    assert "gradtape.plan" in GRAPH["gradtape.tape"]  # in Tape.compile
    assert "gradtape.formats.gguf_reader" in GRAPH["gradtape.models.memory"]  # in a function


@pytest.mark.slow  # a fresh interpreter per module
@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_module_imports_alone(module):
    """In a fresh interpreter, with nothing imported before it (cuda needs CuPy only when
    its backend is built, so it imports everywhere; ``__main__`` runs the CLI instead)."""
    res = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
