"""Finite-difference dot-product tests (float64, first and second order) for every
primitive of ``ops.PRIMS``, with domain-respecting inputs and broadcast cases whose
gradients the engine reduces.  A primitive added to the table without a case here fails
``test_every_primitive_has_cases``."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.ops import PRIMS

from gradtape.blocks import random_blocks

from support.compare import rel_err
from support.fd import (F32_VS_F64_TOL, FD_TOL, Blocks, Const, away_from_zero, check_fd,
                        first_order, ids, normal, positive)

T, N = 3, 4


def _cases():
    """(primitive name, case id, builder(tp, *vars), inputs) for every case."""
    r = np.random.default_rng(1234)
    cases = []

    def case(name, cid, build, *inputs):
        cases.append((name, cid, build, list(inputs)))

    binary = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div}
    for name, fn in binary.items():
        rhs = (lambda *s: away_from_zero(r, *s)) if name == "div" else (lambda *s: normal(r, *s))
        b = lambda tp, a, c, fn=fn: fn(a, c)
        case(name, "same", b, normal(r, T, N), rhs(T, N))
        case(name, "row", b, normal(r, T, N), rhs(N))            # [n] row over [T, n]
        case(name, "col", b, normal(r, T, N), rhs(T, 1))         # [T, 1] column over [T, n]
        case(name, "scalar", b, normal(r, T, N), rhs())          # () scalar over [T, n]
        case(name, "row_lhs", b, normal(r, N), rhs(T, N))        # broadcast on the left
        case(name, "col_lhs", b, normal(r, T, 1), rhs(T, N))
        case(name, "outer", b, normal(r, T, 1), rhs(N))          # both broadcast: [T,1] op [n]
    case("neg", "2d", lambda tp, x: ops.neg(x), normal(r, T, N))
    case("scale", "2d", lambda tp, x: ops.scale(x, -1.7), normal(r, T, N))
    case("addc", "2d", lambda tp, x: ops.addc(x, 0.3), normal(r, T, N))
    for p in (2.0, 2.5, -1.5, 0.5):
        case("powc", f"p{p}", lambda tp, x, p=p: ops.powc(x, p), positive(r, T, N))
    case("exp", "2d", lambda tp, x: ops.exp(x), normal(r, T, N))
    case("log", "2d", lambda tp, x: ops.log(x), positive(r, T, N))
    case("sqrt", "2d", lambda tp, x: ops.sqrt(x), positive(r, T, N))
    case("rsqrt", "2d", lambda tp, x: ops.rsqrt(x), positive(r, T, N))
    case("sigmoid", "2d", lambda tp, x: ops.sigmoid(x), normal(r, T, N, scale=2.0))
    case("tanh", "2d", lambda tp, x: ops.tanh(x), normal(r, T, N))
    for ax in (0, 1, -1):
        case("softmax", f"axis{ax}", lambda tp, x, ax=ax: ops.softmax(x, ax), normal(r, T, N))
        case("logsumexp", f"axis{ax}", lambda tp, x, ax=ax: ops.logsumexp(x, ax),
             normal(r, T, N))
    for ta in (False, True):
        for tb in (False, True):
            a = normal(r, *((5, T) if ta else (T, 5)))
            b = normal(r, *((N, 5) if tb else (5, N)))
            case("matmul", f"ta{ta:d}tb{tb:d}",
                 lambda tp, x, y, ta=ta, tb=tb: ops.matmul(x, y, ta=ta, tb=tb), a, b)
    case("matmul", "self", lambda tp, x: ops.matmul(x, x, tb=True), normal(r, T, N))
    case("transpose", "2d", lambda tp, x: ops.transpose(x), normal(r, T, N))
    case("transpose", "3d", lambda tp, x: ops.transpose(x, (2, 0, 1)), normal(r, 2, T, N))
    case("reshape", "2d", lambda tp, x: ops.reshape(x, (2, 6)), normal(r, T, N))
    case("reshape", "flat", lambda tp, x: ops.reshape(x, (12,)), normal(r, T, N))
    case("slice", "cols", lambda tp, x: ops.slice_(x, 1, 1, 3), normal(r, T, N))
    case("slice", "rows", lambda tp, x: ops.slice_(x, 0, 1, 3), normal(r, T, N))
    case("slice", "neg_axis", lambda tp, x: ops.slice_(x, -1, 0, 2), normal(r, T, N))
    case("pad", "cols", lambda tp, x: ops.pad(x, 1, 2, 1), normal(r, T, N))
    case("pad", "rows", lambda tp, x: ops.pad(x, 0, 0, 3), normal(r, T, N))
    case("concat", "cols", lambda tp, x, y, z: ops.concat([x, y, z], 1),
         normal(r, T, 2), normal(r, T, 1), normal(r, T, 3))
    case("concat", "rows", lambda tp, x, y: ops.concat([x, y], 0), normal(r, 2, N),
         normal(r, T, N))
    case("concat", "same_input", lambda tp, x: ops.concat([x, x], 1), normal(r, T, N))
    for ax in (None, 0, 1):
        for kd in (False, True):
            case("sum", f"axis{ax}_kd{kd:d}",
                 lambda tp, x, ax=ax, kd=kd: ops.reduce_sum(x, ax, kd), normal(r, T, N))
    for shp in ((N,), (T, 1), (1, N), (), (1,)):
        case("sum_to", f"to{list(shp)}", lambda tp, x, shp=shp: ops.sum_to(x, shp),
             normal(r, T, N))
    for src in ((N,), (T, 1), (), (1, N)):
        case("broadcast_to", f"from{list(src)}",
             lambda tp, x: ops.broadcast_to(x, (T, N)), normal(r, *src))
    # select(c, a, b): c is a 0/1 float mask (const: select is not differentiable in it)
    mask = (r.uniform(size=(T, N)) < 0.5).astype(float)
    mask[0, 0], mask[0, 1] = 0.0, 1.0
    sel = lambda tp, c, a, b: ops.select(c, a, b)
    case("select", "mask", sel, Const(mask), normal(r, T, N), normal(r, T, N))
    case("select", "flag_on", sel, Const(np.array(1.0)), normal(r, T, N), normal(r, T, N))
    case("select", "flag_off", sel, Const(np.array(0.0)), normal(r, T, N), normal(r, N))
    case("select", "col_mask", sel, Const(mask[:, :1]), normal(r, T, 1), normal(r, T, N))
    # maxc / gtc: kinks at c; inputs kept >= 0.2 away so x +- h v never crosses them
    kinked = lambda c: c + away_from_zero(r, T, N, lo=0.2, hi=1.5)
    case("maxc", "c0.3", lambda tp, x: ops.maxc(x, 0.3), kinked(0.3))
    case("gtc", "c-0.1", lambda tp, x: ops.gtc(x, -0.1), kinked(-0.1))
    case("take_rows", "dup", lambda tp, tab, i: ops.take_rows(tab, i), normal(r, 5, 3),
         ids(r, 6, 5))
    case("scatter_rows", "dup", lambda tp, s, i: ops.scatter_rows(s, i, 5), normal(r, 6, 3),
         ids(r, 6, 5))
    case("pick", "rows", lambda tp, x, i: ops.pick(x, i), normal(r, T, 5), ids(r, T, 5))
    case("put", "rows", lambda tp, s, i: ops.put(s, i, 5), normal(r, T, 1), ids(r, T, 5))
    case("nll_ids", "rows", lambda tp, x, i: ops.nll_ids(x, i), normal(r, T, 5), ids(r, T, 5))
    case("nll_ids", "large", lambda tp, x, i: ops.nll_ids(x, i), 30.0 * normal(r, T, 5),
         ids(r, T, 5))
    case("nll_ids_grad", "rows", lambda tp, g, x, i: ops.nll_ids_grad(g, x, i),
         normal(r, T, 1), normal(r, T, 5), ids(r, T, 5))
    rope = lambda inverse: lambda tp, x, c, s: ops.rope(x, c, s, inverse=inverse)
    for inverse in (False, True):
        case("rope", "inverse" if inverse else "rows", rope(inverse), normal(r, T, 6),
             normal(r, T, 3), normal(r, T, 3))
    # frozen weights in their stored type: differentiable in x only (w is frozen)
    for qt in ("Q4_K", "Q8_0", "BF16"):
        bm = random_blocks(qt, 5, 256, r, std=0.5)
        case("qmatmul", qt, lambda tp, x, w: ops.qmatmul(x, w), normal(r, T, 256), Blocks(bm))
        case("qmatmul_t", qt, lambda tp, g, w: ops.qmatmul_t(g, w), normal(r, T, 5),
             Blocks(bm))
    return cases


# primitives with no float input to differentiate (their own tests live elsewhere):
# qtake_rows reads a frozen block table by integer ids (tests/core/test_blocks.py)
NO_FLOAT_INPUT = {"qtake_rows"}
# primitives whose output is a constant for backward by definition (test_detach below)
NO_GRADIENT = {"detach"}
# fused primitives, checked in tests/core/test_tiled_head.py / test_tiled_attention.py:
# first-order finite differences of the forward, and the gradient primitives equal to the
# composed ops' VJPs; the gradient primitives have no VJP of their own (no second order)
FUSED = {"head_nll", "head_nll_e", "head_nll_grad_x", "head_nll_grad_w", "head_rows", "attn",
         "attn_grad"}
CASES = _cases()
CASE_IDS = [f"{name}-{cid}" for name, cid, _, _ in CASES]


def test_every_primitive_has_cases():
    covered = {name for name, _, _, _ in CASES}
    missing = sorted(set(PRIMS) - covered - NO_FLOAT_INPUT - FUSED - NO_GRADIENT)
    assert not missing, f"primitives without a finite-difference case: {missing}"
    assert not covered - set(PRIMS), sorted(covered - set(PRIMS))


@pytest.mark.parametrize("name,cid,build,inputs", CASES, ids=CASE_IDS)
def test_case_records_its_primitive(name, cid, build, inputs):
    """Each case really exercises the primitive it is filed under."""
    from support.fd import _leaves
    tp = gt.Tape()
    out = build(tp, *_leaves(tp, inputs))
    assert out.op == name


@pytest.mark.parametrize("name,cid,build,inputs", CASES, ids=CASE_IDS)
def test_fd_first_order(name, cid, build, inputs):
    err = check_fd(build, inputs, order=1)
    assert err <= FD_TOL[1], f"{name}-{cid}: first-order FD error {err:.3e}"


@pytest.mark.parametrize("name,cid,build,inputs", CASES, ids=CASE_IDS)
def test_fd_second_order(name, cid, build, inputs):
    err = check_fd(build, inputs, order=2)
    assert err <= FD_TOL[2], f"{name}-{cid}: second-order FD error {err:.3e}"


@pytest.mark.parametrize("name,cid,build,inputs", CASES, ids=CASE_IDS)
def test_float32_matches_float64(name, cid, build, inputs):
    """The same rules in float32 agree with float64 to float32 accuracy."""
    out64, g64 = first_order(build, inputs, dtype=np.float64)
    out32, g32 = first_order(build, inputs, dtype=np.float32)
    assert rel_err(out32, out64) <= F32_VS_F64_TOL
    for a, b in zip(g32, g64):
        assert rel_err(a, b) <= F32_VS_F64_TOL


def test_broadcast_gradient_shapes_are_reduced():
    """The engine sums broadcast gradients back to each input's own shape."""
    tp = gt.Tape()
    x = tp.param(np.ones((T, N)))
    row = tp.param(np.arange(N, dtype=float))
    col = tp.param(np.arange(T, dtype=float)[:, None])
    s = tp.param(np.array(2.0))
    y = ops.mul(ops.add(ops.mul(x, row), col), s)
    g = tp.backward(ops.reduce_sum(y))
    assert g[row].shape == (N,) and g[col].shape == (T, 1) and g[s].shape == ()
    np.testing.assert_array_equal(g[row].value, np.full(N, 2.0 * T))
    np.testing.assert_array_equal(g[col].value, np.full((T, 1), 2.0 * N))
    np.testing.assert_array_equal(g[s].value, (np.arange(N) + np.arange(T)[:, None]).sum())


