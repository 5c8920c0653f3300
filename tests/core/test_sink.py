"""Computing a large value late (``compile.sink.sink_large``) and a fused scatter-add's
regions (``compile.fuse.scatter_adds``): on a tied embedding, whose head gradient is
recorded at the start of backward and read at its end, the order moves, the plan shrinks
by that gradient, and every value is bitwise what the recorded order gives."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.backends.cpu.backend import CpuBackend
from gradtape.compile import build_graph, plan_memory, program
from gradtape.compile.sink import SINK_MIN, SINK_SPAN, sink_large
from gradtape.optim import AdamWConfig, adamw, global_norm

from support.fd import BACKENDS

V, D, T, LAYERS = 4096, 256, 32, 16  # the table [V, D] float32 is SINK_MIN bytes; T > FUSED_K


def _step(dtype, seed=0):
    """A tied toy model (embed, tanh layers, head on the same table, a squared loss),
    its backward, the gradients' norm and AdamW, as ``train.step`` records them:
    ``(tape, outputs, updates, scalars, params)``."""
    rng = np.random.default_rng(seed)
    tp = gt.Tape(dtype, eager=False)
    table = tp.param((rng.standard_normal((V, D)) * 0.1).astype(dtype))
    ws = [tp.param((rng.standard_normal((D, D)) / np.sqrt(D)).astype(dtype))
          for _ in range(LAYERS)]
    ids = tp.const(rng.integers(0, V, T))
    h = ops.take_rows(table, ids)  # [T, D]
    for w in ws:
        h = ops.tanh(ops.matmul(h, w))
    logits = ops.matmul(h, table, tb=True)  # [T, V]
    loss = ops.reduce_sum(ops.mul(logits, logits))
    grads = tp.backward(loss)
    params = [table, *ws]
    g = [grads[p] for p in params]
    norm = global_norm(g)
    new, scalars, _ = adamw(tp, params, g, AdamWConfig())
    return tp, [loss, norm], new, scalars, params


def _compile(backend, dtype, sink, monkeypatch):
    """The step compiled, or (``sink`` False) in the recorded order with the fused
    scatter's rows given a region of their own, as before either."""
    tp, outs, new, scalars, params = _step(dtype)
    with monkeypatch.context() as m:
        if not sink:
            m.setattr(program, "sink_large", lambda g: g)
            m.setattr(CpuBackend, "fuses_scatter_add", classmethod(lambda cls, g: False))
        prog = tp.compile(outs, backend=backend, updates=new, donate=list(new))
    return prog, scalars, params


def test_the_head_gradient_moves_next_to_the_scatter():
    tp, outs, new, _, _ = _step(np.float32)
    graph = program.passes(tp, outs, new, type("B", (), {"has_kernel": staticmethod(
        lambda op: True)}), False)
    assert V * D * 4 >= SINK_MIN
    moved = sink_large(graph)
    head_grad = [v for v in moved.ops if v.op == "matmul" and v.shape == (V, D)]
    assert len(head_grad) == 1
    i = moved.ops.index(head_grad[0])
    assert [v.op for v in moved.ops[i + 1:i + 3]] == ["scatter_rows", "add"]
    assert graph.ops.index(head_grad[0]) < i - SINK_SPAN  # it was recorded long before
    assert sorted(v.index for v in moved.ops) == sorted(v.index for v in graph.ops)
    pos = {v: k for k, v in enumerate(moved.ops)}
    assert all(pos[x] < pos[v] for v in moved.ops for x in v.inputs if x in pos)


def test_a_value_read_late_is_made_late_and_the_plan_shrinks():
    n = 1024  # [n, n] float32: SINK_MIN bytes
    tp = gt.Tape(np.float32, eager=False)
    x, w = tp.const(np.ones((n, n), np.float32)), tp.const(np.eye(n, dtype=np.float32))
    early = ops.matmul(x, w)  # recorded first, read last
    c = x
    for _ in range(SINK_SPAN):  # a chain longer than SINK_SPAN between the two
        c = ops.tanh(c)
    s = ops.reduce_sum(c)
    y = ops.mul(ops.matmul(early, tp.const(np.ones((n, 1), np.float32))), s)  # [n, 1]
    graph = build_graph(tp, [y], None)
    moved = sink_large(graph)
    assert moved.ops.index(early) == moved.ops.index(y.inputs[0]) - 1
    assert graph.ops.index(early) == 0
    assert plan_memory(moved).nbytes < 0.8 * plan_memory(graph).nbytes
    near = ops.matmul(x, w)  # read within SINK_SPAN ops: stays
    z = ops.mul(ops.matmul(near, tp.const(np.ones((n, 1), np.float32))),
                ops.reduce_sum(ops.tanh(x)))
    assert sink_large(build_graph(tp, [z], None)).ops.index(near) == 0


def test_the_plan_holds_one_table_gradient_at_the_end(monkeypatch):
    late, _, _ = _compile("cpu", np.float32, True, monkeypatch)
    early, _, _ = _compile("cpu", np.float32, False, monkeypatch)
    table = V * D * 4
    # without: the head's gradient (their sum written over it) and the scatter's rows
    assert early.memory.nbytes >= 2 * table
    assert late.memory.nbytes < 1.2 * table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_values_are_bitwise_the_recorded_orders(backend, dtype, monkeypatch):
    runs = []
    for sink in (True, False):
        prog, scalars, params = _compile(backend, dtype, sink, monkeypatch)
        outs = [prog.run(scalars.values(step, 1e-3)) for step in (1, 2, 3)]
        runs.append((outs, [prog.state(p).copy() for p in params]))
    (a_outs, a_state), (b_outs, b_state) = runs
    for x, y in zip(a_outs, b_outs):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)
    for u, v in zip(a_state, b_state):
        np.testing.assert_array_equal(u, v)
