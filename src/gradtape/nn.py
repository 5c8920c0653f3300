"""gradtape.nn: the transformer math as pure tape builders.

Every function takes the tape and input Vars and returns a Var built from the primitives
of ``gradtape.ops``; none defines a gradient, owns a parameter or knows a backend.  The
``*_fill`` functions are host-side helpers that compute constant arrays (rope tables,
the causal mask, cross-entropy targets) for the caller to feed.

Conventions: activations are ``[T, cols]``; weights ``[in, out]`` (``x @ w``); a bias or
norm weight is an ``[out]`` row broadcast over rows; row means use a ones column
``[n, 1]`` made once with ``ones`` (the row mean of ``y`` is ``(y @ ones) / n``).
"""

from __future__ import annotations

import math

import numpy as np

from . import ops, tiled
from .var import is_blocks

MASK_VALUE = tiled.MASK_VALUE
AttentionSpec = tiled.AttentionSpec  # one attention call's heads and options


# --- leaves -------------------------------------------------------------------------------

def _shaped(tp, data, rows, cols):
    shape = (cols,) if rows == 0 else (rows, cols)
    arr = np.asarray(data, dtype=tp.dtype)
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"nn: {arr.size} values do not fill shape {list(shape)}")
    return arr.reshape(shape)


def const(tp, data, rows, cols):
    """A ``[rows, cols]`` const from flat ``data`` (``[cols]`` when ``rows == 0``)."""
    return tp.const(_shaped(tp, data, rows, cols))


def param(tp, data, rows, cols):
    """Like ``const``, registered as a trainable param."""
    return tp.param(_shaped(tp, data, rows, cols))


def ones(tp, n):
    """The ones column ``[n, 1]`` that row reductions multiply by."""
    return tp.const(np.ones((n, 1), tp.dtype))


# --- linear layers ------------------------------------------------------------------------

def _frozen_matmul(x, w):
    """``x @ w`` for a float ``w[in, out]``; for a block-matrix const (a frozen weight in
    its stored type, ``[out, in]`` as ggml and torch store it) the same product is
    ``qmatmul(x, w)`` = ``x @ deq(w)^T``."""
    return ops.qmatmul(x, w) if is_blocks(w) else ops.matmul(x, w)


def linear(tp, x, w):
    """``x[T, in] @ w[in, out] -> [T, out]`` (``w`` may be a block-matrix const)."""
    return _frozen_matmul(x, w)


def linear_bias(tp, x, w, b):
    """``x @ w + b`` with ``b[out]`` broadcast over rows."""
    return ops.add(_frozen_matmul(x, w), b)


def linear_rows(tp, x, table):
    """``x[T, D] @ table[V, D]^T -> [T, V]``: a weight stored ``[out, in]`` (an LM head,
    or a tied one reading the embedding table), float or block matrix; a block matrix's
    product is ``precise`` (never int8: the loss reads the logits directly)."""
    return (ops.qmatmul(x, table, precise=True) if is_blocks(table)
            else ops.matmul(x, table, tb=True))


def embedding(tp, table, ids):
    """Rows ``table[ids]`` of a ``[V, D]`` table (float or block matrix) -> ``[T, D]``."""
    return ops.qtake_rows(table, ids) if is_blocks(table) else ops.take_rows(table, ids)


def lora_linear(tp, x, w0, a, b, scale):
    """``x @ w0 + scale * ((x @ a) @ b)``: a frozen ``w0[in, out]`` plus a rank-r update,
    ``a[in, r]``, ``b[r, out]``, ``scale = alpha / r``."""
    base = _frozen_matmul(x, w0)  # [T, out]
    low = ops.matmul(ops.matmul(x, a), b)  # [T, r] -> [T, out]
    return ops.add(base, ops.scale(low, scale))


