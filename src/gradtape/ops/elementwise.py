"""Elementwise primitives: arithmetic, the unary functions, select, the comparisons
with a constant and ``detach`` (the identity that stops gradients).

Binary ops broadcast their inputs (NumPy's rule); the engine (``tape.backward``) sums a
broadcast input's gradient back to its shape, so the VJPs here return full-size
gradients.  ``elementwise=True`` lets ``compile.fuse`` fuse chains of these ops.
"""

from __future__ import annotations

import numpy as np

from .table import ShapeError, _prim, _rec


def _same(shapes):
    return shapes[0]


def _broadcast(shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError("shapes do not broadcast (allowed: equal shapes, a [n] row over "
                         "[T, n] rows, a [T, 1] column over columns, a scalar)") from None


def _ufunc2(f):
    return lambda out, a, b: f(a, b, out=out)


def _ufunc1(f):
    return lambda out, x: f(x, out=out)


def _fwd_rsqrt(out, x):
    np.sqrt(x, out=out)
    np.divide(1.0, out, out=out)


def _fwd_sigmoid(out, x):
    # 1 / (1 + exp(-x)); exp overflows to inf for x << 0, which gives the right limit 0.
    with np.errstate(over="ignore"):
        np.negative(x, out=out)
        np.exp(out, out=out)
    np.add(out, 1.0, out=out)
    np.divide(1.0, out, out=out)


_prim("add", _broadcast, _ufunc2(np.add),
      lambda g, out, a, b: (lambda: g, lambda: g), elementwise=True)
_prim("sub", _broadcast, _ufunc2(np.subtract),
      lambda g, out, a, b: (lambda: g, lambda: neg(g)), elementwise=True)
_prim("mul", _broadcast, _ufunc2(np.multiply),
      lambda g, out, a, b: (lambda: mul(g, b), lambda: mul(g, a)), elementwise=True)
# d(a/b)/db = -a/b^2 = -out/b
_prim("div", _broadcast, _ufunc2(np.divide),
      lambda g, out, a, b: (lambda: div(g, b), lambda: neg(div(mul(g, out), b))),
      elementwise=True)
_prim("neg", _same, _ufunc1(np.negative),
      lambda g, out, x: (lambda: neg(g),), elementwise=True)
_prim("scale", lambda s, c: s[0], lambda out, x, c: np.multiply(x, c, out=out),
      lambda g, out, x, c: (lambda: scale(g, c),), elementwise=True)
_prim("addc", lambda s, c: s[0], lambda out, x, c: np.add(x, c, out=out),
      lambda g, out, x, c: (lambda: g,), elementwise=True)
# d x^p = p x^(p-1)
_prim("powc", lambda s, p: s[0], lambda out, x, p: np.power(x, p, out=out),
      lambda g, out, x, p: (lambda: mul(g, scale(powc(x, p - 1), p)),), elementwise=True)
_prim("exp", _same, _ufunc1(np.exp),
      lambda g, out, x: (lambda: mul(g, out),), elementwise=True)
_prim("log", _same, _ufunc1(np.log),
      lambda g, out, x: (lambda: div(g, x),), elementwise=True)
# d sqrt(x) = 1 / (2 sqrt(x))
_prim("sqrt", _same, _ufunc1(np.sqrt),
      lambda g, out, x: (lambda: scale(div(g, out), 0.5),), elementwise=True)
# d x^(-1/2) = -1/2 x^(-3/2) = -1/2 out^3
_prim("rsqrt", _same, _fwd_rsqrt,
      lambda g, out, x: (lambda: mul(g, scale(mul(mul(out, out), out), -0.5)),),
      elementwise=True)
# d sigmoid = s (1 - s)
_prim("sigmoid", _same, _fwd_sigmoid,
      lambda g, out, x: (lambda: mul(g, sub(out, mul(out, out))),), elementwise=True)
_prim("tanh", _same, _ufunc1(np.tanh),
      lambda g, out, x: (lambda: mul(g, addc(neg(mul(out, out)), 1.0)),), elementwise=True)
# select(c, a, b) = a where c != 0 else b; c is a 0/1 mask (a training step's "apply the
# update now" flag), so g * c and g * (1 - c) route the gradient exactly.
_prim("select", _broadcast, lambda out, c, a, b: np.copyto(out, np.where(c != 0, a, b)),
      lambda g, out, c, a, b: (None, lambda: mul(g, c), lambda: mul(g, addc(neg(c), 1.0))),
      elementwise=True)
# max(x, c) for a constant c (gradient clipping: clip / max(norm, clip))
_prim("maxc", lambda s, c: s[0], lambda out, x, c: np.maximum(x, c, out=out),
      lambda g, out, x, c: (lambda: mul(g, gtc(x, c)),), elementwise=True)
# the step function 1[x > c]: its derivative is zero wherever it is defined
_prim("gtc", lambda s, c: s[0], lambda out, x, c: np.greater(x, c, out=out, casting="unsafe"),
      lambda g, out, x, c: (lambda: scale(g, 0.0),), elementwise=True)
# the identity whose output is a constant for backward (PyTorch's ``detach``): DoRA's
# weight norm, which PEFT detaches from the gradient graph
_prim("detach", _same, lambda out, x: np.copyto(out, x), None, elementwise=True,
      stops_gradient=True)


# ---------------------------------------------------------------------------------------
# builders

def add(a, b): return _rec("add", a, b)
def sub(a, b): return _rec("sub", a, b)
def mul(a, b): return _rec("mul", a, b)
def div(a, b): return _rec("div", a, b)
def neg(x): return _rec("neg", x)
def scale(x, c): return _rec("scale", x, c=float(c))
def addc(x, c): return _rec("addc", x, c=float(c))
def powc(x, p): return _rec("powc", x, p=float(p))
def exp(x): return _rec("exp", x)
def log(x): return _rec("log", x)
def sqrt(x): return _rec("sqrt", x)
def rsqrt(x): return _rec("rsqrt", x)
def sigmoid(x): return _rec("sigmoid", x)
def tanh(x): return _rec("tanh", x)
def select(c, a, b): return _rec("select", c, a, b)
def maxc(x, c): return _rec("maxc", x, c=float(c))
def gtc(x, c): return _rec("gtc", x, c=float(c))
def detach(x): return _rec("detach", x)
