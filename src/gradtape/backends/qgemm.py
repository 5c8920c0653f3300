"""The cpu backend's kernels for frozen weights in their stored type (``qmatmul``,
``qmatmul_t``, ``qtake_rows``).

The C source (``csrc/ggml_blocks.h``: per-type dequantization bit for bit as
``gguf.quants.dequantize``, shared with ``ggml_vec``; ``csrc/qgemm.c``: tiled GEMM
drivers) is built once with ``_cgen.build`` and cached like the generated kernels.  A product dequantizes one tile of W at a time
(at most ``TILE_ELEMS`` values, a scratch buffer allocated once per program) and hands
it to BLAS: NumPy's own OpenBLAS, whose ``cblas_sgemm`` / ``cblas_dgemm`` are found in
the loaded library and called from C, so the whole float matrix never exists.  Where
that symbol cannot be found, the same tiles go through ``np.matmul`` from Python.

With bf16 compute (``lower_bf16``) the tiles are dequantized straight into bf16, the
activation is rounded to bf16 once per product, and each tile is one oneDNN GEMM with
float32 accumulation (``onednn.py``).

``lower(v, out, ins, scratch)`` is the one place that picks the kernel for a block op:
a float32 ``qmatmul`` of a few rows (decoding) goes to ``ggml_vec``'s matrix-vector
kernel.  This module does not decide fusion, memory or the compute precision;
``cpu.py`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import time
from pathlib import Path

import numpy as np

from ..blocks import BLOCK_TYPES
from . import _cgen, ggml_vec
from .onednn import DnnlError

QOPS = ("qmatmul", "qmatmul_t", "qtake_rows")
# A tile of W is at most this many values (16 MB in float32) and this many rows: BLAS
# reaches its full-matrix rate on [T, k] @ tile^T only from about 512 rows up (measured
# with OpenBLAS at T=256, k=4096: 128-256-row tiles cost up to 2x the whole product), and
# the scratch stays small next to the weights.
TILE_ELEMS = 1 << 22
TILE_ROWS = 1024  # rows of W per tile (then columns are cut to fit TILE_ELEMS)
# bf16 compute (oneDNN): a tile is whole rows of W ([R, k]) or, backward, whole columns
# ([rows, C]) where that gives the wider GEMM (bf16_tile_shape), so each tile is one GEMM.
# Two sizes, the faster per product measured on the CPU at hand (compute.fastest):
# 16M values (32 MB of bf16), where oneDNN's bf16 matmul at T=256 ran at 740-830 GFLOP/s
# from 4096 output columns up and 450 at 1024 (Zen 5, AVX512-BF16, in a loop); and
# 1M values, a tile that stays in the cores' caches between its dequantization and its
# GEMM: on Zen 5 it won 9 of an 8B step's 14 products, and the step took 11.89 s against
# 12.36 s with 16M tiles alone (medians, bench/step_ab.py; docs/benchmarks.md).
BF16_TILE_ELEMS = 1 << 24
BF16_SMALL_TILE_ELEMS = 1 << 20
# A small tile's GEMM takes the activation this many rows at a time (its tile, 2 MB, stays
# in cache across them): at batch 4 x 256 one GEMM of all 1024 rows re-reads an 8 MB
# activation per tile, and oneDNN's bf16 matmul with a [256, N] B, packed, ran at 666-714
# GFLOP/s over 1024 rows against 752-759 as four calls of 256 (Zen 5)
BF16_SMALL_TILE_ROWS = 256

_LIB = None
_BLAS = "unset"

_p = ctypes.c_void_p
_l = ctypes.c_long
_i = ctypes.c_int


def lib():
    """The compiled ``csrc/qgemm.c`` (built and cached on first use)."""
    global _LIB
    if _LIB is None:
        path, _ = _cgen.build_csrc(["qgemm.c"], flags=_cgen.threads_flags(), prefix="gtq")
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
        _LIB = so
    return _LIB


def blas():
    """``(sgemm address, dgemm address, ilp64)`` of the CBLAS NumPy's BLAS library
    exports, or None.  The library is found among the process's mapped files (NumPy
    loaded it); ``$GRADTAPE_BLAS`` names another library."""
    global _BLAS
    if _BLAS != "unset":
        return _BLAS
    _BLAS = None
    candidates = [os.environ["GRADTAPE_BLAS"]] if os.environ.get("GRADTAPE_BLAS") else []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if "blas" in Path(path).name.lower() and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    names = [("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", 1),
             ("cblas_sgemm64_", "cblas_dgemm64_", 1), ("cblas_sgemm", "cblas_dgemm", 0)]
    for path in candidates:
        try:
            so = ctypes.CDLL(path)
        except OSError:
            continue
        for s, d, ilp64 in names:
            try:
                fs, fd = getattr(so, s), getattr(so, d)
            except AttributeError:
                continue
            _BLAS = (ctypes.cast(fs, _p).value, ctypes.cast(fd, _p).value, ilp64, so)
            return _BLAS
    return _BLAS


@functools.lru_cache(maxsize=1)
def blas_threads():
    """``(get, set)``: NumPy's OpenBLAS thread count, read and set at run time, or None
    where the library exports neither (another BLAS)."""
    b = blas()
    if b is None:
        return None
    for get, set_ in (("scipy_openblas_get_num_threads64_",
                       "scipy_openblas_set_num_threads64_"),
                      ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                      ("openblas_get_num_threads", "openblas_set_num_threads")):
        try:
            g, s = getattr(b[3], get), getattr(b[3], set_)
        except AttributeError:
            continue
        g.restype, g.argtypes = ctypes.c_int, []
        s.restype, s.argtypes = None, [ctypes.c_int]
        return g, s
    return None


@functools.lru_cache(maxsize=1)
def _blas_shutdown():
    b = blas()
    for name in ("blas_thread_shutdown_", "scipy_blas_thread_shutdown_"):
        fn = getattr(b[3], name, None) if b is not None else None
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return fn
    return None


def park_blas_threads():
    """Stop NumPy's OpenBLAS worker threads now (no-op with another BLAS); OpenBLAS
    starts them again at its next threaded call, which costs tens of microseconds.  Call
    it before a long OpenMP region (the fused attention): left alone, they poll for up to
    2^28 cycles (~0.1 s) after each GEMM on the cores its threads need, and SmolLM2's
    T=2048 step took 18.9 s against 15.9 s parked (2 Zen 3 cores).  Only where no other
    thread can be inside a BLAS call meanwhile: gradtape replays a program's steps on
    one thread."""
    fn = _blas_shutdown()
    if fn is not None:
        fn()


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's BLAS on one thread inside the block, its own count again after it (also
    after an exception).  For work whose threads are OpenMP's (oneDNN, our kernels):
    OpenBLAS's idle threads spin for up to ~0.1 s after each call, on the cores those
    threads need (the bf16 GEMMs of an 8B step ran at half speed, measured), so the ones
    a GEMM before the block left spinning are parked on entry: ``bf16_fast``'s timing
    right after a NumPy GEMM measured bf16 at 195 GFLOP/s against float32's 208 (441
    parked; SmolLM2's shape, Zen 5), and cached that bf16 was not faster."""
    threads = blas_threads()
    if threads is None:
        yield
        return
    get, set_ = threads
    n = get()
    set_(1)
    park_blas_threads()
    try:
        yield
    finally:
        set_(n)


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
    return 0 if os.environ.get("GRADTAPE_QGEMM_LAYOUT", "transposed") == "direct" else 1


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


