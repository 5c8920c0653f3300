"""The KV cache and the cached forward: new rows through the model after the rows seen.

``forward_cached`` runs the training graph's own layer (``models.graph.block``) on the
new rows only, each layer recorded on its own small eager tape, the keys (already roped)
and values of past rows fed back as consts from a ``KVCache``: a row costs one row of
work, and memory stays bounded by one layer.  The helpers below (weights as consts made
on first use, rope over every head at once, the cached attention) are shared with the
compiled steps (``decode_step``, ``prompt_step``).  The math lives in ``gradtape.nn`` and
``models.graph``; this module wires them around a cache and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import nn, ops
from ..models.graph import attention_spec, block, embed, linear_fn, lm_head
from ..models.rope import rope_tables
from ..tape import Tape

PREFILL_CHUNK = 256  # rows per tape when running a long prompt through the cached path


@dataclass
class KVCache:
    """Per layer, the roped keys and the values of every row seen so far ``[P, nkv*hd]``."""
    k: list
    v: list
    length: int = 0

    @classmethod
    def empty(cls, cfg):
        return cls([None] * cfg.n_layers, [None] * cfg.n_layers, 0)


class LazyConsts(dict):
    """Weights as consts of one tape, made on first use (a layer's tape needs only its
    own weights)."""

    def __init__(self, tp, arrays):
        super().__init__()
        self.tp, self.arrays = tp, arrays

    def __missing__(self, name):
        v = self[name] = self.tp.const(self.arrays[name])
        return v


def rope_consts(tp, cos, sin, n):
    """The ``[t, hd/2]`` rope tables repeated per head (``[t*n, hd/2]``) as consts, for
    ``rope_stacked`` on ``n`` heads."""
    return tp.const(np.repeat(cos, n, axis=0)), tp.const(np.repeat(sin, n, axis=0))


def rope_stacked(tp, x, cos_rep, sin_rep, n, hd):
    """``nn.rope`` on every head of ``x [t, n*hd]`` in one call: the heads are stacked as
    rows (``[t*n, hd]``, row ``p*n + h``) with the tables repeated per head (from
    ``rope_consts``).  Equal to ``nn.rope_heads`` element for element, with n times
    fewer recorded ops (a decode step is dominated by per-op overhead)."""
    t = x.shape[0]
    rows = ops.reshape(x, (t * n, hd))  # [t*n, hd]
    return ops.reshape(nn.rope(tp, rows, cos_rep, sin_rep, t * n, hd), (t, n * hd))


def attend_cached(tp, cfg, i, q, k, v, ropes, past=None):
    """Layer ``i``'s attention of new rows ``q [t, nh*hd]``, ``k, v [t, nkv*hd]`` after the
    cached rows ``past`` (their roped keys and values, consts; None: none): ``(out [t,
    nh*hd], the roped keys and the values of every row)``.  ``ropes``: ``rope_consts``
    of the new rows' positions for the query heads and for the kv heads.  Tiled over the
    keys (``ops.attn``): no ``[t, past + t]`` scores per head."""
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (cq, sq), (ck, sk) = ropes
    kr = rope_stacked(tp, k, ck, sk, nkv, hd)  # [t, nkv*hd]
    if past is not None:
        kr, v = ops.concat([past[0], kr], 0), ops.concat([past[1], v], 0)
    qr = rope_stacked(tp, q, cq, sq, nh, hd)  # [t, nh*hd]
    out = ops.attn(qr, kr, v, attention_spec(cfg, i))
    return ops.slice_(out, 1, 0, nh * hd), kr, v


def forward_cached(cfg, weights, ids, cache: KVCache, lora=None, lora_scale=1.0,
                   dtype=np.float32, last_only=False) -> np.ndarray:
    """Logits ``[t, V]`` of ``t`` new rows after the ``cache.length`` rows in ``cache``
    (which is extended); ``[1, V]`` of the last row only with ``last_only``.  ``weights``:
    arrays of ``dtype``; ``lora``: ``{(layer, target): (A, B)}`` arrays.  Each layer is
    recorded on its own eager tape from ``block``."""
    ids = np.asarray(ids, dtype=np.int64)
    t, start = len(ids), cache.length

    tp = Tape(dtype)
    x = embed(tp, cfg, LazyConsts(tp, weights), tp.const(ids)).value  # [t, D]
    for i in range(cfg.n_layers):
        tp = Tape(dtype)
        W = LazyConsts(tp, weights)
        lw = {key: tuple(tp.const(m) for m in ab) for key, ab in (lora or {}).items()
              if key[0] == i}
        kv = {}
        cos, sin = rope_tables(cfg, t, start, layer=i)  # [t, hd/2], positions start..

        def attend(q, k, v, i=i):
            ropes = (rope_consts(tp, cos, sin, cfg.n_heads),
                     rope_consts(tp, cos, sin, cfg.n_kv_heads))
            past = (tp.const(cache.k[i]), tp.const(cache.v[i])) if start else None
            out, kv["k"], kv["v"] = attend_cached(tp, cfg, i, q, k, v, ropes, past)
            return out

        out = block(tp, cfg, W, i, tp.const(x), nn.ones(tp, cfg.dim),
                    linear_fn(tp, W, lw, lora_scale), attend)
        x = out.value
        cache.k[i], cache.v[i] = kv["k"].value, kv["v"].value
    cache.length = start + t
    if last_only:
        x = x[-1:]  # [1, D]
    tp = Tape(dtype)
    return lm_head(tp, cfg, LazyConsts(tp, weights), tp.const(x), nn.ones(tp, cfg.dim)).value
