"""DoRA's parts beside LoRA's: the fixed column norms of the frozen weights, the magnitude
vectors' initial values, the adapter's tape leaves, the column factors generation uses
and the folded (merged) weight.

DoRA (PEFT's ``use_dora=True``) adapts a linear as ``(x @ w0 + s * x @ A @ B) * m /
||w0 + s * A @ B||``, the norm per output feature and detached (``nn.dora_linear``); the
magnitude ``m [out]`` is a parameter beside ``A`` and ``B`` (``LoraAdapter.magnitudes``).
``||w0_j||^2`` is computed here once per adapted weight, row by row through
dequantization where the weight is kept in its ggml blocks, so a quantized base never
needs a dense copy.  The math of a step is ``gradtape.nn``'s; the file format is
``models.lora``'s.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..blocks import is_block_matrix

# block-matrix rows dequantized at a time for the column norms (bounded scratch)
_ROWS = 256


def _stored_rows(w):
    """The float64 rows ``[n, in]`` of a block matrix (one output feature each), a
    bounded chunk at a time, with the index of the first."""
    rows = w.shape[0]
    for s in range(0, rows, _ROWS):
        yield s, w.dequantize(slice(s, min(s + _ROWS, rows))).astype(np.float64)


# block matrix (frozen, read-only blocks) -> its column norms: a DoRA run's init and its
# step both need them, and a big GGUF's pass of dequantization is worth doing once
_BLOCK_NORMS: dict = {}


def column_norms_sq(w) -> np.ndarray:
    """``||w_j||^2`` per output feature, float64 ``[out]``: over the rows of a float
    ``w [in, out]``, or over each stored row of a block matrix (``[out, in]``, computed
    once per block matrix)."""
    if is_block_matrix(w):
        hit = _BLOCK_NORMS.get(id(w))
        if hit is not None and hit[0]() is w:
            return hit[1]
        out = np.empty(w.shape[0], np.float64)
        for s, d in _stored_rows(w):
            out[s:s + d.shape[0]] = np.einsum("ij,ij->i", d, d)
        for k in [k for k, (ref, _) in _BLOCK_NORMS.items() if ref() is None]:
            del _BLOCK_NORMS[k]  # entries of block matrices gone
        out.flags.writeable = False  # shared by every caller
        _BLOCK_NORMS[id(w)] = (weakref.ref(w), out)
        return out
    w = np.asarray(w, np.float64)
    return np.einsum("ij,ij->j", w, w)


def _a_t_w(w, a) -> np.ndarray:
    """``a^T @ w0``, float64 ``[r, out]``, for ``w`` float ``[in, out]`` or a block matrix."""
    a = np.asarray(a, np.float64)
    if is_block_matrix(w):
        out = np.empty((a.shape[1], w.shape[0]), np.float64)
        for s, d in _stored_rows(w):
            out[:, s:s + d.shape[0]] = (d @ a).T
        return out
    return a.T @ np.asarray(w, np.float64)


def column_norms(w, a, b, scale, w0_sq=None) -> np.ndarray:
    """``||w0 + scale * a @ b||`` per output column, float64 ``[out]``, by the rank-r
    terms ``nn.dora_norm`` records (no dense ``[in, out]`` matrix)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    w0_sq = column_norms_sq(w) if w0_sq is None else w0_sq
    cross = np.einsum("rj,rj->j", _a_t_w(w, a), b)
    low = np.einsum("rj,rj->j", b, (a.T @ a) @ b)
    return np.sqrt(w0_sq + 2.0 * scale * cross + scale * scale * low)


def column_factors(weights, adapter) -> dict:
    """``{key: m / ||w0 + s A B||}`` float64 ``[out]`` of a DoRA adapter: its fixed factor
    per output column where nothing is trained (generation)."""
    return {key: np.asarray(adapter.magnitudes[key], np.float64)
            / column_norms(weights[weight_name(key)], a, b, adapter.scale)
            for key, (a, b) in adapter.weights.items()}


def weight_name(key) -> str:
    """The model weight a ``(layer, target)`` adapts."""
    layer, target = key
    return f"layers.{layer}.{target}"


def init_magnitudes(weights, keys, dtype=np.float32) -> dict:
    """``{key: ||w0_j|| [out]}``: DoRA's initial magnitudes for a fresh adapter (B is zero,
    so ``||w0 + s A B|| = ||w0||``); ``weights`` the model's weights dict."""
    return {key: np.sqrt(column_norms_sq(weights[weight_name(key)])).astype(dtype)
            for key in keys}


def adapter_leaves(tp, adapter, weights) -> dict:
    """The adapter as tape leaves for ``models.graph.record_forward``: ``{key: (A, B)}``
    params for LoRA; for DoRA ``(A, B, m, w0_sq)``, the magnitude a param too and
    ``w0_sq`` the const ``||w0_j||^2``."""
    out = {}
    for key, (a, b) in adapter.weights.items():
        if key in adapter.magnitudes:
            out[key] = (tp.param(a), tp.param(b), tp.param(adapter.magnitudes[key]),
                        tp.const(column_norms_sq(weights[weight_name(key)])))
        else:
            out[key] = (tp.param(a), tp.param(b))
    return out


def leaf_params(leaves) -> list:
    """The trainable params of ``adapter_leaves``' dict, in its order (A, B[, m])."""
    return [p for entry in leaves.values() for p in entry if p.op == "param"]


def fold_magnitude(w, m) -> np.ndarray:
    """DoRA's merge (PEFT's): ``w * m / ||w||`` per output column of the float64 ``w = w0
    + s A B [in, out]``, in place; returns ``w``."""
    w *= np.asarray(m, np.float64) / np.sqrt(np.einsum("ij,ij->j", w, w))
    return w
