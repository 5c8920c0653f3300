"""The fused LM head + cross-entropy (``ops.head_nll``, ``nn.cross_entropy_head``) equals
the composed head and loss (``nn.linear_rows`` / ``softcap`` / ``cross_entropy_ids`` and
SPEC's ``cross_entropy_rows``): loss and every gradient, float64 and float32, tied float
tables, trainable tables and block-matrix tables, with the vocabulary split into several
blocks."""

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops, tiled
from gradtape.blocks import random_blocks

from support.compare import rel_err
from support.fd import BACKENDS, FD_TOL, check_fd

# The same sums in another order (blocks of the vocabulary, an online logsumexp): float64
# rounding, a few ulps of the loss (about 1e-16 relative) accumulated over V terms.
TOL = {np.float64: 1e-12,
       # float32: eps 6e-8 times the conditioning of softmax sums over V ~ 1e2 terms
       np.float32: 2e-5}


@pytest.fixture
def small_blocks(monkeypatch):
    """A budget of 24 * 16 elements: T=24 rows walk the vocabulary 64 rows at a time."""
    monkeypatch.setattr(tiled, "HEAD_BUDGET", 24 * 16)


def _problem(r, t=24, d=16, v=150, dtype=np.float64):
    x = r.standard_normal((t, d)).astype(dtype)
    w = (r.standard_normal((v, d)) * 0.7).astype(dtype)
    targets = r.integers(0, v, t)
    targets[[3, 7]] = -100  # ignored rows
    targets[5] = v - 1  # the last vocabulary row, in the last (partial) block
    return x, w, targets


def _losses(tp, x, w, targets, cap, table_param, grad_in_forward=False):
    """(fused loss, composed loss, their params)."""
    h = tp.param(x)
    table = tp.param(w) if table_param else tp.const(w)
    ids, wts = nn.ce_targets_fill(targets)
    ids, wts = tp.const(ids), tp.const(wts.astype(tp.dtype))
    fused = nn.cross_entropy_head(tp, h, table, ids, wts, cap, grad_in_forward)
    logits = nn.linear_rows(tp, h, table)
    if cap:
        logits = nn.softcap(tp, logits, cap)
    composed = nn.cross_entropy_ids(tp, logits, ids, wts)
    return fused, composed, [h] + [table] * table_param


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("cap", [0.0, 3.0])
@pytest.mark.parametrize("table_param", [False, True])
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_fused_head_equals_composed(small_blocks, dtype, cap, table_param, grad_in_forward):
    """grad_in_forward: without a cap the forward folds up E = softmax(z) @ W and the
    gradient w.r.t. x is elementwise (head_nll_e); under a cap it is the plain head."""
    r = np.random.default_rng(1)
    x, w, targets = _problem(r, dtype=dtype)
    tp = gt.Tape(dtype)
    fused, composed, params = _losses(tp, x, w, targets, cap, table_param, grad_in_forward)
    op = "head_nll_e" if grad_in_forward and not cap else "head_nll"
    (head,) = [v for v in tp.vars if v.op.startswith("head_nll")]
    assert head.op == op
    assert head.attrs["chunk"] == 64  # 3 blocks: 64, 64, 22 rows
    gf, gc = tp.backward(fused), tp.backward(composed)
    assert rel_err(fused.value, composed.value) <= TOL[dtype]
    for p in params:
        assert rel_err(gf[p].value, gc[p].value) <= TOL[dtype]


def test_fused_head_equals_spec_cross_entropy_rows(small_blocks):
    """SPEC's one-hot mean over the first ``keep`` rows is the fused loss with weights
    1/keep on those rows."""
    r = np.random.default_rng(2)
    t, keep, v = 24, 17, 150
    x, w, _ = _problem(r, t=t, v=v)
    targets = r.integers(0, v, t)
    tp = gt.Tape()
    h, table = tp.param(x), tp.const(w)
    onehot = np.zeros((t, v))
    onehot[np.arange(t), targets] = 1.0
    spec = nn.cross_entropy_rows(tp, nn.linear_rows(tp, h, table), tp.const(onehot),
                                 nn.ones(tp, v), keep)
    ids, wts = nn.ce_targets_fill(np.where(np.arange(t) < keep, targets, -100))
    fused = nn.cross_entropy_head(tp, h, table, tp.const(ids), tp.const(wts))
    assert rel_err(fused.value, spec.value) <= TOL[np.float64]
    assert rel_err(tp.backward(fused)[h].value, tp.backward(spec)[h].value) <= TOL[np.float64]


