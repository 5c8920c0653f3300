"""The merge_matmuls pass: narrow matmuls sharing op(a) become one GEMM plus slices, k=1
matmuls become a broadcast mul; the rewritten graph computes the same values.

Tolerance: float64 1e-12 relative for the merged GEMMs (the same dot products, only
BLAS's blocking may differ); the outer products are checked bitwise (one product per
element either way).
"""

from __future__ import annotations

import numpy as np

import gradtape as gt
from gradtape import nn, ops
from gradtape.backends.numpy import NumpyBackend
from gradtape.compile.graph import build_graph
from gradtape.compile import lower
from gradtape.compile.merge_matmuls import merge_matmuls


def _run(graph):
    return lower(graph, NumpyBackend).run({})


def _matmuls(graph):
    return [v for v in graph.ops if v.op == "matmul"]


def _lora_qkv(tp, rng, t=6, d=80, r=3):
    x = tp.const(rng.standard_normal((t, d)))
    w = [tp.const(rng.standard_normal((d, d))) for _ in range(3)]
    ab = [(tp.param(rng.standard_normal((d, r))), tp.param(rng.standard_normal((r, d))))
          for _ in range(3)]
    ones = nn.ones(tp, d)
    h = nn.rmsnorm(tp, x, tp.const(rng.uniform(0.5, 1.5, d)), ones, d, 1e-5)
    outs = [nn.lora_linear(tp, h, w[i], *ab[i], 2.0) for i in range(3)]
    loss = ops.reduce_sum(ops.mul(ops.mul(outs[0], outs[1]), ops.tanh(outs[2])))
    grads = tp.backward(loss)
    return [loss, *grads.values()]


def test_shared_operand_matmuls_merge_and_compute_the_same():
    tp = gt.Tape(np.float64)
    outputs = _lora_qkv(tp, np.random.default_rng(0))
    g = build_graph(tp, outputs, None)
    m = merge_matmuls(g)
    # forward h @ A_{q,k,v}: one GEMM; backward h^T @ g_{q,k,v}: one GEMM
    assert len(_matmuls(m)) == len(_matmuls(g)) - 4
    assert any(v.op == "matmul" and v.shape == (80, 9) for v in m.ops)  # [d, 3r]
    ref, got = _run(g), _run(m)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(b).max())


def test_outer_products_become_a_fused_mul_bitwise():
    rng = np.random.default_rng(1)
    tp = gt.Tape(np.float64)
    a, b = tp.param(rng.standard_normal((5, 1))), tp.param(rng.standard_normal((7, 1)))
    c = tp.param(rng.standard_normal((1, 5)))
    outs = [ops.matmul(a, b, tb=True), ops.matmul(c, b, ta=True, tb=True),
            ops.matmul(a, ops.transpose(b))]
    g = build_graph(tp, outs, None)
    m = merge_matmuls(g)
    assert not _matmuls(m)
    for x, y in zip(_run(m), _run(g)):
        assert np.array_equal(x, y)


def test_a_use_between_the_members_keeps_them_apart():
    """m2's right operand is computed from m1's output: no single point fits both."""
    rng = np.random.default_rng(2)
    tp = gt.Tape(np.float64)
    x = tp.param(rng.standard_normal((4, 6)))
    b1 = tp.param(rng.standard_normal((6, 2)))
    m1 = ops.matmul(x, b1)  # [4, 2]
    b2 = ops.matmul(ops.transpose(x), m1)  # [6, 2], reads m1
    m2 = ops.matmul(x, b2)
    g = build_graph(tp, [ops.add(m1, m2)], None)
    m = merge_matmuls(g)
    assert len(_matmuls(m)) == len(_matmuls(g))
    np.testing.assert_array_equal(_run(m)[0], _run(g)[0])


def test_cpu_backend_runs_the_merged_training_graph():
    """The cpu backend applies the pass; its outputs match the NumPy reference."""
    tp = gt.Tape(np.float32)
    outputs = _lora_qkv(tp, np.random.default_rng(3), t=8, d=72, r=4)
    ref = tp.compile(outputs, backend="numpy").run()
    prog = tp.compile(outputs, backend="cpu")
    got = prog.run()
    assert len(_matmuls(prog.executable.graph)) < len(_matmuls(prog.graph))
    for a, b in zip(got, ref):  # float32: as the cpu backend's parity tests (2e-5)
        assert np.abs(a - b).max() <= 2e-5 * max(np.abs(b).max(), 1e-30)
