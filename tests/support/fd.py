"""Finite-difference dot-product checks shared by the tape and nn test suites.

The check: for a builder ``f`` (tape ops from input Vars to an output Var), a random
cotangent ``u`` and a random direction ``v`` over the float inputs,

    <vjp(u), v>   vs   <u, (f(x + h v) - f(x - h v)) / 2h>

with the central difference refined by one Richardson step (``(4 D(h/2) - D(h)) / 3``,
truncation O(h^4)), so a moderate ``h`` keeps rounding small too.  Second order
differentiates a scalar function of the first-order gradients (``s = sum_i <grad_i, w_i>``)
again and checks its gradient the same way against finite differences of ``s``.

This module holds no tests; ``bench/oracle_report.py`` reuses it to print worst errors.
"""

from __future__ import annotations

import numpy as np

import gradtape as gt
from gradtape import ops

# Backends every compiling test runs on; another backend ("cpu", "cuda") joins by name.
BACKENDS = ["numpy", "cpu"]

# Finite-difference tolerances, float64 only (float32 differences are rounding noise).
# h = 1e-3 with one Richardson step: truncation ~h^4 * f^(5) ~ 1e-12, rounding
# ~eps_mach * |f| / h ~ 1e-13 relative; 1e-8 leaves room for larger higher derivatives
# (exp, powc, rsqrt near small x) without hiding a wrong rule, which errs at O(1).
FD_H = 1e-3
# Second order takes finite differences of the analytic first-order gradient: same bound.
FD_TOL = {1: 1e-8, 2: 1e-8}

# float32 VJPs compared with the float64 VJP on the same inputs: float32 rounding
# (eps 6e-8) amplified by the op's conditioning and sums over ~100 terms.
F32_VS_F64_TOL = 1e-4

# Replay vs a fresh eager tape: the NumPy backend runs the very same forward functions in
# the same order, so it must be bitwise equal; other backends get a per-dtype tolerance
# (reassociated sums, fused kernels).
REPLAY_TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}


def replay_tol(backend, dtype):
    return 0.0 if backend == "numpy" else REPLAY_TOL[np.dtype(dtype)]


class Const:
    """Marks a float input as a const leaf (not differentiated, not perturbed)."""

    def __init__(self, value):
        self.value = np.asarray(value)


class Blocks:
    """Marks a frozen block-matrix input (``blocks.BlockMatrix``): a block const leaf."""

    def __init__(self, bm):
        self.bm = bm


def _leaves(tp, inputs):
    """params for float arrays, consts for integer arrays, ``Const``s and ``Blocks``."""
    vs = []
    for a in inputs:
        if isinstance(a, Blocks):
            vs.append(tp.const_blocks(a.bm))
        elif isinstance(a, Const):
            vs.append(tp.const(a.value))
        elif np.issubdtype(np.asarray(a).dtype, np.integer):
            vs.append(tp.const(np.asarray(a)))
        else:
            vs.append(tp.param(np.asarray(a, np.float64)))
    return vs


def _float_positions(inputs):
    return [i for i, a in enumerate(inputs)
            if not isinstance(a, (Const, Blocks))
            and not np.issubdtype(np.asarray(a).dtype, np.integer)]


def _loss1(out, u, c):
    """sum(u * f) + 1/2 sum(c * f * f): the quadratic term makes the gradient depend on x
    even for linear ops, so second order exercises every VJP rule's own VJP."""
    tp = out.tape
    lin = ops.reduce_sum(ops.mul(out, tp.const(u)))
    quad = ops.reduce_sum(ops.mul(ops.mul(out, out), tp.const(c)))
    return ops.add(lin, ops.scale(quad, 0.5))


def _perturbed(inputs, pos, dirs, t):
    new = list(inputs)
    for i, d in zip(pos, dirs):
        new[i] = np.asarray(inputs[i], np.float64) + t * d
    return new


def _richardson(fn, h):
    d1 = (fn(h) - fn(-h)) / (2 * h)
    d2 = (fn(h / 2) - fn(-h / 2)) / h
    return (4 * d2 - d1) / 3


def _rms(a):
    """The input's spread (its std; its rms when constant): a step that size is small
    against the input's own variation, so a large common offset does not inflate it."""
    a = np.asarray(a, np.float64)
    if a.size == 0:
        return 1.0
    r = float(np.std(a)) or float(np.sqrt(np.mean(np.square(a))))
    return r if r > 0 else 1.0