def _type_id(qtype):
    return BLOCK_TYPES[qtype].id


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"gradtape: {what} failed in the C kernel (status {rc})")


def _tile(split, what, deq, args, gemm):
    """One tile: ``deq(*args)`` (a C kernel's status, checked), then ``gemm()``; with a
    profile's ``split`` (None in a replay), the seconds of each added to its
    "dequantize" and "GEMM" entries."""
    if split is None:
        _check(deq(*args), what)
        gemm()
        return
    t0 = time.perf_counter()
    _check(deq(*args), what)
    t1 = time.perf_counter()
    gemm()
    split["dequantize"] += t1 - t0
    split["GEMM"] += time.perf_counter() - t1


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
        _check(fn(_type_id(qtype), w.ctypes.data, w.shape[1], idp, n, k, out.ctypes.data),
               "dequantize")
    return out


def deq_rows_bf16(w, qtype, k, ids=None):
    """Rows of ``w`` dequantized and rounded to bfloat16 (the bits, uint16 ``[n, k]``):
    the tile format of bf16 compute (``--compute bf16``)."""
    w, n, ids, idp = _rows(w, ids, "deq_rows_bf16")
    out = np.empty((n, k), np.uint16)
    if n and k:
        _check(lib().gt_deq_tile_bf16(_type_id(qtype), w.ctypes.data, w.shape[1], idp, 0, n,
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
    sg, dg, ilp64, _ = blas()
    f64 = out.dtype == np.float64
    fn = {(False, False): L.gt_qgemm_f32, (True, False): L.gt_qgemm_t_f32,
          (False, True): L.gt_qgemm_f64, (True, True): L.gt_qgemm_t_f64}[(transposed, f64)]
    T = a.shape[0]
    if tile.size < R * C + max(R, C) * T:
        raise RuntimeError(f"qmatmul: scratch of {tile.size} values < {R * C + max(R, C) * T}")
    args = (_type_id(qtype), w.ctypes.data, w.strides[0], rows, k, a.ctypes.data,
            T, out.ctypes.data, tile.ctypes.data, R, C, dg if f64 else sg, ilp64,
            transposed_layout(), tile.ctypes.data + R * C * tile.itemsize)

    def run():
        _check(fn(*args), "qmatmul")
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
    if blas() is None:
        return functools.partial(_tiles_numpy, transposed, qtype, w, rows, k, x, out, tile)
    return _gemm_call(transposed, qtype, w, rows, k, x, out, tile)


# --- bf16 compute ---------------------------------------------------------------------

def bf16_tile_sizes():
    """The tile sizes (values) a bf16 block product is timed with, largest first."""
    return tuple(sorted({BF16_TILE_ELEMS, min(BF16_SMALL_TILE_ELEMS, BF16_TILE_ELEMS)},
                        reverse=True))


def _size_name(elems):
    return f"{elems >> 20}M" if elems % (1 << 20) == 0 else str(elems)


def bf16_tile_shape(transposed, qtype, rows, k, elems=None):
    """``(R, C)`` of a bf16 tile of about ``elems`` values (default ``BF16_TILE_ELEMS``):
    ``[R, k]`` whole rows for ``qmatmul``; for ``qmatmul_t`` either ``[rows, C]`` whole
    (block-aligned) columns, each tile writing its own columns of z, or, when that leaves
    a narrower GEMM (a tall W: the LM head, gate, up), whole rows ``[R, k]`` again, the
    tiles' products summed into z."""
    elems = BF16_TILE_ELEMS if elems is None else elems
    fit = elems // max(k, 1)
    if fit > 64:
        fit -= fit % 64  # the GEMM's N in whole 64-column blocks of oneDNN's kernels
    whole_rows = max(1, min(rows, fit)), k
    if not transposed:
        return whole_rows
    block = BLOCK_TYPES[qtype].block
    cols = rows, max(block, min(k, elems // max(rows, 1) // block * block))
    # the GEMM's narrower side: columns [rows, C] -> (K rows, N C); rows -> (K R, N k)
    return whole_rows if min(whole_rows) > min(cols) else cols


def bf16_eligible(v):
    """Whether block op ``v`` runs as bf16 GEMMs under bf16 compute: products of more
    rows than the matrix-vector kernel takes (decoding stays there, float32)."""
    a = v.attrs
    return (v.op in ("qmatmul", "qmatmul_t") and v.inputs[0].shape[0] > ggml_vec.MAX_ROWS
            and a["rows"] > 0 and a["k"] > 0)


def bf16_scratch_elems(ops):
    """``(activation, tile, product)``: the bf16 values the bf16 block GEMMs ``ops`` need
    (the activation rounded once per product, and for a ``qmatmul`` its swapped GEMMs'
    blocked copy; one tile) and the float32 values of one tile's product when it is a
    block of columns of the result or a swapped product (see ``lower_bf16``)."""
    act = tile = prod = 0
    for v, elems in itertools.product(ops, bf16_tile_sizes()):
        a = v.attrs
        r, c = bf16_tile_shape(v.op == "qmatmul_t", a["qtype"], a["rows"], a["k"], elems)
        # the blocked layout pads K to 32 and N to 64 values (gt_deq_tile_vnni)
        pad = lambda n: -(-n // 64) * 64  # noqa: E731
        T, width = v.shape[0], r if v.op == "qmatmul" else c  # the columns a tile writes
        tile = max(tile, pad(r) * pad(c), lib().gt_fused_scratch(
            _type_id(a["qtype"]), a["rows"], a["k"], T, int(v.op == "qmatmul_t")))
        if v.op == "qmatmul":  # x16, then x16^T blocked; each [r, T] swapped product
            act, prod = max(act, T * a["k"] + pad(T) * a["k"]), max(prod, T * width)
        else:
            act = max(act, v.inputs[0].size)
            if width < v.shape[1]:
                prod = max(prod, T * width)
    return act, tile, prod


def _tiles(transposed, rows, k, R, C):
    """The tiles of a block product of ``W [rows, k]`` cut as ``bf16_tile_shape`` says,
    in order: ``(r0, n, c0, nc, K, N, tb, acc, j0)``: W's rows ``[r0, r0 + n)`` and
    columns ``[c0, c0 + nc)``; the tile's GEMM ``[T, K] @ [K, N]`` (``tb``: the tile is
    ``W^T``, y = x W^T; else W, z = g W), added to the result where ``acc``; ``j0``: the
    first of the N result columns it writes, or None for a tile of whole rows of a
    ``qmatmul_t``, whose product is summed into all of z (its A: g's columns
    ``[r0, r0 + n)``)."""
    if not transposed:
        for r0 in range(0, rows, R):
            n = min(R, rows - r0)
            yield r0, n, 0, k, k, n, True, False, r0
    elif C == k:
        for r0 in range(0, rows, R):
            n = min(R, rows - r0)
            yield r0, n, 0, k, n, k, False, r0 > 0, None
    else:
        for c0 in range(0, k, C):
            n = min(C, k - c0)
            yield 0, rows, c0, n, rows, n, False, False, c0


def _row_blocks(dnnl, T, m, k, n, tb, a, w, out, ldc, acc, lda, vnni):
    """``dnnl.bind_ptrs``' product of ``T`` rows as GEMMs of ``m`` rows at a time (the
    same rows of a, bf16, and out, float32): one callable."""
    if m >= T:
        return dnnl.bind_ptrs(T, k, n, tb, a, w, out, ldc, acc, lda, vnni=vnni)
    lda, ldc = k if lda is None else lda, n if ldc is None else ldc
    calls = [dnnl.bind_ptrs(min(m, T - r), k, n, tb, a + 2 * lda * r, w, out + 4 * ldc * r,
                            ldc, acc, lda, vnni=vnni) for r in range(0, T, m)]

    def run():
        for call in calls:
            call()
    return run


class _BoundOnFirstCall:
    """A callable that ``bind()``s the one it stands for when first called (or asked for
    it: ``bound``)."""

    def __init__(self, bind):
        self._bind, self._run = bind, None

    def bound(self):
        if self._run is None:
            self._run = self._bind()
        return self._run

    def __call__(self, *args):
        return self.bound()(*args)


def _gemm_operands(v, out, ins):
    """``(qtype, rows, k, x, w, T, transposed)`` of block product ``v`` (``qmatmul`` or
    ``qmatmul_t``) for the oneDNN lowerings, which read their operands in place."""
    a = v.attrs
    x, w = ins
    if not (x.flags.c_contiguous and out.flags.c_contiguous and w.strides[1] == 1):
        raise RuntimeError(f"{v.op}: operands must be C-contiguous")
    return a["qtype"], a["rows"], a["k"], x, w, x.shape[0], v.op == "qmatmul_t"


def lower_bf16(v, out, ins, dnnl, act16, tile16, prod32, choose=None, rounded=False):
    """A callable computing ``qmatmul`` / ``qmatmul_t`` ``v`` into ``out`` with bf16
    inputs and float32 accumulation: the activation is rounded to bf16 into ``act16``,
    then for each tile, the blocks are dequantized and rounded into ``tile16`` (C, both
    cores) and one oneDNN GEMM writes (or adds to) its block of ``out``:
      qmatmul    y[:, r0:r0+R] = x16 @ tile[R, k]^T
      qmatmul_t  z[:, c0:c0+C] = g16 @ tile[rows, C]   (whole columns), or
                 z (+)= g16[:, r0:r0+R] @ tile[R, k]    (whole rows)
    The tiles are plain rows, which the GEMM reorders into its kernel's layout on every
    call, or, where that layout is the one ``gt_deq_tile_vnni`` writes, already in it;
    or, forward, "swapped": y^T = W x^T, the tile's plain rows the GEMM's A, read in
    place, and x16^T its weights, packed once per product past x16 in act16 (the small
    operand; W is not rearranged at all), each ``[R, T]`` product transposed into y;
    tiles of each of ``bf16_tile_sizes()``; or "fused", one call of our own
    (``gt_qgemm_bf16_fused``) in which each core dequantizes its own part of W a chunk
    at a time and multiplies it at once with our AVX512-BF16 GEMM (forward swapped, x16^T
    packed once past x16), where the CPU has it and W's shape fits its blocking (no
    tiles, no oneDNN); or, for a BF16 W (its bits are the tiles'), "direct": one oneDNN
    GEMM reading W where it lies.  ``choose(op's name, shape, {name: run})`` says which
    run (the blocked one of the largest tiles when None; ``compute.fastest`` times them
    all: the blocked layout saves the GEMM's reorder, 4-7% of it on AVX512-BF16, and
    costs a slower dequantization; small tiles stay in cache between the two, and their
    GEMMs take ``BF16_SMALL_TILE_ROWS`` rows of the activation at a time, "by 256 rows").
    A block of columns is written into ``prod32`` (float32 ``[T, width]``) and then moved
    into place: oneDNN's GEMM writing rows 16-56 KB apart (the result's own rows, 4096 or
    14336 floats) measured 15-20% slower than into contiguous rows.  ``rounded``: act16
    already holds x's bf16 copy when this runs (a ``qmatmul`` after another of the same
    x, whose run wrote it and nothing since), so it is not rounded again."""
    qtype, rows, k, x, w, T, transposed = _gemm_operands(v, out, ins)
    if rounded and transposed:
        raise ValueError("lower_bf16: a qmatmul_t rounds its own operand (its tiles may "
                         "write act16 column by column)")
    L, tid, wp, rb = lib(), _type_id(qtype), w.ctypes.data, w.strides[0]
    xp, ap, tp, op = x.ctypes.data, act16.ctypes.data, tile16.ctypes.data, out.ctypes.data
    width, pp = out.shape[1], prod32.ctypes.data if prod32 is not None else None

    def tiles(R, C, per_tile):
        """per tile of ``[R, C]``: W's rows [r0, r0 + n) and columns [c0, c0 + nc); its
        GEMM (K, N, the tile is W^T (y = x W^T) or W, A, output, ldc, acc, lda); None or
        the (columns, their address in out) it is moved into.  per_tile: each tile of a
        whole-rows qmatmul_t rounds its own columns of g into act16, contiguous (else
        g16's columns are read in place, rows `rows` apart)."""
        out_ = []
        for r0, n, c0, nc, K, N, tb, acc, j0 in _tiles(transposed, rows, k, R, C):
            if j0 is None:
                a_ptr, lda = (ap, None) if per_tile else (ap + 2 * r0, rows)
                out_.append(((r0, n, c0, nc), (K, N, tb, a_ptr, op, k, acc, lda), None))
            elif N == width:  # out[:, j0:j0+N] directly, or through prod32
                out_.append(((r0, n, c0, nc), (K, N, tb, ap, op, None, acc, None), None))
            else:
                out_.append(((r0, n, c0, nc), (K, N, tb, ap, pp, None, acc, None),
                             (N, op + 4 * j0)))
        return out_

    def way(layout, elems):
        """``(layout, (R, C), tiles, per_tile, m)``: the tiles of ``elems`` values, in
        ``layout`` ("plain", "blocked", "swapped"), each GEMM over ``m`` rows of the
        activation at a time; or None where oneDNN's kernel keeps its weights in another
        layout than gt_deq_tile_vnni writes (or a swapped ``qmatmul_t``)"""
        R, C = bf16_tile_shape(transposed, qtype, rows, k, elems)
        if layout == "swapped":
            # the GEMM's weights are x^T, packed, its N all of T (its rows the tile's);
            # one packing serves every tile, the last one's too
            if transposed or dnnl.packed_bytes(R, k, T) > 2 * (act16.size - T * k):
                return None
            md = dnnl.primitive(R, k, T, False, packed=True)[1][1]
            last = rows - (rows - 1) // R * R
            return (layout, (R, C), None, False, T) if dnnl.same_layout(md, last, k, T) \
                else None
        blocked = layout == "blocked"
        m = min(T, BF16_SMALL_TILE_ROWS) if elems <= BF16_SMALL_TILE_ELEMS else T
        # oneDNN keeps the blocked weights only with a contiguous A
        per_tile = blocked and transposed and C == k
        ts = tiles(R, C, per_tile)
        if blocked and not all(dnnl.primitive(mm, kk, n, False, ldc, acc, lda, vnni=True)
                               for _, (kk, n, _tb, _a, _o, ldc, acc, lda), _ in ts
                               for mm in {m, T - (T - 1) // m * m}):
            return None
        return layout, (R, C), ts, per_tile, m

    def swapped_tiles(R):
        """``(calls before the tiles, the tiles)`` of y^T = W x^T a tile at a time: x16^T
        packed once (after x16 in act16) into the layout of oneDNN's kernel, the
        GEMMs' weights; each tile's plain rows their A; each ``[n, T]`` product
        transposed into its columns of y."""
        xt = ap + 2 * T * k
        if dnnl.vnni(R, k, T):  # the layout gt_rows_vnni writes, 10x oneDNN's reorder
            pack = functools.partial(L.gt_rows_vnni, ap, T, k, xt)
        else:
            pack = dnnl.bind_pack(R, k, T, True, ap, xt, 2 * (act16.size - T * k))
        steps = [(None, L.gt_deq_tile_bf16, (tid, wp, rb, None, r0, n, 0, k, tp, k),
                  dnnl.bind_ptrs(n, k, T, False, tp, xt, pp, packed=True),
                  (L.gt_copy_cols_t, (pp, n, T, op + 4 * r0, width)))
                 for r0, n, *_ in _tiles(False, rows, k, R, k)]
        return [(pack, ())], steps

    def bind(layout, R_C, ts, per_tile, m):
        """the callable running ``way``'s tiles"""
        R, C = R_C
        first = []  # calls before the tiles'
        if not (per_tile or rounded):
            first.append((L.gt_f32_bf16, (xp, ap, x.size)))
        # (A's columns to round or None, dequantize, its args, GEMM, move and its args)
        steps = []
        if layout == "swapped":
            more, steps = swapped_tiles(R)
            first += more
        for (r0, n, c0, nc), (kk, nn, tb, a_ptr, dst, ldc, acc, lda), into in ts or ():
            if layout == "blocked":
                deq = (L.gt_deq_tile_vnni, (tid, wp, rb, r0, n, c0, nc, int(not transposed),
                                            tp))
            else:
                deq = (L.gt_deq_tile_bf16, (tid, wp, rb, None, r0, n, c0, nc, tp, nc))
            gemm = _row_blocks(dnnl, T, m, kk, nn, tb, a_ptr, tp, dst, ldc, acc, lda,
                               layout == "blocked")
            cols = (xp + 4 * r0, x.shape[1], T, n, ap) if per_tile else None
            move = (L.gt_copy_cols, (pp, T, into[0], into[1], width)) if into else None
            steps.append((cols, *deq, gemm, move))
        convert_block = L.gt_f32_bf16_block

        def run(split=None):
            """``split``: a dict whose "dequantize" and "GEMM" entries get the seconds of
            each (a profile's; None in a replay)"""
            for f, args in first:
                f(*args)
            for cols, deq, args, gemm, move in steps:
                if cols is not None:
                    convert_block(*cols)
                _tile(split, v.op, deq, args, gemm)
                if move is not None:
                    move[0](*move[1])
        run.label = f"{v.op} bf16 [{T}, {x.shape[1]}] x {qtype}[{rows}, {k}]"
        run.layout, run.precision, run.tile, run.rounded = layout, "bf16", (R, C), rounded
        # kept alive with run, which holds their addresses
        run.buffers = x, w, out, act16, tile16, prod32
        return run

    def bind_fused():
        """the callable running the product as one fused call (``gt_qgemm_bf16_fused``:
        each core dequantizes its own part of W a chunk at a time and multiplies it
        while it is in its cache, with a GEMM of ours; forward as y^T = W x^T, x16^T
        packed once past x16 as in the swapped way).  In a profile's split the cores'
        mean time dequantizing counts as "dequantize", the rest as "GEMM"."""
        first = [] if rounded else [(L.gt_f32_bf16, (xp, ap, x.size))]
        xt = None if transposed else ap + 2 * T * k
        if xt is not None:
            first.append((L.gt_rows_vnni, (ap, T, k, xt)))
        args = (tid, wp, rb, rows, k, int(transposed), ap, xt, T, op, tp, tile16.size)
        fused = L.gt_qgemm_bf16_fused

        def run(split=None):
            for f, f_args in first:
                f(*f_args)
            if split is None:
                _check(fused(*args, None), v.op)
                return
            deq, t0 = ctypes.c_double(0.0), time.perf_counter()
            _check(fused(*args, ctypes.byref(deq)), v.op)
            split["dequantize"] += deq.value
            split["GEMM"] += time.perf_counter() - t0 - deq.value
        run.label = f"{v.op} bf16 [{T}, {x.shape[1]}] x {qtype}[{rows}, {k}]"
        run.layout, run.precision, run.tile, run.rounded = "fused", "bf16", None, rounded
        run.buffers = x, w, out, act16, tile16
        return run

    def bind_direct():
        """the callable running the product as one oneDNN GEMM on W where it lies: a BF16
        W's bits are its tiles' (its rows contiguous), so nothing is dequantized or
        copied, and the GEMM streams W from memory while it computes."""
        first = [] if rounded else [(L.gt_f32_bf16, (xp, ap, x.size))]
        if transposed:  # z [T, k] = g16 [T, rows] @ W [rows, k]
            gemm = dnnl.bind_ptrs(T, rows, k, False, ap, wp, op)
        else:  # y [T, rows] = x16 [T, k] @ W^T
            gemm = dnnl.bind_ptrs(T, k, rows, True, ap, wp, op)

        def run(split=None):
            for f, f_args in first:
                f(*f_args)
            t0 = time.perf_counter() if split is not None else 0.0
            gemm()
            if split is not None:
                split["GEMM"] += time.perf_counter() - t0
        run.label = f"{v.op} bf16 [{T}, {x.shape[1]}] x {qtype}[{rows}, {k}]"
        run.layout, run.precision, run.tile, run.rounded = "direct", "bf16", None, rounded
        run.buffers = x, w, out, act16
        return run

    # each way bound on its first call: only where no decision is cached are they all
    # timed (an 8B step's 447 products bound four ways took a second of its first step)
    runs = {}
    for elems in bf16_tile_sizes():  # largest first: the default
        for layout in ("blocked", "plain", "swapped"):
            w = way(layout, elems)
            if w is not None:
                name = f"{layout} {_size_name(elems)}"
                if w[-1] < T:  # a new way: timed anew where a decision was cached
                    name += f" by {w[-1]} rows"
                runs[name] = _BoundOnFirstCall(functools.partial(bind, *w))
    need = L.gt_fused_scratch(tid, rows, k, T, int(transposed))
    if need and tile16.size >= need:
        runs["fused"] = _BoundOnFirstCall(bind_fused)
    if qtype == "BF16" and rb == 2 * k:
        runs["direct"] = _BoundOnFirstCall(bind_direct)
    name = next(iter(runs)) if choose is None else choose(f"{v.op} {qtype}", (T, rows, k),
                                                            runs)
    return runs[name].bound()


# --- int8 compute ---------------------------------------------------------------------
# An int8 GEMM sums products of at most 255 * 127 in int32 (the activation as u8, q + 128,
# in the blocked layout): at most this many terms
INT8_MAX_TERMS = (2**31 - 1) // (255 * 127)
# the forward's balance of activation and weight ranges, c_j = max|x_j|^a / max|W_j|^(1-a)
# (SmoothQuant's alpha; 0: none): on SmolLM2, 0.5 gave the closest gradients of 0, 0.3,
# 0.4, 0.5, 0.7 and 0.85 (docs/benchmarks.md)
SMOOTH_ALPHA = 0.5


def int8_eligible(v):
    """Whether block op ``v`` runs as int8 GEMMs under int8 compute: a bf16-eligible
    product, not marked ``precise`` (the LM head), whose sums (over ``k`` forward, W's
    rows backward) fit int32."""
    a = v.attrs
    terms = a["k"] if v.op == "qmatmul" else a["rows"]
    return bf16_eligible(v) and not a.get("precise") and terms <= INT8_MAX_TERMS


def int8_scratch_elems(ops):
    """``(activation, tile, scales, product)``: the int8 values of the activation (twice:
    room for a tile's columns of it made contiguous) and of one tile, the float32 scales
    (a row's per activation row, a row's or a column's per W row or column; as many
    int32 column sums), and the int32 values of a tile's product written as a block of
    columns (see ``lower_int8``)."""
    _, tile, prod = bf16_scratch_elems(ops)  # (its activation has room for a swapped way)
    act = max(v.inputs[0].size for v in ops)
    scales = max(max(v.inputs[0].shape[0], v.attrs["rows"], v.attrs["k"]) for v in ops)
    return 2 * act, tile, scales, prod


def col_scales(w, qtype, rows, k):
    """``(scale, inverse)``: float32 ``[k]``, each column of the block matrix ``w``'s
    largest magnitude / 127, and 127 / it (0 for a column of zeros): the scales of W's
    int8 copy as the right-hand operand of ``g @ W``."""
    mx = np.empty(k, np.float32)
    w = np.ascontiguousarray(w)
    _check(lib().gt_col_absmax(_type_id(qtype), w.ctypes.data, w.strides[0], rows, k,
                               mx.ctypes.data), "column maxima")
    inv = np.zeros(k, np.float32)
    np.divide(np.float32(127), mx, out=inv, where=mx > 0)
    return mx / np.float32(127), inv


def lower_int8(v, out, ins, dnnl, act8, tile8, ascale, wscale, csum, prod32, columns,
               choose=None):
    """A callable computing ``qmatmul`` / ``qmatmul_t`` ``v`` into ``out`` with int8
    inputs, int32 sums and float32 scales (W8A8: ``int8_eligible`` ops only).  The
    activation's rows are quantized into ``act8`` (a scale per row into ``ascale``),
    then for each tile (``bf16_tile_shape``'s), the blocks are dequantized and
    quantized into ``tile8`` and one oneDNN GEMM writes (or adds to) int32 sums, which
    ``gt_s32_scale`` multiplies by both scales into their block of ``out``:
      qmatmul    y[:, r0:r0+R] = x8 @ tile[R, k]^T, each row of W its own scale
                 (``wscale``; the sum runs along the row), after x's columns are divided
                 and W's multiplied by c_j (``SMOOTH_ALPHA``: SmoothQuant's balance of
                 the two ranges, taken afresh on each call)
      qmatmul_t  z[:, c0:c0+C] = g8 @ tile[rows, C], or
                 z (+)= g8[:, r0:r0+R] @ tile[R, k] summed in int32 over the tiles
                 in place in ``out``, then scaled once;
                 each column of W its own scale (the sum runs along the column), the
                 same for every tile: ``columns()`` gives ``col_scales``' pair.
    The tiles are plain rows (oneDNN reorders them on every call) or, where oneDNN's
    kernel keeps its weights in the layout ``gt_deq_tile_s8_vnni`` writes, already in it
    with the activation as u8 (q + 128; the tiles' column sums, into ``csum``, take the
    offset off): ``choose`` as in ``lower_bf16``.  The int32 sums of a block of columns
    go to ``prod32`` (contiguous rows, as in ``lower_bf16``), else straight into
    ``out``'s bytes."""
    qtype, rows, k, x, w, T, transposed = _gemm_operands(v, out, ins)
    R, C = bf16_tile_shape(transposed, qtype, rows, k)
    L, tid, wp, rb = lib(), _type_id(qtype), w.ctypes.data, w.strides[0]
    xp, ap, tp, op = x.ctypes.data, act8.ctypes.data, tile8.ctypes.data, out.ctypes.data
    sa, sw, cs = ascale.ctypes.data, wscale.ctypes.data, csum.ctypes.data
    width, pp = out.shape[1], prod32.ctypes.data if prod32 is not None else None
    cols = x.shape[1]
    # per tile: W's rows [r0, r0 + n) and columns [c0, c0 + nc) (nc: the plain tile's
    # row length); its GEMM (K, N, tb, A, output, ldc, acc, lda); None or the block of
    # out its sums are scaled into (sums, ldc, rows, columns, first column, into, ldo)
    steps = []
    for r0, n, c0, nc, K, N, tb, acc, j0 in _tiles(transposed, rows, k, R, C):
        if j0 is None:
            steps.append(((r0, n, c0, nc), (K, N, tb, ap + r0, op, k, acc, rows), None))
            continue
        dst, ldc = (op, width) if N == width else (pp, N)
        steps.append(((r0, n, c0, nc), (K, N, tb, ap, dst, ldc, acc, None),
                      (dst, ldc, T, N, j0, op + 4 * j0, width)))
    smooth = None if transposed else np.empty((3, k), np.float32)  # x's maxima, 1 / c, c

    def smoothing(s):
        """(1 / c, c) addresses, or (None, None) (no smoothing: backward, or alpha 0)"""
        if smooth is None or not SMOOTH_ALPHA:
            return None, None
        ax, rx, c = smooth
        L.gt_absmax_cols(xp, cols, T, cols, ax.ctypes.data)
        aw = s * np.float32(127)
        c.fill(1)
        np.divide(ax ** SMOOTH_ALPHA, aw ** (1 - SMOOTH_ALPHA), out=c,
                  where=(ax > 0) & (aw > 0))
        np.divide(1, c, out=rx)
        return rx.ctypes.data, c.ctypes.data

    def bind(blocked):
        """the callable running the tiles plain or blocked (None where oneDNN's kernel
        keeps its int8 weights in another layout than gt_deq_tile_s8_vnni writes)"""
        # oneDNN keeps the blocked weights only with a contiguous A: each tile of a
        # whole-rows qmatmul_t copies its columns of g8 into one
        per_tile = blocked and transposed and C == k
        gs = [g for _, g, _ in steps]
        if per_tile:  # the columns go after g8 in act8 (int8_scratch_elems)
            g8 = act8.view(np.uint8)[:T * rows].reshape(T, rows)
            a_tile = act8.view(np.uint8)[T * rows:T * (rows + R)]
            moves = [(a_tile[:T * n].reshape(T, n), g8[:, r0:r0 + n])
                     for (r0, n, *_), _, _ in steps]
            gs = [(kk, n, tb, a_tile.ctypes.data, dst, ldc, acc, None)
                  for kk, n, tb, _, dst, ldc, acc, _ in gs]
        try:
            if blocked and not all(dnnl.primitive(T, kk, n, False, ldc, acc, lda, vnni=True,
                                                  s8=True)
                                   for kk, n, _tb, _a, _o, ldc, acc, lda in gs):
                return None
        except DnnlError:  # no u8 x s8 matmul of this kind here: plain rows only
            return None
        gemms = [dnnl.bind_ptrs(T, kk, n, tb and not blocked, a_ptr, tp, dst, ldc, acc, lda,
                                vnni=blocked, s8=True)
                 for kk, n, tb, a_ptr, dst, ldc, acc, lda in gs]
        quant, scale = L.gt_quant_rows_s8, L.gt_s32_scale
        deq = L.gt_deq_tile_s8_vnni if blocked else L.gt_deq_tile_s8
        comp = cs if blocked else None

        def run(split=None):
            """``split``: as ``lower_bf16``'s run"""
            s, inv = columns()
            scales, invp = s.ctypes.data, inv.ctypes.data
            cx, cw = smoothing(s)
            _check(quant(xp, cols, T, cols, cx, int(blocked), ap, sa), v.op)
            if blocked:
                csum.fill(0)
            for i, (((r0, n, c0, nc), _, into), gemm) in enumerate(zip(steps, gemms)):
                if per_tile:
                    np.copyto(*moves[i])
                if blocked and transposed:
                    args = (tid, wp, rb, r0, n, c0, nc, 0, invp + 4 * c0, None, tp, None,
                            cs + 4 * c0)
                elif blocked:
                    args = (tid, wp, rb, r0, n, c0, nc, 1, None, cw, tp, sw + 4 * r0,
                            cs + 4 * r0)
                elif transposed:
                    args = (tid, wp, rb, r0, n, c0, nc, invp + 4 * c0, None, tp, nc, None)
                else:
                    args = (tid, wp, rb, r0, n, c0, nc, None, cw, tp, nc, sw + 4 * r0)
                _tile(split, v.op, deq, args, gemm)
                if into is not None:
                    src, ld, m, nn, j0, dst, ldo_ = into
                    scale(src, ld, m, nn, sa, (scales if transposed else sw) + 4 * j0,
                          comp + 4 * j0 if comp else None, dst, ldo_)
            if transposed and C == k:
                scale(op, k, T, k, sa, scales, comp, op, k)
        run.label = f"{v.op} int8 [{T}, {x.shape[1]}] x {qtype}[{rows}, {k}]"
        run.blocked, run.precision = blocked, "int8"
        run.buffers = x, w, out, act8, tile8, ascale, wscale, csum, prod32  # as lower_bf16
        return run

    blocked, plain = bind(True), bind(False)
    if blocked is None:
        return plain
    if choose is None or choose(f"{v.op} {qtype} int8", (T, rows, k), blocked, plain):
        return blocked
    return plain
