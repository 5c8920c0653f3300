"""``DecodeStep``: one new token through the whole model, recorded once and replayed per
token (``decoder="graph"``, and float64 generation).

The graph is the training graph's layer (``models.graph.block``) on one row, attending
over a cache of fixed capacity held in the step's own buffers; it replays on a backend
(numpy by default) without re-recording.  It decides nothing about when it runs
(``generator``).
"""

from __future__ import annotations

import numpy as np

from .. import nn, ops
from ..models.graph import block, embed, linear_fn, lm_head, rope_keys
from ..models.rope import rope_tables
from ..tape import Tape
from .kv_cache import KVCache, LazyConsts, rope_stacked


def grouped_attention(tp, q, k, v, mask_tiled, nh, nkv, hd, iscale, softcap=0.0):
    """``nn.attention`` with the ``g = nh/nkv`` query heads that share a kv head stacked
    as extra query rows: ``q [tq, nh*hd]`` is regrouped to ``[g*tq, nkv*hd]`` (row
    ``r*tq + p``, column block ``j`` = query head ``j*g + r`` at position ``p``), attended
    with ``nkv`` heads and the ``[tq, tk]`` mask tiled ``g`` times (``mask_tiled [g*tq,
    tk]``), and regrouped back.  Each output row is the same softmax(q k^T * iscale +
    mask) v that ``nn.attention`` computes; GQA costs nkv instead of nh head loops."""
    tq, g = q.shape[0], nh // nkv
    if g == 1:
        return nn.attention(tp, q, k, v, mask_tiled, nh, nkv, hd, iscale, softcap)
    qg = ops.transpose(ops.reshape(q, (tq, nkv, g, hd)), (2, 0, 1, 3))  # [g, tq, nkv, hd]
    qg = ops.reshape(qg, (g * tq, nkv * hd))
    out = nn.attention(tp, qg, k, v, mask_tiled, nkv, nkv, hd, iscale, softcap)  # [g*tq, nkv*hd]
    out = ops.transpose(ops.reshape(out, (g, tq, nkv, hd)), (1, 2, 0, 3))  # [tq, nkv, g, hd]
    return ops.reshape(out, (tq, nh * hd))


