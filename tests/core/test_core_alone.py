"""The core stands alone: importing gradtape, recording (layers, the fused primitives,
an optimizer step) and ``backward`` load neither ``gradtape.compile`` nor any backend;
compiling for the NumPy backend then loads the compiler and the NumPy backend, never a
CPU or CUDA backend module.

Each check runs in a fresh interpreter, where ``sys.modules`` shows what was loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import numpy as np

def loaded():
    return sorted(m for m in sys.modules if m == "gradtape" or m.startswith("gradtape."))

import gradtape as gt
from gradtape import nn, ops, optim
after_import = loaded()

rng = np.random.default_rng(0)
tp = gt.Tape()
T, D, V, nh, hd = 4, 8, 11, 2, 4
x = tp.const(rng.standard_normal((T, D)))
w = tp.param(rng.standard_normal((D, D)) * 0.3)
table = tp.param(rng.standard_normal((V, D)))
ids = tp.const(np.array([1, 5, 0, 10]))
ones = nn.ones(tp, D)
h = nn.rmsnorm(tp, nn.linear(tp, x, w), tp.const(np.ones(D)), ones, D, 1e-5)
cos, sin = nn.rope_fill(T, hd, 1e4)
att = nn.tiled_attention(tp, h, h, h, tp.const(cos), tp.const(sin),
                         nn.AttentionSpec(nh, nh, hd, 0.5))
loss = nn.cross_entropy_head(tp, att, table, ids, tp.const(np.full((T, 1), 1.0 / T)))
grads = tp.backward(loss)
new, scalars, _ = optim.adamw(tp, list(grads), list(grads.values()), optim.AdamWConfig())
after_backward = loaded()

prog = tp.compile([loss, *grads.values()], backend="numpy", updates=new)
outs = prog.run(scalars.values(1, 1e-3))
assert np.array_equal(outs[0], loss.value)
assert isinstance(prog, gt.Program)
after_compile = loaded()
print(json.dumps([after_import, after_backward, after_compile]))
"""


def _stages():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_recording_and_backward_load_no_compiler_and_no_backend():
    after_import, after_backward, after_compile = _stages()
    for stage in (after_import, after_backward):
        upper = [m for m in stage if m.startswith(("gradtape.compile", "gradtape.backends"))]
        assert not upper, upper
    # what a NumPy replay may load from the backends: the registry, the interface, the
    # shared lowering table and the NumPy backend itself
    allowed = {"gradtape.backends", "gradtape.backends.base", "gradtape.backends.lowering",
               "gradtape.backends.numpy"}
    backends = {m for m in after_compile if m.startswith("gradtape.backends")}
    assert "gradtape.backends.numpy" in backends
    assert backends <= allowed, sorted(backends - allowed)
    assert "gradtape.compile" in after_compile
