"""Primitives that move data without arithmetic: transpose, reshape, slice, pad,
concat, and the row gathers and scatters by integer ids (``take_rows`` / ``scatter_rows``,
``pick`` / ``put``).

Each one's VJP is another of them (slice and pad, take_rows and scatter_rows, pick and
put are each other's transposes), so second order comes for free.  Integer id inputs
(``index_inputs``) get no gradient.
"""

from __future__ import annotations

import numpy as np

from .table import ShapeError, _index, _norm_axis, _prim, _rec


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


def _fwd_slice(out, x, axis, start, stop):
    np.copyto(out, x[_index(x.ndim, axis, start, stop)])


def _fwd_pad(out, x, axis, before, after):
    out.fill(0)
    out[_index(x.ndim, axis, before, before + x.shape[axis])] = x


def _fwd_scatter_rows(out, src, ids, nrows):
    out.fill(0)
    np.add.at(out, ids, src)


def _fwd_pick(out, x, idx):
    out[:, 0] = x[np.arange(x.shape[0]), idx]


def _fwd_put(out, src, idx, ncols):
    out.fill(0)
    out[np.arange(src.shape[0]), idx] = src[:, 0]


def _concat_vjp(g, out, *xs, axis):
    offsets = np.cumsum([0] + [x.shape[axis] for x in xs]).tolist()
    return tuple((lambda s=s, e=e: slice_(g, axis, s, e)) for s, e in zip(offsets, offsets[1:]))


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
_prim("concat", _concat_shape,
      lambda out, *xs, axis: np.concatenate(xs, axis=axis, out=out), _concat_vjp)
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


# ---------------------------------------------------------------------------------------
# builders

def transpose(x, perm=None):
    perm = tuple(perm) if perm is not None else tuple(range(x.ndim))[::-1]
    return _rec("transpose", x, perm=perm)


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


def take_rows(table, ids):
    """table[ids]: rows of a [V, D] table picked by integer ids [T] -> [T, D]."""
    return _rec("take_rows", table, ids)


def scatter_rows(src, ids, nrows):
    """The transpose of take_rows: out[ids[i]] += src[i], out [nrows, D]."""
    return _rec("scatter_rows", src, ids, nrows=int(nrows))


def pick(x, idx):
    """x[t, idx[t]] for every row t -> [T, 1]."""
    return _rec("pick", x, idx)


def put(src, idx, ncols):
    """The transpose of pick: a [T, ncols] zero matrix with out[t, idx[t]] = src[t, 0]."""
    return _rec("put", src, idx, ncols=int(ncols))