@pytest.mark.parametrize("qtype, cap", [("Q8_0", 5.0), ("Q4_K", 5.0), ("Q4_K", 0.0)])
def test_fused_head_on_block_table(small_blocks, qtype, cap):
    """A frozen table kept in its ggml blocks: the blocks of rows are dequantized one at
    a time, and the result equals the composed ``qmatmul`` head (without a cap through
    head_nll_e: its x gradient takes the table's dequantized rows)."""
    r = np.random.default_rng(3)
    x, _, targets = _problem(r, d=256, v=130)
    bm = random_blocks(qtype, 130, 256, r, std=0.1)
    tp = gt.Tape()
    h, table = tp.param(x), tp.const_blocks(bm)
    ids, wts = (tp.const(a) for a in nn.ce_targets_fill(targets))
    fused = nn.cross_entropy_head(tp, h, table, ids, wts, cap, grad_in_forward=True)
    logits = nn.linear_rows(tp, h, table)
    composed = nn.cross_entropy_ids(tp, nn.softcap(tp, logits, cap) if cap else logits,
                                    ids, wts)
    assert rel_err(fused.value, composed.value) <= TOL[np.float64]
    assert rel_err(tp.backward(fused)[h].value,
                   tp.backward(composed)[h].value) <= TOL[np.float64]


