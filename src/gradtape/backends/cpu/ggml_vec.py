"""Matrix-vector products and row lookups straight from ggml blocks, and the one-call
LLaMA decode step built on them (``csrc/ggml_vec.c``, ``csrc/llama_decode.c``).

A block matrix here is ``(qtype, data)``: a ggml type name and a ``uint8`` array
``[rows, row_bytes]`` (a view of a memory-mapped GGUF file: never copied or expanded);
its logical shape is ``[rows, k]`` (rows = output units).  ``matvec`` computes
``x [T, k] @ deq(W).T`` for ``T <= 4`` rows with the weights dequantized in registers
exactly as ``gguf.quants.dequantize`` does it and float32 accumulation, split over
threads; ``matmul`` does the same for many rows (prefill) from panels of dequantized
weight rows.  ``matvec_q8`` is the decode step's other way (``csrc/q8_dots.c``): x
quantized to 8 bits once (``quantize_q8_0``, ``quantize_q8_k``: llama.cpp's rounding) and
integer dots with the blocks of the types in ``Q8_TYPES``; ``matmul_q8`` the same scheme
over many rows as the prefill runs it, integer GEMMs for ``gemm_q8_types()``: on AMX tiles
(``csrc/q8_amx.c``, where ``amx_int8()``), else with AVX2 for the K-quants and (at the
AVX2 class) the 32-element types, and for IQ2_XXS to IQ4_XS everywhere
(``csrc/q8_gemm.c``).  This module does not run training
GEMMs (the cpu backend's tiled GEMM does) or know the model graph (the decode engine's
wrapper in ``infer/`` wires the decode step).

The C sources (they include ``csrc/gt_prelude.h`` for its vectorizable ``gt_expf``; the
block dequantization, ``csrc/ggml_blocks.h``, is shared with the training GEMMs'
``qgemm``) are compiled once with OpenMP by ``toolchain.build_csrc`` and cached; without a
C compiler ``available()`` is False and callers use the NumPy reference.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from ... import settings
from ...blocks import BLOCK_TYPES, F32
from . import toolchain

SOURCES = ("ggml_vec.c", "q8_dots.c", "q8_amx.c", "q8_gemm.c", "llama_decode.c")

# ggml type name -> (ggml id, elements per block, bytes per block), from the one table
QTYPES = {t.name: (t.id, t.block, t.nbytes) for t in (*BLOCK_TYPES.values(), F32)}
PANEL = 16  # weight rows a matmul dequantizes at a time (csrc/ggml_vec.h's GV_PANEL)
TILE_EXTRA = 2048  # and the floats its tile holds beyond PANEL * k (GV_TILE)
MAX_ROWS = 4  # rows of x per matvec call (more rows: a GEMM)

_LIBS = {}  # the build flags (the instruction-set class in force) -> the library
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


MAX_THREADS = 16  # a decode step is memory-bound: more threads only add barrier time


def threads() -> int:
    """Threads for the kernels: $GRADTAPE_THREADS, else the CPUs this process may use
    (at most MAX_THREADS)."""
    asked = settings.integer("GRADTAPE_THREADS", minimum=-(1 << 31))
    if asked is not None:
        return max(1, asked)
    return min(settings.cpus(), MAX_THREADS)


def lib():
    """The compiled library for the instruction-set class in force (``toolchain.isa``;
    built on first use, cached on disk by source hash)."""
    plain = toolchain.isa_flags()
    if plain not in _LIBS:
        # OpenMP where the compiler's probe says it has it (else the same code on one
        # thread); an error in the sources themselves is raised, not built around
        path, _ = toolchain.build_csrc(SOURCES, flags=toolchain.threads_flags(plain),
                                       prefix="ggml_vec")
        # libgomp reads its wait policy once, when first loaded: if this library loads it
        # first (generation before training, as in the demo), its threads must sleep
        # too, or they spin on the cores the GEMMs' OpenBLAS threads need (a training
        # step then takes several times as long)
        toolchain.quiet_openmp()
        so = ctypes.CDLL(str(path))
        so.gv_lanes.restype = _i64
        so.gv_block_elems.restype = _i64
        so.gv_block_elems.argtypes = [_i64]
        so.gv_matvec.restype = None
        so.gv_matvec.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64]
        so.gv_take_rows.restype = None
        so.gv_take_rows.argtypes = [_i64, _ptr, _i64, _i64, _ptr, _i64, _ptr]
        so.gv_matmul.restype = None
        so.gv_matmul.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr]
        so.gd_scratch_floats.restype = _i64
        so.gv_packed.restype = ctypes.c_int
        so.gv_packed.argtypes = []
        so.gd_prefill_floats.restype = _i64
        so.gd_prefill_floats.argtypes = [_ptr, _i64]
        so.gd_prefill.restype = None
        so.gd_prefill.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr]
        so.gd_step.restype = None
        so.gd_step.argtypes = [_ptr, _i64, _i64, _ptr]
        so.gd_halves.restype = None
        so.gd_halves.argtypes = [_ptr, _i64, _ptr]
        so.gq_path.restype = so.gq_bytes.restype = _i64
        so.gq_bytes.argtypes = [_i64]
        so.gq_q8_0.restype = so.gq_q8_k.restype = so.gq_matvec.restype = None
        so.gq_q8_0.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr]
        so.gq_q8_k.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr]
        so.gq_matvec.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr]
        so.gq_amx_ready.restype = so.gq_amx_build.restype = ctypes.c_int
        so.gq_amx_ready.argtypes = so.gq_amx_build.argtypes = []
        so.gq_gemm_type.restype = ctypes.c_int
        so.gq_gemm_type.argtypes = [_i64]
        so.gq_gemm_scratch_bytes.restype = so.gq_gemm_buf_bytes.restype = _i64
        so.gq_gemm_scratch_bytes.argtypes = [_i64]
        so.gq_gemm_buf_bytes.argtypes = [_i64, _i64]
        so.gq_gemm_matmul.restype = ctypes.c_int
        so.gq_gemm_matmul.argtypes = [_i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64,
                                      _ptr, _ptr]
        _LIBS[plain] = so
    return _LIBS[plain]


def available() -> bool:
    try:
        lib()
    except (toolchain.CompilerMissing, RuntimeError, OSError):
        return False
    return True


def row_elems(qtype: str, data: np.ndarray) -> int:
    """``k``: the logical row length of blocks ``data [rows, row_bytes]``."""
    if qtype not in QTYPES:
        raise ValueError(f"ggml_vec: type {qtype} is not supported (supported: "
                         f"{', '.join(QTYPES)})")
    _, qk, bs = QTYPES[qtype]
    if data.ndim != 2 or data.dtype != np.uint8 or data.shape[1] % bs:
        raise ValueError(f"ggml_vec: {qtype} blocks must be uint8 [rows, n*{bs}], got "
                         f"{data.dtype} {list(data.shape)}")
    return data.shape[1] // bs * qk


def _check(qtype, data):
    k = row_elems(qtype, data)
    if not data.flags.c_contiguous:
        raise ValueError("ggml_vec: block rows must be C-contiguous")
    min_k = 16 if QTYPES[qtype][1] == 1 else QTYPES[qtype][1]
    if k % min_k:
        raise ValueError(f"ggml_vec: {qtype} rows of {k} elements: the kernel needs a "
                         f"multiple of {min_k}")
    return k


def matvec(qtype: str, data: np.ndarray, x: np.ndarray, out=None, nthreads=None):
    """``x [T, k] @ deq(W).T -> [T, rows]`` (float32), ``W`` = ``(qtype, data)``."""
    k = _check(qtype, data)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"ggml_vec.matvec: x{list(x.shape)} against W[{data.shape[0]}, {k}]: "
                         f"need [T <= {MAX_ROWS}, {k}]")
    rows, T = data.shape[0], x.shape[0]
    if out is None:
        out = np.empty((T, rows), np.float32)
    lib().gv_matvec(QTYPES[qtype][0], data.ctypes.data, rows, k, data.shape[1],
                    x.ctypes.data, T, out.ctypes.data, nthreads or threads())
    return out


def matvec_call(qtype: str, w: np.ndarray, rows: int, k: int, x: np.ndarray,
                out: np.ndarray):
    """A zero-argument callable computing ``out[T, rows] = x[T, k] @ deq(w).T`` in place
    (the cpu backend's ``qmatmul`` for ``T <= MAX_ROWS``); ``w [rows, row_bytes]`` may have
    a row stride larger than its row (a view); x and out must be C-contiguous float32."""
    if not (x.dtype == out.dtype == np.float32 and x.flags.c_contiguous
            and out.flags.c_contiguous and w.strides[1] == 1 and 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError("ggml_vec.matvec_call: needs C-contiguous float32 x [T <= 4, k] "
                         "and out, and contiguous block rows")
    if k % (16 if QTYPES[qtype][1] == 1 else QTYPES[qtype][1]):
        raise ValueError(f"ggml_vec.matvec_call: {qtype} rows of {k} elements")
    return functools.partial(lib().gv_matvec, QTYPES[qtype][0], w.ctypes.data, rows, k,
                             w.strides[0], x.ctypes.data, x.shape[0], out.ctypes.data,
                             threads())


def _rows_operand(what, qtype, data, x):
    """``(k, x)``: W's row length and ``x [T, k]`` as contiguous float32 rows, checked."""
    k = _check(qtype, data)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"ggml_vec.{what}: x{list(x.shape)} against W[{data.shape[0]}, {k}]")
    return k, x


