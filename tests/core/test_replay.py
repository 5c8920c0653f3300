"""Compile and replay: graphs holding backward ops replayed with new
leaf values against fresh eager tapes, bitwise equality on the recorded values, leaves
that keep their values, state updates across runs, pruning, and the memory plan."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.compile import memplan

from support.compare import rel_err
from support.fd import BACKENDS, replay_tol

DTYPES = [np.float64, np.float32]


def _build(tp, xa, wa, ba, ta):
    """A small MLP with a softmax-cross-entropy-ish loss; returns (leaves, loss, grads)."""
    x = tp.const(xa)
    w = tp.param(wa)
    b = tp.param(ba)
    tgt = tp.const(ta)
    h = ops.tanh(ops.add(ops.matmul(x, w), b))  # [T, n]
    p = ops.softmax(ops.scale(h, 3.0), 1)
    loss = ops.scale(ops.reduce_sum(ops.log(ops.pick(p, tgt))), -1.0 / xa.shape[0])
    grads = tp.backward(loss)
    return (x, w, b, tgt), loss, grads


def _data(rng, T=6, d=5, n=4):
    return (rng.standard_normal((T, d)), rng.standard_normal((d, n)) * 0.5,
            rng.standard_normal(n), rng.integers(0, n, T))


def _check(got, ref, backend, dtype):
    tol = replay_tol(backend, dtype)
    for g, r in zip(got, ref):
        assert g.dtype == np.dtype(dtype) and g.shape == r.shape
        if tol == 0.0:
            np.testing.assert_array_equal(g, r)
        else:
            assert rel_err(g, r) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_same_values_is_bitwise_eager(backend, dtype):
    rng = np.random.default_rng(0)
    tp = gt.Tape(dtype)
    _, loss, grads = _build(tp, *_data(rng))
    # every intermediate too, not only the outputs: ask for all non-leaf Vars
    everything = [v for v in tp.vars if not v.is_leaf]
    prog = tp.compile(everything, backend=backend)
    for _ in range(2):
        _check(prog.run(), [v.value for v in everything], backend, dtype)
    prog = tp.compile([loss, *grads.values()], backend=backend)
    _check(prog.run(), [loss.value] + [g.value for g in grads.values()], backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_new_leaves_matches_fresh_eager(backend, dtype):
    rng = np.random.default_rng(1)
    tp = gt.Tape(dtype)
    leaves, loss, grads = _build(tp, *_data(rng))
    prog = tp.compile([loss, *grads.values()], backend=backend)
    for _ in range(3):
        new = _data(rng)
        got = prog.run(dict(zip(leaves, new)))
        tp2 = gt.Tape(dtype)
        _, loss2, grads2 = _build(tp2, *new)
        _check(got, [loss2.value] + [g.value for g in grads2.values()], backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_second_order_graph(backend):
    """A program whose outputs are second-order gradients replays like any other."""
    rng = np.random.default_rng(2)

    def build(tp, xa):
        x = tp.param(xa)
        loss = ops.reduce_sum(ops.mul(ops.sigmoid(x), ops.exp(ops.scale(x, 0.5))))
        g = tp.backward(loss)[x]
        h = tp.backward(ops.reduce_sum(ops.mul(g, g)))[x]
        return x, [loss, g, h]

    tp = gt.Tape()
    x, outs = build(tp, rng.standard_normal((3, 4)))
    prog = tp.compile(outs, backend=backend)
    xa = rng.standard_normal((3, 4))
    _, ref = build(gt.Tape(), xa)
    _check(prog.run({x: xa}), [r.value for r in ref], backend, np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unfed_leaves_keep_recorded_values(backend):
    rng = np.random.default_rng(3)
    data = _data(rng)
    tp = gt.Tape()
    (x, w, b, tgt), loss, grads = _build(tp, *data)
    prog = tp.compile([loss, grads[w]], backend=backend)
    rec = [loss.value, grads[w].value]
    # feed only x: w, b, tgt keep their recorded values
    xa = rng.standard_normal(x.shape)
    got = prog.run({x: xa})
    _, l2, g2 = _build(gt.Tape(), xa, *data[1:])
    _check(got, [l2.value, list(g2.values())[0].value], backend, np.float64)
    # a leaf fed last run and not now goes back to its recorded value
    _check(prog.run(), rec, backend, np.float64)
    _check(prog.run({}), rec, backend, np.float64)
    # the tape's own eager values were never touched by the replays
    np.testing.assert_array_equal(x.value, data[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_feeds_do_not_alias_caller_arrays(backend):
    tp = gt.Tape()
    x = tp.param(np.ones(3))
    y = ops.scale(x, 2.0)
    prog = tp.compile([y, x], backend=backend)
    feed = np.array([1.0, 2.0, 3.0])
    out = prog.run({x: feed})
    feed[:] = 0.0
    np.testing.assert_array_equal(out[0], [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(out[1], [1.0, 2.0, 3.0])
    out[0][:] = -1  # returned arrays are the caller's own
    np.testing.assert_array_equal(prog.run({x: [1.0, 2.0, 3.0]})[0], [2.0, 4.0, 6.0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_updates_make_state_across_runs(backend, dtype):
    """SGD as part of the replayed step: w <- w - lr * grad, b likewise, for 4 runs."""
    rng = np.random.default_rng(4)
    data = _data(rng)
    lr = 0.3
    tp = gt.Tape(dtype)
    (x, w, b, tgt), loss, grads = _build(tp, *data)
    new_w = ops.sub(w, ops.scale(grads[w], lr))
    new_b = ops.sub(b, ops.scale(grads[b], lr))
    prog = tp.compile([loss], backend=backend, updates={w: new_w, b: new_b})
    wa, ba = data[1], data[2]
    for step in range(4):
        xa = rng.standard_normal(x.shape)
        (got,) = prog.run({x: xa})
        tp2 = gt.Tape(dtype)
        (_, w2, b2, _), l2, g2 = _build(tp2, xa, wa, ba, data[3])
        _check([got], [l2.value], backend, dtype)
        wa = (w2.value - np.asarray(lr, dtype) * g2[w2].value).astype(dtype)
        ba = (b2.value - np.asarray(lr, dtype) * g2[b2].value).astype(dtype)
        _check([prog.state(w), prog.state(b)], [wa, ba], backend, dtype)
    # the recorded values are untouched; state is the program's
    np.testing.assert_array_equal(w.value, data[1].astype(dtype))
    # feeding a state leaf sets it
    prog.run({w: data[1]})
    assert not np.array_equal(prog.state(w), data[1].astype(dtype))  # updated after run


@pytest.mark.parametrize("backend", BACKENDS)
def test_pruning_drops_unneeded_ops(backend):
    tp = gt.Tape()
    x = tp.param(np.ones((2, 2)))
    unused_leaf = tp.const(np.ones((2, 2)))
    y = ops.exp(x)
    dead = ops.log(ops.add(y, unused_leaf))  # noqa: F841 (not an output)
    prog = tp.compile([y], backend=backend)
    assert [v.op for v in prog.graph.ops] == ["exp"]
    assert unused_leaf not in prog.graph.leaves
    # feeding a leaf the outputs do not need is harmless
    np.testing.assert_array_equal(prog.run({unused_leaf: np.zeros((2, 2))})[0], np.exp(1.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_in_caller_order_with_repeats_and_leaves(backend):
    tp = gt.Tape()
    x = tp.param(np.array([1.0, 2.0]))
    y = ops.scale(x, 3.0)
    z = ops.neg(y)
    out = tp.compile([z, x, y, z], backend=backend).run()
    np.testing.assert_array_equal(out[0], [-3.0, -6.0])
    np.testing.assert_array_equal(out[1], [1.0, 2.0])
    np.testing.assert_array_equal(out[2], [3.0, 6.0])
    np.testing.assert_array_equal(out[3], [-3.0, -6.0])


def test_unknown_backend_lists_known_ones():
    tp = gt.Tape()
    x = tp.param(np.ones(2))
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; known backends: .*numpy"):
        tp.compile([x], backend="tpu")


# --- the memory plan --------------------------------------------------------------------

def _chain(tp, xa, n_ops):
    """n_ops elementwise ops on a [64, 64] input (a long dependent chain)."""
    x = tp.param(xa)
    y = x
    for i in range(n_ops):
        y = [lambda v: ops.tanh(v), lambda v: ops.scale(v, 1.01),
             lambda v: ops.addc(v, 0.01), lambda v: ops.mul(v, x)][i % 4](y)
    return x, y


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_plan_reuses_buffers_on_a_long_chain(backend):
    rng = np.random.default_rng(5)
    tp = gt.Tape()
    x, y = _chain(tp, rng.standard_normal((64, 64)) * 0.1, 200)
    loss = ops.reduce_sum(y)
    g = tp.backward(loss)[x]
    prog = tp.compile([loss, g], backend=backend)
    n_ops = len(prog.graph.ops)
    assert n_ops > 400  # forward chain plus its backward
    plan = prog.memory
    # forward values live until backward reads them, so what can be reused are the
    # backward's temporaries and the forward-only chain; still far below one per op
    assert plan.n_buffers < n_ops / 2, (plan.n_buffers, n_ops)
    # forward only: a dependent chain needs a handful of buffers, not 200
    tp2 = gt.Tape()
    x2, y2 = _chain(tp2, rng.standard_normal((64, 64)), 200)
    prog2 = tp2.compile([ops.reduce_sum(y2)], backend=backend)
    assert len(prog2.graph.ops) == 201
    assert prog2.memory.n_buffers <= 4, prog2.memory.n_buffers
    assert prog2.memory.nbytes <= 4 * 64 * 64 * 8


def test_memory_plan_never_overwrites_a_live_value():
    """Every op's output buffer differs from the buffers of the values it reads, and no two
    simultaneously live values share a buffer (checked on a graph with backward ops); a
    reshape shares its input's region (a view: the two live as one)."""
    rng = np.random.default_rng(6)
    tp = gt.Tape()
    (x, w, b, tgt), loss, grads = _build(tp, *_data(rng))
    outs = [loss, *grads.values()]
    prog = tp.compile(outs)
    g, plan = prog.graph, prog.memory
    pos = {v: i for i, v in enumerate(g.ops)}
    last = {v: (len(g.ops) if v in outs else pos[v]) for v in g.ops}
    for i, v in enumerate(g.ops):
        for x_ in v.inputs:
            if x_ in pos:
                last[x_] = max(last[x_], i)
    views = memplan.reshape_views(g.ops)
    assert views  # the loss's reshapes
    root = {}
    for v in g.ops:
        r = v
        while r in views:
            r = views[r]
        root[v] = r
    for v in g.ops:  # a view keeps its root's region alive
        pos[root[v]] = min(pos[root[v]], pos[v])
        last[root[v]] = max(last[root[v]], last[v])
    for v in g.ops:
        pos[v], last[v] = pos[root[v]], last[root[v]]
    region = {v: (plan.slot[v], plan.offset.get(v, 0), plan.offset.get(v, 0) + v.size)
              for v in g.ops}
    for a in g.ops:
        for b_ in g.ops:
            (sa, a0, a1), (sb, b0, b1) = region[a], region[b_]
            if root[a] is root[b_]:
                assert region[a] == region[root[a]]
                continue
            if sa != sb or a1 <= b0 or b1 <= a0:
                continue
            # overlapping memory: live ranges [pos, last] must not touch (an op that
            # wrote where its input lives would read what it overwrites)
            lo, hi = (a, b_) if pos[a] < pos[b_] else (b_, a)
            assert last[lo] < pos[hi], (lo, hi)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_memory_plan_regions_are_cache_line_aligned_and_staggered(backend):
    """The host arenas start on a page; every region on a 64-byte line; the equal-sized
    values of a wide layer do not all start at one offset within a page (a kernel storing
    one while loading another there stalls: 4K aliasing)."""
    rng = np.random.default_rng(7)
    tp = gt.Tape()
    x, y = _chain(tp, rng.standard_normal((256, 256)).astype(np.float32), 40)
    prog = tp.compile([ops.reduce_sum(y), tp.backward(ops.reduce_sum(y))[x]],
                      backend=backend)
    ex = prog.executable
    assert all(b.ctypes.data % 4096 == 0 for b in ex._buffers)
    starts = [ex._values[v].ctypes.data for v in prog.graph.ops if v in prog.memory.slot]
    assert all(a % 64 == 0 for a in starts)
    big = [ex._values[v].ctypes.data for v in prog.graph.ops
           if v in prog.memory.slot and v.size == 256 * 256]
    offsets = {a % 4096 for a in set(big)}
    lines = 4096 // (memplan.ALIGN * y.dtype.itemsize)  # the offsets a region can start at
    assert len(set(big)) >= 2
    assert len(offsets) >= min(len(set(big)), lines) // 2, sorted(offsets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replays_allocate_nothing_new(backend):
    rng = np.random.default_rng(8)
    tp = gt.Tape()
    x, y = _chain(tp, rng.standard_normal((64, 64)) * 0.1, 200)
    loss = ops.reduce_sum(y)
    g = tp.backward(loss)[x]
    prog = tp.compile([loss, g], backend=backend)
    buffers_before = prog.memory.buffer_sizes
    xa = rng.standard_normal((64, 64)) * 0.1
    prog.run({x: xa})  # first run: may own the fed leaf
    gc.collect()
    tracemalloc.start()
    try:
        prog.run({x: xa})
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            out = prog.run({x: xa})
            del out
        gc.collect()
        cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one = 64 * 64 * 8
    assert cur - base < one, (cur - base)  # nothing retained across replays
    # the peak holds the returned outputs and per-op temporaries, never the plan again
    assert peak - base < 4 * one + 64 * 1024, (peak - base)
    assert prog.memory.buffer_sizes == buffers_before
    # the buffers exist (allocated once, at compile): at least the [64, 64] gradient output
    # (rematerialization keeps the 200-op chain itself from being stored for backward)
    assert prog.memory.nbytes >= one


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["prev_first", "cur_first"])
def test_updates_are_simultaneous(backend, order):
    """Every update reads the values from before the run's updates: {prev: cur, cur: new}
    keeps the previous value whatever the dict order, and {a: b, b: a} swaps."""
    tp = gt.Tape()
    prev = tp.param(np.array([0.0]))
    cur = tp.param(np.array([1.0]))
    new = ops.addc(ops.scale(cur, 2.0), 1.0)  # cur <- 2 cur + 1
    upd = {prev: cur, cur: new} if order == "prev_first" else {cur: new, prev: cur}
    prog = tp.compile([new], backend=backend, updates=upd)
    seq = [1.0]
    for _ in range(3):
        prog.run()
        seq.append(2 * seq[-1] + 1)
        np.testing.assert_array_equal(prog.state(cur), [seq[-1]])
        np.testing.assert_array_equal(prog.state(prev), [seq[-2]])
    tp = gt.Tape()
    a, b = tp.param(np.array([1.0])), tp.param(np.array([2.0]))
    prog = tp.compile([ops.add(a, b)], backend=backend, updates={a: b, b: a})
    for i in range(3):
        prog.run()
        np.testing.assert_array_equal([prog.state(a), prog.state(b)],
                                      [[1.0], [2.0]] if i % 2 else [[2.0], [1.0]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_program_without_outputs(backend):
    tp = gt.Tape()
    x = tp.param(np.ones(2))
    prog = tp.compile([], backend=backend)
    assert prog.run() == []
    with pytest.raises(ValueError, match=r"run: feed key .* is not a leaf \(param or const\) "
                                         r"of this program's tape"):
        prog.run({x: np.ones(2)})


# --- random graphs: replay and memory plan on arbitrary DAGs ------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_UNARY = [lambda v: ops.tanh(v), lambda v: ops.scale(v, 0.7), lambda v: ops.sigmoid(v),
          lambda v: ops.exp(ops.scale(v, 0.1)), lambda v: ops.softmax(v, 1),
          lambda v: ops.transpose(ops.transpose(v)),
          lambda v: ops.add(v, ops.reduce_sum(v, 1, keepdims=True)),  # [4,1] column
          lambda v: ops.mul(v, ops.reduce_sum(v, 0)),  # [5] row
          lambda v: ops.concat([ops.slice_(v, 1, 2, 5), ops.slice_(v, 1, 0, 2)], 1)]
_BINARY = [ops.add, ops.sub, ops.mul, lambda a, b: ops.matmul(ops.matmul(a, b, tb=True), a)]


def _random_graph(tp, recipe, leaves):
    vs = [tp.param(a) for a in leaves]
    for kind, i, j in recipe:
        a, b = vs[i % len(vs)], vs[j % len(vs)]
        if kind < len(_UNARY):
            vs.append(_UNARY[kind](a))
        else:
            vs.append(ops.scale(_BINARY[kind - len(_UNARY)](a, b), 0.5))
    return vs


@settings(max_examples=40, deadline=None)
@given(recipe=st.lists(st.tuples(st.integers(0, len(_UNARY) + len(_BINARY) - 1),
                                  st.integers(0, 10 ** 6), st.integers(0, 10 ** 6)),
                       min_size=1, max_size=25),
       outs=st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=4),
       with_grad=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_random_graphs_replay_bitwise(recipe, outs, with_grad, seed):
    rng = np.random.default_rng(seed)
    leaves = [rng.standard_normal((4, 5)) * 0.5 for _ in range(2)]
    tp = gt.Tape()
    vs = _random_graph(tp, recipe, leaves)
    chosen = [vs[2 + o % (len(vs) - 2)] for o in outs]
    if with_grad:
        loss = ops.reduce_sum(ops.mul(chosen[0], chosen[0]))
        chosen += list(tp.backward(loss).values())
    idx = [v.index for v in chosen]
    for backend in BACKENDS:
        prog = tp.compile(chosen, backend=backend)
        _check(prog.run(), [v.value for v in chosen], backend, np.float64)
        new = [rng.standard_normal((4, 5)) * 0.5 for _ in range(2)]
        got = prog.run({vs[0]: new[0], vs[1]: new[1]})
        tp2 = gt.Tape()
        vs2 = _random_graph(tp2, recipe, new)
        if with_grad:
            c2 = [vs2[2 + o % (len(vs2) - 2)] for o in outs]
            tp2.backward(ops.reduce_sum(ops.mul(c2[0], c2[0])))
        _check(got, [tp2.vars[i].value for i in idx], backend, np.float64)