class DecodeStep:
    """One decode step (a single new token) recorded once and replayed per token.

    The graph is ``block`` x n_layers + the head for one row, attending over a cache of
    fixed capacity ``cap``: per layer the cached roped keys / values ``[cap, nkv*hd]``
    are leaves fed each step, the new row's key / value are appended in-graph
    (``[cap+1, nkv*hd]``), and cache rows not yet written are masked out (-1e9, so their
    softmax weight is exactly 0).  A step feeds the token id, its rope row, the mask and
    the caches, and gets the logits and the new key / value rows back.  Replay skips the
    per-op recording cost that dominates a one-row step on an eager tape.
    """

    def __init__(self, cfg, weights, lora, lora_scale, dtype, cap, backend="numpy"):
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.cfg, self.cap, self.g = cfg, cap, nh // nkv
        tp = Tape(dtype, eager=False)
        W = LazyConsts(tp, weights)
        lw = {key: tuple(tp.const(m) for m in ab) for key, ab in (lora or {}).items()}
        lin = linear_fn(tp, W, lw, lora_scale)
        zeros = np.zeros
        self.tok = tp.const(zeros(1, np.int64))
        # per rope setting: the position's (cos, sin) rows repeated per q head and per kv
        # head, and a layer that uses it
        self.keys = rope_keys(cfg)
        self.ropes = {key: (i, tuple(tp.const(zeros((n, hd // 2))) for n in (nh, nh, nkv, nkv)))
                      for i, key in reversed(self.keys.items())}
        # one mask per distinct sliding window (0: full), [g*1, cap+1]
        self.masks = {w: tp.const(zeros((self.g, cap + 1)))
                      for w in sorted({cfg.window(i) for i in range(cfg.n_layers)})}
        self.kc = [tp.const(zeros((cap, nkv * hd))) for _ in range(cfg.n_layers)]
        self.vc = [tp.const(zeros((cap, nkv * hd))) for _ in range(cfg.n_layers)]
        ones = nn.ones(tp, cfg.dim)
        iscale = cfg.attn_iscale
        new_k, new_v = [], []
        x = embed(tp, cfg, W, self.tok)  # [1, D]
        for i in range(cfg.n_layers):
            def attend(q, k, v, i=i, mask=self.masks[cfg.window(i)],
                       rope=self.ropes[self.keys[i]][1]):
                cq, sq, ck, sk = rope
                kr = rope_stacked(tp, k, ck, sk, nkv, hd)  # [1, nkv*hd]
                new_k.append(kr)
                new_v.append(v)
                keys = ops.concat([self.kc[i], kr], 0)  # [cap+1, nkv*hd]
                vals = ops.concat([self.vc[i], v], 0)
                qr = rope_stacked(tp, q, cq, sq, nh, hd)  # [1, nh*hd]
                return grouped_attention(tp, qr, keys, vals, mask, nh, nkv, hd, iscale,
                                         cfg.attn_softcap)
            x = block(tp, cfg, W, i, x, ones, lin, attend)
        logits = lm_head(tp, cfg, W, x, ones)  # [1, V]
        self.prog = tp.compile([logits, *new_k, *new_v], backend=backend)
        self.kbuf = [zeros((cap, nkv * hd), dtype) for _ in range(cfg.n_layers)]
        self.vbuf = [zeros((cap, nkv * hd), dtype) for _ in range(cfg.n_layers)]
        self.length = 0

    def load(self, cache: KVCache):
        """Take over the rows of an eager ``KVCache`` (e.g. after the prompt)."""
        n = cache.length
        if n >= self.cap:
            raise ValueError(f"DecodeStep: {n} cached rows do not fit capacity {self.cap}")
        for i in range(self.cfg.n_layers):
            self.kbuf[i][:n], self.vbuf[i][:n] = cache.k[i], cache.v[i]
        self.length = n

    def take(self, other: "DecodeStep"):
        """Take over the cache of a smaller step (growing the capacity)."""
        n = other.length
        for i in range(self.cfg.n_layers):
            self.kbuf[i][:n], self.vbuf[i][:n] = other.kbuf[i][:n], other.vbuf[i][:n]
        self.length = n

    def __call__(self, token) -> np.ndarray:
        """Logits ``[V]`` of ``token`` at position ``self.length``; the cache grows by one."""
        cfg, p = self.cfg, self.length
        if p >= self.cap:
            raise ValueError(f"DecodeStep: the cache is full ({self.cap} rows)")
        feeds = {self.tok: np.array([token])}
        for layer, (cq, sq, ck, sk) in self.ropes.values():
            cos, sin = rope_tables(cfg, 1, p, layer=layer)  # [1, hd/2]
            feeds.update({cq: np.repeat(cos, cfg.n_heads, 0), sq: np.repeat(sin, cfg.n_heads, 0),
                          ck: np.repeat(cos, cfg.n_kv_heads, 0),
                          sk: np.repeat(sin, cfg.n_kv_heads, 0)})
        for w, var in self.masks.items():
            mask = np.zeros((self.g, self.cap + 1))
            mask[:, p:self.cap] = nn.MASK_VALUE  # rows not yet written; the new row is last
            if w:
                mask[:, :max(0, p - w + 1)] = nn.MASK_VALUE  # key j is seen iff j > p - w
            feeds[var] = mask
        feeds.update(zip(self.kc, self.kbuf))
        feeds.update(zip(self.vc, self.vbuf))
        outs = self.prog.run(feeds)
        n = cfg.n_layers
        for i in range(n):
            self.kbuf[i][p], self.vbuf[i][p] = outs[1 + i][0], outs[1 + n + i][0]
        self.length = p + 1
        return outs[0][0]
