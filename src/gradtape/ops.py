"""The primitive table: every op the tape can record, declared once.

Each primitive has a shape rule (checked when the op is recorded), a NumPy forward that
writes into a preallocated ``out`` array (the same function runs eagerly and at replay, so
a replay is bitwise equal to the eager values), and a vector-Jacobian rule written in tape
ops, so that ``backward`` is just more graph.  A VJP rule is a pure function
``(g, out, *inputs, **attrs) -> tuple`` with one entry per input: a thunk building that
input's gradient, or ``None`` where the input is not differentiable (integer indices).
Gradients of broadcast inputs are reduced by the engine (``tape.backward``), not here.

This module also holds the builder functions (``add``, ``matmul``, ``softmax`` ...) that
layers and VJP rules call; they are thin wrappers over ``Tape.record``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import tiled


class ShapeError(ValueError):
    """Raised by a shape rule; the recorder prefixes the op and every input shape."""


@dataclass(frozen=True)
class Prim:
    name: str
    shape: Callable  # (in_shapes, **attrs) -> out shape; raises ShapeError
    forward: Callable  # (out, *inputs, **attrs) -> None; writes into out
    vjp: Callable | None  # (g, out, *inputs, **attrs) -> tuple of thunks / None
    elementwise: bool = False  # out[i] depends only on inputs[i] (after broadcasting)
    index_inputs: tuple = field(default_factory=tuple)  # positions holding integer ids
    block_inputs: tuple = field(default_factory=tuple)  # positions holding a block matrix
    # positions that may hold a float matrix or a block matrix (the fused LM head's table)
    maybe_block_inputs: tuple = field(default_factory=tuple)
    # fused primitives: elements of scratch the forward allocates beyond its output, as a
    # function of the op's Var (the memory estimate adds the largest)
    scratch: Callable | None = None
    # fused primitives: ``(tp, *inputs, **attrs) -> Var``, the same value from composed
    # primitives, for a backend with no kernel of its own (``compile.decompose``)
    decompose: Callable | None = None


PRIMS: dict[str, Prim] = {}


def _prim(name, shape, forward, vjp, elementwise=False, index_inputs=(), block_inputs=(),
          maybe_block_inputs=(), scratch=None, decompose=None):
    PRIMS[name] = Prim(name, shape, forward, vjp, elementwise, tuple(index_inputs),
                       tuple(block_inputs), tuple(maybe_block_inputs), scratch, decompose)


def _rec(op, *inputs, **attrs):
    return inputs[0].tape.record(op, inputs, **attrs)


# ---------------------------------------------------------------------------------------
# shape rules

def _same(shapes):
    return shapes[0]


def _broadcast(shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError("shapes do not broadcast (allowed: equal shapes, a [n] row over "
                         "[T, n] rows, a [T, 1] column over columns, a scalar)") from None


def _norm_axis(axis, ndim):
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} out of range for {ndim}-d input")
    return axis % ndim


def _reduce_shape(shape, axis, keepdims):
    if axis is None:
        return tuple(1 for _ in shape) if keepdims else ()
    a = _norm_axis(axis, len(shape))
    if keepdims:
        return shape[:a] + (1,) + shape[a + 1:]
    return shape[:a] + shape[a + 1:]


def _softmax_shape(shapes, axis):
    _norm_axis(axis, len(shapes[0]))
    return shapes[0]


def _matmul_shape(shapes, ta=False, tb=False):
    a, b = shapes
    if len(a) not in (2, 3) or len(b) != len(a):
        raise ShapeError("operands must both be 2-d, or both 3-d (a batch of matrices)")
    if len(a) == 3 and a[0] != b[0]:
        raise ShapeError(f"batch sizes {a[0]} != {b[0]}")
    m, k = (a[-1], a[-2]) if ta else a[-2:]
    k2, n = (b[-1], b[-2]) if tb else b[-2:]
    if k != k2:
        raise ShapeError(f"inner dims {k} != {k2}")
    return a[:-2] + (m, n)


def _slice_shape(shapes, axis, start, stop):
    (s,) = shapes
    a = _norm_axis(axis, len(s))
    if not 0 <= start <= stop <= s[a]:
        raise ShapeError(f"slice [{start}:{stop}] out of range for dim {a} of size {s[a]}")
    return s[:a] + (stop - start,) + s[a + 1:]


def _pad_shape(shapes, axis, before, after):
    (s,) = shapes
    a = _norm_axis(axis, len(s))
    if before < 0 or after < 0:
        raise ShapeError("pad widths must be >= 0")
    return s[:a] + (s[a] + before + after,) + s[a + 1:]


def _concat_shape(shapes, axis):
    a = _norm_axis(axis, len(shapes[0]))
    for s in shapes:
        if len(s) != len(shapes[0]) or s[:a] + s[a + 1:] != shapes[0][:a] + shapes[0][a + 1:]:
            raise ShapeError(f"all inputs must match except on axis {a}")
    return shapes[0][:a] + (sum(s[a] for s in shapes),) + shapes[0][a + 1:]


def _transpose_shape(shapes, perm):
    (s,) = shapes
    if sorted(perm) != list(range(len(s))):
        raise ShapeError(f"perm {perm} is not a permutation of {len(s)} axes")
    return tuple(s[p] for p in perm)


def _reshape_shape(shapes, shape):
    (s,) = shapes
    if int(np.prod(s)) != int(np.prod(shape)) or any(d < 0 for d in shape):
        raise ShapeError(f"cannot reshape {int(np.prod(s))} elements to {list(shape)}")
    return tuple(shape)


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


def _rows_index_shape(shapes):
    x, ids = shapes
    if len(x) != 2 or len(ids) != 1:
        raise ShapeError("expects a 2-d table and 1-d ids")
    return (ids[0], x[1])


def _scatter_rows_shape(shapes, nrows):
    src, ids = shapes
    if len(src) != 2 or len(ids) != 1 or src[0] != ids[0]:
        raise ShapeError("expects src [n, d] and ids [n]")
    return (nrows, src[1])


def _pick_shape(shapes):
    x, idx = shapes
    if len(x) != 2 or len(idx) != 1 or x[0] != idx[0]:
        raise ShapeError("expects x [T, V] and idx [T]")
    return (x[0], 1)


def _put_shape(shapes, ncols):
    src, idx = shapes
    if len(src) != 2 or src[1] != 1 or len(idx) != 1 or src[0] != idx[0]:
        raise ShapeError("expects src [T, 1] and idx [T]")
    return (src[0], ncols)


# ---------------------------------------------------------------------------------------
# NumPy forwards: each writes into `out`.

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


def _mT(x, t):
    """x, or x with its last two axes swapped (a view): a matrix or a batch of them."""
    return np.swapaxes(x, -1, -2) if t else x


def _fwd_matmul(out, a, b, ta=False, tb=False):
    np.matmul(_mT(a, ta), _mT(b, tb), out=out)


def _index(ndim, axis, start, stop):
    idx = [slice(None)] * ndim
    idx[axis % ndim] = slice(start, stop)
    return tuple(idx)


def _fwd_slice(out, x, axis, start, stop):
    np.copyto(out, x[_index(x.ndim, axis, start, stop)])


def _fwd_pad(out, x, axis, before, after):
    out.fill(0)
    out[_index(x.ndim, axis, before, before + x.shape[axis])] = x


def _fwd_sum(out, x, axis=None, keepdims=False):
    np.sum(x, axis=axis, keepdims=keepdims, out=out)


def _fwd_sum_to(out, x, shape):
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    np.sum(x, axis=axes, keepdims=True, out=out.reshape((1,) * lead + tuple(shape)))


def _fwd_scatter_rows(out, src, ids, nrows):
    out.fill(0)
    np.add.at(out, ids, src)


def _fwd_pick(out, x, idx):
    out[:, 0] = x[np.arange(x.shape[0]), idx]


def _fwd_put(out, src, idx, ncols):
    out.fill(0)
    out[np.arange(src.shape[0]), idx] = src[:, 0]


# ---------------------------------------------------------------------------------------
# The table.  VJP rules use the builders defined below (late-bound names).

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
# softmax VJP: y * (g - sum(g * y))
_prim("softmax", _softmax_shape, _fwd_softmax,
      lambda g, out, x, axis: (
          lambda: mul(out, sub(g, reduce_sum(mul(g, out), axis, keepdims=True))),))
# logsumexp VJP: g * exp(x - lse) = g * softmax(x)
_prim("logsumexp", lambda s, axis: _reduce_shape(s[0], axis, True), _fwd_logsumexp,
      lambda g, out, x, axis: (lambda: mul(g, exp(sub(x, out))),))
_prim("matmul", _matmul_shape, _fwd_matmul, lambda g, out, a, b, ta=False, tb=False: {
    # C = op(A) op(B); each case is dA, dB written without materialised transposes.
    (False, False): (lambda: matmul(g, b, tb=True), lambda: matmul(a, g, ta=True)),
    (False, True): (lambda: matmul(g, b), lambda: matmul(g, a, ta=True)),
    (True, False): (lambda: matmul(b, g, tb=True), lambda: matmul(a, g)),
    (True, True): (lambda: matmul(b, g, ta=True, tb=True),
                   lambda: matmul(g, a, ta=True, tb=True)),
}[(ta, tb)])
_prim("transpose", _transpose_shape,
      lambda out, x, perm: np.copyto(out, x.transpose(perm)),
      lambda g, out, x, perm: (lambda: transpose(g, tuple(np.argsort(perm).tolist())),))
_prim("reshape", _reshape_shape, lambda out, x, shape: np.copyto(out, x.reshape(shape)),
      lambda g, out, x, shape: (lambda: reshape(g, x.shape),))
_prim("slice", _slice_shape, _fwd_slice,
      lambda g, out, x, axis, start, stop: (
          lambda: pad(g, axis, start, x.shape[axis] - stop),))
_prim("pad", _pad_shape, _fwd_pad,
      lambda g, out, x, axis, before, after: (
          lambda: slice_(g, axis, before, before + x.shape[axis]),))


def _concat_vjp(g, out, *xs, axis):
    offsets = np.cumsum([0] + [x.shape[axis] for x in xs]).tolist()
    return tuple((lambda s=s, e=e: slice_(g, axis, s, e)) for s, e in zip(offsets, offsets[1:]))


_prim("concat", _concat_shape,
      lambda out, *xs, axis: np.concatenate(xs, axis=axis, out=out), _concat_vjp)
_prim("sum", lambda s, axis=None, keepdims=False: _reduce_shape(s[0], axis, keepdims),
      _fwd_sum,
      lambda g, out, x, axis=None, keepdims=False: (
          lambda: broadcast_to(reshape(g, _reduce_shape(x.shape, axis, True)), x.shape),))
_prim("sum_to", _sum_to_shape, _fwd_sum_to,
      lambda g, out, x, shape: (lambda: broadcast_to(g, x.shape),))
_prim("broadcast_to", _broadcast_to_shape, lambda out, x, shape: np.copyto(out, x),
      lambda g, out, x, shape: (lambda: sum_to(g, x.shape),))
_prim("take_rows", _rows_index_shape,
      lambda out, table, ids: np.take(table, ids, axis=0, out=out),
      lambda g, out, table, ids: (lambda: scatter_rows(g, ids, table.shape[0]), None),
      index_inputs=(1,))
_prim("scatter_rows", _scatter_rows_shape, _fwd_scatter_rows,
      lambda g, out, src, ids, nrows: (lambda: take_rows(g, ids), None), index_inputs=(1,))
_prim("pick", _pick_shape, _fwd_pick,
      lambda g, out, x, idx: (lambda: put(g, idx, x.shape[1]), None), index_inputs=(1,))
_prim("put", _put_shape, _fwd_put,
      lambda g, out, src, idx, ncols: (lambda: pick(g, idx), None), index_inputs=(1,))


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
# Frozen weights in their stored type (``blocks.BlockMatrix``, a uint8 const of raw
# blocks).  ``w`` is ``[rows, k]`` in ggml / torch orientation, so a linear layer is
# ``x @ deq(w)^T``.  No gradient ever flows into ``w`` (VJP None: it is frozen); the
# gradients w.r.t. x are each other's primitive, so second order comes for free.
# Attrs: qtype, rows, k (the logical shape; the input is [rows, row_bytes]).

def _block_shape(w, qtype, rows, k):
    from .blocks import BLOCK_TYPES, row_bytes
    if qtype not in BLOCK_TYPES:
        raise ShapeError(f"ggml type {qtype!r} is not one we run ({', '.join(BLOCK_TYPES)})")
    want = (rows, row_bytes(qtype, k))
    if tuple(w) != want:
        raise ShapeError(f"blocks {list(w)} do not hold a {qtype} [{rows}, {k}] matrix "
                         f"(need {list(want)})")


def _qmatmul_shape(shapes, qtype, rows, k, precise=False):
    x, w = shapes
    _block_shape(w, qtype, rows, k)
    if len(x) != 2 or x[1] != k:
        raise ShapeError(f"x{list(x)} @ W[{rows}, {k}]^T ({qtype}): x must be [T, {k}]")
    return (x[0], rows)


def _qmatmul_t_shape(shapes, qtype, rows, k, precise=False):
    g, w = shapes
    _block_shape(w, qtype, rows, k)
    if len(g) != 2 or g[1] != rows:
        raise ShapeError(f"g{list(g)} @ W[{rows}, {k}] ({qtype}): g must be [T, {rows}]")
    return (g[0], k)


def _qtake_rows_shape(shapes, qtype, rows, k):
    w, ids = shapes
    _block_shape(w, qtype, rows, k)
    if len(ids) != 1:
        raise ShapeError("expects 1-d ids")
    return (ids[0], k)


def _deq(w, qtype, dtype):
    from .blocks import dequantize
    return dequantize(w, qtype).astype(dtype, copy=False)  # [rows, k], one weight at a time


def _fwd_qmatmul(out, x, w, qtype, rows, k, precise=False):
    np.matmul(x, _deq(w, qtype, out.dtype).T, out=out)


def _fwd_qmatmul_t(out, g, w, qtype, rows, k, precise=False):
    np.matmul(g, _deq(w, qtype, out.dtype), out=out)


def _fwd_qtake_rows(out, w, ids, qtype, rows, k):
    if len(ids) and (ids.min() < 0 or ids.max() >= rows):
        raise IndexError(f"qtake_rows: ids out of range [0, {rows})")
    np.copyto(out, _deq(w[ids], qtype, out.dtype))


_prim("qmatmul", _qmatmul_shape, _fwd_qmatmul,
      lambda g, out, x, w, **a: (lambda: qmatmul_t(g, w, a.get("precise", False)), None),
      block_inputs=(1,))
_prim("qmatmul_t", _qmatmul_t_shape, _fwd_qmatmul_t,
      lambda g, out, h, w, **a: (lambda: qmatmul(g, w, a.get("precise", False)), None),
      block_inputs=(1,))
_prim("qtake_rows", _qtake_rows_shape, _fwd_qtake_rows,
      lambda g, out, w, ids, **a: (None, None), index_inputs=(1,), block_inputs=(0,))


# ---------------------------------------------------------------------------------------
# Tiled primitives (NumPy forwards in ``tiled.py``): memory linear in T.  Their gradients
# are primitives of their own that recompute each block from saved row statistics; those
# have no VJP (no second order through a fused op: differentiate the composed version).
# ``decompose`` gives each one as composed primitives, for a backend without a kernel.
#
# head_nll(x [T, D], table [V, D] float or blocks, ids [T]) -> [T, 2]: per row
# (lse_t - z[t, ids[t]], lse_t) with z = cap(x @ table^T), never a whole [T, V] block.

def _head_table_shape(w, qtype, rows, k):
    if qtype is not None:
        _block_shape(w, qtype, rows, k)
        return rows, k
    if len(w) != 2:
        raise ShapeError(f"the table must be [V, D], got {list(w)}")
    return tuple(w)


def _head_nll_shape(shapes, cap, chunk, qtype=None, rows=None, k=None):
    x, w, ids = shapes[:3]
    V, D = _head_table_shape(w, qtype, rows, k)
    if len(x) != 2 or x[1] != D:
        raise ShapeError(f"x{list(x)} @ table[{V}, {D}]^T: x must be [T, {D}]")
    if tuple(ids) != (x[0],):
        raise ShapeError(f"ids{list(ids)} must be [{x[0]}] (one per row of x)")
    if chunk < 1 or cap < 0:
        raise ShapeError(f"chunk {chunk} must be >= 1 and cap {cap} >= 0")
    return (x[0], 2)


def _head_grad_check(shapes, attrs):
    g, x, w, ids, o = shapes
    _head_nll_shape([x, w, ids], **attrs)
    if tuple(g) != (x[0], 2) or tuple(o) != (x[0], 2):
        raise ShapeError(f"g{list(g)} and the forward's out{list(o)} must be [{x[0]}, 2]")
    return x


def _head_grad_x_shape(shapes, **attrs):
    return tuple(_head_grad_check(shapes, attrs))


def _head_grad_w_shape(shapes, **attrs):
    _head_grad_check(shapes, attrs)
    return tuple(shapes[2])


def _head_scratch(v):
    """A [T, chunk] logits block (two under a cap: the tanh is kept), the [T, D] product
    of a gradient block (head_nll_e: and its sum E), for a block table its dequantized
    [chunk, D] rows (in float32, or twice in bf16: the blocked layouts of both products,
    ``tiled_c.Bf16HeadGemms``) and x's and the block's bf16 copies (half a value each;
    counted whatever the compute, which this estimate does not know)."""
    x = v.inputs[1] if v.op not in ("head_nll", "head_nll_e") else v.inputs[0]
    rows = v.attrs["chunk"] * x.shape[1] if v.attrs.get("qtype") else 0
    capped = 2 if v.attrs.get("cap") else 1
    products = 2 if v.op == "head_nll_e" else 1
    logits = x.shape[0] * v.attrs["chunk"]
    return logits * capped + products * x.size + rows + (x.size + logits) // 2


def _dec_head_nll(tp, x, w, ids, cap, chunk, qtype=None, rows=None, k=None):
    z = qmatmul(x, w, precise=True) if qtype is not None else matmul(x, w, tb=True)  # [T, V]
    if cap:
        z = scale(tanh(scale(z, 1.0 / cap)), cap)
    return concat([nll_ids(z, ids), logsumexp(z, 1)], 1)


def _dec_vjp(fwd, n_fwd, wrt):
    """The decomposition of a gradient primitive ``(g, *fwd_inputs, y, *rest)``: the
    composed forward's own VJP with cotangent ``g``, w.r.t. the forward inputs ``wrt``
    (flattened and joined when more than one)."""
    def rule(tp, g, *ins, **attrs):
        xs = ins[:n_fwd] + ins[n_fwd + 1:]  # the forward inputs, without y
        grads = tp.backward(reduce_sum(mul(fwd(tp, *xs, **attrs), g)))
        if len(wrt) == 1:
            return grads[xs[wrt[0]]]
        return concat([reshape(grads[xs[i]], (xs[i].size,)) for i in wrt], 0)
    return rule


def _head_nll_vjp(g, out, x, w, ids, **attrs):
    return (lambda: _rec("head_nll_grad_x", g, x, w, ids, out, **attrs),
            lambda: _rec("head_nll_grad_w", g, x, w, ids, out, **attrs), None)


# head_nll_e(x, table, ids) -> [T, 2 + D]: head_nll's two columns (no cap) and E =
# softmax(z) @ table, from which the gradient w.r.t. x is elementwise (``tiled.
# fwd_head_nll_e``): one GEMM over the vocabulary in forward instead of two in backward.
# E is not for use: ``head_nll`` slices it away, and its cotangent is taken as zero.

def _head_nll_e_shape(shapes, chunk, qtype=None, rows=None, k=None):
    t, _ = _head_nll_shape(shapes, 0.0, chunk, qtype, rows, k)
    return (t, 2 + shapes[0][1])


def _head_nll_e_vjp(g, out, x, w, ids, chunk, **attrs):
    def dx():
        b = slice_(g, 1, 0, 1)  # the nll's cotangent; with the lse's, a = b + g_lse
        rows = qtake_rows(w, ids) if attrs else take_rows(w, ids)
        return sub(mul(add(b, slice_(g, 1, 1, 2)), slice_(out, 1, 2, out.shape[1])),
                   mul(b, rows))
    return (dx, lambda: _rec("head_nll_grad_w", slice_(g, 1, 0, 2), x, w, ids,
                             slice_(out, 1, 0, 2), cap=0.0, chunk=chunk), None)


def _dec_head_nll_e(tp, x, w, ids, chunk, qtype=None, rows=None, k=None):
    z = qmatmul(x, w, precise=True) if qtype is not None else matmul(x, w, tb=True)  # [T, V]
    p = softmax(z, 1)
    e = qmatmul_t(p, w, precise=True) if qtype is not None else matmul(p, w)
    return concat([nll_ids(z, ids), logsumexp(z, 1), e], 1)


_prim("head_nll", _head_nll_shape, tiled.fwd_head_nll, _head_nll_vjp, index_inputs=(2,),
      maybe_block_inputs=(1,), scratch=_head_scratch, decompose=_dec_head_nll)
_prim("head_nll_e", _head_nll_e_shape, tiled.fwd_head_nll_e, _head_nll_e_vjp,
      index_inputs=(2,), maybe_block_inputs=(1,), scratch=_head_scratch,
      decompose=_dec_head_nll_e)
_prim("head_nll_grad_x", _head_grad_x_shape, tiled.fwd_head_nll_grad_x, None,
      index_inputs=(3,), maybe_block_inputs=(2,), scratch=_head_scratch,
      decompose=_dec_vjp(_dec_head_nll, 3, (0,)))
_prim("head_nll_grad_w", _head_grad_w_shape, tiled.fwd_head_nll_grad_w, None,
      index_inputs=(3,), scratch=_head_scratch, decompose=_dec_vjp(_dec_head_nll, 3, (1,)))


# attn(q [Nq, nh*hd], k, v [Nk, nkv*hd][, seg [N]]) -> [Nq, nh*hd + nh]: per query head
# softmax(cap(q_h k_kv^T * iscale) + mask) v_kv and the rows' logsumexp (the backward's
# statistics), key tile by key tile; tiles no row of a query tile sees are skipped.  The
# mask: causal, a sliding window, equal segment ids (``tiled.AttnLayout``).

def _attn_dims(q, k, v, seg, nh, nkv, hd, n_seq, tile):
    if nkv <= 0 or nh % nkv:
        raise ShapeError(f"nh={nh} is not a multiple of nkv={nkv}")
    if len(q) != 2 or q[1] != nh * hd:
        raise ShapeError(f"q{list(q)} must be [N, nh*hd = {nh * hd}]")
    if len(k) != 2 or tuple(v) != tuple(k) or k[1] != nkv * hd:
        raise ShapeError(f"k{list(k)} and v{list(v)} must both be [N, nkv*hd = {nkv * hd}]")
    if n_seq < 1 or q[0] % n_seq or k[0] % n_seq or k[0] // n_seq < q[0] // n_seq:
        raise ShapeError(f"{q[0]} query rows and {k[0]} key rows do not split into "
                         f"{n_seq} sequences with at least as many keys as queries")
    if seg and (tuple(seg[0]) != (q[0],) or q[0] != k[0]):
        raise ShapeError(f"segment ids{list(seg[0])} need [N] with N query rows = N key rows")
    if tile < 1:
        raise ShapeError(f"tile {tile} must be >= 1")
    return q[0], k[0]


def _attn_shape(shapes, nh, nkv, hd, n_seq, tile, **attrs):
    nq, _ = _attn_dims(*shapes[:3], shapes[3:], nh, nkv, hd, n_seq, tile)
    return (nq, nh * hd + nh)


def _attn_grad_shape(shapes, nh, nkv, hd, n_seq, tile, **attrs):
    gy, q, k, v, y = shapes[:5]
    nq, nk = _attn_dims(q, k, v, shapes[5:], nh, nkv, hd, n_seq, tile)
    if tuple(gy) != (nq, nh * hd + nh) or tuple(y) != tuple(gy):
        raise ShapeError(f"g{list(gy)} and the forward's out{list(y)} must be "
                         f"[{nq}, {nh * hd + nh}]")
    return (nq * nh * hd + 2 * nk * nkv * hd,)


def _attn_scratch(v):
    """The backward's (the larger) scratch: three [nh, qt, kt] score blocks (p, dp, the
    cap's 1 - tanh^2), six [nh, qt, hd] row blocks (grouped q, do, o, their product, dq,
    ds k) and one [nkv, kt, hd] (a key tile's dk or dv, before its strided add); and the
    fused C attention's (``csrc/flash.c``) key-sized arrays: the keys and values packed
    twice, and each thread's but the first's dk, dv (``_omp_threads`` of them)."""
    a = v.attrs
    n_seq = a["n_seq"]
    # query rows: attn's q, attn_grad's g; key rows: attn's v, attn_grad's k
    qt, kt = tiled.attn_tiles(a["tile"], v.inputs[0].shape[0] // n_seq,
                              v.inputs[2].shape[0] // n_seq)
    return (a["nh"] * qt * (3 * kt + 6 * a["hd"]) + a["nkv"] * kt * a["hd"]
            + (4 + 2 * (_omp_threads() - 1)) * v.inputs[2].size)


def _omp_threads():
    """The threads an OpenMP region takes by default: ``$OMP_NUM_THREADS`` (its first
    number), else the CPUs this process may use."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)


def _attn_vjp(g, out, q, k, v, *seg, **attrs):
    memo = []  # the one attn_grad op the three thunks slice

    def part(i):
        if not memo:
            memo.append(_rec("attn_grad", g, q, k, v, out, *seg, **attrs))
        sizes = [q.size, k.size, v.size]
        start = sum(sizes[:i])
        return reshape(slice_(memo[0], 0, start, start + sizes[i]), (q, k, v)[i].shape)
    return (lambda: part(0), lambda: part(1), lambda: part(2)) + (None,) * len(seg)


def _dec_attn(tp, q, k, v, *seg, nh, nkv, hd, iscale, cap, window, n_seq, tile, f32=False):
    """Composed: per sequence and query head, the scores with an additive mask (-1e9
    where hidden, as ``nn.causal_mask_fill``; segments through one-hot products)."""
    g, nq, nk = nh // nkv, q.shape[0] // n_seq, k.shape[0] // n_seq
    mask = tp.const(tiled.causal_mask(nq, nk - nq, window))  # [nq, nk]
    rows = []
    if seg:  # one-hot rows of the segment ids (0 <= id < N): [N, N]
        n = q.shape[0]
        onehots = put(tp.const(np.ones((n, 1), tp.dtype)), seg[0], n)
    for b in range(n_seq):
        qb, kb, vb = (slice_(x, 0, b * n, (b + 1) * n) for x, n in ((q, nq), (k, nk), (v, nk)))
        mb = mask
        if seg:
            onehot = slice_(onehots, 0, b * nq, (b + 1) * nq)
            same = matmul(onehot, onehot, tb=True)  # [nq, nq]: 1 where the segments agree
            mb = add(mask, scale(addc(same, -1.0), -tiled.MASK_VALUE))
        outs, lses = [], []
        for h in range(nh):
            col = lambda x, j: slice_(x, 1, j * hd, (j + 1) * hd)  # noqa: E731
            sc = scale(matmul(col(qb, h), col(kb, h // g), tb=True), iscale)
            if cap:
                sc = scale(tanh(scale(sc, 1.0 / cap)), cap)
            sc = add(sc, mb)
            outs.append(matmul(softmax(sc, 1), col(vb, h // g)))
            lses.append(logsumexp(sc, 1))
        rows.append(concat(outs + lses, 1))
    return concat(rows, 0) if n_seq > 1 else rows[0]


_prim("attn", _attn_shape, tiled.fwd_attn, _attn_vjp, index_inputs=(3,),
      scratch=_attn_scratch, decompose=_dec_attn)
_prim("attn_grad", _attn_grad_shape, tiled.fwd_attn_grad, None, index_inputs=(5,),
      scratch=_attn_scratch, decompose=_dec_vjp(_dec_attn, 3, (0, 1, 2)))


# ---------------------------------------------------------------------------------------
# Builders: the functions layers and VJP rules call.

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
def softmax(x, axis): return _rec("softmax", x, axis=int(axis))
def logsumexp(x, axis): return _rec("logsumexp", x, axis=int(axis))


def matmul(a, b, ta=False, tb=False):
    """op(a) @ op(b), where op transposes when ta / tb is set (no copy is made).  Both
    2-d, or both 3-d ``[batch, m, k] @ [batch, k, n]`` (op swapping the last two axes)."""
    return _rec("matmul", a, b, ta=bool(ta), tb=bool(tb))


def transpose(x, perm=None):
    return _rec("transpose", x, perm=tuple(perm) if perm is not None else tuple(range(x.ndim))[::-1])


def reshape(x, shape): return _rec("reshape", x, shape=tuple(int(d) for d in shape))


def slice_(x, axis, start, stop):
    """x[..., start:stop, ...] along `axis`."""
    return _rec("slice", x, axis=int(axis), start=int(start), stop=int(stop))


def pad(x, axis, before, after):
    """Zero-pad `x` along `axis` with `before` and `after` entries."""
    return _rec("pad", x, axis=int(axis), before=int(before), after=int(after))


def concat(xs, axis):
    xs = list(xs)
    if not xs:
        raise ValueError("concat: needs at least one input")
    return _rec("concat", *xs, axis=int(axis))


def reduce_sum(x, axis=None, keepdims=False):
    return _rec("sum", x, axis=None if axis is None else int(axis), keepdims=bool(keepdims))


def sum_to(x, shape): return _rec("sum_to", x, shape=tuple(shape))
def broadcast_to(x, shape): return _rec("broadcast_to", x, shape=tuple(shape))


def take_rows(table, ids):
    """table[ids]: rows of a [V, D] table picked by integer ids [T] -> [T, D]."""
    return _rec("take_rows", table, ids)


def scatter_rows(src, ids, nrows):
    """The transpose of take_rows: out[ids[i]] += src[i], out [nrows, D]."""
    return _rec("scatter_rows", src, ids, nrows=int(nrows))


def pick(x, idx):
    """x[t, idx[t]] for every row t -> [T, 1]."""
    return _rec("pick", x, idx)


def nll_ids(x, ids):
    """``logsumexp(x[t]) - x[t, ids[t]]`` per row of ``x[T, V]`` -> ``[T, 1]``."""
    return _rec("nll_ids", x, ids)


def nll_ids_grad(g, x, ids):
    """``g[t] * (softmax(x[t]) - onehot(ids[t]))`` -> ``[T, V]`` (the VJP of nll_ids)."""
    return _rec("nll_ids_grad", g, x, ids)


def put(src, idx, ncols):
    """The transpose of pick: a [T, ncols] zero matrix with out[t, idx[t]] = src[t, 0]."""
    return _rec("put", src, idx, ncols=int(ncols))


def _block_attrs(w, op):
    attrs = getattr(w, "attrs", None) or {}
    if "qtype" not in attrs:
        raise TypeError(f"{op}: the weight must be a block matrix const (Tape.const_blocks), "
                        f"got {w!r}")
    rows, k = attrs["logical"]
    return {"qtype": attrs["qtype"], "rows": int(rows), "k": int(k)}


def qmatmul(x, w, precise=False):
    """``x[T, k] @ deq(w)^T -> [T, rows]`` for a block-matrix const ``w [rows, k]``: a
    linear layer on a frozen weight kept in its stored type.  ``precise``: never
    computed in int8 (``--compute int8``), nor its gradient; for the LM head, whose
    logits the loss reads directly."""
    return _rec("qmatmul", x, w, **_block_attrs(w, "qmatmul"), **_precise(precise))


def qmatmul_t(g, w, precise=False):
    """``g[T, rows] @ deq(w) -> [T, k]``: the transpose of ``qmatmul``."""
    return _rec("qmatmul_t", g, w, **_block_attrs(w, "qmatmul_t"), **_precise(precise))


def _precise(flag):
    """A block product's ``precise`` attr as its op records it: only where true (the
    other products' attrs stay as they were)"""
    return {"precise": True} if flag else {}


def qtake_rows(w, ids):
    """Dequantized rows ``deq(w)[ids]`` of a block-matrix table ``[V, D]`` -> ``[T, D]``
    (an embedding lookup; no gradient for ``w``)."""
    return _rec("qtake_rows", w, ids, **_block_attrs(w, "qtake_rows"))


def head_nll(x, table, ids, cap=0.0, *, grad_in_forward=False):
    """``[T, 2]``: per row ``(lse_t - z[t, ids[t]], lse_t)`` with ``z = x @ table^T``
    (soft-capped to ``cap * tanh(z / cap)`` when ``cap > 0``) and ``lse_t =
    logsumexp(z[t])``, computed a block of vocabulary rows at a time.  ``x [T, D]``;
    ``table [V, D]``, a float matrix or a block-matrix const; ``ids [T]``.

    ``grad_in_forward`` (a loss that will be differentiated, no cap): the forward also
    folds up what the gradient w.r.t. ``x`` needs (``head_nll_e``), so the backward makes
    no second pass over the vocabulary: two GEMMs over it in all instead of three."""
    attrs = _block_attrs(table, "head_nll") if "qtype" in (table.attrs or {}) else {}
    V = attrs["rows"] if attrs else table.shape[0]
    chunk = tiled.head_chunk(x.shape[0], V)
    if grad_in_forward and not cap:
        e = _rec("head_nll_e", x, table, ids, chunk=chunk, **attrs)
        # its [T, 2 + D] rows are all the backward reads: activation checkpointing keeps
        # them instead of walking the vocabulary again
        return slice_(x.tape.checkpoint(e), 1, 0, 2)
    return _rec("head_nll", x, table, ids, cap=float(cap), chunk=chunk, **attrs)


def attn(q, k, v, seg=None, *, nh, nkv, hd, iscale, cap=0.0, window=0, n_seq=1,
         tile=tiled.ATTN_TILE, f32=False):
    """Tiled causal attention of already-roped ``q [Nq, nh*hd]`` over ``k, v [Nk,
    nkv*hd]`` (query head ``h`` reads kv head ``h // (nh // nkv)``), ``n_seq``
    sequences stacked as rows: ``[Nq, nh*hd + nh]``, the heads' outputs then each row's
    logsumexp per head.  ``cap > 0`` soft-caps the scaled scores; ``window > 0`` hides
    keys ``window`` or more positions back; ``seg [N]`` (integer ids) hides keys of
    other segments.  ``tile`` query rows per tile over key tiles ``tiled.ATTN_KEYS`` times
    as wide: never more than a few such score blocks.  ``f32``: its products stay
    float32 in a bf16 program (where they otherwise take bf16 inputs), as the composed
    attention's do."""
    attrs = dict(nh=int(nh), nkv=int(nkv), hd=int(hd), iscale=float(iscale),
                 cap=float(cap), window=int(window), n_seq=int(n_seq), tile=int(tile),
                 f32=bool(f32))
    return _rec("attn", q, k, v, *([seg] if seg is not None else []), **attrs)
