"""int8 products of block weights (``--compute int8``, W8A8): ``lower_int8``.

The activation's rows are quantized to int8 (a scale per row), then for each tile
(``qgemm_tiles.bf16_tile_shape``'s) the blocks are dequantized and quantized to int8 into
scratch and one oneDNN GEMM writes (or adds to) int32 sums, exact, which
``gt_s32_scale`` multiplies by both scales into their block of the result:

  qmatmul    y[:, r0:r0+R] = x8 @ tile[R, k]^T, each row of W its own scale (the sum runs
             along the row), after x's columns are divided and W's multiplied by c_j
             (``SMOOTH_ALPHA``: SmoothQuant's balance of the two ranges, taken afresh on
             each call)
  qmatmul_t  z[:, c0:c0+C] = g8 @ tile[rows, C], or
             z (+)= g8[:, r0:r0+R] @ tile[R, k] summed in int32 over the tiles in place in
             the result, then scaled once; each column of W its own scale (the sum runs
             along the column), the same for every tile (``col_scales``)

The tiles are plain rows (oneDNN reorders them on every call) or, where oneDNN's kernel
keeps its weights in the layout ``gt_deq_tile_s8_vnni`` writes, already in it, with the
activation as u8 (q + 128; the tiles' column sums take the offset off).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .onednn import DnnlError, Gemm
from .qgemm import check, lib, run_tile, type_id
from .qgemm_tiles import (BlockProduct, Tile, bf16_eligible, bf16_scratch_elems,
                          bf16_tile_shape)

# An int8 GEMM sums products of at most 255 * 127 in int32 (the activation as u8, q + 128,
# in the blocked layout): at most this many terms
INT8_MAX_TERMS = (2**31 - 1) // (255 * 127)
# the forward's balance of activation and weight ranges, c_j = max|x_j|^a / max|W_j|^(1-a)
# (SmoothQuant's alpha; 0: none): on SmolLM2 0.5 gave the closest gradients of the values
# tried (docs/benchmarks.md)
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


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class Int8Scratch:
    """The buffers of a program's int8 block products (``int8_scratch_elems``)."""

    act: np.ndarray  # int8: the activation quantized (and a tile's columns of it)
    tile: np.ndarray  # int8: one tile
    act_scales: np.ndarray  # float32: a scale per activation row
    w_scales: np.ndarray  # float32: a scale per row of W (forward)
    col_sums: np.ndarray  # int32: a blocked tile's column sums (the u8 offset's share)
    prod: np.ndarray | None  # int32: a tile's sums as contiguous rows

    @classmethod
    def allocate(cls, ops):
        act, tile, scales, prod = int8_scratch_elems(ops)
        return cls(np.empty(act, np.int8), np.empty(tile, np.int8),
                   np.empty(scales, np.float32), np.empty(scales, np.float32),
                   np.empty(scales, np.int32), np.empty(prod, np.int32) if prod else None)

    def arrays(self):
        return [self.act, self.tile, self.act_scales, self.w_scales, self.col_sums,
                self.prod]


def col_scales(w, qtype, rows, k):
    """``(scale, inverse)``: float32 ``[k]``, each column of the block matrix ``w``'s
    largest magnitude / 127, and 127 / it (0 for a column of zeros): the scales of W's
    int8 copy as the right-hand operand of ``g @ W``."""
    mx = np.empty(k, np.float32)
    w = np.ascontiguousarray(w)
    check(lib().gt_col_absmax(type_id(qtype), w.ctypes.data, w.strides[0], rows, k,
                              mx.ctypes.data), "column maxima")
    inv = np.zeros(k, np.float32)
    np.divide(np.float32(127), mx, out=inv, where=mx > 0)
    return mx / np.float32(127), inv


