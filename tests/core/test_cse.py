"""Common subexpressions (``compile.cse``): a forward op recorded again on the same inputs
is computed once, values unchanged; backward ops and ops that differ stay apart."""

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.compile import build_graph, plan_memory
from gradtape.compile.cse import merge_common
from gradtape.models.lora import init_adapter
from gradtape.train.step import TrainStep

from support.fd import BACKENDS
from support.tinymodel import tiny_model

T, N, H = 12, 3, 4


def _layers(tp, x0, table, n_layers=4):
    """Each layer broadcasts the same ``[T, H]`` table to ``N`` heads (as the rope of
    ``nn.tiled_attention`` does) and scales its rows by it; a squared-sum loss."""
    x = tp.param(x0)
    tab = tp.const(table)
    for _ in range(n_layers):
        wide = ops.reshape(ops.broadcast_to(ops.reshape(tab, (T, 1, H)), (T, N, H)), (T * N, H))
        x = ops.tanh(ops.mul(x, wide))
    loss = ops.reduce_sum(ops.mul(x, x))
    return loss, tp.backward(loss)[tp.vars[0]]


def _case(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T * N, H)), rng.standard_normal((T, H))


def test_repeated_forward_ops_are_computed_once():
    tp = gt.Tape(np.float64)
    loss, grad = _layers(tp, *_case())
    graph = build_graph(tp, [loss, grad], None)
    merged, new_of = merge_common(graph, tp.backward_marks)
    mark = tp.backward_marks[0]
    forward = lambda g, op: sum(v.op == op and v.index < mark for v in g.ops)  # noqa: E731
    assert forward(graph, "broadcast_to") == 4 and forward(merged, "broadcast_to") == 1
    assert new_of  # the merged copies map to the survivor
    # every copy was alive until backward read it: one table instead of four
    assert plan_memory(merged).nbytes < plan_memory(graph).nbytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_program_computes_the_same(backend):
    tp = gt.Tape(np.float64)
    loss, grad = _layers(tp, *_case(1))
    got = tp.compile([loss, grad], backend=backend).run()
    tol = 0.0 if backend == "numpy" else 1e-13  # the same arithmetic on numpy
    for want, g in zip((loss.value, grad.value), got):
        assert np.abs(g - want).max() <= tol * np.abs(want).max()


def test_backward_ops_and_other_attributes_stay_apart():
    tp = gt.Tape(np.float64)
    x = tp.param(np.linspace(-1.0, 1.0, 12).reshape(3, 4))
    a, b = ops.slice_(x, 1, 0, 2), ops.slice_(x, 1, 2, 4)  # other bounds: not the same op
    loss = ops.reduce_sum(ops.mul(ops.exp(a), b))
    grad = tp.backward(loss)[x]
    again = ops.exp(a)  # recorded after the backward mark: a backward value
    graph = build_graph(tp, [loss, grad, again], None)
    merged, _ = merge_common(graph, tp.backward_marks)
    assert sum(v.op == "slice" for v in merged.ops) == 2
    assert sum(v.op == "exp" for v in merged.ops) == sum(v.op == "exp" for v in graph.ops) == 2


def test_training_step_keeps_one_rope_table_per_head_count(monkeypatch):
    """A tiled-attention step broadcasts the rope tables to the heads once, not once per
    layer: 2 tables (cos, sin) x 2 head counts (queries, keys), whatever the depth; and
    checkpointing still finds the kept values (the merge maps them)."""
    from gradtape.models import graph as M

    monkeypatch.setattr(M, "ATTN_TILED_MIN", 0)
    model = tiny_model(seed=2, n_layers=3)
    for mode in ("off", "on"):
        ts = TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1), 1, 16,
                       backend="numpy", grad_checkpoint=mode, compute="float32")
        mark = ts.tape.backward_marks[0]
        tables = [v for v in ts.program.graph.ops if v.op == "broadcast_to" and v.index < mark]
        # checkpointed: each recomputed once more in backward (clones keep their index)
        assert len(tables) == (8 if mode == "on" else 4), mode
        assert ts.checkpointed == (3 if mode == "on" else 0)  # layers recomputed
