"""How ``generate`` runs a prompt: as one compiled program (``PromptStep``) in a GEMM
precision, or row by row in the decoder's own prefill.

``prompt_compute`` is the whole decision, a function of the model's config, the
precision asked for, the prompt's rows and the dtype; the GEMM rates it relies on are
measured once per CPU (``backends.cpu.measure``).  It builds nothing and runs nothing
(``generator`` does).
"""

from __future__ import annotations

import numpy as np

from ..backends.cpu import measure  # the GEMM decisions, measured once per CPU
from ..backends.cpu import ggml_vec
from ..errors import GradtapeError

# under compute "auto" a prompt runs as one compiled bf16 program from this much GEMM
# work on: below it, building the program costs more than it saves
PROMPT_BF16_FLOPS = 1e11
# float32 prompts of this many rows on run as a float32 program too: the C prefill
# attends a row at a time, the program's attention is tiled
PROMPT_F32_ROWS = 2048


def linear_weights(cfg) -> int:
    """The weights of the linears a token goes through (the layers' projections and MLP;
    not the embedding or the LM head): its GEMM work is twice this."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * (2 * cfg.dim * q + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim)


def prompt_compute(cfg, compute, rows, dtype):
    """The precision ``generate`` runs a prompt of ``rows`` rows in as one compiled
    ``PromptStep``, or None: row by row in the decoder's own prefill.  "bf16" (or
    "int8") under ``auto`` where this CPU's bf16 GEMMs are faster and the prompt's
    work pays for compiling the program (``PROMPT_BF16_FLOPS``), under ``bf16``
    wherever the prompt has more rows than the matrix-vector kernels take and this
    CPU's bf16 GEMMs are fast at the model's width (at 256 rows); else "float32"
    from ``PROMPT_F32_ROWS`` rows on (the program's tiled attention)."""
    if compute not in measure.COMPUTE_CHOICES:
        raise GradtapeError(f"compute must be one of {', '.join(measure.COMPUTE_CHOICES)}, "
                            f"got {compute!r}")
    precision = "float32"
    small = compute == "auto" and 2 * rows * linear_weights(cfg) < PROMPT_BF16_FLOPS
    if compute != "float32" and rows > ggml_vec.MAX_ROWS and not small:
        applies = np.dtype(dtype) == np.float32 or "generation in float64 runs float64"
        # asked for by name: wherever this CPU's bf16 GEMMs are fast at the model's
        # width, whatever the prompt's length
        m = rows if compute == "auto" else measure.DEFAULT_SHAPE[0]
        precision, _ = measure.decide(compute, applies, shape=(m, cfg.dim, cfg.ffn_dim))
    if precision != "float32":
        return precision
    return "float32" if np.dtype(dtype) == np.float32 and rows >= PROMPT_F32_ROWS else None