@pytest.mark.parametrize("cap, grad_in_forward", [(0.0, False), (2.0, False), (0.0, True)])
def test_fused_head_finite_differences(small_blocks, cap, grad_in_forward):
    r = np.random.default_rng(4)
    x, w, targets = _problem(r, t=8, d=5, v=70)  # budget 384 / 8 rows: 64-row blocks
    ids = np.where(targets < 0, 0, targets)

    def build(tp, h, table, ids):  # both columns: nll and lse
        return ops.head_nll(h, table, ids, cap, grad_in_forward=grad_in_forward)

    assert check_fd(build, [x, w, ids]) <= FD_TOL[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_head_replays(small_blocks, backend):
    r = np.random.default_rng(5)
    x, w, targets = _problem(r)
    tp = gt.Tape()
    fused, _, (h,) = _losses(tp, x, w, targets, 0.0, False)
    g = tp.backward(fused)[h]
    x2 = r.standard_normal(x.shape)
    prog = tp.compile([fused, g], backend=backend)
    got = prog.run({h: x2})
    tp2 = gt.Tape()
    f2, _, (h2,) = _losses(tp2, x2, w, targets, 0.0, False)
    want = [f2.value, tp2.backward(f2)[h2].value]
    for a, b in zip(got, want):
        # numpy replays the very same forwards; cpu runs them too, BLAS threads may differ
        assert rel_err(a, b) <= (0.0 if backend == "numpy" else 1e-13)


def test_fused_head_shape_errors():
    tp = gt.Tape()
    x, w = tp.param(np.zeros((4, 8))), tp.const(np.zeros((10, 7)))
    ids = tp.const(np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"head_nll\(\[4, 8\], \[10, 7\], \[4\].*"
                                         r"x\[4, 8\] @ table\[10, 7\]\^T: x must be \[T, 7\]"):
        ops.head_nll(x, w, ids)
    with pytest.raises(ValueError, match=r"ids\[3\] must be \[4\]"):
        ops.head_nll(x, tp.const(np.zeros((10, 8))), tp.const(np.zeros(3, np.int64)))


def test_fused_head_has_no_second_order(small_blocks):
    tp = gt.Tape()
    x, w, targets = _problem(np.random.default_rng(6))
    fused, _, (h,) = _losses(tp, x, w, targets, 0.0, False)
    g = tp.backward(fused)[h]
    with pytest.raises(ValueError, match="head_nll_grad_x' has no gradient rule"):
        tp.backward(ops.reduce_sum(ops.mul(g, g)))


@pytest.mark.parametrize("cap, table_param, grad_in_forward",
                         [(0.0, True, False), (3.0, False, False), (0.0, True, True)])
def test_fused_head_decomposes_for_a_backend_without_kernel(monkeypatch, small_blocks, cap,
                                                            table_param, grad_in_forward):
    """A backend with no kernel for the fused ops runs their composed decomposition:
    the same loss and gradients as the fused forwards (and no head_nll op is left)."""
    from gradtape.backends.numpy import NumpyBackend

    r = np.random.default_rng(7)
    x, w, targets = _problem(r)
    tp = gt.Tape()
    fused, _, params = _losses(tp, x, w, targets, cap, table_param, grad_in_forward)
    g = tp.backward(fused)
    outs = [fused] + [g[p] for p in params]
    want = [v.value for v in outs]
    monkeypatch.setattr(NumpyBackend, "has_kernel", staticmethod(lambda op: False))
    prog = tp.compile(outs, backend="numpy")
    assert not [v for v in prog.graph.ops if v.op.startswith("head_nll")]
    for a, b in zip(prog.run(), want):
        assert rel_err(a, b) <= TOL[np.float64]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("table", ["const", "param", "Q8_0"])
@pytest.mark.parametrize("quantum", [1, 4, 64])  # 64: padded up to every row
def test_rows_without_a_target_are_skipped(small_blocks, monkeypatch, backend, table,
                                          quantum):
    """Fed -1 (``ce_targets_fill``'s ``no_target``), a row without a target is left out
    of the head's walks: its outputs are 0 (padding rows up to ``TARGETED_QUANTUM`` are
    walked, then zeroed), and the loss and every gradient equal those with every row
    walked (id 0, weight 0), up to the GEMMs' row count (float64 rounding)."""
    monkeypatch.setattr(tiled, "TARGETED_QUANTUM", quantum)
    r = np.random.default_rng(8)
    x, w, targets = _problem(r, d=256 if table == "Q8_0" else 16)
    targets[10:15] = -100  # 7 rows without a target (3, 7 and these)
    bm = random_blocks("Q8_0", w.shape[0], 256, r, std=0.1) if table == "Q8_0" else None
    results = []
    for no_target in (0, -1):
        tp = gt.Tape(eager=False)
        h = tp.param(x)
        tab = (tp.const_blocks(bm) if bm is not None else
               tp.param(w) if table == "param" else tp.const(w))
        ids, wts = nn.ce_targets_fill(targets, no_target=no_target)
        ids = tp.const(ids)
        head = ops.head_nll(h, tab, ids, grad_in_forward=True)  # nll, lse (head_nll_e)
        loss = ops.reduce_sum(ops.mul(ops.slice_(head, 1, 0, 1), tp.const(wts)))
        params = [h] + [tab] * (table == "param")
        g = tp.backward(loss)
        results.append(tp.compile([loss, head] + [g[p] for p in params],
                                  backend=backend).run())
    (loss0, head0, *g0), (loss1, head1, *g1) = results
    untargeted = targets < 0
    assert not head1[untargeted].any() and head1[~untargeted].all()
    assert rel_err(head1[~untargeted], head0[~untargeted]) <= TOL[np.float64]
    assert rel_err(loss1, loss0) <= TOL[np.float64]
    assert not g1[0][untargeted].any()
    for a, b in zip(g1, g0):
        assert rel_err(a, b) <= TOL[np.float64]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_without_any_target_walks_nothing(small_blocks, backend):
    r = np.random.default_rng(9)
    x, w, _ = _problem(r)
    tp = gt.Tape(eager=False)
    h, tab = tp.param(x), tp.param(w)
    ids, wts = nn.ce_targets_fill(np.full(len(x), -100), no_target=-1)
    head = ops.head_nll(h, tab, tp.const(ids), grad_in_forward=True)
    loss = ops.reduce_sum(ops.mul(ops.slice_(head, 1, 0, 1), tp.const(wts)))
    g = tp.backward(loss)
    for a in tp.compile([loss, head, g[h], g[tab]], backend=backend).run():
        assert not np.asarray(a).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", [None, "Q4_K"])
def test_head_rows_are_the_table_rows_and_zero_without_a_target(backend, qtype):
    """``head_rows`` (head_nll_e's gradient reads it): the table's rows ``ids``, a block
    table's dequantized as ``qtake_rows``, and a zero row for an id of -1."""
    from gradtape.blocks import dequantize

    r = np.random.default_rng(10)
    ids = np.array([3, -1, 0, 129, -1, 3])
    tp = gt.Tape(eager=False)
    if qtype:
        bm = random_blocks(qtype, 130, 256, r, std=0.1)
        table, dense = tp.const_blocks(bm), dequantize(bm.data, qtype)
    else:
        dense = r.standard_normal((130, 16))
        table = tp.const(dense)
    rows = ops.lm_head._rec("head_rows", table, tp.const(ids), **(
        {"qtype": qtype, "rows": 130, "k": 256} if qtype else {}))
    (got,) = tp.compile([rows], backend=backend).run()
    want = np.where(ids[:, None] >= 0, dense[ids], 0.0)
    assert np.array_equal(got, want)
