"""The LM head fused with its cross-entropy: ``head_nll``, ``head_nll_e`` and their
gradient primitives ``head_nll_grad_x`` / ``head_nll_grad_w``.

``head_nll(x [T, D], table [V, D] float or blocks, ids [T]) -> [T, 2]``: per row
``(lse_t - z[t, ids[t]], lse_t)`` with ``z = cap(x @ table^T)``, a block of vocabulary
rows at a time (``tiled.fwd_head_nll``), never a whole ``[T, V]`` block.  The table may
be a frozen weight in ggml blocks (``block_weights``).  See ``fused`` for what the fused
primitives share.

A row whose id is negative has no target: the host backends' walks skip it (its outputs
and its gradient are zero), so a loss that counts some rows only (``nn.ce_targets_fill``'s
``no_target``) pays the vocabulary's GEMMs for those alone.  The composed forms
(``decompose``, for a backend without these kernels) need ids in range.
"""

from __future__ import annotations

from .. import tiled
from .block_weights import _block_attrs, _block_shape, qmatmul, qmatmul_t, qtake_rows
from .elementwise import add, mul, scale, sub, tanh
from .fused import decomposed_vjp
from .linalg import matmul
from .movement import concat, slice_, take_rows
from .reductions import logsumexp, nll_ids, softmax
from .table import ShapeError, _prim, _rec


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
    the cpu backend's ``Bf16HeadGemms``) and x's and the block's bf16 copies (half a
    value each; counted whatever the compute, which this estimate does not know)."""
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
        rows = _rec("head_rows", w, ids, **attrs)
        return sub(mul(add(b, slice_(g, 1, 1, 2)), slice_(out, 1, 2, out.shape[1])),
                   mul(b, rows))
    return (dx, lambda: _rec("head_nll_grad_w", slice_(g, 1, 0, 2), x, w, ids,
                             slice_(out, 1, 0, 2), cap=0.0, chunk=chunk), None)


def _dec_head_nll_e(tp, x, w, ids, chunk, qtype=None, rows=None, k=None):
    z = qmatmul(x, w, precise=True) if qtype is not None else matmul(x, w, tb=True)  # [T, V]
    p = softmax(z, 1)
    e = qmatmul_t(p, w, precise=True) if qtype is not None else matmul(p, w)
    return concat([nll_ids(z, ids), logsumexp(z, 1), e], 1)


# head_rows(table, ids) -> [T, D]: the table's rows ids (a block table's dequantized), zero
# where an id is negative: head_nll_e's gradient w.r.t. x reads them

def _head_rows_shape(shapes, qtype=None, rows=None, k=None):
    w, ids = shapes
    _, D = _head_table_shape(w, qtype, rows, k)
    if len(ids) != 1:
        raise ShapeError(f"ids{list(ids)} must be 1-d")
    return (ids[0], D)


def _dec_head_rows(tp, w, ids, qtype=None, rows=None, k=None):
    return qtake_rows(w, ids) if qtype is not None else take_rows(w, ids)


_prim("head_rows", _head_rows_shape, tiled.fwd_head_rows,
      lambda g, out, w, ids, **a: (None, None), index_inputs=(1,), maybe_block_inputs=(0,),
      decompose=_dec_head_rows)
_prim("head_nll", _head_nll_shape, tiled.fwd_head_nll, _head_nll_vjp, index_inputs=(2,),
      maybe_block_inputs=(1,), scratch=_head_scratch, decompose=_dec_head_nll)
_prim("head_nll_e", _head_nll_e_shape, tiled.fwd_head_nll_e, _head_nll_e_vjp,
      index_inputs=(2,), maybe_block_inputs=(1,), scratch=_head_scratch,
      decompose=_dec_head_nll_e)
_prim("head_nll_grad_x", _head_grad_x_shape, tiled.fwd_head_nll_grad_x, None,
      index_inputs=(3,), maybe_block_inputs=(2,), scratch=_head_scratch,
      decompose=decomposed_vjp(_dec_head_nll, 3, (0,)))
_prim("head_nll_grad_w", _head_grad_w_shape, tiled.fwd_head_nll_grad_w, None,
      index_inputs=(3,), scratch=_head_scratch,
      decompose=decomposed_vjp(_dec_head_nll, 3, (1,)))


def head_nll(x, table, ids, cap=0.0, *, grad_in_forward=False, budget=None):
    """``[T, 2]``: per row ``(lse_t - z[t, ids[t]], lse_t)`` with ``z = x @ table^T``
    (soft-capped to ``cap * tanh(z / cap)`` when ``cap > 0``) and ``lse_t =
    logsumexp(z[t])``, computed a block of vocabulary rows at a time.  ``x [T, D]``;
    ``table [V, D]``, a float matrix or a block-matrix const; ``ids [T]``.

    ``grad_in_forward`` (a loss that will be differentiated, no cap): the forward also
    folds up what the gradient w.r.t. ``x`` needs (``head_nll_e``), so the backward makes
    no second pass over the vocabulary: two GEMMs over it in all instead of three.
    ``budget``: elements of one logits block (``tiled.head_chunk``; its scratch grows with
    it)."""
    attrs = _block_attrs(table, "head_nll") if "qtype" in (table.attrs or {}) else {}
    V = attrs["rows"] if attrs else table.shape[0]
    chunk = tiled.head_chunk(x.shape[0], V, budget)
    if grad_in_forward and not cap:
        e = _rec("head_nll_e", x, table, ids, chunk=chunk, **attrs)
        # its [T, 2 + D] rows are all the backward reads: activation checkpointing keeps
        # them instead of walking the vocabulary again
        return slice_(x.tape.checkpoint(e), 1, 0, 2)
    return _rec("head_nll", x, table, ids, cap=float(cap), chunk=chunk, **attrs)