def lower_int8(v, out, ins, dnnl, scratch, columns, choose=None):
    """A callable computing ``qmatmul`` / ``qmatmul_t`` ``v`` into ``out`` from the input
    arrays ``ins`` with int8 inputs, int32 sums and float32 scales (``int8_eligible``
    ops only), in ``scratch`` (``Int8Scratch``).  ``columns()`` gives ``col_scales``'
    pair of W.  The tiles in plain rows or oneDNN's blocked layout, as ``choose(op's
    name, shape, blocked, plain)`` says (``measure.blocked_faster``; blocked where None
    and oneDNN's kernel takes it)."""
    p = BlockProduct.of(v, out, ins)
    R, C = bf16_tile_shape(p.transposed, p.qtype, p.rows, p.k)
    steps = _int8_tiles(p, scratch, R, C)
    smooth = None if p.transposed else np.empty((3, p.k), np.float32)  # x's maxima, 1/c, c
    blocked, plain = (_bind_int8(p, scratch, dnnl, steps, (R, C), smooth, columns, way)
                      for way in (True, False))
    if blocked is None:
        return plain
    if choose is None or choose(f"{v.op} {p.qtype} int8", (p.T, p.rows, p.k), blocked, plain):
        return blocked
    return plain


@dataclass(frozen=True)
class _Sums:
    """Where a tile's int32 sums are (``addr``, rows ``ld`` apart, ``cols`` of them) and
    the first column of the result they are scaled into."""

    addr: int
    ld: int
    cols: int
    out_col0: int


@dataclass(frozen=True)
class _Int8Tile:
    """One tile, its GEMM (``m``: the activation's rows), the addresses of its A and its
    output, and its sums to scale after it (None for a tile of whole rows of a
    ``qmatmul_t``: summed in place, scaled once at the end)."""

    tile: Tile
    gemm: Gemm
    a_addr: int
    out_addr: int
    sums: _Sums | None


def _int8_tiles(p, scratch, R, C):
    """The GEMMs of the tiles ``[R, C]`` of ``p`` and where their sums go."""
    out = []
    act = scratch.act.ctypes.data
    prod = scratch.prod.ctypes.data if scratch.prod is not None else None
    for t in p.tiles(R, C):
        gemm = Gemm(p.T, t.gemm_k, t.gemm_n, t.w_transposed, acc=t.acc, s8=True)
        if t.out_col0 is None:
            out.append(_Int8Tile(t, replace(gemm, lda=p.rows, ldc=p.k), act + t.row0,
                                 p.out_addr, None))
            continue
        dst, ldc = (p.out_addr, p.width) if t.gemm_n == p.width else (prod, t.gemm_n)
        out.append(_Int8Tile(t, replace(gemm, ldc=ldc), act, dst,
                             _Sums(dst, ldc, t.gemm_n, t.out_col0)))
    return out


def _smoothing(p, smooth, w_col_scales):
    """(1 / c, c) addresses, or (None, None) (no smoothing: backward, or alpha 0)."""
    if smooth is None or not SMOOTH_ALPHA:
        return None, None
    x_max, inv_c, c = smooth
    cols = p.x.shape[1]
    lib().gt_absmax_cols(p.x_addr, cols, p.T, cols, x_max.ctypes.data)
    w_max = w_col_scales * np.float32(127)
    c.fill(1)
    np.divide(x_max ** SMOOTH_ALPHA, w_max ** (1 - SMOOTH_ALPHA), out=c,
              where=(x_max > 0) & (w_max > 0))
    np.divide(1, c, out=inv_c)
    return inv_c.ctypes.data, c.ctypes.data


