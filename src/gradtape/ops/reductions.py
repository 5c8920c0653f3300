"""Primitives that reduce along an axis, and their transposes: ``sum``, ``sum_to`` (a
broadcast gradient summed back to its input's shape) and ``broadcast_to``; ``softmax``
and ``logsumexp``; ``nll_ids`` (the next-token loss per row over integer targets) and
its gradient ``nll_ids_grad``.

Axes follow NumPy (``axis=1`` reduces each row).  The row-wise forwards subtract the
row maximum first, so they neither overflow nor lose the large logits.
"""

from __future__ import annotations

import numpy as np

from .elementwise import exp, mul, sub
from .movement import reshape
from .table import ShapeError, _index, _norm_axis, _prim, _rec, _reduce_shape


def _softmax_shape(shapes, axis):
    _norm_axis(axis, len(shapes[0]))
    return shapes[0]


def _sum_to_shape(shapes, shape):
    (s,) = shapes
    shape = tuple(shape)
    try:
        ok = len(shape) <= len(s) and np.broadcast_shapes(shape, s) == tuple(s)
    except ValueError:  # numpy's own message would not name the op
        ok = False
    if not ok:
        raise ShapeError(f"cannot sum {list(s)} down to {list(shape)}")
    return shape


def _broadcast_to_shape(shapes, shape):
    (s,) = shapes
    shape = tuple(shape)
    try:
        if np.broadcast_shapes(s, shape) != shape:
            raise ValueError
    except ValueError:
        raise ShapeError(f"cannot broadcast {list(s)} to {list(shape)}") from None
    return shape


def _fwd_softmax(out, x, axis):
    np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(axis=axis, keepdims=True), out=out)


def _fwd_logsumexp(out, x, axis):
    # in slabs along the other axis: the exp temporary stays small for [T, vocab] logits
    step = max(1, (1 << 16) // max(1, x.shape[axis]))
    other = 1 - axis % 2 if x.ndim == 2 else None
    if other is None or x.shape[other] <= step:
        m = x.max(axis=axis, keepdims=True)
        np.log(np.exp(x - m).sum(axis=axis, keepdims=True), out=out)
        np.add(out, m, out=out)
        return
    for s in range(0, x.shape[other], step):
        idx = _index(2, other, s, s + step)
        _fwd_logsumexp(out[idx], x[idx], axis)


def _fwd_sum(out, x, axis=None, keepdims=False):
    np.sum(x, axis=axis, keepdims=keepdims, out=out)


def _fwd_sum_to(out, x, shape):
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    np.sum(x, axis=axes, keepdims=True, out=out.reshape((1,) * lead + tuple(shape)))


# softmax VJP: y * (g - sum(g * y))
_prim("softmax", _softmax_shape, _fwd_softmax,
      lambda g, out, x, axis: (
          lambda: mul(out, sub(g, reduce_sum(mul(g, out), axis, keepdims=True))),))
# logsumexp VJP: g * exp(x - lse) = g * softmax(x)
_prim("logsumexp", lambda s, axis: _reduce_shape(s[0], axis, True), _fwd_logsumexp,
      lambda g, out, x, axis: (lambda: mul(g, exp(sub(x, out))),))
_prim("sum", lambda s, axis=None, keepdims=False: _reduce_shape(s[0], axis, keepdims),
      _fwd_sum,
      lambda g, out, x, axis=None, keepdims=False: (
          lambda: broadcast_to(reshape(g, _reduce_shape(x.shape, axis, True)), x.shape),))
_prim("sum_to", _sum_to_shape, _fwd_sum_to,
      lambda g, out, x, shape: (lambda: broadcast_to(g, x.shape),))
_prim("broadcast_to", _broadcast_to_shape, lambda out, x, shape: np.copyto(out, x),
      lambda g, out, x, shape: (lambda: sum_to(g, x.shape),))


# nll_ids(x, ids)[t] = logsumexp(x[t]) - x[t, ids[t]]: next-token loss per row without a
# [T, V] one-hot or log-softmax in memory.  Its gradient g * (softmax(x) - onehot(ids)) is
# one fused op too (nll_ids_grad), whose own VJP is written in tape ops (second order).
def _nll_ids_shape(shapes):
    x, ids = shapes
    if len(x) != 2 or len(ids) != 1 or x[0] != ids[0]:
        raise ShapeError("expects x [T, V] and ids [T]")
    return (x[0], 1)


def _nll_ids_grad_shape(shapes):
    g, x, ids = shapes
    if len(x) != 2 or tuple(g) != (x[0], 1) or tuple(ids) != (x[0],):
        raise ShapeError("expects g [T, 1], x [T, V] and ids [T]")
    return tuple(x)


def _fwd_nll_ids(out, x, ids):
    _fwd_logsumexp(out, x, 1)
    out[:, 0] -= x[np.arange(x.shape[0]), ids]


def _fwd_nll_ids_grad(out, g, x, ids):
    _fwd_softmax(out, x, 1)
    out[np.arange(x.shape[0]), ids] -= 1.0
    np.multiply(out, g, out=out)


def _nll_ids_grad_vjp(u, out, g, x, ids):
    p = softmax(x, 1)
    ones = g.tape.const(np.ones(g.shape, g.dtype))
    # d/dg: sum_j u_j (p_j - onehot_j); d/dx: g * p * (u - sum_j u_j p_j)
    return (lambda: reduce_sum(mul(u, nll_ids_grad(ones, x, ids)), 1, keepdims=True),
            lambda: mul(g, mul(p, sub(u, reduce_sum(mul(u, p), 1, keepdims=True)))),
            None)


_prim("nll_ids", _nll_ids_shape, _fwd_nll_ids,
      lambda g, out, x, ids: (lambda: nll_ids_grad(g, x, ids), None), index_inputs=(1,))
_prim("nll_ids_grad", _nll_ids_grad_shape, _fwd_nll_ids_grad, _nll_ids_grad_vjp,
      index_inputs=(2,))


# ---------------------------------------------------------------------------------------
# builders

def softmax(x, axis): return _rec("softmax", x, axis=int(axis))
def logsumexp(x, axis): return _rec("logsumexp", x, axis=int(axis))


def reduce_sum(x, axis=None, keepdims=False):
    return _rec("sum", x, axis=None if axis is None else int(axis), keepdims=bool(keepdims))


def sum_to(x, shape): return _rec("sum_to", x, shape=tuple(shape))
def broadcast_to(x, shape): return _rec("broadcast_to", x, shape=tuple(shape))


def nll_ids(x, ids):
    """``logsumexp(x[t]) - x[t, ids[t]]`` per row of ``x[T, V]`` -> ``[T, 1]``."""
    return _rec("nll_ids", x, ids)


def nll_ids_grad(g, x, ids):
    """``g[t] * (softmax(x[t]) - onehot(ids[t]))`` -> ``[T, V]`` (the VJP of nll_ids)."""
    return _rec("nll_ids_grad", g, x, ids)
