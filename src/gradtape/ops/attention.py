"""Tiled attention: ``attn`` and its gradient primitive ``attn_grad``.

``attn(q [Nq, nh*hd], k, v [Nk, nkv*hd], spec[, seg [N]]) -> [Nq, nh*hd + nh]``: per
query head ``softmax(cap(q_h k_kv^T * iscale) + mask) v_kv`` and the rows' logsumexp (the
backward's statistics), key tile by key tile (``tiled.fwd_attn``); tiles no row of a
query tile sees are skipped.  The heads and options are one ``tiled.AttentionSpec``, the
op's ``spec`` attr.  The mask: causal, a sliding window, equal segment ids
(``tiled.AttnLayout``).  See ``fused`` for what the fused primitives share.
"""

from __future__ import annotations


import numpy as np

from .. import settings, tiled
from .elementwise import add, addc, scale, tanh
from .fused import decomposed_vjp
from .linalg import matmul
from .movement import concat, put, reshape, slice_
from .reductions import logsumexp, softmax
from .table import ShapeError, _prim, _rec


def _attn_dims(q, k, v, seg, spec):
    nh, nkv, hd, n_seq = spec.nh, spec.nkv, spec.hd, spec.n_seq
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
    if spec.tile < 1:
        raise ShapeError(f"tile {spec.tile} must be >= 1")
    return q[0], k[0]


def _attn_shape(shapes, spec, f32=False):
    nq, _ = _attn_dims(*shapes[:3], shapes[3:], spec)
    return (nq, spec.nh * spec.hd + spec.nh)


def _attn_grad_shape(shapes, spec, f32=False):
    gy, q, k, v, y = shapes[:5]
    nq, nk = _attn_dims(q, k, v, shapes[5:], spec)
    nh, nkv, hd = spec.nh, spec.nkv, spec.hd
    if tuple(gy) != (nq, nh * hd + nh) or tuple(y) != tuple(gy):
        raise ShapeError(f"g{list(gy)} and the forward's out{list(y)} must be "
                         f"[{nq}, {nh * hd + nh}]")
    return (nq * nh * hd + 2 * nk * nkv * hd,)


def _attn_scratch(v):
    """The backward's (the larger) scratch: three [nh, qt, kt] score blocks (p, dp, the
    cap's 1 - tanh^2), six [nh, qt, hd] row blocks (grouped q, do, o, their product, dq,
    ds k) and one [nkv, kt, hd] (a key tile's dk or dv, before its strided add); and the
    fused C attention's (the cpu backend's ``csrc/flash.c``) key-sized arrays: the keys
    and values packed twice, and each thread's but the first's dk, dv (``_omp_threads``
    of them)."""
    spec = v.attrs["spec"]
    n_seq = spec.n_seq
    # query rows: attn's q, attn_grad's g; key rows: attn's v, attn_grad's k
    qt, kt = tiled.attn_tiles(spec.tile, v.inputs[0].shape[0] // n_seq,
                              v.inputs[2].shape[0] // n_seq)
    return (spec.nh * qt * (3 * kt + 6 * spec.hd) + spec.nkv * kt * spec.hd
            + (4 + 2 * (_omp_threads() - 1)) * v.inputs[2].size)


def _omp_threads():
    """The threads an OpenMP region takes (``settings.omp_threads``): a memory
    estimate's input, never a value's."""
    return settings.omp_threads()


def _attn_vjp(g, out, q, k, v, *seg, **attrs):
    memo = []  # the one attn_grad op the three thunks slice

    def part(i):
        if not memo:
            memo.append(_rec("attn_grad", g, q, k, v, out, *seg, **attrs))
        sizes = [q.size, k.size, v.size]
        start = sum(sizes[:i])
        return reshape(slice_(memo[0], 0, start, start + sizes[i]), (q, k, v)[i].shape)
    return (lambda: part(0), lambda: part(1), lambda: part(2)) + (None,) * len(seg)


def _dec_attn(tp, q, k, v, *seg, spec, f32=False):
    """Composed: per sequence and query head, the scores with an additive mask (-1e9
    where hidden, as ``nn.causal_mask_fill``; segments through one-hot products)."""
    nh, nkv, hd, n_seq = spec.nh, spec.nkv, spec.hd, spec.n_seq
    iscale, cap, window = spec.iscale, spec.softcap, spec.window
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
      scratch=_attn_scratch, decompose=decomposed_vjp(_dec_attn, 3, (0, 1, 2)))


def attn(q, k, v, spec, seg=None, *, f32=False):
    """Tiled causal attention of already-roped ``q [Nq, nh*hd]`` over ``k, v [Nk,
    nkv*hd]`` with the heads and options of ``spec`` (a ``tiled.AttentionSpec``: query
    head ``h`` reads kv head ``h // (nh // nkv)``, ``n_seq`` sequences stacked as rows):
    ``[Nq, nh*hd + nh]``, the heads' outputs then each row's logsumexp per head.  A
    ``softcap > 0`` soft-caps the scaled scores; ``window > 0`` hides keys ``window`` or
    more positions back; ``seg [N]`` (integer ids) hides keys of other segments.
    ``spec.tile`` query rows per tile over key tiles ``tiled.ATTN_KEYS`` times as wide:
    never more than a few such score blocks.  ``f32``: its products stay float32 in a
    bf16 program (where they otherwise take bf16 inputs), as the composed attention's
    do; a precision the backend reads, not part of the math."""
    if not isinstance(spec, tiled.AttentionSpec):
        raise TypeError(f"attn: spec must be a tiled.AttentionSpec, got {spec!r}")
    return _rec("attn", q, k, v, *([seg] if seg is not None else []), spec=spec,
                f32=bool(f32))