def _bind_int8(p, scratch, dnnl, steps, shape, smooth, columns, blocked):
    """The callable running the tiles plain or ``blocked`` (None where oneDNN's kernel
    keeps its int8 weights in another layout than gt_deq_tile_s8_vnni writes)."""
    R, C = shape
    T = p.T
    # oneDNN keeps the blocked weights only with a contiguous A: each tile of a
    # whole-rows qmatmul_t copies its columns of g8 into one
    per_tile = blocked and p.transposed and C == p.k
    specs = [(s.gemm, s.a_addr) for s in steps]
    moves = None
    if per_tile:  # the columns go after g8 in scratch.act (int8_scratch_elems)
        g8 = scratch.act.view(np.uint8)[:T * p.rows].reshape(T, p.rows)
        a_tile = scratch.act.view(np.uint8)[T * p.rows:T * (p.rows + R)]
        moves = [(a_tile[:T * s.tile.n_rows].reshape(T, s.tile.n_rows),
                  g8[:, s.tile.row0:s.tile.row0 + s.tile.n_rows]) for s in steps]
        specs = [(replace(s.gemm, lda=None), a_tile.ctypes.data) for s in steps]
    try:
        if blocked and not all(dnnl.primitive(replace(g, tb=False, vnni=True))
                               for g, _ in specs):
            return None
    except DnnlError:  # no u8 x s8 matmul of this kind here: plain rows only
        return None
    gemms = [dnnl.bind_ptrs(replace(g, tb=g.tb and not blocked, vnni=blocked), a,
                            scratch.tile.ctypes.data, s.out_addr)
             for (g, a), s in zip(specs, steps)]
    run = _int8_run(p, scratch, steps, gemms, moves, smooth, columns, blocked, C)
    run.label = p.label("int8")
    run.blocked, run.precision = blocked, "int8"
    run.buffers = (p.x, p.w, p.out, *scratch.arrays())  # kept alive with run
    return run


def _deq_args(p, scratch, t, blocked, col_inv, w_smooth):
    """The arguments of the C kernel dequantizing and quantizing tile ``t``: W's columns'
    scales backward, its rows' (written into ``scratch.w_scales``, after the smoothing)
    forward; blocked tiles also sum their columns."""
    head = (p.type_id, p.w_addr, p.w_stride, t.row0, t.n_rows, t.col0, t.n_cols)
    tile, w_scales = scratch.tile.ctypes.data, scratch.w_scales.ctypes.data
    col_sums = scratch.col_sums.ctypes.data
    if blocked and p.transposed:
        return (*head, 0, col_inv + 4 * t.col0, None, tile, None, col_sums + 4 * t.col0)
    if blocked:
        return (*head, 1, None, w_smooth, tile, w_scales + 4 * t.row0, col_sums + 4 * t.row0)
    if p.transposed:
        return (*head, col_inv + 4 * t.col0, None, tile, t.n_cols, None)
    return (*head, None, w_smooth, tile, t.n_cols, w_scales + 4 * t.row0)


def _int8_run(p, scratch, steps, gemms, moves, smooth, columns, blocked, C):
    """The replay's callable: quantize x, then each tile (its columns of g copied first
    where ``moves``), its sums scaled into the result."""
    L = lib()
    quant, scale = L.gt_quant_rows_s8, L.gt_s32_scale
    deq = L.gt_deq_tile_s8_vnni if blocked else L.gt_deq_tile_s8
    comp = scratch.col_sums.ctypes.data if blocked else None
    act_scales, w_scales = scratch.act_scales.ctypes.data, scratch.w_scales.ctypes.data
    cols = p.x.shape[1]

    def run(split=None):
        """``split``: as ``qgemm_bf16``'s runs"""
        s, inv = columns()
        col_scale, col_inv = s.ctypes.data, inv.ctypes.data
        x_smooth, w_smooth = _smoothing(p, smooth, s)
        check(quant(p.x_addr, cols, p.T, cols, x_smooth, int(blocked), scratch.act.ctypes.data,
                    act_scales), p.op)
        if blocked:
            scratch.col_sums.fill(0)
        for i, (step, gemm) in enumerate(zip(steps, gemms)):
            if moves is not None:
                np.copyto(*moves[i])
            run_tile(split, p.op, deq, _deq_args(p, scratch, step.tile, blocked, col_inv,
                                                 w_smooth), gemm)
            if step.sums is not None:
                sums, j0 = step.sums, step.sums.out_col0
                scale(sums.addr, sums.ld, p.T, sums.cols, act_scales,
                      (col_scale if p.transposed else w_scales) + 4 * j0,
                      comp + 4 * j0 if comp else None, p.out_addr + 4 * j0, p.width)
        if p.transposed and C == p.k:
            scale(p.out_addr, p.k, p.T, p.k, act_scales, col_scale, comp, p.out_addr, p.k)
    return run
