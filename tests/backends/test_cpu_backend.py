"""The cpu backend against the NumPy reference: every primitive (forward and backward),
random fused graphs, the nn layers; the fusion pass's group structure; the compile cache;
the fallback without a C compiler.

Tolerances (max |cpu - numpy| / max |numpy| per output):
* float64: 1e-10.  The C kernels use the same formulas and libm functions as the NumPy
  forwards; what differs is summation order (row sums accumulate in double, vectorized,
  where NumPy sums pairwise) and division-free rewrites are not used, so the observed
  error is ~1e-15; 1e-10 is the issue's bound.
* float32: 2e-5.  float32 exp is our own vectorizable polynomial (<= 1 ulp, NumPy's is
  <= 2.4 ulp measured), row sums accumulate in double instead of float32 pairwise, and a
  backward graph chains ~10-30 rounding steps and cancellations (softmax VJP:
  g - sum(g * y)); observed errors are ~1e-6.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops
from gradtape.backends import lowering
from gradtape.backends.cpu import toolchain
from gradtape.compile.fuse import (LATE_JOIN_SPAN, FusedGroup, fuse, plan_schedule_memory,
                                   prefix_level)
from gradtape.compile.graph import build_graph
from gradtape.blocks import random_blocks
from gradtape.ops import PRIMS

from support import parity
from support.compare import rel_err

DTYPES = [np.float64, np.float32]


def cpu_program(tp, outputs, updates=None):
    prog = tp.compile(outputs, backend="cpu", updates=updates)
    assert prog.backend == "cpu"
    return prog


def compare(tp, outputs, feeds_list=({},), updates=None, ref64=None):
    """The cpu program of ``outputs`` against the NumPy reference: (program, worst)."""
    prog = cpu_program(tp, outputs, updates)
    return prog, parity.compare(tp, outputs, prog, updates, feeds_list, ref64)


def check_built(build, dtype, **kw):
    return parity.check_built(build, dtype, cpu_program, **kw)


# --- every primitive, forward and backward --------------------------------------------------

T, N, V = 5, 7, 6


def _pos(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def _nrm(rng, *shape):
    return rng.standard_normal(shape)


# name -> builder(tp, rng) returning the op's output Var (inputs are params, so backward
# records that primitive's VJP ops too)
PRIM_CASES = {
    "add": lambda tp, r: ops.add(tp.param(_nrm(r, T, N)), tp.param(_nrm(r, N))),
    "sub": lambda tp, r: ops.sub(tp.param(_nrm(r, T, 1)), tp.param(_nrm(r, T, N))),
    "mul": lambda tp, r: ops.mul(tp.param(_nrm(r, T, N)), tp.param(_nrm(r, T, 1))),
    "div": lambda tp, r: ops.div(tp.param(_nrm(r, T, N)), tp.param(_pos(r, N))),
    "neg": lambda tp, r: ops.neg(tp.param(_nrm(r, T, N))),
    "scale": lambda tp, r: ops.scale(tp.param(_nrm(r, T, N)), 0.37),
    "addc": lambda tp, r: ops.addc(tp.param(_nrm(r, T, N)), -1.25),
    "powc": lambda tp, r: ops.powc(tp.param(_pos(r, T, N)), 1.7),
    "exp": lambda tp, r: ops.exp(tp.param(_nrm(r, T, N))),
    "log": lambda tp, r: ops.log(tp.param(_pos(r, T, N))),
    "sqrt": lambda tp, r: ops.sqrt(tp.param(_pos(r, T, N))),
    "rsqrt": lambda tp, r: ops.rsqrt(tp.param(_pos(r, T, N))),
    "sigmoid": lambda tp, r: ops.sigmoid(tp.param(_nrm(r, T, N) * 3)),
    "tanh": lambda tp, r: ops.tanh(tp.param(_nrm(r, T, N))),
    "softmax": lambda tp, r: ops.softmax(tp.param(_nrm(r, T, N) * 3), 1),
    "logsumexp": lambda tp, r: ops.logsumexp(tp.param(_nrm(r, T, N) * 3), 1),
    "matmul": lambda tp, r: ops.matmul(tp.param(_nrm(r, N, T)), tp.param(_nrm(r, N, 4)),
                                       ta=True),
    "transpose": lambda tp, r: ops.transpose(tp.param(_nrm(r, T, N))),
    "reshape": lambda tp, r: ops.reshape(tp.param(_nrm(r, T, N)), (N, T)),
    "slice": lambda tp, r: ops.slice_(tp.param(_nrm(r, T, N)), 1, 2, 5),
    "pad": lambda tp, r: ops.pad(tp.param(_nrm(r, T, N)), 0, 1, 2),
    "concat": lambda tp, r: ops.concat([tp.param(_nrm(r, T, 3)), tp.param(_nrm(r, T, N))], 1),
    "sum": lambda tp, r: ops.reduce_sum(tp.param(_nrm(r, T, N)), 1, keepdims=True),
    "sum_to": lambda tp, r: ops.sum_to(tp.param(_nrm(r, T, N)), (N,)),
    "broadcast_to": lambda tp, r: ops.broadcast_to(tp.param(_nrm(r, T, 1)), (T, N)),
    "take_rows": lambda tp, r: ops.take_rows(tp.param(_nrm(r, V, N)),
                                             tp.const(np.array([0, 3, 3, 5, 1]))),
    "scatter_rows": lambda tp, r: ops.scatter_rows(tp.param(_nrm(r, T, N)),
                                                   tp.const(np.array([0, 3, 3, 5, 1])), V),
    "pick": lambda tp, r: ops.pick(tp.param(_nrm(r, T, N)), tp.const(np.array([0, 6, 2, 2, 4]))),
    "put": lambda tp, r: ops.put(tp.param(_nrm(r, T, 1)), tp.const(np.array([0, 6, 2, 2, 4])), N),
    "nll_ids": lambda tp, r: ops.nll_ids(tp.param(_nrm(r, T, N)), tp.const(np.array([0, 6, 2, 2, 4]))),
    "nll_ids_grad": lambda tp, r: ops.nll_ids_grad(tp.param(_nrm(r, T, 1)), tp.param(_nrm(r, T, N)),
                                                   tp.const(np.array([0, 6, 2, 2, 4]))),
    "rope": lambda tp, r: ops.rope(tp.param(_nrm(r, T, 6)), tp.param(_nrm(r, T, 3)),
                                   tp.param(_nrm(r, T, 3))),
    "select": lambda tp, r: ops.select(tp.const((r.uniform(size=(T, N)) > 0.5) * 1.0),
                                       tp.param(_nrm(r, T, N)), tp.param(_nrm(r, N))),
    "maxc": lambda tp, r: ops.maxc(tp.param(_nrm(r, T, N)), 0.2),
    "gtc": lambda tp, r: ops.gtc(tp.param(_nrm(r, T, N)), 0.2),
    "detach": lambda tp, r: ops.detach(ops.tanh(tp.param(_nrm(r, T, N)))),
    # frozen weights in their stored type (every ggml type: tests/backends/test_qgemm.py)
    "qmatmul": lambda tp, r: ops.qmatmul(tp.param(_nrm(r, T, 64)),
                                         tp.const(random_blocks("Q4_0", N, 64, r))),
    "qmatmul_t": lambda tp, r: ops.qmatmul_t(tp.param(_nrm(r, T, N)),
                                             tp.const(random_blocks("Q8_0", N, 64, r))),
    "qtake_rows": lambda tp, r: ops.qtake_rows(tp.const(random_blocks("Q4_K", V, 256, r)),
                                               tp.const(np.array([0, 3, 3, 5, 1]))),
    # fused primitives (tests/core/test_tiled_*.py): the head over a vocabulary of V rows
    # and attention over 2 sequences with 4 heads sharing 2 kv heads, tiles of 2 rows
    "head_nll": lambda tp, r: ops.head_nll(tp.param(_nrm(r, T, N)), tp.param(_nrm(r, V, N)),
                                           tp.const(np.array([0, 5, 2, 2, 4])), 2.5),
    "head_nll_e": lambda tp, r: ops.head_nll(tp.param(_nrm(r, T, N)), tp.param(_nrm(r, V, N)),
                                             tp.const(np.array([0, 5, 2, 2, 4])),
                                             grad_in_forward=True).inputs[0],  # unsliced
    "head_rows": lambda tp, r: ops._rec("head_rows", tp.const(_nrm(r, V, N)),
                                        tp.const(np.array([0, 5, 2, 2, 4]))),
    "head_nll_grad_x": lambda tp, r: _grad_case(tp, r, "head_nll_grad_x", _head_case),
    "head_nll_grad_w": lambda tp, r: _grad_case(tp, r, "head_nll_grad_w", _head_case),
    "attn": lambda tp, r: _attn_case(tp, r, tp.param),
    "attn_grad": lambda tp, r: _grad_case(tp, r, "attn_grad", _attn_case),
}


def _head_case(tp, r, leaf):
    return ops.head_nll(leaf(_nrm(r, T, N)), leaf(_nrm(r, V, N)),
                        tp.const(np.array([0, 5, 2, 2, 4])), 2.5)


def _attn_case(tp, r, leaf):
    """Two sequences of 6 rows, 4 query heads on 2 kv heads of 3 dims, a window of 4,
    soft-capped scores and two packed segments in the second sequence."""
    q, k, v = (leaf(_nrm(r, 12, n * 3)) for n in (4, 2, 2))
    seg = tp.const(np.array([0] * 6 + [0, 0, 0, 1, 1, 1]))
    return ops.attn(q, k, v, nn.AttentionSpec(nh=4, nkv=2, hd=3, iscale=0.6, softcap=2.0,
                                               window=4, n_seq=2, tile=2), seg)


def _grad_case(tp, r, name, fwd_case):
    """A fused gradient primitive on the forward's own output (all consts: its forward
    values are what the parity compares; it has no VJP)."""
    y = fwd_case(tp, r, tp.const)
    return ops._rec(name, tp.const(_nrm(r, *y.shape)), *y.inputs[:3], y, *y.inputs[3:],
                    **y.attrs)


def _loss_of(tp, out, rng):
    """sum(u * out) + 1/2 sum(c * out^2): the gradient depends on out, so the VJP ops
    run on non-trivial cotangents."""
    u = tp.const(rng.standard_normal(out.shape))
    c = tp.const(rng.standard_normal(out.shape))
    return ops.add(ops.reduce_sum(ops.mul(out, u)),
                   ops.scale(ops.reduce_sum(ops.mul(ops.mul(out, out), c)), 0.5))


def test_every_primitive_has_a_case():
    missing = sorted(set(PRIMS) - set(PRIM_CASES))
    assert not missing, f"add cpu-backend parity cases for {missing}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PRIM_CASES))
def test_primitive_parity(name, dtype):
    def build(tp):
        rng = np.random.default_rng(sorted(PRIM_CASES).index(name))
        out = PRIM_CASES[name](tp, rng)
        assert out.op == name
        loss = _loss_of(tp, out, rng)
        return [out, loss, *tp.backward(loss).values()]

    check_built(build, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("by_loss", [False, True], ids=["sft", "weights-from-loss"])
def test_the_loss_and_its_gradient_share_one_pass(dtype, by_loss):
    """Token weights that do not depend on the loss (SFT): the gradient runs right after
    the loss and one kernel writes both (``loss_pairs``); weights computed from the loss
    (as DPO's are): two kernels, in recording order.  Either way the gradient is written
    over the logits.  Both as the NumPy reference."""
    def build(tp):
        r = np.random.default_rng(4)
        logits = ops.matmul(tp.param(_nrm(r, T, N)), tp.param(_nrm(r, N, V)))
        nll = ops.nll_ids(logits, tp.const(np.array([0, 5, 2, 2, 4])))
        weights = tp.const(r.uniform(0.1, 1.0, (T, 1)))
        if by_loss:
            weights = ops.mul(weights, ops.sigmoid(nll))
        loss = ops.reduce_sum(ops.mul(nll, weights))
        return [nll, loss, *tp.backward(loss).values()]

    prog, _ = check_built(build, dtype)
    pairs = prog.executable._loss_pair
    assert len(pairs) == (0 if by_loss else 1)
    steps = [s for s in prog.executable.schedule.steps if not isinstance(s, FusedGroup)]
    ops_of = [s.op for s in steps]
    assert ops_of.count("nll_ids") == ops_of.count("nll_ids_grad") == 1
    n, d = ops_of.index("nll_ids"), ops_of.index("nll_ids_grad")
    assert (d == n + 1) == (not by_loss)
    # the logits' gradient takes the logits' region, which nothing reads after it
    plan, grad = prog.executable.plan, steps[d]
    logits = grad.inputs[1]
    assert (plan.slot[grad], plan.offset[grad]) == (plan.slot[logits], plan.offset[logits])


def test_large_copies_split_over_threads_are_the_copies():
    """Slices, pads and concats big enough to split over the threads (by rows, or one
    contiguous block in chunks): the very values NumPy's forwards give."""
    tp = gt.Tape(np.float32)
    r = np.random.default_rng(8)
    flat, rows = tp.param(r.standard_normal(150_001)), tp.param(r.standard_normal((999, 70)))
    outs = [ops.slice_(flat, 0, 7, 140_003), ops.slice_(rows, 1, 3, 64),
            ops.slice_(rows, 0, 2, 990), ops.pad(rows, 1, 5, 9),
            ops.concat([rows, ops.neg(rows)], 1), ops.concat([rows, rows], 0)]
    got = cpu_program(tp, outs).run()
    want = tp.compile(outs, backend="numpy").run()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# --- random fused graphs ---------------------------------------------------------------------

UNARY = ["neg", "exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "scale", "addc", "powc",
         "maxc", "gtc"]
BINARY = ["add", "sub", "mul", "div"]


def _random_graph(tp, rng, n_ops=25):
    """A random DAG over [T, n] values with [n] rows, [T, 1] columns and scalars mixed in,
    matmuls, and last-axis reductions (their results broadcast back as columns)."""
    t, n = int(rng.integers(3, 9)), int(rng.integers(2, 40))
    pool = [tp.param(rng.standard_normal((t, n))) for _ in range(3)]
    pool += [tp.param(rng.standard_normal(n)), tp.param(rng.standard_normal((t, 1))),
             tp.param(rng.standard_normal(()))]
    w = tp.param(rng.standard_normal((n, n)) / np.sqrt(n))

    def bounded(x):  # keep values O(1) so exp/log/div stay well conditioned
        return ops.tanh(x)

    for _ in range(n_ops):
        r = rng.uniform()
        a = pool[int(rng.integers(len(pool)))]
        if r < 0.35:
            op = UNARY[int(rng.integers(len(UNARY)))]
            if op in ("log", "sqrt", "rsqrt"):
                v = getattr(ops, op)(ops.addc(ops.mul(a, a), 0.5))
            elif op == "exp":
                v = ops.exp(bounded(a))
            elif op == "powc":
                v = ops.powc(ops.addc(ops.mul(a, a), 0.5), float(rng.choice([2.0, 1.5, -1.0, 0.5])))
            elif op in ("scale", "addc", "maxc", "gtc"):
                v = getattr(ops, op)(a, float(rng.standard_normal()))
            else:
                v = getattr(ops, op)(a)
        elif r < 0.7:
            b = pool[int(rng.integers(len(pool)))]
            op = BINARY[int(rng.integers(len(BINARY)))]
            if op == "div":
                b = ops.addc(ops.mul(b, b), 1.0)
            v = getattr(ops, op)(a, b)
        elif r < 0.8:
            full = [p for p in pool if p.shape == (t, n)]
            v = ops.matmul(bounded(full[int(rng.integers(len(full)))]), w)
        elif r < 0.9:
            full = [p for p in pool if p.shape == (t, n)]
            x = full[int(rng.integers(len(full)))]
            kind = rng.integers(3)
            if kind == 0:
                v = ops.softmax(ops.scale(bounded(x), 3.0), 1)
            elif kind == 1:
                v = ops.logsumexp(bounded(x), 1)
            else:
                v = ops.reduce_sum(x, 1, keepdims=True)
        else:
            b = pool[int(rng.integers(len(pool)))]
            c = tp.const((rng.uniform(size=(t, n)) > 0.5) * 1.0)
            v = ops.select(c, a, b)
        pool.append(bounded(v) if rng.uniform() < 0.3 else v)
    outs = [p for p in pool[-8:] if p.requires_grad]
    total = ops.reduce_sum(ops.mul(outs[0], outs[0]))
    for o in outs[1:]:
        total = ops.add(total, ops.reduce_sum(ops.mul(o, tp.const(rng.standard_normal(o.shape)))))
    return total, outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
def test_random_graph_parity(seed, dtype):
    def build(tp):
        loss, outs = _random_graph(tp, np.random.default_rng(seed))
        return [loss, *outs, *tp.backward(loss).values()]

    prog, _ = check_built(build, dtype)
    assert prog.executable.schedule.groups  # something was fused


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_parity(dtype):
    """rmsnorm, layernorm, swiglu, GQA attention with rope and mask, both cross-entropies."""
    def build(tp):
        rng = np.random.default_rng(1)
        t, h, nh, nkv, hd, vocab = 6, 16, 4, 2, 4, 11
        x = tp.param(rng.standard_normal((t, h)))
        ones = nn.ones(tp, h)
        xn = nn.rmsnorm(tp, x, tp.param(1 + 0.1 * rng.standard_normal(h)), ones, h, 1e-5)
        xl = nn.layernorm(tp, x, tp.param(rng.standard_normal(h)), tp.param(rng.standard_normal(h)),
                          ones, h, 1e-5)
        wq = tp.param(rng.standard_normal((h, nh * hd)) / 4)
        wk = tp.param(rng.standard_normal((h, nkv * hd)) / 4)
        wv = tp.param(rng.standard_normal((h, nkv * hd)) / 4)
        cos, sin = nn.rope_fill(t, hd, 10000.0)
        mask = tp.const(nn.causal_mask_fill(t))
        att = nn.gqa_attention(tp, nn.linear(tp, xn, wq), nn.linear(tp, xn, wk), nn.linear(tp, xl, wv),
                               tp.const(cos), tp.const(sin), mask, t, nh, nkv, hd, hd ** -0.5)
        wg = tp.param(rng.standard_normal((nh * hd, 24)) / 4)
        wu = tp.param(rng.standard_normal((nh * hd, 24)) / 4)
        mlp = nn.swiglu(tp, nn.linear(tp, att, wg), nn.linear(tp, att, wu))
        logits = nn.linear(tp, mlp, tp.param(rng.standard_normal((24, vocab)) / 4))
        targets = rng.integers(0, vocab, t)
        onehot = np.eye(vocab)[targets]
        l1 = nn.cross_entropy(tp, logits, tp.const(onehot), nn.ones(tp, vocab))
        ids, wts = nn.ce_targets_fill(targets)
        l2 = nn.cross_entropy_ids(tp, logits, tp.const(ids), tp.const(wts))
        loss = ops.add(l1, l2)
        grads = tp.backward(loss)
        return [loss, att, mlp, *grads.values()]

    check_built(build, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,to", [((5, 7), (7,)), ((5, 7), (1, 7)), ((5, 7), (5, 1)),
                                      ((1, 7), (7,)), ((5, 1), (5, 1)), ((1, 1), (1,))])