def _dot(grads, dirs):
    return float(sum(np.vdot(g, d) for g, d in zip(grads, dirs)))


def _scale_of(grads, dirs):
    return float(sum(np.linalg.norm(g) * np.linalg.norm(d) for g, d in zip(grads, dirs)))


def _grads_of(tp, loss, params):
    """Gradients of ``loss`` for each of ``params`` (zeros where it does not depend)."""
    g = tp.backward(loss)
    return [g[p] if p in g else None for p in params]


def first_order(build, inputs, seed=0, dtype=np.float64):
    """The eager output value and the VJP of ``_loss1`` at ``inputs`` (float arrays)."""
    rng = np.random.default_rng(seed)
    tp = gt.Tape(dtype)
    vs = _leaves(tp, inputs)
    out = build(tp, *vs)
    u = rng.standard_normal(out.shape)
    c = rng.standard_normal(out.shape)
    pos = _float_positions(inputs)
    gs = _grads_of(tp, _loss1(out, u, c), [vs[i] for i in pos])
    return out.value.copy(), [np.zeros(vs[i].shape) if g is None else g.value.copy()
                              for i, g in zip(pos, gs)]


def check_fd(build, inputs, order=1, seed=0, h=FD_H):
    """Dot-product test of ``build`` at ``inputs``; returns the relative error

        |<analytic gradient, v> - finite difference| / sum_i |grad_i| |v_i|

    (the Cauchy-Schwarz scale of the dot product, robust to cancellation).
    ``order=2`` checks the gradient of ``s(x) = sum_i <grad_i(x), w_i>``.
    """
    rng = np.random.default_rng(seed)
    pos = _float_positions(inputs)
    assert pos, "nothing to differentiate"
    # probe the output shape once to draw u, c (same draws in every evaluation)
    tp0 = gt.Tape()
    out_shape = build(tp0, *_leaves(tp0, inputs)).shape
    u = rng.standard_normal(out_shape)
    c = rng.standard_normal(out_shape)
    w = [rng.standard_normal(np.shape(inputs[i])) for i in pos]
    # directions scaled to each input's size: h is then a relative step, right for
    # inputs of norm 1e-3 and 1e3 alike
    v = [rng.standard_normal(np.shape(inputs[i])) * _rms(inputs[i]) for i in pos]

    def scalar(xs, analytic):
        """The checked scalar at xs, and (if analytic) its gradient wrt the float inputs."""
        tp = gt.Tape()
        vs = _leaves(tp, xs)
        params = [vs[i] for i in pos]
        out = build(tp, *vs)
        loss1 = _loss1(out, u, c)
        if order == 1:
            target = loss1
        else:
            g1 = _grads_of(tp, loss1, params)
            terms = [ops.reduce_sum(ops.mul(g, tp.const(wi)))
                     for g, wi in zip(g1, w) if g is not None]
            target = terms[0]
            for t in terms[1:]:
                target = ops.add(target, t)
            if not target.requires_grad:  # the gradient is constant: s has zero gradient
                return float(target.value), [np.zeros(np.shape(xs[i])) for i in pos]
        val = float(target.value)
        if not analytic:
            return val, None
        gs = _grads_of(tp, target, params)
        return val, [np.zeros(p.shape) if g is None else g.value for p, g in zip(params, gs)]

    _, grads = scalar(inputs, True)
    lhs = _dot(grads, v)
    rhs = _richardson(lambda t: scalar(_perturbed(inputs, pos, v, t), False)[0], h)
    scale = max(_scale_of(grads, v), abs(rhs), 1e-300)
    if abs(lhs - rhs) == 0.0:
        return 0.0
    return abs(lhs - rhs) / scale


# --- input samplers that respect each op's domain ----------------------------------------

def normal(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def positive(rng, *shape, lo=0.5, hi=2.0):
    """Away from 0 (log, sqrt, rsqrt, powc): derivatives stay moderate."""
    return rng.uniform(lo, hi, shape)


def away_from_zero(rng, *shape, lo=0.5, hi=2.0):
    """Either sign, |x| in [lo, hi] (denominators)."""
    return rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)


def ids(rng, n, high):
    """Integer ids in [0, high) with at least one repeat when n > 1 (scatter must add)."""
    out = rng.integers(0, high, n)
    if n > 1:
        out[-1] = out[0]
    return out.astype(np.int64)
