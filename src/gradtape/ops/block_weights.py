"""Primitives over frozen weights kept in their stored ggml type: ``qmatmul``,
``qmatmul_t`` and ``qtake_rows``.

The weight is a ``blocks.BlockMatrix`` recorded as a uint8 const of raw blocks
(``Tape.const_blocks``), ``[rows, k]`` in ggml / torch orientation, so a linear layer is
``x @ deq(w)^T``.  No gradient ever flows into ``w`` (VJP None: it is frozen); the
gradients w.r.t. x are each other's primitive, so second order comes for free.  Attrs:
qtype, rows, k (the logical shape; the input is ``[rows, row_bytes]``).  The NumPy
forwards dequantize one whole weight at a time; the cpu backend works a tile at a time.
"""

from __future__ import annotations

import numpy as np

from ..blocks import BLOCK_TYPES, dequantize, row_bytes
from .table import ShapeError, _prim, _rec


def _block_shape(w, qtype, rows, k):
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
# builders

def _block_attrs(w, op):
    attrs = getattr(w, "attrs", None) or {}
    if "qtype" not in attrs:
        raise TypeError(f"{op}: the weight must be a block matrix const (Tape.const_blocks), "
                        f"got {w!r}")
    rows, k = attrs["logical"]
    return {"qtype": attrs["qtype"], "rows": int(rows), "k": int(k)}


def _precise(flag):
    """A block product's ``precise`` attr as its op records it: only where true (the
    other products' attrs stay as they were)"""
    return {"precise": True} if flag else {}


def qmatmul(x, w, precise=False):
    """``x[T, k] @ deq(w)^T -> [T, rows]`` for a block-matrix const ``w [rows, k]``: a
    linear layer on a frozen weight kept in its stored type.  ``precise``: never
    computed in int8 (``--compute int8``), nor its gradient; for the LM head, whose
    logits the loss reads directly."""
    return _rec("qmatmul", x, w, **_block_attrs(w, "qmatmul"), **_precise(precise))


def qmatmul_t(g, w, precise=False):
    """``g[T, rows] @ deq(w) -> [T, k]``: the transpose of ``qmatmul``."""
    return _rec("qmatmul_t", g, w, **_block_attrs(w, "qmatmul_t"), **_precise(precise))


def qtake_rows(w, ids):
    """Dequantized rows ``deq(w)[ids]`` of a block-matrix table ``[V, D]`` -> ``[T, D]``
    (an embedding lookup; no gradient for ``w``)."""
    return _rec("qtake_rows", w, ids, **_block_attrs(w, "qtake_rows"))
