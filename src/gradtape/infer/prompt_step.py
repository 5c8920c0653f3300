"""``PromptStep``: a whole prompt through the model as one compiled program on the cpu
backend, whose keys and values a decoder then takes over.

The graph is ``kv_cache.forward_cached``'s at start 0 (the training graph's layer,
``models.graph.block``), recorded once for a fixed number of rows and compiled with a
GEMM precision (float32, bf16, int8).  Whether a prompt runs this way, and in which
precision, is ``prompt_choice``'s; keeping one program across calls is ``generator``'s.
"""

from __future__ import annotations

import numpy as np

from .. import nn, ops
from ..compile.memplan import fused_scratch_bytes
from ..models.graph import block, embed, linear_fn, lm_head
from ..models.rope import rope_tables
from ..tape import Tape
from .kv_cache import KVCache, LazyConsts, attend_cached, rope_consts


class PromptStep:
    """A prompt of up to ``rows`` rows through the whole model as one compiled program
    on the cpu backend, whose frozen-weight GEMMs run in ``compute`` (bf16: the block
    GEMMs of a training step): the logits after the prompt's last row and each layer's
    roped keys and values, which a decoder takes over (``load``).  Shorter prompts are
    padded with id 0 up to ``rows``: causal attention keeps the padding out of the real
    rows, whose keys and values alone are kept.  The graph is ``forward_cached``'s at
    start 0, recorded once and compiled."""

    def __init__(self, cfg, weights, lora, lora_scale, rows, compute):
        self.cfg, self.rows = cfg, rows
        tp = Tape(np.float32, eager=False)
        W = LazyConsts(tp, weights)
        lw = {key: tuple(tp.const(m) for m in ab) for key, ab in (lora or {}).items()}
        lin = linear_fn(tp, W, lw, lora_scale)
        self.ids = tp.const(np.zeros(rows, np.int64))
        self.last = tp.const(np.zeros(1, np.int64))  # the prompt's last row
        ones = nn.ones(tp, cfg.dim)
        tables = {}  # rope setting -> the (cos, sin) consts repeated per q and kv head
        keys, values = [], []
        x = embed(tp, cfg, W, self.ids)  # [rows, D]
        for i in range(cfg.n_layers):
            setting = cfg.rope_for(i)
            if setting not in tables:
                cos, sin = rope_tables(cfg, rows, 0, layer=i)  # [rows, hd/2]
                tables[setting] = (rope_consts(tp, cos, sin, cfg.n_heads),
                                   rope_consts(tp, cos, sin, cfg.n_kv_heads))

            def attend(q, k, v, i=i, ropes=tables[setting]):
                out, kr, vv = attend_cached(tp, cfg, i, q, k, v, ropes)
                keys.append(kr)
                values.append(vv)
                return out

            x = block(tp, cfg, W, i, x, ones, lin, attend)
        logits = lm_head(tp, cfg, W, ops.take_rows(x, self.last), ones)  # [1, V]
        self.prog = tp.compile([logits, *keys, *values], backend="cpu", compute=compute)

    @property
    def nbytes(self) -> int:
        """Bytes the program holds once it runs: its memory plan (allocated when it is
        compiled, its pages touched on the first run), the block GEMMs' scratch, the bf16
        copies of dense weights and the largest scratch of a fused primitive."""
        ex = self.prog.executable
        return int(self.prog.memory.nbytes + ex.scratch_bytes()
                   + sum(a.nbytes for a in ex.bf16_weights())
                   + fused_scratch_bytes(self.prog.graph))

    def __call__(self, ids, cache: KVCache) -> np.ndarray:
        """Logits ``[V]`` after ``ids`` (at most ``rows``); ``cache`` (empty) gets their
        keys and values: views of the program's outputs, valid until its next call (a
        decoder's ``load`` copies them; an 8B's at 8k rows are 2 GiB)."""
        n, L = len(ids), self.cfg.n_layers
        padded = np.zeros(self.rows, np.int64)
        padded[:n] = ids
        outs = self.prog.run({self.ids: padded, self.last: np.array([n - 1])})
        cache.k = [o[:n] for o in outs[1:1 + L]]
        cache.v = [o[:n] for o in outs[1 + L:]]
        cache.length = n
        return outs[0][0]
