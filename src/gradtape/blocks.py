"""Frozen weights in their stored type: the ggml type table and ``BlockMatrix``.

A ``BlockMatrix`` is a frozen ``[rows, k]`` weight (ggml / torch orientation: ``rows``
output units, ``k`` input features) kept as the bytes it is stored in: ``data`` is a
``uint8 [rows, row_bytes]`` array, usually a view of a memory-mapped file, where every
row is a whole number of blocks of its ``qtype`` (Q4_0 ... Q6_K, IQ2_XXS ... IQ4_XS, F16,
BF16).  It is never expanded to a float copy as a whole; ``dequantize`` (the NumPy
reference, llama.cpp's own ``gguf.quants.dequantize``, bit for bit) makes float32 rows
one weight or a few rows at a time.  The tape takes it as a uint8 const (``Tape.const``)
that only the block primitives (``ops.qmatmul``, ``qmatmul_t``, ``qtake_rows``) read.

The table of ggml types lives here, in the core, rather than in ``formats``: the
primitives' shape rules need it and the core never imports ``formats`` (the GGUF reader
imports it from here).  This module reads no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GGMLType:
    name: str
    id: int  # ggml's enum value (GGUF tensor type)
    block: int  # elements per block
    nbytes: int  # bytes per block


# The ggml types a BlockMatrix holds (ids and block layouts as in ggml.h / ggml-common.h).
# Together with F32 they make up the Q2_K, Q3_K_S/M/L, Q4_K_M, Q5_K_M, Q6_K, Q8_0 and
# IQ2 / IQ3 / IQ4 files people use (not the IQ1 and ternary types).
BLOCK_TYPES = {t.name: t for t in (
    GGMLType("F16", 1, 1, 2),
    GGMLType("Q4_0", 2, 32, 2 + 16),            # d f16, 32 4-bit quants
    GGMLType("Q4_1", 3, 32, 2 + 2 + 16),        # d, m f16, 32 4-bit quants
    GGMLType("Q5_0", 6, 32, 2 + 4 + 16),        # d, 32 high bits, 32 low nibbles
    GGMLType("Q5_1", 7, 32, 2 + 2 + 4 + 16),
    GGMLType("Q8_0", 8, 32, 2 + 32),            # d, 32 int8
    GGMLType("Q4_K", 12, 256, 2 + 2 + 12 + 128),  # d, dmin, 8 x 6-bit (scale, min), nibbles
    GGMLType("Q5_K", 13, 256, 2 + 2 + 12 + 32 + 128),
    GGMLType("Q6_K", 14, 256, 128 + 64 + 16 + 2),  # low nibbles, high 2 bits, int8 scales, d
    GGMLType("Q2_K", 10, 256, 16 + 64 + 2 + 2),  # 4-bit (scale, min), 2-bit quants, d, dmin
    GGMLType("Q3_K", 11, 256, 32 + 64 + 12 + 2),  # high bits, 2-bit quants, 6-bit scales, d
    GGMLType("IQ4_NL", 20, 32, 2 + 16),         # d, 32 4-bit indices into a value table
    GGMLType("IQ4_XS", 23, 256, 2 + 2 + 4 + 128),  # d, 8 x 6-bit scales, 4-bit indices
    GGMLType("IQ2_XXS", 16, 256, 2 + 64),       # d, per 32: 4 grid rows, signs, scale
    GGMLType("IQ2_XS", 17, 256, 2 + 64 + 8),    # d, 32 x (9-bit row, 7-bit signs), scales
    GGMLType("IQ2_S", 22, 256, 2 + 32 + 32 + 8 + 8),  # d, rows, signs, high bits, scales
    GGMLType("IQ3_XXS", 18, 256, 2 + 64 + 32),  # d, 64 grid rows, per 32: signs, scale
    GGMLType("IQ3_S", 21, 256, 2 + 64 + 8 + 32 + 4),  # d, rows, high bits, signs, scales
    GGMLType("BF16", 30, 1, 2),
)}
F32 = GGMLType("F32", 0, 1, 4)
BY_ID = {t.id: t for t in (*BLOCK_TYPES.values(), F32)}


def ggml_type(type_id: int) -> GGMLType | None:
    """The layout of ggml type ``type_id``: ours for the types we run and F32, gguf's
    table (``GGML_QUANT_SIZES``) for every other type a file may hold; None if unknown."""
    t = BY_ID.get(type_id)
    if t is not None:
        return t
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        q = GGMLQuantizationType(type_id)
        block, nbytes = GGML_QUANT_SIZES[q]
    except (ValueError, KeyError):
        return None
    return GGMLType(q.name, int(type_id), int(block), int(nbytes))


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` elements; ``k`` must be a whole number of blocks."""
    t = BLOCK_TYPES[qtype]
    if k % t.block:
        raise ValueError(f"{qtype}: a row of {k} elements is not a whole number of "
                         f"{t.block}-element blocks")
    return k // t.block * t.nbytes


