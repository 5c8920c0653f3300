"""The cpu backend's block-weight kernels (``csrc/qgemm.c``), and the float products of
frozen weights kept in their ggml blocks (``qmatmul``, ``qmatmul_t``, ``qtake_rows``).

The C source (``csrc/ggml_blocks.h``: per-type dequantization bit for bit as
``gguf.quants.dequantize``, shared with ``ggml_vec``; ``csrc/qgemm.c``: tiled GEMM
drivers) is built once with ``toolchain.build_csrc`` and cached like the generated
kernels; ``lib()`` is every kernel of it, for this module and for the bf16 and int8
products (``qgemm_bf16.py``, ``qgemm_int8.py``).  A float product dequantizes one tile
of W at a time (at most ``TILE_ELEMS`` values, a scratch buffer allocated once per
program) and hands it to BLAS: NumPy's own, whose ``cblas_sgemm`` / ``cblas_dgemm`` are
found in the loaded library (``blas.cblas``) and called from C, so the whole float matrix
never exists.  Where that symbol cannot be found, the same tiles go through
``np.matmul`` from Python.

``lower(v, out, ins, scratch)`` is the one place that picks the kernel for a block op in
float: a float32 ``qmatmul`` of a few rows (decoding) goes to ``ggml_vec``'s
matrix-vector kernel.  This module does not decide fusion, memory or the compute
precision; ``backend.py`` does.
"""

from __future__ import annotations

import ctypes
import functools
import time

import numpy as np

from ... import settings
from ...blocks import BLOCK_TYPES
from . import blas, ggml_vec, toolchain

QOPS = ("qmatmul", "qmatmul_t", "qtake_rows")
# A tile of W is at most this many values (16 MB in float32) and this many rows: BLAS
# reaches its full-matrix rate on [T, k] @ tile^T only from about 512 rows up (smaller
# tiles cost up to twice the whole product), and the scratch stays small next to the
# weights.
TILE_ELEMS = 1 << 22
TILE_ROWS = 1024  # rows of W per tile (then columns are cut to fit TILE_ELEMS)

_LIBS = {}  # the build flags (the instruction-set class in force) -> the library

_p = ctypes.c_void_p
_l = ctypes.c_long
_i = ctypes.c_int


def lib():
    """The compiled ``csrc/qgemm.c`` for the instruction-set class in force
    (``toolchain.isa``; built and cached on first use)."""
    key = toolchain.isa_flags()
    if key not in _LIBS:
        path, _ = toolchain.build_csrc(["qgemm.c"], flags=toolchain.threads_flags(),
                                       prefix="gtq")
        so = ctypes.CDLL(str(path))
        for name in ("gt_deq_rows", "gt_deq_rows_f64"):
            getattr(so, name).argtypes = [_i, _p, _l, _p, _l, _l, _p]
            getattr(so, name).restype = _i
        so.gt_deq_tile_bf16.argtypes = [_i, _p, _l, _p, _l, _l, _l, _l, _p, _l]
        so.gt_deq_tile_bf16.restype = _i
        so.gt_deq_tile_vnni.argtypes = [_i, _p, _l, _l, _l, _l, _l, _i, _p]
        so.gt_deq_tile_vnni.restype = _i
        so.gt_f32_bf16.argtypes = [_p, _p, _l]
        so.gt_f32_bf16.restype = None
        so.gt_f32_bf16_block.argtypes = [_p, _l, _l, _l, _p]
        so.gt_f32_bf16_block.restype = None
        so.gt_copy_cols.argtypes = [_p, _l, _l, _p, _l]
        so.gt_copy_cols.restype = None
        so.gt_copy_cols_t.argtypes = [_p, _l, _l, _p, _l]
        so.gt_copy_cols_t.restype = None
        so.gt_fused_scratch.argtypes = [_i, _l, _l, _l, _i]
        so.gt_fused_scratch.restype = _l
        so.gt_qgemm_bf16_fused.argtypes = [_i, _p, _l, _l, _l, _i, _p, _p, _l, _p, _p, _l,
                                           _p]
        so.gt_qgemm_bf16_fused.restype = _i
        so.gt_qgemm_bf16_amx.argtypes = so.gt_qgemm_bf16_fused.argtypes
        so.gt_qgemm_bf16_amx.restype = _i
        so.gt_qgemm_bf16_amx_rows.argtypes = so.gt_qgemm_bf16_fused.argtypes
        so.gt_qgemm_bf16_amx_rows.restype = _i
        so.gt_amx_ready.argtypes = []
        so.gt_amx_ready.restype = _i
        so.gt_rows_vnni.argtypes = [_p, _l, _l, _p]
        so.gt_rows_vnni.restype = None
        so.gt_quant_rows_s8.argtypes = [_p, _l, _l, _l, _p, _i, _p, _p]
        so.gt_quant_rows_s8.restype = _i
        so.gt_absmax_cols.argtypes = [_p, _l, _l, _l, _p]
        so.gt_absmax_cols.restype = None
        so.gt_deq_tile_s8.argtypes = [_i, _p, _l, _l, _l, _l, _l, _p, _p, _p, _l, _p]
        so.gt_deq_tile_s8.restype = _i
        so.gt_col_absmax.argtypes = [_i, _p, _l, _l, _l, _p]
        so.gt_col_absmax.restype = _i
        so.gt_deq_tile_s8_vnni.argtypes = [_i, _p, _l, _l, _l, _l, _l, _i, _p, _p, _p, _p, _p]
        so.gt_deq_tile_s8_vnni.restype = _i
        so.gt_s32_scale.argtypes = [_p, _l, _l, _l, _p, _p, _p, _p, _l]
        so.gt_s32_scale.restype = None
        for name in ("gt_qgemm_f32", "gt_qgemm_t_f32", "gt_qgemm_f64", "gt_qgemm_t_f64"):
            getattr(so, name).argtypes = [_i, _p, _l, _l, _l, _p, _l, _p, _p, _l, _l, _p, _i,
                                          _i, _p]
            getattr(so, name).restype = _i
        _LIBS[key] = so
    return _LIBS[key]


