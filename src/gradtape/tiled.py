"""NumPy forwards of the tiled primitives: an LM head fused with its cross-entropy, and
attention with an online softmax; neither ever holds a ``[T, V]`` or ``[T, T]`` array.

These are the reference definitions the primitive table (``ops.lm_head``,
``ops.attention``) registers for ``head_nll`` / ``head_nll_e`` / ``head_nll_grad_x`` /
``head_nll_grad_w`` and ``attn`` / ``attn_grad``: block after block of the vocabulary
(head) or of the keys (attention), each block's scores computed by one GEMM into a
scratch block, folded into per-row statistics, and recomputed in the backward pass from
those statistics.  Memory is linear in T: the scratch is a fixed budget of elements
(``HEAD_BUDGET``) or a few ``[tile, ATTN_KEYS * tile]`` score blocks per head.  The sums
run in another order than the composed ops (``nn.cross_entropy_ids``,
``nn.gqa_attention``): equal to them up to rounding, not bitwise.

An attention call's heads and options travel as one ``AttentionSpec``, from the layers
(``nn``) through the primitive (``ops.attn``) to these walks and a backend's kernels.

This module knows nothing of tapes; ``ops`` declares the shapes and the VJPs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .blocks import dequantize

# elements of one [T, chunk] logits block of the fused head (32 MB in float32)
HEAD_BUDGET = 1 << 23


def head_chunk(t, v, budget=None):
    """Vocabulary rows per block for ``t`` rows: ``budget`` elements' worth (default
    ``HEAD_BUDGET``), a multiple of 64."""
    budget = HEAD_BUDGET if budget is None else budget
    c = max(64, (budget // max(t, 1)) // 64 * 64)
    return min(c, v)


class HeadGemms:
    """The fused head's two products with the table ``w [V, D]`` (ggml blocks when
    ``qtype`` is set), a block of vocabulary rows at a time, in NumPy: ``rows(v0, v1)``
    takes the block (a view of a float table; a block table's rows dequantized by
    ``kern.table_rows``), then ``logits(z)``: ``z = x @ Wc^T``, ``weigh(z, out)``: ``out
    = z @ Wc``.  A backend's kernels may hand out another (``backends/cpu/tiled.py``:
    bf16)."""

    def __init__(self, x, w, qtype, kern):
        self.x, self.w, self.qtype, self.kern = x, w, qtype, kern

    def rows(self, v0, v1):
        if self.qtype is None:
            self.wc = self.w[v0:v1]
        else:
            self.wc = self.kern.table_rows(self.w, v0, v1, self.qtype, self.x.shape[1],
                                           self.x.dtype)

    def logits(self, z):
        np.matmul(self.x, self.wc.T, out=z)

    def weigh(self, z, out):
        np.matmul(z, self.wc, out=out)

    def table_grad(self, z, out):
        """``out = z^T @ x``: a block of the table's gradient (``z``: its logits'
        gradient)."""
        np.matmul(z.T, self.x, out=out)


def _in_chunk(ids, v0, v1):
    rows = np.nonzero((ids >= v0) & (ids < v1))[0]
    return rows, ids[rows] - v0


def _softcap(z, cap):
    """In place ``z = cap * tanh(z / cap)`` (in the order ``nn.softcap`` computes it);
    returns ``tanh(z / cap)`` for the derivative ``1 - tanh^2``."""
    np.multiply(z, 1.0 / cap, out=z)
    np.tanh(z, out=z)
    t = z.copy()
    np.multiply(z, cap, out=z)
    return t


class NumpyTiles:
    """The elementwise work on one block of scores, in NumPy: the reference.  A backend
    with kernels of its own (``backends/cpu/tiled.py``) passes an object with the same
    methods as ``kern``; the GEMMs and the walk over the blocks stay the same, unless
    its ``fused_attn`` takes a whole attention call over."""

    @staticmethod
    def fused_attn(*args, **kwargs):
        """The whole attention in one kernel: none here (``backends.cpu.tiled.CTiles`` has one)."""
        return False

    head_gemms = HeadGemms
    grad_w_gemms = HeadGemms  # those of the table's gradient (a trained table)

    @staticmethod
    def buffer(name, shape, dtype):
        """A scratch array for a walk (``name`` says which): a new one each call here; a
        backend's kernels may keep theirs from call to call (``backends.cpu.tiled.CTiles``)."""
        return np.empty(shape, dtype)

    @staticmethod
    def table_rows(w, v0, v1, qtype, k, dtype):
        """Rows ``[v0, v1)`` of the block table ``w`` as ``[v1 - v0, k]`` floats of
        ``dtype``: ``gguf``'s dequantization."""
        return dequantize(w[v0:v1], qtype).astype(dtype, copy=False)

    @staticmethod
    def head_fwd(z, m, s, picked, ids, v0, cap):
        """Fold the raw logits block ``z [T, c]`` (vocabulary rows ``v0 ...``) into the
        rows' running max ``m``, sum ``s = sum_j exp(z_j - m)`` (rescaled by ``exp(m_old
        - m_new)`` when the max grows) and picked logit; ``z`` is overwritten."""
        if cap:
            _softcap(z, cap)
        r, c = _in_chunk(ids, v0, v0 + z.shape[1])
        picked[r] = z[r, c]
        mn = np.maximum(m, z.max(axis=1))
        alpha = np.exp(m - mn)  # 0 on the first block (m = -inf)
        np.subtract(z, mn[:, None], out=z)
        np.exp(z, out=z)
        s *= alpha
        s += z.sum(axis=1)
        m[...] = mn

    @staticmethod
    def head_dz(z, lse, a, b, ids, v0, cap):
        """In place, the raw logits block ``z`` becomes the loss's gradient w.r.t. it: ``a
        * softmax - b * onehot(ids)`` (``a = g0 + g1``: the nll's and the lse's
        cotangents, d lse / dz = softmax; ``b = g0``), times ``1 - tanh^2`` under a cap."""
        t = _softcap(z, cap) if cap else None
        z -= lse[:, None]
        np.exp(z, out=z)  # softmax
        z *= a[:, None]
        r, c = _in_chunk(ids, v0, v0 + z.shape[1])
        z[r, c] -= b[r]
        if cap:
            # d cap*tanh(u/cap) / du = 1 - tanh^2
            np.multiply(t, t, out=t)
            np.subtract(1.0, t, out=t)
            z *= t

    @staticmethod
    def _scores(s, iscale, cap, vis, g):
        """In place: ``cap(s * iscale)``, ``-inf`` where hidden (``vis``, a ``Visible``
        or None); the tanh (or None)."""
        s *= iscale
        t = _softcap(s, cap) if cap else None
        if vis is not None:
            nkv, gn, m = s.shape
            s.reshape(nkv, g, gn // g, m)[:, :, ~vis.dense(m)] = -np.inf
        return t

    @classmethod
    def attn_fwd(cls, s, m, l, acc, iscale, cap, vis, g):
        """Fold the raw score tile ``s [nkv, g*n, k]`` into each row's running max ``m``,
        sum ``l`` and unnormalised output ``acc`` (both rescaled by ``exp(m_old -
        m_new)``); ``s`` becomes the tile's ``exp(s - m_new)`` (0 where masked)."""
        cls._scores(s, iscale, cap, vis, g)
        mn = np.maximum(m, s.max(axis=2, keepdims=True))
        safe = np.where(np.isfinite(mn), mn, 0.0)  # rows with nothing visible yet
        alpha = np.exp(m - safe)
        np.subtract(s, safe, out=s)
        np.exp(s, out=s)
        l *= alpha
        l += s.sum(axis=2, keepdims=True)
        acc *= alpha
        m[...] = mn

    @classmethod
    def attn_p(cls, s, t, lse, iscale, cap, vis, g):
        """The raw score tile ``s`` becomes the probabilities ``exp(cap(s * iscale) -
        lse)`` (0 where masked); under a cap ``t`` gets ``1 - tanh^2``."""
        th = cls._scores(s, iscale, cap, vis, g)
        np.subtract(s, lse, out=s)
        np.exp(s, out=s)
        if cap:
            np.multiply(th, th, out=t)
            np.subtract(1.0, t, out=t)

    @staticmethod
    def attn_ds(dp, p, t, D, iscale, cap):
        """``dp`` (``do v^T``) becomes the raw scores' gradient: ``p * (dp - D)``, times
        ``1 - tanh^2`` under a cap, times ``iscale``."""
        dp -= D
        dp *= p
        if cap:
            dp *= t
        dp *= iscale


NUMPY_TILES = NumpyTiles()


def _head_walk(out, x, w, ids, cap, chunk, qtype, kern, E=None):
    """The forward walk of the fused heads: ``out[:, :2] = (nll, lse)``, a ``chunk`` of
    vocabulary rows at a time (``head_fwd``); where ``E [T, D]`` (zeros) is given, it
    becomes ``softmax(z) @ W``, folded in like the row sums (rescaled by ``exp(m_old -
    m_new)`` as the max grows)."""
    t, dtype = x.shape[0], out.dtype
    V = w.shape[0]
    m = np.full(t, -np.inf, dtype)
    s = np.zeros(t, dtype)
    picked = np.zeros(t, dtype)
    buf = kern.buffer("head logits", (t * min(chunk, V),), dtype)
    prod = kern.buffer("head product", E.shape, dtype) if E is not None else None
    gemms = kern.head_gemms(x, w, qtype, kern)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        z = _block(buf, t, v1 - v0)
        gemms.rows(v0, v1)
        gemms.logits(z)
        m_old = m.copy() if E is not None else None
        kern.head_fwd(z, m, s, picked, ids, v0, cap)  # z: exp(z - m)
        if E is not None:
            E *= np.exp(m_old - m)[:, None]  # 0 on the first block
            gemms.weigh(z, prod)
            E += prod
    if E is not None:
        E /= s[:, None]
    np.log(s, out=s)
    s += m  # lse
    out[:, 1] = s
    np.subtract(s, picked, out=out[:, 0])


def _targeted(ids):
    """The rows that have a target (``ids >= 0``), or None where every row has one: the
    head walks skip the others (zero rows out, no gradient), so a loss that counts only
    some rows (an answer's tokens, not its prompt's) pays the vocabulary's GEMMs for
    those alone."""
    return None if ids.size == 0 or ids.min() >= 0 else np.flatnonzero(ids >= 0)


# the targeted rows a head walk takes are padded to a multiple of this with untargeted
# ones: a few row counts, not one per batch, for the GEMMs' ways measured per shape
TARGETED_QUANTUM = 64


def _on_targeted(out, ids, walk, *rows_of):
    """``walk(out_rows, ids_rows, *rows)`` over the targeted rows only (``_targeted``; with
    untargeted ones up to a multiple of ``TARGETED_QUANTUM``), ``rows_of`` each sliced to
    them; ``out``'s other rows are zero."""
    keep = _targeted(ids)
    if keep is None:
        return walk(out, ids, *rows_of)
    if keep.size:
        pad = min(-keep.size % TARGETED_QUANTUM, ids.size - keep.size)
        keep = np.sort(np.concatenate([keep, np.flatnonzero(ids < 0)[:pad]]))
    if keep.size == ids.size:  # padded up to every row
        walk(out, ids, *rows_of)
        out[ids < 0] = 0
        return
    part = np.zeros((keep.size,) + out.shape[1:], out.dtype)
    if keep.size:
        walk(part, ids[keep], *(a[keep] for a in rows_of))
        part[ids[keep] < 0] = 0
    out.fill(0)
    out[keep] = part


def fwd_head_nll(out, x, w, ids, cap, chunk, qtype=None, kern=NUMPY_TILES, **logical):
    """``out[t] = (lse_t - z[t, ids[t]], lse_t)`` with ``z = cap(x @ W^T)`` and ``lse_t =
    logsumexp(z[t])``, a ``chunk`` of vocabulary rows at a time (``head_fwd``); zero
    where ``ids[t] < 0`` (no target).  ``logical``: a block table's ``rows`` and ``k``
    (the op's attrs, read by its shape rule only), as for the other head walks."""
    _on_targeted(out, ids, lambda o, i, xs: _head_walk(o, xs, w, i, cap, chunk, qtype, kern),
                 x)


def fwd_head_nll_e(out, x, w, ids, chunk, qtype=None, kern=NUMPY_TILES, **logical):
    """``out = [nll | lse | E]``: ``fwd_head_nll``'s two columns (no cap) and ``E =
    softmax(z) @ W [T, D]``, the softmax-weighted table rows (zero without a target).
    The gradient w.r.t. ``x`` is then ``(g_nll + g_lse) E - g_nll W[ids]``: the backward
    needs no second walk over the vocabulary (Liger's fused linear cross-entropy does the
    same)."""
    def walk(o, i, xs):
        E = o[:, 2:]  # folded in place
        E.fill(0)
        _head_walk(o, xs, w, i, 0.0, chunk, qtype, kern, E)
    _on_targeted(out, ids, walk, x)


def fwd_head_rows(out, w, ids, qtype=None, kern=NUMPY_TILES, **logical):
    """``out[t] = W[ids[t]]`` (a block table's rows dequantized as ``qtake_rows``), zero
    where ``ids[t] < 0``: the table rows of ``head_nll_e``'s gradient."""
    keep = ids >= 0
    rows = w[ids[keep]]
    out.fill(0)
    out[keep] = rows if qtype is None else dequantize(rows, qtype)


def _head_grad_blocks(x, w, ids, g, o, cap, chunk, dtype, kern, gemms):
    """Yield ``(v0, v1, dz)`` for every vocabulary block (its table rows taken by
    ``gemms``): the logits' gradient, recomputed from ``x`` and the forward's lse."""
    t, V = x.shape[0], w.shape[0]
    buf = kern.buffer("head logits", (t * min(chunk, V),), dtype)
    lse, b = np.ascontiguousarray(o[:, 1]), np.ascontiguousarray(g[:, 0])
    a = b + g[:, 1]
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        z = _block(buf, t, v1 - v0)
        gemms.rows(v0, v1)
        gemms.logits(z)
        kern.head_dz(z, lse, a, b, ids, v0, cap)
        yield v0, v1, z


def fwd_head_nll_grad_x(out, g, x, w, ids, o, cap, chunk, qtype=None, kern=NUMPY_TILES,
                        **logical):
    """``out = dz @ W`` summed over the vocabulary blocks (dz from ``head_dz``); zero
    where ``ids[t] < 0``."""
    def walk(out, ids, g, x, o):
        out.fill(0)
        tmp = kern.buffer("head product", out.shape, out.dtype)
        gemms = kern.head_gemms(x, w, qtype, kern)
        for _, _, dz in _head_grad_blocks(x, w, ids, g, o, cap, chunk, out.dtype, kern,
                                          gemms):
            gemms.weigh(dz, tmp)
            out += tmp
    _on_targeted(out, ids, walk, g, x, o)


def fwd_head_nll_grad_w(out, g, x, w, ids, o, cap, chunk, kern=NUMPY_TILES):
    """``out[v0:v1] = dz^T @ x`` for every vocabulary block (a float table only), in
    ``kern.grad_w_gemms`` (NumPy's, or a backend's: bf16 inputs where it runs them), over
    the rows with a target (``ids >= 0``)."""
    keep = _targeted(ids)
    if keep is not None:
        g, x, o, ids = g[keep], x[keep], o[keep], ids[keep]
    if not len(ids):
        out.fill(0)
        return
    gemms = kern.grad_w_gemms(x, w, None, kern)
    for v0, v1, dz in _head_grad_blocks(x, w, ids, g, o, cap, chunk, out.dtype, kern, gemms):
        gemms.table_grad(dz, out[v0:v1])


# --- attention ----------------------------------------------------------------------------

ATTN_TILE = 128  # query rows per tile
ATTN_KEYS = 4  # key rows per tile, in query tiles: wide key tiles, few small diagonal ones
MASK_VALUE = -1e9  # the additive mask of the composed attention (nn.causal_mask_fill)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention call's heads and options: ``nh`` query heads of ``hd`` values over
    ``nkv`` kv heads (query head ``h`` reads kv head ``h // (nh // nkv)``), ``n_seq``
    sequences stacked as rows, the scores scaled by ``iscale`` and, where ``softcap > 0``,
    soft-capped to ``softcap * tanh(s / softcap)``; where ``window > 0`` keys ``window``
    or more positions back are hidden.  ``tile``: query rows per tile of the tiled walk.

    The composed attention (``nn.gqa_attention_seqs``) reads the heads, scale, cap and
    ``n_seq``; its mask carries the window.  The fields are coerced to plain ints and
    floats, so an op holding a spec in its attrs compares and hashes by value
    (``compile.cse``).  The shapes are checked where the spec is used, against the
    arrays."""
    nh: int
    nkv: int
    hd: int
    iscale: float
    softcap: float = 0.0
    window: int = 0
    n_seq: int = 1
    tile: int = ATTN_TILE

    def __post_init__(self):
        for name, kind in (("nh", int), ("nkv", int), ("hd", int), ("iscale", float),
                           ("softcap", float), ("window", int), ("n_seq", int),
                           ("tile", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))


def attn_tiles(tile, tq, tk):
    """``(query rows, key rows)`` of the largest tile for ``tile`` and sequences of ``tq``
    query and ``tk`` key rows: what the scratch blocks are sized by."""
    return min(tile, tq), min(ATTN_KEYS * tile, tk)


def causal_mask(t, past=0, window=0):
    """The additive ``[t, past + t]`` mask: 0 where query row ``i`` sees key ``j`` (``j <=
    past + i``, and ``j > past + i - window`` when ``window > 0``), ``MASK_VALUE``
    elsewhere."""
    m = np.triu(np.full((t, past + t), MASK_VALUE), k=past + 1)
    if window:
        m += np.tril(np.full((t, past + t), MASK_VALUE), k=past - window)
    return m


class Visible:
    """The keys each query row ``i`` of a tile sees: columns ``[lo[i], hi[i])`` (int64
    ``[n]``: the causal and window limits) and, where ``mask`` is given (``[n, m]``
    bools: equal segments), only those it marks."""

    def __init__(self, lo, hi, mask):
        self.lo, self.hi, self.mask = lo, hi, mask

    def dense(self, m):
        """As one ``[n, m]`` bool array (the NumPy reference's form)."""
        cols = np.arange(m)
        vis = (cols >= self.lo[:, None]) & (cols < self.hi[:, None])
        return vis if self.mask is None else vis & self.mask


class AttnLayout:
    """Which keys each query row sees, tile by tile.

    ``n_seq`` independent sequences are stacked as rows: sequence ``b`` has query rows
    ``b*tq ...`` and key rows ``b*tk ...``, and its query row ``r`` sits at position
    ``past + r`` with ``past = tk - tq`` (cached keys before the new rows).  Key ``j`` is
    visible to query ``i`` (positions within the sequence) iff ``j <= i`` (causal),
    ``j > i - window`` when ``window > 0``, and ``seg[i] == seg[j]`` when segment ids are
    given (packed examples; query and key rows are the same rows then).  Query tiles have
    ``tile`` rows, key tiles ``ktile`` (wide ones: fewer, larger GEMMs) and a key tile
    ends at its query tile's last row, so the keys computed and then hidden by the causal
    limit are at most a ``tile x tile`` triangle per query tile.

    Packed examples lie in contiguous runs of rows (``train.data.pack_rows``): a row's
    first visible key is then its run's first row, so segments become column ranges too
    (``starts``), and a query tile's key tiles begin at its first row's example instead
    of at the sequence's start.  Segment ids in any other pattern take a mask.
    """

    def __init__(self, nq, nk, n_seq, window, seg, tile, ktile=None):
        self.n_seq, self.tq, self.tk = n_seq, nq // n_seq, nk // n_seq
        self.past = self.tk - self.tq
        self.window, self.seg, self.tile = window, seg, tile
        self.ktile = ktile or tile
        self.starts = run_starts(seg, self.tq) if seg is not None else None

    def q_tiles(self):
        """``(q0, q1, base)``: query row ranges (absolute) and their sequence's key base."""
        for b in range(self.n_seq):
            for r0 in range(0, self.tq, self.tile):
                yield b * self.tq + r0, b * self.tq + min(self.tq, r0 + self.tile), b
        return

    def k_tiles(self, q0, q1, b):
        """``(k0, k1, vis)`` for the key tiles query rows ``[q0, q1)`` of sequence ``b``
        see at least in part; ``vis`` (a ``Visible``) is None when all are visible."""
        tq, tk, past, w, kt = self.tq, self.tk, self.past, self.window, self.ktile
        p0, p1 = past + q0 - b * tq, past + q1 - 1 - b * tq  # positions of the first, last row
        pos = np.arange(p0, p1 + 1, dtype=np.int64)  # [n]: each row's position
        first = np.maximum(pos - w + 1, 0) if w else np.zeros_like(pos)  # its first key
        if self.starts is not None:  # and its example's first row
            first = np.maximum(first, self.starts[q0:q1])
        lo = int(first.min())  # the first key any row sees
        for j0 in range(lo - lo % self.tile, min(tk, p1 + 1), kt):
            j1 = min(tk, j0 + kt, p1 + 1)
            k0, k1 = b * tk + j0, b * tk + j1
            full = j1 - 1 <= p0 and first.max() <= j0
            mask = None
            if self.seg is not None and self.starts is None:
                sq, sk = self.seg[q0:q1], self.seg[k0:k1]
                if sk.max() < sq.min() or sk.min() > sq.max():
                    continue  # no common segment: nothing visible
                if not (sq.min() == sq.max() == sk.min() == sk.max()):
                    mask = sq[:, None] == sk[None, :]
            if full and mask is None:
                yield k0, k1, None
                continue
            hi = np.clip(pos + 1 - j0, 0, j1 - j0)  # keys j <= pos
            yield k0, k1, Visible(np.clip(first - j0, 0, j1 - j0), hi, mask)


def run_starts(seg, t):
    """For segment ids ``seg`` of sequences of ``t`` rows, each row's position (within
    its sequence) of the first row of its run of equal ids, where every id of a sequence
    is one run; else None (the ids need a mask).  Read-only, and computed once for the
    ids of a step: each layer's attention, forward and backward, asks again."""
    seg = np.asarray(seg)
    return _run_starts(seg.tobytes(), seg.dtype.str, t)


@functools.lru_cache(maxsize=4)
def _run_starts(raw, dtype, t):
    seg = np.frombuffer(raw, dtype)
    starts = np.empty(len(seg), np.int64)
    for b0 in range(0, len(seg), t):
        s = np.asarray(seg[b0:b0 + t])
        new = np.r_[True, s[1:] != s[:-1]]
        heads = np.flatnonzero(new)
        if len(heads) != len(np.unique(s)):
            return None
        starts[b0:b0 + t] = heads[np.cumsum(new) - 1]
    starts.flags.writeable = False
    return starts


def _q_group(q, q0, q1, nkv, g, hd):
    """Query rows ``[q0, q1)`` as ``[nkv, g*n, hd]``: the ``g`` heads sharing a kv head
    stacked as rows (head ``kv*g + i`` at rows ``i*n ...``)."""
    n = q1 - q0
    return np.ascontiguousarray(
        q[q0:q1].reshape(n, nkv, g, hd).transpose(1, 2, 0, 3)).reshape(nkv, g * n, hd)


def _ungroup(a, n, nkv, g, hd):
    """The inverse of ``_q_group``: ``[nkv, g*n, hd]`` -> ``[n, nkv*g*hd]``."""
    return a.reshape(nkv, g, n, hd).transpose(2, 0, 1, 3).reshape(n, nkv * g * hd)


def _kv_heads(x, k0, k1, nkv, hd):
    return x[k0:k1].reshape(k1 - k0, nkv, hd).transpose(1, 0, 2)  # [nkv, n, hd] (a view)


def _layout(q, k, seg, spec):
    lay = AttnLayout(q.shape[0], k.shape[0], spec.n_seq, spec.window, seg[0] if seg else None,
                     spec.tile, ATTN_KEYS * spec.tile)
    return lay, attn_tiles(spec.tile, lay.tq, lay.tk)


def _block(buf, *shape):
    """A contiguous ``shape`` view at the start of the flat scratch ``buf``."""
    return buf[:int(np.prod(shape))].reshape(shape)


def fwd_attn(out, q, k, v, *seg, spec, f32=False, kern=NUMPY_TILES):
    """``out = [o | lse]``: per query head the softmax-weighted values ``o [N, nh*hd]`` and
    the row log-sum-exps ``lse [N, nh]`` of the (capped, masked) scores of the call
    ``spec`` (an ``AttentionSpec``), walking the key tiles with an online softmax
    (``attn_fwd``): at the end ``o = acc / l`` and ``lse = m + log l``.  The scratch
    (score block, products) is allocated once per call.  ``f32``: float32 products even
    in a bf16 program (read by the cpu backend when it picks ``kern``)."""
    nh, nkv, hd, iscale, cap = spec.nh, spec.nkv, spec.hd, spec.iscale, spec.softcap
    g, dtype = nh // nkv, out.dtype
    lay, (qt, kt) = _layout(q, k, seg, spec)
    if kern.fused_attn(out, q, k, v, lay, spec):
        return
    sbuf = np.empty(nh * qt * kt, dtype)  # one [nkv, g*n, m] score block
    pbuf = np.empty(nh * qt * hd, dtype)  # one [nkv, g*n, hd] product p @ v
    for q0, q1, b in lay.q_tiles():
        n = q1 - q0
        qg = _q_group(q, q0, q1, nkv, g, hd)  # [nkv, g*n, hd]
        m = np.full((nkv, g * n, 1), -np.inf, dtype)
        l = np.zeros((nkv, g * n, 1), dtype)
        acc = np.zeros((nkv, g * n, hd), dtype)
        pv = _block(pbuf, nkv, g * n, hd)
        for k0, k1, vis in lay.k_tiles(q0, q1, b):
            s = _block(sbuf, nkv, g * n, k1 - k0)
            np.matmul(qg, _kv_heads(k, k0, k1, nkv, hd).transpose(0, 2, 1), out=s)
            kern.attn_fwd(s, m, l, acc, iscale, cap, vis, g)
            np.matmul(s, _kv_heads(v, k0, k1, nkv, hd), out=pv)
            acc += pv
        acc /= l
        out[q0:q1, :nh * hd] = _ungroup(acc, n, nkv, g, hd)
        np.log(l, out=l)
        l += m
        out[q0:q1, nh * hd:] = l.reshape(nkv * g, n).T


def fwd_attn_grad(out, gy, q, k, v, y, *seg, spec, f32=False, kern=NUMPY_TILES):
    """The VJP of ``attn`` (the call ``spec``) for all of q, k, v at once, ``out = [dq |
    dk | dv]`` flattened.

    Per key tile the probabilities are recomputed from the forward's ``lse``: ``p =
    exp(s - lse)``.  With ``do`` the output's cotangent and ``gl`` the lse's,
    ``dv += p^T do``; ``ds = p * (do v^T - D)`` with ``D = rowsum(do * o) - gl`` (the
    softmax VJP, plus d lse / ds = p), times ``1 - tanh^2`` under a cap and ``iscale``;
    ``dq += ds k``, ``dk += ds^T q``.  The g query heads of a kv head add into its dk, dv.
    """
    nh, nkv, hd, iscale, cap = spec.nh, spec.nkv, spec.hd, spec.iscale, spec.softcap
    g, dtype = nh // nkv, out.dtype
    lay, (qt, kt) = _layout(q, k, seg, spec)
    if kern.fused_attn(out, q, k, v, lay, spec, gy=gy, y=y):
        return
    nq, nk = q.shape[0], k.shape[0]
    dq = out[:nq * nh * hd].reshape(nq, nh * hd)
    dk = out[nq * nh * hd:nq * nh * hd + nk * nkv * hd].reshape(nk, nkv * hd)
    dv = out[nq * nh * hd + nk * nkv * hd:].reshape(nk, nkv * hd)
    out.fill(0)
    do_all, o_all = gy[:, :nh * hd], y[:, :nh * hd]
    sbuf, dpbuf = np.empty(nh * qt * kt, dtype), np.empty(nh * qt * kt, dtype)
    tbuf = np.empty(nh * qt * kt, dtype) if cap else None
    qbuf = np.empty(nh * qt * hd, dtype)  # [nkv, g*n, hd]: ds @ k
    kbuf = np.empty(nkv * kt * hd, dtype)  # [nkv, m, hd]: p^T do, ds^T q
    for q0, q1, b in lay.q_tiles():
        n = q1 - q0
        qg = _q_group(q, q0, q1, nkv, g, hd)
        dog = _q_group(do_all, q0, q1, nkv, g, hd)
        lse = _q_group(y[:, nh * hd:], q0, q1, nkv, g, 1)  # [nkv, g*n, 1]
        gl = _q_group(gy[:, nh * hd:], q0, q1, nkv, g, 1)
        D = (dog * _q_group(o_all, q0, q1, nkv, g, hd)).sum(axis=2, keepdims=True) - gl
        dqg = np.zeros_like(qg)
        dsk = _block(qbuf, nkv, g * n, hd)
        for k0, k1, vis in lay.k_tiles(q0, q1, b):
            kt_, vt = _kv_heads(k, k0, k1, nkv, hd), _kv_heads(v, k0, k1, nkv, hd)
            shape = (nkv, g * n, k1 - k0)
            s, dp = _block(sbuf, *shape), _block(dpbuf, *shape)
            t = _block(tbuf, *shape) if cap else None
            np.matmul(qg, kt_.transpose(0, 2, 1), out=s)  # [nkv, g*n, m]
            kern.attn_p(s, t, lse, iscale, cap, vis, g)  # s: p
            kv = _block(kbuf, nkv, k1 - k0, hd)
            np.matmul(s.transpose(0, 2, 1), dog, out=kv)  # [nkv, m, hd]: p^T do
            _kv_heads(dv, k0, k1, nkv, hd)[...] += kv  # a strided add, no copy
            np.matmul(dog, vt.transpose(0, 2, 1), out=dp)  # [nkv, g*n, m]
            kern.attn_ds(dp, s, t, D, iscale, cap)
            np.matmul(dp, kt_, out=dsk)
            dqg += dsk
            np.matmul(dp.transpose(0, 2, 1), qg, out=kv)  # [nkv, m, hd]: ds^T q
            _kv_heads(dk, k0, k1, nkv, hd)[...] += kv
        dq[q0:q1] = _ungroup(dqg, n, nkv, g, hd)