def matmul(qtype: str, data: np.ndarray, x: np.ndarray, nthreads=None):
    """``x [T, k] @ deq(W).T -> [T, rows]`` for any T (prefill): PANEL weight rows are
    dequantized at a time and used by every row of x; float32 accumulation."""
    k, x = _rows_operand("matmul", qtype, data, x)
    nt = nthreads or threads()
    out = np.empty((x.shape[0], data.shape[0]), np.float32)
    tile = np.empty(nt * (PANEL * k + TILE_EXTRA), np.float32)
    lib().gv_matmul(QTYPES[qtype][0], data.ctypes.data, data.shape[0], k, data.shape[1],
                    x.ctypes.data, x.shape[0], out.ctypes.data, nt, tile.ctypes.data)
    return out


def take_rows(qtype: str, data: np.ndarray, ids) -> np.ndarray:
    """Rows ``ids`` of a block table, dequantized: ``[len(ids), k]`` float32."""
    k = _check(qtype, data)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= data.shape[0]):
        raise ValueError(f"ggml_vec.take_rows: ids out of range [0, {data.shape[0]})")
    out = np.empty((ids.size, k), np.float32)
    lib().gv_take_rows(QTYPES[qtype][0], data.ctypes.data, k, data.shape[1],
                       ids.ctypes.data, ids.size, out.ctypes.data)
    return out


