"""Rematerialization: cheap activations are recomputed in backward, results unchanged."""

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops
from gradtape.compile import build_graph, plan_memory
from gradtape.compile.remat import rematerialize

from support.fd import BACKENDS

T, D, F = 16, 8, 32


def _weights(rng, layers):
    return [rng.standard_normal(s) / np.sqrt(s[0]) for _ in range(layers)
            for s in ((D, F), (D, F), (F, D))]


def _mlp(tp, x0, weights):
    """Pre-norm SwiGLU residual blocks and a squared-sum loss; returns (loss, params)."""
    x = tp.const(x0)
    ones = nn.ones(tp, D)
    params = [tp.param(w) for w in weights]
    for wg, wu, wd in zip(params[0::3], params[1::3], params[2::3]):
        h = nn.rmsnorm(tp, x, tp.const(np.ones(D)), ones, D, 1e-5)
        x = ops.add(x, nn.linear(tp, nn.swiglu(tp, nn.linear(tp, h, wg), nn.linear(tp, h, wu)), wd))
    return ops.reduce_sum(ops.mul(x, x)), params


def _step(tp, x0, weights):
    loss, params = _mlp(tp, x0, weights)
    grads = tp.backward(loss)
    return [loss] + [grads[p] for p in params], params


def test_remat_lowers_the_plan_and_keeps_values_bitwise():
    rng = np.random.default_rng(0)
    tp = gt.Tape(np.float64)
    outs, _ = _step(tp, rng.standard_normal((T, D)), _weights(rng, 4))
    graph = build_graph(tp, outs, None)
    remat = rematerialize(graph, tp.backward_marks)
    assert len(remat.ops) > len(graph.ops)  # clones were added
    assert plan_memory(remat).nbytes < 0.8 * plan_memory(graph).nbytes
    for v, got in zip(outs, tp.compile(outs).run()):
        assert np.array_equal(v.value, got)  # recomputation is the same arithmetic


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_replays_with_new_inputs(backend):
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((T, D))
    tp = gt.Tape(np.float64)
    outs, params = _step(tp, x0, _weights(rng, 2))
    new = _weights(rng, 2)
    got = tp.compile(outs, backend=backend).run(dict(zip(params, new)))
    want, _ = _step(gt.Tape(np.float64), x0, new)  # a fresh eager tape on the new values
    for a, b in zip(got, want):
        assert np.abs(a - b.value).max() <= 1e-12 * np.abs(b.value).max()


def test_no_backward_no_change():
    rng = np.random.default_rng(2)
    tp = gt.Tape()
    loss, _ = _mlp(tp, rng.standard_normal((T, D)), _weights(rng, 1))
    graph = build_graph(tp, [loss], None)
    assert rematerialize(graph, tp.backward_marks) is graph