def test_fd_detects_a_wrong_rule(monkeypatch):
    """The checker itself is sharp: a VJP off by a relative 1e-5 fails it by far."""
    bad = PRIMS["exp"].__class__(
        "exp", PRIMS["exp"].shape, PRIMS["exp"].forward,
        lambda g, out, x: (lambda: ops.scale(ops.mul(g, out), 1.0 + 1e-5),),
        elementwise=True)
    monkeypatch.setitem(PRIMS, "exp", bad)
    r = np.random.default_rng(0)
    err = check_fd(lambda tp, x: ops.exp(x), [normal(r, T, N)])
    assert err > 1e2 * FD_TOL[1], err


def test_detach_passes_values_and_stops_gradients():
    """``detach(x)`` is ``x`` forward; backward treats it as a constant: the gradient of
    ``sum(detach(x) * x)`` w.r.t. ``x`` is ``detach(x)``'s value, not ``2x``."""
    r = np.random.default_rng(7)
    tp = gt.Tape()
    x = tp.param(r.standard_normal((T, N)))
    d = ops.detach(x)
    assert not d.requires_grad and np.array_equal(d.value, x.value)
    (g,) = tp.backward(ops.reduce_sum(ops.mul(d, x))).values()
    assert np.array_equal(g.value, x.value)
