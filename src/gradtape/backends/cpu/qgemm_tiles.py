"""How a bf16 or int8 product of a block weight is cut into tiles, each one oneDNN GEMM.

A ``qmatmul`` (``y = x W^T``) or ``qmatmul_t`` (``z = g W``) of a weight kept in its ggml
blocks, ``W [rows, k]``, runs tile by tile under bf16 and int8 compute: each tile of W is
dequantized (and rounded) into a scratch buffer and multiplied at once.  A tile is whole
rows of W (``[R, k]``) or, backward, whole columns (``[rows, C]``) where that gives the
wider GEMM (``bf16_tile_shape``).  This module holds what the two precisions share: the
tile sizes and shapes, the scratch they need, the operands of one product
(``BlockProduct``) and its tiles in order (``BlockProduct.tiles``).  The ways of running
them are ``qgemm_bf16.py``'s and ``qgemm_int8.py``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ...blocks import BLOCK_TYPES
from . import ggml_vec
from .qgemm import lib, type_id

# Two tile sizes, the faster per product measured on the CPU at hand (measure.fastest):
# 16M values (32 MB of bf16), where oneDNN's bf16 matmul reaches its full rate from a few
# thousand output columns up; and 1M values, a tile that stays in the cores' caches
# between its dequantization and its GEMM (docs/benchmarks.md).
BF16_TILE_ELEMS = 1 << 24
BF16_SMALL_TILE_ELEMS = 1 << 20
# A small tile's GEMM takes the activation this many rows at a time (its tile, 2 MB, stays
# in cache across them): one GEMM of a batch's thousand rows re-reads a large activation
# per tile, and ran slower than calls of this many rows
BF16_SMALL_TILE_ROWS = 256


def bf16_tile_sizes():
    """The tile sizes (values) a bf16 block product is timed with, largest first."""
    return tuple(sorted({BF16_TILE_ELEMS, min(BF16_SMALL_TILE_ELEMS, BF16_TILE_ELEMS)},
                        reverse=True))


def size_name(elems):
    """A tile size as the ways' names say it: "16M", "1M"."""
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


def _pad64(n):
    return -(-n // 64) * 64


def bf16_scratch_elems(ops):
    """``(activation, tile, product)``: the bf16 values the bf16 block GEMMs ``ops`` need
    (the activation rounded once per product, and for a ``qmatmul`` its swapped GEMMs'
    blocked copy; one tile) and the float32 values of one tile's product when it is a
    block of columns of the result or a swapped product (see ``qgemm_bf16``)."""
    act = tile = prod = 0
    for v, elems in itertools.product(ops, bf16_tile_sizes()):
        a = v.attrs
        r, c = bf16_tile_shape(v.op == "qmatmul_t", a["qtype"], a["rows"], a["k"], elems)
        T, width = v.shape[0], r if v.op == "qmatmul" else c  # the columns a tile writes
        # the blocked layout pads K to 32 and N to 64 values (gt_deq_tile_vnni)
        tile = max(tile, _pad64(r) * _pad64(c), lib().gt_fused_scratch(
            type_id(a["qtype"]), a["rows"], a["k"], T, int(v.op == "qmatmul_t")))
        if v.op == "qmatmul":  # x16, then x16^T blocked; each [r, T] swapped product
            act, prod = max(act, T * a["k"] + _pad64(T) * a["k"]), max(prod, T * width)
        else:
            act = max(act, v.inputs[0].size)
            if width < v.shape[1]:
                prod = max(prod, T * width)
    return act, tile, prod


@dataclass(frozen=True)
class Tile:
    """One tile of a block product: W's rows ``[row0, row0 + n_rows)`` and columns
    ``[col0, col0 + n_cols)``, and its GEMM ``[T, gemm_k] @ [gemm_k, gemm_n]``."""

    row0: int
    n_rows: int
    col0: int
    n_cols: int
    gemm_k: int
    gemm_n: int
    w_transposed: bool  # the tile is the GEMM's W^T (y = x W^T); else W (z = g W)
    acc: bool  # the product is added to the result
    # the first of the gemm_n result columns it writes; None for a tile of whole rows of
    # a qmatmul_t, whose product is summed into all of z (its A: g's columns of its rows)
    out_col0: int | None


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class BlockProduct:
    """A ``qmatmul`` / ``qmatmul_t`` with its operands where they lie (the oneDNN
    lowerings read them in place): ``x`` the activation ``[T, k]`` (forward) or the
    incoming gradient ``[T, rows]`` (backward), ``w`` W's blocks ``[rows, row bytes]``,
    ``out`` the result."""

    op: str
    qtype: str
    rows: int
    k: int
    x: np.ndarray
    w: np.ndarray
    out: np.ndarray

    @classmethod
    def of(cls, v, out, ins):
        x, w = ins
        if not (x.flags.c_contiguous and out.flags.c_contiguous and w.strides[1] == 1):
            raise RuntimeError(f"{v.op}: operands must be C-contiguous")
        a = v.attrs
        return cls(v.op, a["qtype"], a["rows"], a["k"], x, w, out)

    @property
    def transposed(self):
        """Whether this is the backward product, ``z = g W``."""
        return self.op == "qmatmul_t"

    @property
    def T(self):
        """The activation's rows."""
        return self.x.shape[0]

    @property
    def type_id(self):
        return type_id(self.qtype)

    @property
    def w_addr(self):
        return self.w.ctypes.data

    @property
    def w_stride(self):
        """Bytes from one row of W's blocks to the next."""
        return self.w.strides[0]

    @property
    def x_addr(self):
        return self.x.ctypes.data

    @property
    def out_addr(self):
        return self.out.ctypes.data

    @property
    def width(self):
        """The result's columns."""
        return self.out.shape[1]

    def label(self, precision):
        return (f"{self.op} {precision} [{self.T}, {self.x.shape[1]}] x "
                f"{self.qtype}[{self.rows}, {self.k}]")

    def tiles(self, R, C, transposed=None):
        """The tiles of W cut ``[R, C]`` as ``bf16_tile_shape`` says, in order (those of
        the forward product where ``transposed`` is False)."""
        rows, k = self.rows, self.k
        if not (self.transposed if transposed is None else transposed):
            for r0 in range(0, rows, R):
                n = min(R, rows - r0)
                yield Tile(r0, n, 0, k, k, n, True, False, r0)
        elif C == k:
            for r0 in range(0, rows, R):
                n = min(R, rows - r0)
                yield Tile(r0, n, 0, k, n, k, False, r0 > 0, None)
        else:
            for c0 in range(0, k, C):
                n = min(C, k - c0)
                yield Tile(0, rows, c0, n, rows, n, False, False, c0)