def test_sum_to_kernels(shape, to, dtype):
    def build(tp):
        x = tp.param(np.random.default_rng(0).standard_normal(shape))
        return [ops.sum_to(ops.exp(x), to)]

    check_built(build, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_with_feeds_and_updates(dtype):
    """A tiny SGD step as state updates: both backends track each other over replays,
    with fed leaves changing every run and a non-contiguous leaf."""
    rng = np.random.default_rng(3)
    tp = gt.Tape(dtype)
    x = tp.const(rng.standard_normal((6, 5)))
    w = tp.param(rng.standard_normal((5, 5)))
    b = tp.param(rng.standard_normal(5))
    tcol = tp.const(np.asfortranarray(rng.standard_normal((6, 5))))  # non-contiguous
    y = ops.softmax(ops.add(ops.matmul(x, w), b), 1)
    loss = ops.reduce_sum(ops.mul(ops.sub(y, tcol), ops.sub(y, tcol)))
    g = tp.backward(loss)
    upd = {w: ops.sub(w, ops.scale(g[w], 0.1)), b: ops.sub(b, ops.scale(g[b], 0.1))}
    feeds = [{x: rng.standard_normal((6, 5))} for _ in range(3)] + [{}]
    prog, _ = compare(tp, [loss, g[w]], feeds, updates=upd)
    assert prog.state(w).shape == (5, 5)


@pytest.mark.parametrize("backend", ["cpu", "numpy"])
def test_leaves_fed_for_the_first_time_bind_the_steps_once(backend, monkeypatch):
    """A program fed many leaves it does not own yet (an eval program fed the adapter)
    copies each, and binds its steps to the copies once before the replay, not once per
    leaf; set_state then run does the same.  The results follow the feeds."""
    rng = np.random.default_rng(4)
    tp = gt.Tape(np.float32)
    x = tp.const(rng.standard_normal((3, 4)))
    ws = [tp.param(rng.standard_normal((4, 4))) for _ in range(6)]
    y = x
    for w in ws:
        y = ops.matmul(y, w)
    prog = tp.compile([ops.reduce_sum(y)], backend=backend)
    ex = prog.executable
    binds = []
    real = ex._bind_steps
    monkeypatch.setattr(ex, "_bind_steps", lambda val: binds.append(1) or real(val))
    new = {w: rng.standard_normal((4, 4)).astype(np.float32) for w in ws}
    (got,) = prog.run(new)
    want = x.value
    for w in ws:
        want = want @ new[w]
    assert len(binds) == 1
    assert rel_err(got, want.sum()) < 1e-5
    prog.run(new)
    assert len(binds) == 1  # owned now: nothing to bind again
    prog2 = tp.compile([ops.reduce_sum(y)], backend=backend)
    real2, binds2 = prog2.executable._bind_steps, []
    monkeypatch.setattr(prog2.executable, "_bind_steps",
                        lambda val: binds2.append(1) or real2(val))
    prog2.set_state(new)
    (got2,) = prog2.run()
    assert len(binds2) == 1 and rel_err(got2, want.sum()) < 1e-5


def test_float32_replay_flushes_denormals_and_puts_the_mode_back():
    """A float32 replay takes denormals as zero (codegen.DENORMALS: Intel cores pay a
    microcode assist per denormal); float64, the exact reference, keeps them; the
    caller's floating-point mode is the same after the replay."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flush is MXCSR's, x86 only")
    tiny = {np.float32: 1e-20, np.float64: 1e-160}  # squares: denormals of each
    for dtype in (np.float32, np.float64):
        tp = gt.Tape(dtype)
        x = tp.const(np.full(64, tiny[dtype]))
        sq = ops.mul(x, ops.add(x, x))  # one fused kernel: 2 * tiny^2, a denormal
        prog = tp.compile([sq], backend="cpu")
        got = prog.run()[0]
        want = np.full(64, 2 * dtype(tiny[dtype]) ** 2, dtype)
        assert 0 < want[0] < np.finfo(dtype).tiny  # a denormal in eager NumPy
        if dtype == np.float32:
            assert np.all(got == 0)
        else:
            np.testing.assert_array_equal(got, want)
        # NumPy on this thread makes denormals again after the replay
        assert 0 < np.float32(1e-20) * np.float32(1e-20) < np.finfo(np.float32).tiny


# --- the fusion pass ------------------------------------------------------------------------

def _schedule(outputs, **kw):
    tp = outputs[0].tape
    return fuse(build_graph(tp, outputs, None), **kw)


def test_prefix_level():
    assert prefix_level((4, 1), (4, 8)) == 1
    assert prefix_level((4, 8), (4, 8)) == 2
    assert prefix_level((), (4, 8)) == 0
    assert prefix_level((8,), (4, 8)) is None  # a row varies along the inner axis only
    assert prefix_level((8,), (1, 8)) == 2


def test_chain_is_one_group_and_internals_need_no_buffer():
    tp = gt.Tape()
    x = tp.param(np.ones((4, 8)))
    w = tp.param(np.ones(8))
    y = ops.exp(ops.mul(ops.addc(ops.scale(x, 2.0), 1.0), w))
    sched = _schedule([y])
    (g,) = sched.steps
    assert isinstance(g, FusedGroup) and g.kind == "elementwise"
    assert [v.op for v in g.ops] == ["scale", "addc", "mul", "exp"]
    assert set(g.inputs) == {x, w} and g.outputs == (y,)
    assert g.domain == (4, 8)
    plan = plan_schedule_memory(sched)
    assert set(plan.slot) == {y}  # scale, addc, mul live in registers


def test_kernel_calls_one_at_a_time_are_the_replay():
    """``kernel_calls`` (what bench/profile_step.py --kernels times) lists every generated
    kernel call of the replay in order, each labelled: run one by one they compute what
    the replay computes (this program has no other steps)."""
    rng = np.random.default_rng(3)
    tp = gt.Tape(np.float32)
    x = tp.param(rng.standard_normal((6, 16)).astype(np.float32))
    h = ops.reshape(ops.softmax(ops.scale(x, 0.5), 1), (2, 3, 16))
    loss = ops.reduce_sum(ops.mul(h, h))
    prog = cpu_program(tp, [loss, tp.backward(loss)[x]])
    ex = prog.executable
    want = [o.copy() for o in prog.run()]
    calls = ex.kernel_calls()
    assert all(getattr(f, "func", None) is ex.lib.gt_run for f in ex._steps)
    assert sum(f.args[2] for f in ex._steps) == len(calls) > 1
    assert "rowreduce [6, 16] [scale,softmax]" in [label for _, label, _ in calls]
    for o in ex._outputs:
        o.fill(np.nan)
    for _, _, run in calls:
        run()
    for got, ref in zip(ex._outputs, want):
        np.testing.assert_array_equal(got, ref)


def test_no_fusion_across_matmul():
    tp = gt.Tape()
    x = tp.param(np.ones((4, 8)))
    w = tp.param(np.ones((8, 8)))
    y = ops.tanh(ops.matmul(ops.exp(x), w))
    steps = _schedule([y]).steps
    assert [type(s).__name__ for s in steps] == ["FusedGroup", "Var", "FusedGroup"]
    assert steps[1].op == "matmul"
    assert [v.op for v in steps[0].ops] == ["exp"] and [v.op for v in steps[2].ops] == ["tanh"]


def test_column_chain_joins_wider_group_hoisted():
    """rmsnorm: the [T, 1] chain scale -> addc -> rsqrt joins the [T, n] multiply."""
    tp = gt.Tape()
    x = tp.param(np.ones((4, 8)))
    y = nn.rmsnorm(tp, x, tp.param(np.ones(8)), nn.ones(tp, 8), 8, 1e-5)
    steps = _schedule([y]).steps
    ops_ = [[v.op for v in s.ops] if isinstance(s, FusedGroup) else s.op for s in steps]
    assert ops_ == [["mul"], "matmul", ["scale", "addc", "rsqrt", "mul", "mul"]]
    assert steps[2].domain == (4, 8) and steps[2].outputs == (y,)


def test_row_reduction_closes_group():
    tp = gt.Tape()
    x = tp.param(np.ones((4, 8)))
    m = tp.const(np.zeros((4, 8)))
    p = ops.softmax(ops.add(ops.scale(x, 0.5), m), 1)
    z = ops.exp(p)
    steps = _schedule([z]).steps
    assert steps[0].kind == "rowreduce" and [v.op for v in steps[0].ops] == ["scale", "add",
                                                                              "softmax"]
    assert steps[0].outputs == (p,)
    assert steps[1].kind == "elementwise" and steps[1].inputs == (p,)
    # without reductions the softmax stays a single op
    steps = _schedule([z], reductions=False).steps
    assert [type(s).__name__ for s in steps] == ["FusedGroup", "Var", "FusedGroup"]


def test_no_cycle_when_a_member_was_read_outside():
    """x = exp(a) feeds a matmul; a later x-consumer cannot join x's group (the group
    would have to run both before and after the matmul)."""
    tp = gt.Tape()
    a = tp.param(np.ones((4, 4)))
    x = ops.exp(a)
    mm = ops.matmul(x, a)
    y = ops.add(x, mm)
    steps = _schedule([y]).steps
    assert [v.op for v in steps[0].ops] == ["exp"] and steps[0].outputs == (x,)
    assert steps[1] is mm and [v.op for v in steps[2].ops] == ["add"]


def test_a_product_operand_recorded_after_a_sealed_group_joins_it():
    """x = exp(a) feeds a matmul, then scale(x) feeds another: the scale reads nothing
    made after x's group, and no elementwise op reads it, so it is computed in that group
    (one pass over x fewer) and the products still read what they recorded."""
    rng = np.random.default_rng(0)
    tp = gt.Tape()
    a = tp.param(rng.standard_normal((4, 4)))
    w = tp.param(rng.standard_normal((4, 4)))
    x = ops.exp(a)
    mm = ops.matmul(x, w)
    s = ops.scale(x, 0.5)
    y = ops.matmul(s, w)
    steps = _schedule([mm, y]).steps
    assert [v.op for v in steps[0].ops] == ["exp", "scale"] and steps[0].outputs == (x, s)
    assert steps[1] is mm and steps[2] is y
    compare(tp, [mm, y])


def test_a_late_op_feeding_elementwise_ops_or_far_away_stays_apart():
    """An op that an elementwise op reads fuses with its reader instead; one recorded more
    than LATE_JOIN_SPAN ops after the group (a value remat.py recomputes late on purpose)
    is not moved back to it."""
    tp = gt.Tape()
    a = tp.param(np.ones((4, 4)))
    x = ops.exp(a)
    mm = ops.matmul(x, a)
    y = ops.add(ops.scale(x, 0.5), mm)
    steps = _schedule([y]).steps
    assert [v.op for v in steps[0].ops] == ["exp"]
    assert steps[1] is mm and [v.op for v in steps[2].ops] == ["scale", "add"]
    h = mm
    for _ in range(LATE_JOIN_SPAN):
        h = ops.matmul(h, a)
    z = ops.matmul(ops.scale(x, 0.5), h)
    steps = _schedule([z]).steps
    assert [v.op for v in steps[0].ops] == ["exp"]
    assert [v.op for v in steps[-2].ops] == ["scale"] and steps[-1] is z


def test_a_recomputed_value_joining_its_original_group_runs_once():
    """Soft-capped logits (Gemma 2): backward's ``c * tanh`` is a clone of forward's
    (remat.py; a clone keeps its original's tape index) and joins forward's group late.
    The group runs once, at its place, so its output written over its input is not
    computed again from itself, and the gradients are the reference's."""
    rng = np.random.default_rng(4)
    tp = gt.Tape(np.float64, eager=False)
    h = tp.param(rng.standard_normal((6, 24)))  # 24 terms: the logits a product of their own
    w = tp.param(rng.standard_normal((24, 32)))
    ids = tp.const(rng.integers(0, 32, 6))
    capped = ops.scale(ops.tanh(ops.scale(ops.matmul(h, w), 1 / 3)), 3.0)
    loss = ops.reduce_sum(ops.nll_ids(capped, ids))
    grads = tp.backward(loss)
    prog, worst = compare(tp, [loss, grads[h], grads[w]])
    steps = prog.executable.schedule.steps
    assert len({id(s) for s in steps}) == len(steps)
    assert worst < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_a_narrow_product_is_computed_in_its_readers_kernel(dtype, ta, tb):
    """LoRA's ``(x A) B``: a product of rank r <= FUSED_K read by elementwise ops runs in
    their kernel (its [T, n] never written), its operands in either layout, its sums as
    the reference's within the dtype's tolerance; its gradients too."""
    rng = np.random.default_rng(1)
    T, r, n = 12, 5, 40
    tp = gt.Tape(dtype)
    xa = tp.param(rng.standard_normal((r, T) if ta else (T, r)))
    b = tp.param(rng.standard_normal((n, r) if tb else (r, n)))
    base = tp.param(rng.standard_normal((T, n)))
    p = ops.matmul(xa, b, ta=ta, tb=tb)
    y = ops.tanh(ops.add(base, ops.scale(p, 0.5)))
    loss = ops.reduce_sum(ops.mul(y, y))
    grads = tp.backward(loss)
    outs = [y, grads[xa], grads[b], grads[base]]
    prog, _ = compare(tp, outs)
    groups = prog.executable.schedule.groups
    (g,) = [g for g in groups if p in g.ops]
    assert [v.op for v in g.ops][:4] == ["matmul", "scale", "add", "tanh"]
    assert p not in g.outputs and g.domain == (T, n)


def test_a_product_never_shares_a_group_with_its_operands():
    """A reader of both a product and the product's operand (k = n, so the shapes would
    merge) leaves them apart: the product reads whole rows of its operand, which a group
    computes element by element; nor does a row reduction close a product's group."""
    rng = np.random.default_rng(2)
    tp = gt.Tape(np.float32)
    x = tp.param(rng.standard_normal((6, 8)).astype(np.float32))
    w = tp.param(rng.standard_normal((8, 8)).astype(np.float32))
    a = ops.exp(x)
    p = ops.matmul(a, w)
    z = ops.add(ops.scale(p, 2.0), a)
    s = ops.softmax(ops.tanh(p), 1)
    prog, _ = compare(tp, [z, s])
    (g,) = [g for g in prog.executable.schedule.groups if p in g.ops]
    assert a not in g.ops and a in g.inputs and g.kind == "elementwise"
    assert [v.op for v in g.ops] == ["matmul", "scale", "add", "tanh"]


def test_row_broadcast_is_not_a_member_of_a_wider_group():
    tp = gt.Tape()
    r = tp.param(np.ones(8))
    x = tp.param(np.ones((4, 8)))
    y = ops.mul(x, ops.exp(r))  # exp over [8] runs once, not once per row
    steps = _schedule([y]).steps
    assert [(s.domain, [v.op for v in s.ops]) for s in steps] == [((8,), ["exp"]),
                                                                  ((4, 8), ["mul"])]


# --- compile cache and fallback --------------------------------------------------------------

def test_compile_cache_hit_on_second_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    tp = gt.Tape()
    x = tp.param(np.ones((3, 5)))
    y = ops.sigmoid(ops.scale(x, 1.2345))
    p1 = tp.compile([y], backend="cpu")
    assert p1.executable.cache_hit is False
    assert list(tmp_path.glob("gt_*.so"))
    p2 = tp.compile([y], backend="cpu")
    assert p2.executable.cache_hit is True
    np.testing.assert_array_equal(p1.run()[0], p2.run()[0])


def test_a_library_build_is_announced_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    """A csrc library's first build says so on stderr where that is a terminal (it takes
    seconds, before anything else is shown); a cached one, or a stderr that is not a
    terminal, prints nothing."""
    for tty, cache in ((False, "a"), (True, "b")):
        monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path / cache))
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        for hit in (False, True):
            path, was_hit = toolchain.build_csrc(["split_sgemm.c"], prefix="announced")
            assert was_hit is hit and path.parent == tmp_path / cache
            said = capsys.readouterr().err
            assert said == ("gradtape: compiling C kernels (announced) for this CPU (once; "
                            f"kept in {tmp_path / cache})\n" if tty and not hit else "")