# the types the prefill's integer GEMM on AMX tiles takes (csrc/q8_amx.c), each against
# the row form of Q8_TYPES; without AMX the AVX2 GEMM takes the K-quants, and the IQ
# types everywhere (csrc/q8_gemm.c)
AMX_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
IQ_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")
GEMM_TYPES = AMX_TYPES + ("Q2_K", "Q3_K", "IQ4_NL") + IQ_TYPES  # the types some GEMM takes


def amx_int8() -> bool:
    """Whether the prefill's products with ``AMX_TYPES`` weights can run as integer GEMMs
    on AMX tiles here: a build of the class in force with AMX-INT8 (``native`` on such a
    CPU) and the tile state granted by Linux."""
    return available() and bool(lib().gq_amx_ready())


def packed_gemm() -> bool:
    """Whether the prefill's float32 GEMM runs AVX2's packed kernel here
    (``csrc/ggml_vec.c``): a panel of weights packed once per call and used by every row."""
    return available() and bool(lib().gv_packed())


def gemm_q8_types() -> tuple:
    """The weight types whose prefill products run as integer GEMMs against 8-bit rows
    here (with the q8 decode dots): ``AMX_TYPES`` where ``amx_int8()``, else the K-quants
    (Q2_K to Q6_K) wherever the build has AVX2 (``csrc/q8_gemm.c``) and the 32-element
    types (Q4_0 to Q8_0, IQ4_NL) at the AVX2 class (AVX-512 keeps float32 rows for them);
    with AVX2, AMX or not, IQ2_XXS to IQ4_XS too; none without AVX2."""
    if not available():
        return ()
    so = lib()
    return tuple(t for t in GEMM_TYPES if so.gq_gemm_type(QTYPES[t][0]))


