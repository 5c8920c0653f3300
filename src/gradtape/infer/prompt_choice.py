"""How ``generate`` runs a prompt: as one compiled program (``PromptStep``) in a GEMM
precision, or row by row in the decoder's own prefill.

The decision is the execution plan's (``plan.prompt_compute``); this module hands it
what it needs of the model (its work per token) and of the decoder (the rows its
matrix-vector kernels take).  It builds nothing and runs nothing.
"""

from __future__ import annotations

from .. import plan
from ..backends.cpu import ggml_vec
from ..plan import PROMPT_BF16_FLOPS, PROMPT_F32_ROWS

__all__ = ["PROMPT_BF16_FLOPS", "PROMPT_F32_ROWS", "linear_weights", "prompt_compute"]


def linear_weights(cfg) -> int:
    """The weights of the linears a token goes through (the layers' projections and MLP;
    not the embedding or the LM head): its GEMM work is twice this."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * (2 * cfg.dim * q + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim)


def prompt_compute(cfg, compute, rows, dtype):
    """The precision ``generate`` runs a prompt of ``rows`` rows in as one compiled
    ``PromptStep`` ("bf16", "int8", "float32"), or None: row by row in the decoder's own
    prefill (``plan.prompt_compute``)."""
    return plan.prompt_compute(cfg, compute, rows, dtype, ggml_vec.MAX_ROWS,
                               linear_weights(cfg)).value