def type_id(qtype):
    """The ggml id of ``qtype``: how the C kernels name a block type."""
    return BLOCK_TYPES[qtype].id


def check(rc, what):
    """Raise where a C kernel returned a nonzero status."""
    if rc != 0:
        raise RuntimeError(f"gradtape: {what} failed in the C kernel (status {rc})")


def run_tile(split, what, deq, args, gemm):
    """One tile: ``deq(*args)`` (a C kernel's status, checked), then ``gemm()``; with a
    profile's ``split`` (None in a replay), the seconds of each added to its
    "dequantize" and "GEMM" entries."""
    if split is None:
        check(deq(*args), what)
        gemm()
        return
    t0 = time.perf_counter()
    check(deq(*args), what)
    t1 = time.perf_counter()
    gemm()
    split["dequantize"] += t1 - t0
    split["GEMM"] += time.perf_counter() - t1


def tile_shape(qtype, rows, k):
    """``(R, C)``: rows and block-aligned columns of W per tile (``R * C <= TILE_ELEMS``)."""
    block = BLOCK_TYPES[qtype].block
    c = max(block, min(k, TILE_ELEMS // TILE_ROWS) // block * block)
    r = max(1, min(rows, TILE_ELEMS // c))
    return r, c


def transposed_layout():
    """Whether the GEMM drivers compute each product block transposed and transpose it
    into place (1, the default: faster with OpenBLAS here, see csrc/qgemm.c) or write it
    directly (0).  ``$GRADTAPE_QGEMM_LAYOUT=direct`` chooses the latter."""
    return 0 if settings.get("GRADTAPE_QGEMM_LAYOUT") == "direct" else 1


def scratch_elems(ops):
    """Scratch values the block ops ``ops`` need: one tile, and the transposed product
    block of the transposed layout (float64 tiles also hold the float32 row they are
    widened from, which fits inside the tile's own bytes)."""
    need = 0
    for v in ops:
        if v.op in ("qmatmul", "qmatmul_t"):
            a = v.attrs
            r, c = tile_shape(a["qtype"], a["rows"], a["k"])
            need = max(need, r * c + max(r, c) * v.shape[0])
    return need


def _rows(w, ids, what):
    """``(w, n, ids, ids address)``: block data made contiguous and the rows asked for
    (all when ``ids`` is None), checked against the matrix's rows."""
    w = np.ascontiguousarray(w)
    if ids is None:
        return w, w.shape[0], None, None
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError(f"{what}: ids out of range [0, {w.shape[0]})")
    return w, len(ids), ids, ids.ctypes.data


def deq_rows(w, qtype, k, ids=None, dtype=np.float32, out=None):
    """Rows ``ids`` (all when None) of the block data ``w [rows, row_bytes]`` dequantized
    by the C kernels into ``out [n, k]`` of ``dtype``."""
    w, n, ids, idp = _rows(w, ids, "qtake_rows")
    if out is None:
        out = np.empty((n, k), dtype)
    fn = lib().gt_deq_rows if out.dtype == np.float32 else lib().gt_deq_rows_f64
    if n and k:
        check(fn(type_id(qtype), w.ctypes.data, w.shape[1], idp, n, k, out.ctypes.data),
               "dequantize")
    return out


def deq_rows_bf16(w, qtype, k, ids=None):
    """Rows of ``w`` dequantized and rounded to bfloat16 (the bits, uint16 ``[n, k]``):
    the tile format of bf16 compute (``--compute bf16``)."""
    w, n, ids, idp = _rows(w, ids, "deq_rows_bf16")
    out = np.empty((n, k), np.uint16)
    if n and k:
        check(lib().gt_deq_tile_bf16(type_id(qtype), w.ctypes.data, w.shape[1], idp, 0, n,
                                      0, k, out.ctypes.data, k), "dequantize")
    return out


def _tiles_numpy(transposed, qtype, w, rows, k, a, out, tile):
    """The tiled product without a CBLAS pointer: each tile through ``np.matmul``."""
    R, C = tile_shape(qtype, rows, k)
    out.fill(0)
    bt = BLOCK_TYPES[qtype]
    for r0 in range(0, rows, R):
        r1 = min(rows, r0 + R)
        for c0 in range(0, k, C):
            c1 = min(k, c0 + C)
            b0, b1 = c0 // bt.block * bt.nbytes, c1 // bt.block * bt.nbytes
            t = deq_rows(w[r0:r1, b0:b1], qtype, c1 - c0, dtype=out.dtype,
                         out=tile[:(r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0))
            if transposed:
                out[:, c0:c1] += a[:, r0:r1] @ t
            else:
                out[:, r0:r1] += a[:, c0:c1] @ t.T


def _gemm_call(transposed, qtype, w, rows, k, a, out, tile):
    L = lib()
    R, C = tile_shape(qtype, rows, k)
    sg, dg, ilp64, _ = blas.cblas()
    f64 = out.dtype == np.float64
    fn = {(False, False): L.gt_qgemm_f32, (True, False): L.gt_qgemm_t_f32,
          (False, True): L.gt_qgemm_f64, (True, True): L.gt_qgemm_t_f64}[(transposed, f64)]
    T = a.shape[0]
    if tile.size < R * C + max(R, C) * T:
        raise RuntimeError(f"qmatmul: scratch of {tile.size} values < {R * C + max(R, C) * T}")
    args = (type_id(qtype), w.ctypes.data, w.strides[0], rows, k, a.ctypes.data,
            T, out.ctypes.data, tile.ctypes.data, R, C, dg if f64 else sg, ilp64,
            transposed_layout(), tile.ctypes.data + R * C * tile.itemsize)

    def run():
        check(fn(*args), "qmatmul")
    run.label = (f"{'qmatmul_t' if transposed else 'qmatmul'} {out.dtype} "
                 f"[{T}, {a.shape[1]}] x {qtype}[{rows}, {k}]")
    return run


def lower(v, out, ins, scratch):
    """A callable computing block op ``v`` into ``out`` from input arrays ``ins``.

    The kernel is chosen here: ``ggml_vec``'s matrix-vector kernel for a float32
    ``qmatmul`` of at most four rows, the tiled dequantize + BLAS GEMM otherwise."""
    a = v.attrs
    qtype, rows, k = a["qtype"], a["rows"], a["k"]
    if v.op == "qtake_rows":
        w, ids = ins
        return functools.partial(deq_rows, w, qtype, k, ids, out.dtype, out)
    x, w = ins
    transposed = v.op == "qmatmul_t"
    tile = scratch
    if out.size == 0 or x.shape[0] == 0:
        return lambda: None
    if (k if not transposed else rows) == 0 or (rows if not transposed else k) == 0:
        return functools.partial(out.fill, 0)
    if not (x.flags.c_contiguous and out.flags.c_contiguous and w.strides[1] == 1):
        raise RuntimeError(f"{v.op}: operands must be C-contiguous")
    if (not transposed and out.dtype == np.float32 and x.shape[0] <= ggml_vec.MAX_ROWS
            and k % 16 == 0 and ggml_vec.available()):
        # a few rows (decoding): read the blocks once, dequantized in registers
        return ggml_vec.matvec_call(qtype, w, rows, k, x, out)
    if blas.cblas() is None:
        return functools.partial(_tiles_numpy, transposed, qtype, w, rows, k, x, out, tile)
    return _gemm_call(transposed, qtype, w, rows, k, x, out, tile)


# --- bf16 compute ---------------------------------------------------------------------