def dora_norm(tp, w0, a, b, w0_sq, scale):
    """``||w0 + scale * a @ b||`` over each output column ``[out]``, detached (PEFT's
    DoRA treats it as a constant), without forming the dense ``[in, out]`` matrix:
    ``||w0_j||^2 + 2 s (a^T w0)_j . b_j + s^2 b_j^T (a^T a) b_j``, where ``w0_sq [out]``
    is ``||w0_j||^2`` (fixed; ``models.dora.column_norms_sq``) and the two other terms
    are products of rank r (``w0`` may be a block-matrix const)."""
    a, b = ops.detach(a), ops.detach(b)
    # a^T @ w0 at the precision of the layer's own product x @ w0 (a block matrix's r
    # rows read the same resident bf16 copy): the norm normalises what that product gives
    if is_blocks(w0):
        aw = _frozen_matmul(ops.transpose(a, (1, 0)), w0)  # [r, out]
    else:
        aw = ops.matmul(a, w0, ta=True)  # [r, out]
    cross = ops.reduce_sum(ops.mul(aw, b), 0)  # [out]
    low = ops.reduce_sum(ops.mul(b, ops.matmul(ops.matmul(a, a, ta=True), b)), 0)  # [out]
    sq = ops.add(ops.add(w0_sq, ops.scale(cross, 2.0 * scale)), ops.scale(low, scale * scale))
    return ops.sqrt(sq)


def scaled_lora_linear(tp, x, w0, a, b, scale, c):
    """``lora_linear`` times a fixed factor per output column ``c [out]``: DoRA where
    nothing is trained (generation), ``c = m / ||w0 + scale * a @ b||`` computed once
    (``models.dora.column_factors``)."""
    return ops.mul(lora_linear(tp, x, w0, a, b, scale), c)  # [T, out]


def dora_linear(tp, x, w0, a, b, m, w0_sq, scale):
    """DoRA as PEFT computes it (``use_dora=True``): ``(x @ w0 + scale * (x @ a) @ b) *
    (m / ||w0 + scale * a @ b||)``, the norm per output column and detached
    (``dora_norm``); ``m [out]`` the magnitude, ``w0_sq [out]`` = ``||w0_j||^2``."""
    return ops.mul(lora_linear(tp, x, w0, a, b, scale),
                   ops.div(m, dora_norm(tp, w0, a, b, w0_sq, scale)))  # [T, out]


# --- norms and activations ----------------------------------------------------------------

def rmsnorm(tp, x, w, ones, h, eps):
    """``x * rsqrt(mean(x^2) + eps) * w`` over each row; ``x[T, h]``, ``w[h]``."""
    ms = ops.scale(ops.matmul(ops.mul(x, x), ones), 1.0 / h)  # [T, 1]
    return ops.mul(ops.mul(x, ops.rsqrt(ops.addc(ms, eps))), w)


def layernorm(tp, x, w, b, ones, h, eps):
    """``(x - m) / sqrt(var + eps) * w + b`` with the row mean ``m`` and the biased row
    variance ``var``; ``x[T, h]``, ``w, b[h]``."""
    m = ops.scale(ops.matmul(x, ones), 1.0 / h)  # [T, 1]
    xc = ops.sub(x, m)
    var = ops.scale(ops.matmul(ops.mul(xc, xc), ones), 1.0 / h)  # [T, 1]
    return ops.add(ops.mul(ops.div(xc, ops.sqrt(ops.addc(var, eps))), w), b)


def silu(tp, x):
    """``x * sigmoid(x)``."""
    return ops.mul(x, ops.sigmoid(x))


def swiglu(tp, gate, up):
    """``silu(gate) * up``: the LLaMA MLP's gated activation, ``[T, ffn]``."""
    return ops.mul(silu(tp, gate), up)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(tp, x):
    """GELU, tanh approximation: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``
    (PyTorch's ``gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``)."""
    inner = ops.scale(ops.add(x, ops.scale(ops.mul(ops.mul(x, x), x), 0.044715)), _GELU_C)
    return ops.mul(ops.scale(x, 0.5), ops.addc(ops.tanh(inner), 1.0))


def geglu(tp, gate, up):
    """``gelu_tanh(gate) * up``: Gemma's gated MLP activation, ``[T, ffn]``."""
    return ops.mul(gelu_tanh(tp, gate), up)


def softcap(tp, x, cap):
    """``cap * tanh(x / cap)``: squashes ``x`` smoothly into ``(-cap, cap)`` (Gemma 2's
    attention-score and final-logit soft-capping)."""
    return ops.scale(ops.tanh(ops.scale(x, 1.0 / cap)), cap)