@dataclass(frozen=True, eq=False)
class BlockMatrix:
    """A frozen ``[rows, k]`` weight kept as its stored blocks (see the module docstring).

    ``data``: ``uint8 [rows, row_bytes(qtype, k)]`` with C-contiguous rows (a view of a
    memory map, or of a copy of it whose rows were permuted)."""

    qtype: str
    shape: tuple  # (rows, k), logical
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"BlockMatrix: ggml type {self.qtype!r} is not one we run "
                             f"({', '.join(BLOCK_TYPES)})")
        rows, k = (int(d) for d in self.shape)
        object.__setattr__(self, "shape", (rows, k))
        want = (rows, row_bytes(self.qtype, k))
        d = self.data
        if not isinstance(d, np.ndarray) or d.dtype != np.uint8 or d.shape != want:
            raise ValueError(f"BlockMatrix {self.qtype} [{rows}, {k}]: data must be uint8 "
                             f"{list(want)}, got {getattr(d, 'dtype', type(d).__name__)} "
                             f"{list(getattr(d, 'shape', ()))}")
        if d.strides[1] != 1 or (rows > 1 and d.strides[0] < want[1]):
            raise ValueError(f"BlockMatrix {self.qtype} [{rows}, {k}]: rows must be "
                             "contiguous byte runs")

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0]) * int(self.data.shape[1])

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])

    def dequantize(self, rows=None) -> np.ndarray:
        """Float32 ``[n, k]`` of rows ``rows`` (an index array or slice; all by default):
        the NumPy reference, ``gguf.quants.dequantize``."""
        return dequantize(self.data if rows is None else self.data[rows], self.qtype)

    def release(self):
        """Drop this process's resident pages of ``data`` where it is a view of a memory
        map (``MADV_DONTNEED``; the file's page cache keeps them, a later read maps them
        again): for blocks copied elsewhere (full fine-tuning's float32 params) that stop
        counting in the resident set.  Best effort: a no-op for a copy or where the
        platform cannot."""
        import mmap

        base, top = self.data, None
        while base is not None and not isinstance(base, mmap.mmap):
            top, base = base, getattr(base, "base", None)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if base is None or advice is None or not isinstance(top, np.ndarray):
            return
        page = mmap.PAGESIZE
        start = self.data.ctypes.data - top.ctypes.data  # top: the whole map's array
        lo = -(-start // page) * page
        hi = (start + self.data.nbytes) // page * page
        if hi > lo:
            try:
                base.madvise(advice, lo, hi - lo)
            except (OSError, ValueError):
                pass

    def __repr__(self):
        return f"BlockMatrix({self.qtype} {list(self.shape)}, {self.nbytes} bytes)"


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """Float32 ``[n, k]`` from uint8 rows ``data [n, row_bytes]`` of ``qtype`` (the
    reference: llama.cpp's ``gguf.quants.dequantize``)."""
    from gguf import GGMLQuantizationType, quants

    data = np.ascontiguousarray(data)
    if data.shape[0] == 0:
        t = BLOCK_TYPES[qtype]
        return np.zeros((0, data.shape[1] // t.nbytes * t.block), np.float32)
    with np.errstate(all="ignore"):  # a block's scale may be inf / NaN: values say so
        out = quants.dequantize(data, GGMLQuantizationType[qtype])
    return np.asarray(out, dtype=np.float32)


def is_block_matrix(w) -> bool:
    return isinstance(w, BlockMatrix)


# Where each type keeps its float16 scales (byte offset, and the scale's size relative
# to the weight spread ``std`` it should produce: d * (typical |q| spread) ~ std).  A
# K-quant's spread per unit d counts its sub-blocks' random scales and mins too (d sc q -
# dmin m, d drawn 0.5-1.5x: 14.5, 276, 560 for Q2_K, Q4_K, Q5_K), and dmin / d = mean(sc)
# mean(q) / mean(m) centres the values on zero.
_SCALE_FIELDS = {
    "Q4_0": ((0, 1 / 4.6),), "Q5_0": ((0, 1 / 9.2),), "Q8_0": ((0, 1 / 74.0),),
    "Q4_1": ((0, 1 / 4.6), (2, -8 / 4.6)), "Q5_1": ((0, 1 / 9.2), (2, -16 / 9.2)),
    "Q4_K": ((0, 1 / 276.0), (2, 7.5 / 276.0)), "Q5_K": ((0, 1 / 560.0), (2, 15.5 / 560.0)),
    "Q6_K": ((208, 1 / (64 * 18.5)),),
    "Q2_K": ((80, 1 / 14.5), (82, 1.5 / 14.5)),
    "Q3_K": ((108, 1 / (18.5 * 2.3)),),
    "IQ4_NL": ((0, 1 / 68.0),), "IQ4_XS": ((0, 1 / (18.5 * 68.0)),),
    # the IQ2 / IQ3 types: d (0.5 + s) / 4 (IQ3_XXS: / 2; IQ3_S: d (1 + 2 s)) times grid
    # values of about 25 (IQ3_XXS 30, IQ3_S 8), s about 8
    "IQ2_XXS": ((0, 1 / 53.0),), "IQ2_XS": ((0, 1 / 53.0),), "IQ2_S": ((0, 1 / 53.0),),
    "IQ3_XXS": ((0, 1 / 127.0),), "IQ3_S": ((0, 1 / 128.0),),
}


def random_blocks(qtype: str, rows: int, k: int, rng, std=0.02) -> BlockMatrix:
    """A valid ``[rows, k]`` BlockMatrix of random blocks whose values spread about
    ``std``: random quant bytes with float16 scales set to sane magnitudes (tests and
    benchmarks; llama.cpp's quantizer is not needed to make valid blocks)."""
    t = BLOCK_TYPES[qtype]
    if qtype in ("F16", "BF16"):
        vals = (rng.standard_normal((rows, k)) * std).astype(np.float32)
        raw = (vals.astype(np.float16).view(np.uint16) if qtype == "F16"
               else (vals.view(np.uint32) >> 16).astype(np.uint16))
        return BlockMatrix(qtype, (rows, k), raw.view(np.uint8).reshape(rows, 2 * k))
    nb = rows * (k // t.block) if k % t.block == 0 else None
    if nb is None:
        raise ValueError(f"random_blocks: k={k} is not a multiple of {t.block}")
    data = rng.integers(0, 256, (nb, t.nbytes), dtype=np.uint8)
    for off, rel in _SCALE_FIELDS[qtype]:
        d = (std * rel * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
        data[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    return BlockMatrix(qtype, (rows, k), data.reshape(rows, k // t.block * t.nbytes))
