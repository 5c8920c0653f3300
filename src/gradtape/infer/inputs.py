"""The checked inputs of ``logits`` and ``generate``: token ids, the weights in the dtype
asked for, and an adapter's A and B as arrays.

Each function checks one input and says what is wrong with it; none computes model math.
"""

from __future__ import annotations

import numpy as np

from ..blocks import is_block_matrix
from ..errors import GradtapeError
from ..models.dora import column_factors
from ..models.lora import check_adapter_fits


def check_ids(cfg, ids) -> np.ndarray:
    """``ids`` as a flat int64 array, each id within the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) and ids.size:
        raise GradtapeError(f"ids must be a flat list of integers, got shape "
                            f"{list(ids.shape)} dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise GradtapeError(f"token id out of range [0, {cfg.vocab_size}): "
                            f"{int(ids.min())}..{int(ids.max())}")
    return ids


def weights_as(weights, dtype) -> dict:
    """``weights`` with their float arrays in ``dtype`` (float32 or float64): the dict
    itself where they already are."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise GradtapeError(f"dtype must be float32 or float64, got {dtype}")
    if all(is_block_matrix(w) or w.dtype == dtype for w in weights.values()):
        return weights
    # block matrices stay as they are: the block primitives compute in the tape's dtype
    return {k: w if is_block_matrix(w) else w.astype(dtype) for k, w in weights.items()}


def lora_arrays(adapter, cfg, dtype, weights=None):
    """``(lora arrays {(layer, target): (A, B)} in dtype, scale)`` from an adapter object
    checked to fit the model's config; ``(None, 1.0)`` without one.  A DoRA adapter's
    entries are ``(A, B, c)``, ``c`` its fixed column factor from the model's
    ``weights`` (``models.dora.column_factors``)."""
    if adapter is None:
        return None, 1.0
    check_adapter_fits(adapter, cfg)
    factors = column_factors(weights, adapter) if adapter.dora else {}
    out = {key: (np.asarray(a, dtype), np.asarray(b, dtype))
           + ((np.asarray(factors[key], dtype),) if key in factors else ())
           for key, (a, b) in adapter.weights.items()}
    return out, float(adapter.scale)
