"""Which attention a training step records: the composed one or the fused (tiled) one.

``attention_from`` asks the execution plan (``plan.attention_route``) for the rows per
sequence from which a step's attention is the fused primitive (``graph.record_forward``'s
``fused_from``), handing it this module's probe (``_time_attention``: a few layers'
attention both ways, as a step records them), which the plan times where the choice is
close, once per CPU.  It records nothing the step runs; the graph itself is ``graph``'s.
"""

from __future__ import annotations

import math

import numpy as np

from .. import nn, ops
from ..backends.cpu import measure  # the probe's timing helper
from ..plan import Decision, attention_route
from ..tape import Tape
from . import graph
from .rope import rope_tables


def attention_from(cfg, n_seq, t, backend, compute) -> Decision:
    """The rows per sequence from which a training step's attention is the fused
    primitive, and why (``plan.attention_route``, timing both routes with this module's
    probe where the choice is close, against the graph's threshold)."""
    return attention_route(cfg, n_seq, t, backend, compute, _time_attention,
                           tiled_min=graph.ATTN_TILED_MIN)


# layers of the attention probe: one layer's attention stays in cache, where both ways run
# at about one speed; from four on, its activations go through memory as a step's do, and
# the probe's ratio is the step's
ATTN_PROBE_LAYERS = 4


def _time_attention(cfg, n_seq, t, compute):
    """The seconds (``measure.seconds_in_turn``) of a few layers' attention, forward and
    backward, composed and fused (``attention_from``), as a training step records them:
    the residual rows ``x [n_seq*t, D]`` projected to q, k, v and back by frozen weights
    (so that a bf16 step's program is one here too), packed rows' rope tables and
    segments."""
    rng = np.random.default_rng(0)
    n, hd = n_seq * t, cfg.head_dim
    spec = graph.attention_spec(cfg, 0, n_seq)
    cos, sin = (np.tile(c, (n_seq, 1)) for c in rope_tables(cfg, t, layer=0))
    scale = np.float32(1 / math.sqrt(cfg.dim))  # scores of a trained model's size

    weights = {}  # one random matrix per shape, each layer's const a copy of it

    def frozen(tp, rows, cols):
        if (rows, cols) not in weights:
            weights[rows, cols] = scale * rng.standard_normal((rows, cols), dtype=np.float32)
        return tp.const(weights[rows, cols])
    runs = []
    for fused in (False, True):
        tp = Tape(np.float32, eager=False)
        x0 = x = tp.param(rng.standard_normal((n, cfg.dim), dtype=np.float32))
        cosc, sinc, segments = tp.const(cos), tp.const(sin), tp.const(np.zeros(n, np.int64))
        mask = nn.segment_mask(tp, segments,
                               tp.const(nn.causal_mask_fill(t, window=spec.window)), n_seq, t)
        for _ in range(min(cfg.n_layers, ATTN_PROBE_LAYERS)):
            q, k, v = (ops.matmul(x, frozen(tp, cfg.dim, h * hd))
                       for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads))
            if fused:
                o = nn.tiled_attention(tp, q, k, v, cosc, sinc, spec, segments, f32=True)
            else:
                o = nn.gqa_attention_seqs(tp, q, k, v, cosc, sinc, mask, spec)
            x = ops.add(x, ops.matmul(o, frozen(tp, cfg.n_heads * hd, cfg.dim)))
        loss = ops.reduce_sum(ops.mul(x, tp.const(rng.standard_normal(x.shape,
                                                                      dtype=np.float32))))
        runs.append(tp.compile([tp.backward(loss)[x0]], backend="cpu", compute=compute).run)
    return measure.seconds_in_turn(runs)