def test_fallback_without_compiler(monkeypatch):
    monkeypatch.setenv("GRADTAPE_CC", "/nonexistent/cc")
    rng = np.random.default_rng(0)
    tp = gt.Tape()
    x = tp.param(rng.standard_normal((3, 5)))
    loss = ops.reduce_sum(ops.softmax(ops.exp(x), 1))
    g = tp.backward(loss)
    with pytest.warns(RuntimeWarning, match="numpy fallback"):
        prog = tp.compile([loss, g[x]], backend="cpu")
    assert prog.backend == "numpy"
    ref = tp.compile([loss, g[x]], backend="numpy").run()
    for a, b in zip(prog.run(), ref):
        np.testing.assert_array_equal(a, b)


def test_one_kernel_per_distinct_group():
    """Identical groups (every head, every layer) share one generated kernel."""
    tp = gt.Tape()
    xs = [tp.param(np.ones((4, 6))) for _ in range(5)]
    outs = [ops.softmax(ops.scale(x, 0.5), 1) for x in xs]
    prog = tp.compile(outs, backend="cpu")
    assert len(prog.executable.schedule.groups) == 5
    assert prog.executable.n_kernels == 1


def test_generated_source_compiles_without_warnings(tmp_path, monkeypatch):
    """Every expression the generator knows, in both dtypes, through the real compiler."""
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    for dtype in DTYPES:
        tp = gt.Tape(dtype)
        x = tp.param(np.full((2, 3), 0.5))
        c = tp.const(np.ones((2, 3)))
        v = x
        for op in sorted(lowering.C_ELEMENTWISE):
            if op == "select":
                v = ops.select(c, v, x)
            elif op in ("add", "sub", "mul", "div"):
                v = getattr(ops, op)(v, x)
            elif op in ("scale", "addc", "maxc", "gtc"):
                v = getattr(ops, op)(v, 0.25)
            elif op == "powc":
                v = ops.powc(ops.addc(ops.mul(v, v), 1.0), 1.5)
            else:
                v = getattr(ops, op)(ops.addc(ops.mul(v, v), 1.0))
        compare(tp, [v])