def softmax(tp, x, axis):
    """Softmax over ``axis`` (NumPy meaning: ``axis=1`` normalises each row)."""
    return ops.softmax(x, axis)


# --- rope, heads, masks, attention --------------------------------------------------------

def rope_fill(t, hd, base, cos_out=None, sin_out=None, start=0, factors=None):
    """Host-side rope tables ``[t, hd//2]``: ``cos[p, j] = cos(p * base**(-2j/hd))``.

    Positions run from ``start`` (a KV-cache decode step uses its own offset).
    ``factors [hd//2]`` (rope scaling, e.g. Llama 3.1's) divide each frequency:
    ``cos(p * base**(-2j/hd) / factors[j])``.  Computed in float64 and filled into
    ``cos_out``/``sin_out`` in place when given.
    """
    inv = float(base) ** (-2.0 * np.arange(hd // 2, dtype=np.float64) / hd)  # [hd/2]
    if factors is not None and len(factors):
        inv = inv / np.asarray(factors, dtype=np.float64)
    ang = np.arange(start, start + t, dtype=np.float64)[:, None] * inv[None, :]  # [t, hd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    if cos_out is not None:
        cos_out[...] = cos
        cos = cos_out
    if sin_out is not None:
        sin_out[...] = sin
        sin = sin_out
    return cos, sin


def rope(tp, h, cosc, sinc, t, hd):
    """NEOX half-split rotary embedding of one head ``h[t, hd]``:
    ``[x1*cos - x2*sin, x2*cos + x1*sin]`` with ``x1, x2`` its two column halves."""
    return ops.rope(h, cosc, sinc)  # one primitive: its composed form is ops.rotary's


def head(tp, q, t, hi, hd):
    """Columns ``[hi*hd, hi*hd + hd)`` of a ``[t, nh*hd]`` projection: head ``hi``."""
    return ops.slice_(q, 1, hi * hd, hi * hd + hd)


def causal_mask_fill(t, out=None, past=0, window=0):
    """Host-side additive causal mask ``[t, past + t]``: 0 where query row ``i`` may see key
    ``j`` (``j <= past + i``), -1e9 above.  ``past`` counts cached keys before the rows.
    ``window > 0`` (sliding-window attention) also hides keys ``window`` or more positions
    back: row ``i`` sees ``past + i - window < j <= past + i``."""
    m = tiled.causal_mask(t, past, window)
    if out is not None:
        out[...] = m
        return out
    return m


def _scores(tp, s, iscale, mask, cap):
    """``s * iscale`` soft-capped to ``cap * tanh(. / cap)`` when ``cap > 0``, plus the mask."""
    s = ops.scale(s, iscale)
    if cap:
        s = softcap(tp, s, cap)
    return ops.add(s, mask)


def _attend(tp, q_heads, k_heads, v_heads, mask, iscale, cap=0.0):
    """``softmax(q_h @ k_hᵀ * iscale + mask, axis=1) @ v_h`` for each query head, using kv
    head ``qi // (nh // nkv)``; the heads concatenated ``[tq, nh*hd]``.  ``cap > 0``
    soft-caps the scaled scores before the mask."""
    group = len(q_heads) // len(k_heads)
    outs = []
    for qi, qh in enumerate(q_heads):
        kv = qi // group
        s = _scores(tp, ops.matmul(qh, k_heads[kv], tb=True), iscale, mask, cap)  # [tq, tk]
        outs.append(ops.matmul(ops.softmax(s, 1), v_heads[kv]))  # [tq, hd]
    return ops.concat(outs, 1)


def _check_heads(nh, nkv):
    if nkv <= 0 or nh % nkv:
        raise ValueError(f"attention: nh={nh} is not a multiple of nkv={nkv}")


def gqa_attention(tp, q, k, v, cosc, sinc, mask, t, nh, nkv, hd, iscale):
    """Grouped-query causal attention over pre-projected ``q[t, nh*hd]``, ``k, v[t,
    nkv*hd]``: rope on each q and k head, query head ``qi`` attends with kv head
    ``qi // (nh // nkv)``; returns the heads concatenated ``[t, nh*hd]``."""
    _check_heads(nh, nkv)
    qs = [rope(tp, head(tp, q, t, i, hd), cosc, sinc, t, hd) for i in range(nh)]
    ks = [rope(tp, head(tp, k, t, i, hd), cosc, sinc, t, hd) for i in range(nkv)]
    vs = [head(tp, v, t, i, hd) for i in range(nkv)]
    return _attend(tp, qs, ks, vs, mask, iscale)


def _rope_last(tp, x, cosc, sinc, hd):
    """NEOX rope on the last axis (``hd``) of a batch ``x[..., rows, hd]``."""
    half, ax = hd // 2, len(x.shape) - 1
    x1 = ops.slice_(x, ax, 0, half)  # [..., rows, hd/2]
    x2 = ops.slice_(x, ax, half, hd)
    return ops.concat([ops.sub(ops.mul(x1, cosc), ops.mul(x2, sinc)),
                       ops.add(ops.mul(x2, cosc), ops.mul(x1, sinc))], ax)


def segment_mask(tp, segments, causal, n_seq, t):
    """The additive mask ``[n_seq, t, t]`` of rows that pack several examples: query ``i``
    sees key ``j`` iff ``causal [t, t]`` lets it and both have the same segment (example
    index within the row; ``segments``: an integer const ``[n_seq*t]``).  Rows of a
    single segment get exactly ``causal``: ``MASK_VALUE * 0`` adds nothing."""
    index = tp.const(np.arange(t, dtype=tp.dtype)[:, None])  # segment ids as numbers
    seg = ops.take_rows(index, segments)  # [n_seq*t, 1]
    d = ops.sub(ops.reshape(seg, (n_seq, t, 1)), ops.reshape(seg, (n_seq, 1, t)))
    other = ops.gtc(ops.mul(d, d), 0.25)  # [n_seq, t, t]: 1 where the segments differ
    return ops.add(ops.scale(other, MASK_VALUE), causal)


def gqa_attention_seqs(tp, q, k, v, cosc, sinc, mask, spec):
    """``gqa_attention`` of ``spec.n_seq`` independent sequences of length ``t`` stacked as
    rows (``q[n_seq*t, nh*hd]``, ``k, v[n_seq*t, nkv*hd]``), batched over (sequence, kv
    head): a constant number of ops however many heads and sequences.  ``spec``: a
    ``tiled.AttentionSpec`` (its ``window`` and ``tile`` are not read: ``mask`` holds the
    window).

    The ``g = nh/nkv`` query heads sharing kv head ``j`` become one ``[g*t, hd]`` matrix
    (query head ``qi = j*g + i`` at rows ``i*t ...``), so each batch entry is one
    ``[g*t, t]`` score matrix; ``cosc, sinc[t, hd/2]`` and ``mask[t, t]`` are tiled g times.
    Equal to running ``gqa_attention`` on each sequence and stacking the results.
    ``spec.softcap > 0`` soft-caps the scaled scores before the mask (Gemma 2).

    Packed rows (several examples to a sequence) give each token its own rope row,
    ``cosc, sinc [n_seq*t, hd/2]``, and each sequence its own ``mask [n_seq, t, t]``
    (``segment_mask``); these are broadcast over the kv heads of the batch.
    """
    n_seq, nh, nkv, hd = spec.n_seq, spec.nh, spec.nkv, spec.hd
    iscale, softcap = spec.iscale, spec.softcap
    _check_heads(nh, nkv)
    t = q.shape[0] // n_seq
    g = nh // nkv
    b = n_seq * nkv
    h2 = hd // 2
    qb = ops.reshape(ops.transpose(ops.reshape(q, (n_seq, t, nkv, g, hd)), (0, 2, 3, 1, 4)),
                     (b, g * t, hd))  # [n_seq*nkv, g*t, hd]

    def kv_batch(x):
        return ops.reshape(ops.transpose(ops.reshape(x, (n_seq, t, nkv, hd)), (0, 2, 1, 3)),
                           (b, t, hd))  # [n_seq*nkv, t, hd]

    def tile(x, axis=0):  # the g query heads of a kv head are stacked as rows
        return ops.concat([x] * g, axis) if g > 1 else x

    if cosc.shape[0] == t:  # one rope table for every sequence
        qr = _rope_last(tp, qb, tile(cosc), tile(sinc), hd)
        kr = _rope_last(tp, kv_batch(k), cosc, sinc, hd)
    else:  # a rope row per token: [n_seq, 1, rows, hd/2] against [n_seq, nkv, rows, hd]
        def per_seq(x, reps=1):
            x = ops.reshape(x, (n_seq, 1, t, h2))
            return ops.concat([x] * reps, 2) if reps > 1 else x

        qr = ops.reshape(_rope_last(tp, ops.reshape(qb, (n_seq, nkv, g * t, hd)),
                                    per_seq(cosc, g), per_seq(sinc, g), hd), (b, g * t, hd))
        kr = ops.reshape(_rope_last(tp, ops.reshape(kv_batch(k), (n_seq, nkv, t, hd)),
                                    per_seq(cosc), per_seq(sinc), hd), (b, t, hd))
    s = ops.matmul(qr, kr, tb=True)  # [b, g*t, t]
    if len(mask.shape) == 2:  # one mask for every sequence
        s = _scores(tp, s, iscale, tile(mask), softcap)
    else:  # a mask per sequence, [n_seq, 1, g*t, t] against [n_seq, nkv, g*t, t]
        m = ops.reshape(tile(mask, 1), (n_seq, 1, g * t, t))
        s = ops.reshape(_scores(tp, ops.reshape(s, (n_seq, nkv, g * t, t)), iscale, m,
                                softcap), (b, g * t, t))
    o = ops.matmul(ops.softmax(s, 2), kv_batch(v))  # [b, g*t, hd]
    o = ops.transpose(ops.reshape(o, (n_seq, nkv, g, t, hd)), (0, 3, 1, 2, 4))
    return ops.reshape(o, (n_seq * t, nh * hd))  # [n_seq*t, nh*hd]


def _rope_rows(tp, x, cosc, sinc, n, hd):
    """Rope on every head of ``x [N, n*hd]`` at once (the heads as rows ``[N*n, hd]``);
    ``cosc, sinc [P, hd/2]`` hold one row per position of a sequence, repeated over the
    ``N / P`` stacked sequences (``P = N`` for per-row tables)."""
    rows, half = x.shape[0], hd // 2
    p = cosc.shape[0]
    if rows % p:
        raise ValueError(f"attention: rope tables of {p} rows do not tile {rows} rows")

    def per_head(c):  # [P, hd/2] -> [N*n, hd/2], row r*n + h = c[r mod P]
        c = ops.reshape(ops.broadcast_to(ops.reshape(c, (p, 1, half)), (p, n, half)),
                        (p * n, half))
        return ops.concat([c] * (rows // p), 0) if rows > p else c
    out = rope(tp, ops.reshape(x, (rows * n, hd)), per_head(cosc), per_head(sinc), rows * n,
               hd)
    return ops.reshape(out, (rows, n * hd))


def tiled_attention(tp, q, k, v, cosc, sinc, spec, segments=None, f32=False):
    """``gqa_attention_seqs`` with the causal (and sliding-window, ``spec.window > 0``)
    mask applied by position, as one tiled primitive (``ops.attn``, the call ``spec``, a
    ``tiled.AttentionSpec``): memory linear in ``t``, the key tiles no query of a tile
    sees never computed.  ``segments [n_seq*t]`` (integer ids, ``0 <= id < n_seq*t``) also
    hides keys of other segments (packed examples).  ``q [n_seq*t, nh*hd]``, ``k, v
    [n_seq*t, nkv*hd]``; rope tables ``[t, hd/2]`` (or one row per row of ``q``); returns
    ``[n_seq*t, nh*hd]``.  ``f32``: as ``ops.attn``'s."""
    _check_heads(spec.nh, spec.nkv)
    qr = _rope_rows(tp, q, cosc, sinc, spec.nh, spec.hd)
    kr = _rope_rows(tp, k, cosc, sinc, spec.nkv, spec.hd)
    out = ops.attn(qr, kr, v, spec, segments, f32=f32)  # [N, nh*hd + nh]
    return ops.slice_(out, 1, 0, spec.nh * spec.hd)


def rope_heads(tp, x, cosc, sinc, t, n, hd):
    """Rope on every head of ``x[t, n*hd]``, concatenated back to ``[t, n*hd]``."""
    return ops.concat([rope(tp, head(tp, x, t, i, hd), cosc, sinc, t, hd) for i in range(n)], 1)


def attention(tp, q, k, v, mask, nh, nkv, hd, iscale, softcap=0.0):
    """The attention core of ``gqa_attention`` on already-roped ``q[tq, nh*hd]`` and
    ``k, v[tk, nkv*hd]`` with a ``[tq, tk]`` mask: what a KV-cache decode step uses."""
    _check_heads(nh, nkv)
    tq, tk = q.shape[0], k.shape[0]
    return _attend(tp, [head(tp, q, tq, i, hd) for i in range(nh)],
                   [head(tp, k, tk, i, hd) for i in range(nkv)],
                   [head(tp, v, tk, i, hd) for i in range(nkv)], mask, iscale, softcap)


# --- losses -------------------------------------------------------------------------------

def cross_entropy(tp, logits, onehot, onesV):
    """``-mean(log(picked))`` with ``picked = (softmax(logits, 1) * onehot) @ onesV``:
    the mean next-token loss over all rows of ``logits[T, V]`` (a one-element Var)."""
    picked = ops.matmul(ops.mul(ops.softmax(logits, 1), onehot), onesV)  # [T, 1]
    return ops.scale(ops.reduce_sum(ops.log(picked)), -1.0 / logits.shape[0])


def cross_entropy_rows(tp, logits, onehot, onesV, keep):
    """``cross_entropy`` over the first ``keep`` rows only."""
    return cross_entropy(tp, ops.slice_(logits, 0, 0, keep), ops.slice_(onehot, 0, 0, keep),
                         onesV)


def cross_entropy_ids(tp, logits, ids, weights):
    """``sum_t weights[t] * (logsumexp(logits[t]) - logits[t, ids[t]])``: the weighted
    negative log-likelihood over target ids, with no ``[T, V]`` one-hot and a stable
    log-softmax.  ``ids`` is an integer const ``[T]``, ``weights`` a const ``[T, 1]``;
    ``ce_targets_fill`` makes both (weights ``1/n`` on the ``n`` counted rows gives the
    mean; a token count shared by several micro-batches gives exact accumulation)."""
    nll = ops.nll_ids(logits, ids)  # [T, 1]: logsumexp(logits[t]) - logits[t, ids[t]]
    return ops.reduce_sum(ops.mul(nll, weights))


def ce_targets_fill(targets, ignore_index=-100, denominator=None, no_target=0):
    """Host-side: ``(ids[T] int64, weights[T, 1])`` for ``cross_entropy_ids``.

    Rows whose target is ``ignore_index`` (or negative) get weight 0 and the id
    ``no_target``: 0, harmless to any loss, or -1 for the fused head's walks, which then
    skip the row (``ops.lm_head``); the others ``1 / denominator`` (default: the number
    of counted rows, giving the mean).
    """
    targets = np.asarray(targets, dtype=np.int64)
    keep = (targets != ignore_index) & (targets >= 0)
    n = int(keep.sum()) if denominator is None else denominator
    ids = np.where(keep, targets, no_target)
    weights = (keep / max(n, 1)).astype(np.float64)[:, None]
    return ids, weights


def cross_entropy_head(tp, h, table, ids, weights, cap=0.0, grad_in_forward=False,
                       budget=None):
    """``cross_entropy_ids`` of the LM head's logits ``z = h @ table^T`` (soft-capped to
    ``cap * tanh(z / cap)`` when ``cap > 0``) without the ``[T, V]`` logits: the head and
    the loss are one primitive (``ops.head_nll``) that walks the vocabulary a block of
    rows at a time and recomputes each block in backward.  ``h [T, D]``; ``table [V, D]``
    (the embedding table of a tied head, or ``lm_head``; float or a block-matrix const);
    ``ids``, ``weights`` as for ``cross_entropy_ids``; ``grad_in_forward`` as for
    ``ops.head_nll`` (a training loss: the gradient w.r.t. ``h`` folded up in forward),
    ``budget`` too (the logits block's elements)."""
    head = ops.head_nll(h, table, ids, cap, grad_in_forward=grad_in_forward, budget=budget)
    nll = ops.slice_(head, 1, 0, 1)  # [T, 1]
    return ops.reduce_sum(ops.mul(nll, weights))
