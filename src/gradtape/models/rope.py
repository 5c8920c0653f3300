"""Host-side rope tables of a model: the cos / sin rows each layer's rope uses, shared by
the graph (``graph.py``, ``infer/kv_cache.py``) and the C decode step
(``infer/block_decoder.py``)."""

from __future__ import annotations

import numpy as np

from .. import nn


def rope_tables(cfg, t, start=0, layer=0):
    """Host-side ``(cos, sin) [t, hd/2]`` of positions ``start..start+t`` with ``layer``'s
    rope (``LlamaConfig.rope_for``: its base and frequency factors); for a layer without
    rope (SmolLM3's NoPE) cos = 1 and sin = 0, with which rope is exactly the identity."""
    rope = cfg.rope_for(layer)
    if rope is None:
        return np.ones((t, cfg.head_dim // 2)), np.zeros((t, cfg.head_dim // 2))
    return nn.rope_fill(t, cfg.head_dim, rope[0], start=start, factors=rope[1])