def matmul_q8(qtype: str, data: np.ndarray, x: np.ndarray, nthreads=None):
    """``x [T, k] @ deq(W).T -> [T, rows]`` with each row of x quantized to 8 bits (the
    type's form in ``Q8_TYPES``) and integer block dots over many rows at once (on AMX
    tiles, or with AVX2): the decode step's q8 scheme (``matvec_q8``) as the prefill runs
    it, for the types in ``gemm_q8_types()``."""
    if qtype not in GEMM_TYPES:
        raise ValueError(f"ggml_vec.matmul_q8: {qtype} has no integer GEMM (those that may: "
                         f"{', '.join(GEMM_TYPES)})")
    if qtype not in gemm_q8_types():
        raise RuntimeError(f"ggml_vec.matmul_q8: no integer GEMM for {qtype} in this build "
                           f"or process (here: {', '.join(gemm_q8_types()) or 'none'})")
    k, x = _rows_operand("matmul_q8", qtype, data, x)
    nt = nthreads or threads()
    out = np.empty((x.shape[0], data.shape[0]), np.float32)
    so = lib()
    buf = np.empty(so.gq_gemm_buf_bytes(x.shape[0], k), np.uint8)
    scratch = np.empty(nt * (so.gq_gemm_scratch_bytes(k) + 64), np.uint8)
    so.gq_gemm_matmul(QTYPES[qtype][0], data.ctypes.data, data.shape[0], k, data.shape[1],
                      x.ctypes.data, x.shape[0], out.ctypes.data, nt, buf.ctypes.data,
                      scratch.ctypes.data)
    return out


# the types with integer dots against an 8-bit activation row (csrc/q8_dots.c), and the
# row form each reads: Q8_0 blocks of 32 (with Q8_1's sums) or Q8_K blocks of 256
Q8_TYPES = {"Q4_0": "Q8_0", "Q4_1": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q8_0": "Q8_0",
            "IQ4_NL": "Q8_0",
            "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
            "IQ4_XS": "Q8_K", "IQ2_XXS": "Q8_K", "IQ2_XS": "Q8_K", "IQ2_S": "Q8_K",
            "IQ3_XXS": "Q8_K", "IQ3_S": "Q8_K"}


def _row(x, block):
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size % block:
        raise ValueError(f"ggml_vec: a row of a multiple of {block} floats, got "
                         f"{list(x.shape)}")
    return x


def quantize_q8_0(x):
    """``(q int8 [k], d [k/32], s [k/32])``: x in Q8_0 blocks as llama.cpp's x86
    ``quantize_row_q8_1`` rounds them (d and s the float32 values of their f16 stores)."""
    x = _row(x, 32)
    q = np.empty(x.size, np.int8)
    d, s = np.empty(x.size // 32, np.float32), np.empty(x.size // 32, np.float32)
    z = np.empty(x.size // 4, np.int32)  # Q5_0's offset term, not returned
    lib().gq_q8_0(x.ctypes.data, x.size, q.ctypes.data, d.ctypes.data, s.ctypes.data,
                  z.ctypes.data)
    return q, d, s


def quantize_q8_k(x):
    """``(q int8 [k], d [k/256], bsums int16 [k/16])``: x in Q8_K blocks
    (``quantize_row_q8_K_ref``)."""
    x = _row(x, 256)
    q = np.empty(x.size, np.int8)
    d, bs = np.empty(x.size // 256, np.float32), np.empty(x.size // 16, np.int16)
    lib().gq_q8_k(x.ctypes.data, x.size, q.ctypes.data, d.ctypes.data, bs.ctypes.data)
    return q, d, bs


def matvec_q8(qtype: str, data: np.ndarray, x: np.ndarray, nthreads=None):
    """``deq(W) @ x -> [rows]`` (float32) with x quantized to 8 bits once and integer
    block dots (``Q8_TYPES``), as the decode step runs it by default."""
    if qtype not in Q8_TYPES:
        raise ValueError(f"ggml_vec.matvec_q8: {qtype} has no integer dots (those that "
                         f"do: {', '.join(Q8_TYPES)})")
    k = _check(qtype, data)
    x = _row(x, QTYPES[qtype][1])
    if x.size != k:
        raise ValueError(f"ggml_vec.matvec_q8: x[{x.size}] against W[{data.shape[0]}, {k}]")
    out = np.empty(data.shape[0], np.float32)
    buf = np.empty(lib().gq_bytes(k), np.uint8)
    lib().gq_matvec(QTYPES[qtype][0], data.ctypes.data, data.shape[0], k, data.shape[1],
                    x.ctypes.data, out.ctypes.data, nthreads or threads(), buf.ctypes.data)
    return out
