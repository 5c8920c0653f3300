"""bf16 products of block weights (``--compute bf16``): ``lower_bf16`` and its ways.

The activation is rounded to bf16 once per product; W is dequantized straight into
bf16 a tile at a time (``qgemm_tiles.py``) and each tile is one oneDNN GEMM with float32
accumulation.  The ways of running one product, each a function here:

* ``plain``: the tiles in plain rows, which the GEMM reorders into its kernel's layout
  on every call;
* ``blocked``: the tiles dequantized straight into the layout the kernel keeps
  (``gt_deq_tile_vnni``, where that is its layout): no reorder, a slower dequantization;
* ``swapped`` (forward only): ``y^T = W x^T``, the tile's plain rows the GEMM's A, read in
  place, and ``x16^T`` its weights, packed once per product past ``x16`` (the small
  operand; W is not rearranged at all), each ``[R, T]`` product transposed into y;
* ``fused``: one call of our own (``gt_qgemm_bf16_fused``) in which each core
  dequantizes its own part of W a chunk at a time and multiplies it at once with our
  AVX512-BF16 GEMM, where the CPU has it and W's shape fits its blocking;
* ``amx``: ``fused`` with its GEMM on AMX tiles (``gt_qgemm_bf16_amx``), where the build
  has AMX's instructions and Linux grants this process their use; ``amx-rows``
  (backward): the same with g's rows outermost, each 32 of them in L1 while a group's
  panels pass, from copies in strides off the cache's 4 KB sets
  (``gt_qgemm_bf16_amx_rows``; timed beside amx per shape like every way);
* ``direct``: a BF16 W (its bits are the tiles') read where it lies by one GEMM;
* ``resident``: ``direct`` on a bf16 copy of the whole W, dequantized once and kept for
  the program's life (where the execution plan leaves room for it): the tiles' very
  values, without dequantizing them again each step.

The GEMMs of the plain, direct and resident ways read plain rows: where the plan's
``bf16_gemms`` says MKL (``mkl.py``), those ways are offered run by MKL as well, their
names saying so ("plain 16M mkl"), and timed with the others.

The tiled ways come in each of ``bf16_tile_sizes()``; small tiles stay in cache between
their dequantization and their GEMM, which takes ``BF16_SMALL_TILE_ROWS`` rows of the
activation at a time ("by 256 rows").  A block of result columns is written into
contiguous scratch rows and then moved into place: a GEMM writing rows a whole result row
apart is slower.  ``measure.fastest`` times the ways once per CPU and picks one.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass, replace

import numpy as np

from ..base import page_aligned
from . import qgemm_tiles as tiles
from .onednn import Gemm
from .qgemm import check, lib, run_tile
from .qgemm_tiles import (BlockProduct, Tile, bf16_scratch_elems, bf16_tile_shape,
                          bf16_tile_sizes, size_name)


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class Bf16Scratch:
    """The buffers of a program's bf16 block products (``bf16_scratch_elems``)."""

    act: np.ndarray  # uint16: x16 (forward: and x16^T packed past it) or g16
    tile: np.ndarray  # uint16: one tile's values (or the fused call's scratch)
    prod: np.ndarray | None  # float32: a tile's product as contiguous rows

    @classmethod
    def allocate(cls, ops):
        act, tile, prod = bf16_scratch_elems(ops)
        return cls(page_aligned(act, np.uint16), page_aligned(tile, np.uint16),
                   page_aligned(prod, np.float32) if prod else None)

    def arrays(self):
        return [self.act, self.tile, self.prod]

    @property
    def act_addr(self):
        return self.act.ctypes.data

    @property
    def tile_addr(self):
        return self.tile.ctypes.data

    @property
    def prod_addr(self):
        return self.prod.ctypes.data if self.prod is not None else None


def lower_bf16(v, out, ins, dnnl, scratch, choose=None, rounded=False, resident=None,
               plain_gemms=None):
    """A callable computing ``qmatmul`` / ``qmatmul_t`` ``v`` into ``out`` from the input
    arrays ``ins`` with bf16 inputs and float32 accumulation, in ``scratch``
    (``Bf16Scratch``):
      qmatmul    y[:, r0:r0+R] = x16 @ tile[R, k]^T
      qmatmul_t  z[:, c0:c0+C] = g16 @ tile[rows, C]   (whole columns), or
                 z (+)= g16[:, r0:r0+R] @ tile[R, k]    (whole rows)
    in the way ``choose(op's name, shape, {name: run})`` picks (the first, the blocked
    one of the largest tiles where oneDNN's kernel takes it, when None; each way bound on
    its first call, so that only where no decision is cached are they all bound).
    ``rounded``: ``scratch.act`` already holds x's bf16 copy when this runs (a
    ``qmatmul`` after another of the same x, whose run wrote it and nothing since).
    ``resident``: a callable giving W's bf16 copy (uint16 ``[rows, k]``, made on its
    first call and shared by the products of W), which offers the ``resident`` way.
    ``plain_gemms``: a second library for the GEMMs on plain rows (``mkl.Mkl``, where the
    plan's ``bf16_gemms`` says so): the plain, direct and resident ways run by it are
    offered too, named so ("plain 16M mkl"); None: oneDNN's ways alone."""
    p = BlockProduct.of(v, out, ins)
    if rounded and p.transposed:
        raise ValueError("lower_bf16: a qmatmul_t rounds its own operand (its tiles may "
                         "write act16 column by column)")
    runs = {}
    # oneDNN's ways first (the first is the default), then MKL's plain ones beside them
    for gemms in (dnnl, *([plain_gemms] if plain_gemms is not None else [])):
        tag = "" if gemms is dnnl else f" {gemms.provider.lower()}"
        for elems in bf16_tile_sizes():  # largest first: the default
            for layout in ("blocked", "plain", "swapped") if gemms is dnnl else ("plain",):
                way = _tile_way(p, scratch, dnnl, layout, elems)
                if way is not None:
                    name = f"{layout} {size_name(elems)}"
                    if way.rows_at_once < p.T:  # a new name: a cached decision is timed anew
                        name += f" by {way.rows_at_once} rows"
                    runs[name + tag] = _BoundOnFirstCall(functools.partial(
                        _bind_tiles, p, scratch, gemms, way, rounded))
        need = lib().gt_fused_scratch(p.type_id, p.rows, p.k, p.T, int(p.transposed))
        if gemms is dnnl and need and scratch.tile.size >= need:
            runs["fused"] = _BoundOnFirstCall(functools.partial(_bind_fused, p, scratch,
                                                                rounded))
            if lib().gt_amx_ready():
                runs["amx"] = _BoundOnFirstCall(functools.partial(_bind_fused, p, scratch,
                                                                  rounded, amx=True))
                if p.transposed:
                    runs["amx-rows"] = _BoundOnFirstCall(functools.partial(
                        _bind_fused, p, scratch, rounded, amx="rows"))
        if p.qtype == "BF16" and p.w_stride == 2 * p.k:
            runs["direct" + tag] = _BoundOnFirstCall(functools.partial(
                _bind_direct, p, scratch, gemms, rounded))
        elif resident is not None:
            runs["resident" + tag] = _BoundOnFirstCall(functools.partial(
                _bind_resident, p, scratch, gemms, rounded, resident))
    name = next(iter(runs)) if choose is None else choose(f"{v.op} {p.qtype}",
                                                            (p.T, p.rows, p.k), runs)
    return runs[name].bound()


@dataclass(frozen=True)
class _TileGemm:
    """One tile's GEMM (its ``m``: the activation's rows), the addresses of its A and its
    output, and where a block of columns written to ``prod`` is moved (None: written in
    place)."""

    tile: Tile
    gemm: Gemm
    a_addr: int
    out_addr: int
    move_to: int | None


@dataclass(frozen=True)
class _TileWay:
    """A tiled way of one product: ``layout`` ("plain", "blocked", "swapped"), the
    tiles' ``shape`` ``(R, C)``, their GEMMs (None where swapped), whether each tile
    rounds its own columns of g (``per_tile``) and the activation's rows per GEMM."""

    layout: str
    shape: tuple
    gemms: tuple | None
    per_tile: bool
    rows_at_once: int


def _tile_gemms(p, scratch, R, C, per_tile):
    """The GEMMs of the tiles ``[R, C]`` of ``p``.  ``per_tile``: each tile of a
    whole-rows qmatmul_t rounds its own columns of g into ``scratch.act``, contiguous
    (else g16's columns are read in place, rows ``p.rows`` apart)."""
    out = []
    for t in p.tiles(R, C):
        gemm = Gemm(p.T, t.gemm_k, t.gemm_n, t.w_transposed, acc=t.acc)
        if t.out_col0 is None:  # whole rows of a qmatmul_t: summed into all of z
            a_addr, lda = ((scratch.act_addr, None) if per_tile
                           else (scratch.act_addr + 2 * t.row0, p.rows))
            out.append(_TileGemm(t, replace(gemm, lda=lda, ldc=p.k), a_addr, p.out_addr,
                                 None))
        elif t.gemm_n == p.width:  # every column of out, written in place
            out.append(_TileGemm(t, gemm, scratch.act_addr, p.out_addr, None))
        else:  # a block of out's columns, through prod
            out.append(_TileGemm(t, gemm, scratch.act_addr, scratch.prod_addr,
                                 p.out_addr + 4 * t.out_col0))
    return out


def _tile_way(p, scratch, dnnl, layout, elems):
    """The way ``layout`` with tiles of ``elems`` values, or None where oneDNN's kernel
    keeps its weights in another layout than gt_deq_tile_vnni writes (or, swapped, than
    the packed x16^T of the last tile; or a swapped ``qmatmul_t``)."""
    R, C = bf16_tile_shape(p.transposed, p.qtype, p.rows, p.k, elems)
    if layout == "swapped":
        return _swapped_way(p, scratch, dnnl, R, C)
    blocked = layout == "blocked"
    m = min(p.T, tiles.BF16_SMALL_TILE_ROWS) if elems <= tiles.BF16_SMALL_TILE_ELEMS else p.T
    # oneDNN keeps the blocked weights only with a contiguous A
    per_tile = blocked and p.transposed and C == p.k
    gemms = _tile_gemms(p, scratch, R, C, per_tile)
    if blocked and not all(dnnl.primitive(replace(g.gemm, m=rows, vnni=True))
                           for g in gemms for rows in {m, p.T - (p.T - 1) // m * m}):
        return None
    return _TileWay(layout, (R, C), tuple(gemms), per_tile, m)


def _swapped_way(p, scratch, dnnl, R, C):
    """The swapped way's tiles: the GEMM's weights are x^T, packed, its N all of T (its
    rows the tile's); one packing serves every tile, the last one's too."""
    T, k = p.T, p.k
    if p.transposed or dnnl.packed_bytes(R, k, T) > 2 * (scratch.act.size - T * k):
        return None
    md = dnnl.primitive(Gemm(R, k, T, packed=True))[1][1]
    last = p.rows - (p.rows - 1) // R * R
    return _TileWay("swapped", (R, C), None, False, T) if dnnl.same_layout(md, last, k, T) \
        else None


def _round_x(p, scratch):
    """The call rounding the activation into ``scratch.act``."""
    return lib().gt_f32_bf16, (p.x_addr, scratch.act_addr, p.x.size)


def _described(run, p, layout, tile, rounded, buffers):
    """``run`` with what a profile and the tests read of it; ``buffers``: the arrays
    whose addresses it holds, kept alive with it."""
    run.label = p.label("bf16")
    run.layout, run.precision, run.tile, run.rounded = layout, "bf16", tile, rounded
    run.buffers = buffers
    return run


def _bind_tiles(p, scratch, dnnl, way, rounded):
    """The callable running a tiled way's tiles."""
    L = lib()
    first = [] if (way.per_tile or rounded) else [_round_x(p, scratch)]
    if way.layout == "swapped":
        pack, steps = _swapped_steps(p, scratch, dnnl, way.shape[0])
        first.append((pack, ()))
    else:
        steps = [_tile_step(p, scratch, dnnl, way, g) for g in way.gemms]
    convert_block = L.gt_f32_bf16_block

    def run(split=None):
        """``split``: a dict whose "dequantize" and "GEMM" entries get the seconds of
        each (a profile's; None in a replay)"""
        for f, args in first:
            f(*args)
        for cols, deq, args, gemm, move in steps:
            if cols is not None:
                convert_block(*cols)
            run_tile(split, p.op, deq, args, gemm)
            if move is not None:
                move[0](*move[1])
    return _described(run, p, way.layout, way.shape, rounded,
                      (p.x, p.w, p.out, scratch.act, scratch.tile, scratch.prod))


def _tile_step(p, scratch, dnnl, way, g):
    """``(columns of x to round or None, dequantize, its args, GEMM, move or None)`` of
    one tile of a plain or blocked way."""
    L, t = lib(), g.tile
    blocked = way.layout == "blocked"
    if blocked:
        deq = L.gt_deq_tile_vnni, (p.type_id, p.w_addr, p.w_stride, t.row0, t.n_rows, t.col0,
                                   t.n_cols, int(not p.transposed), scratch.tile_addr)
    else:
        deq = L.gt_deq_tile_bf16, (p.type_id, p.w_addr, p.w_stride, None, t.row0, t.n_rows,
                                   t.col0, t.n_cols, scratch.tile_addr, t.n_cols)
    gemm = _row_blocks(dnnl, replace(g.gemm, vnni=blocked), way.rows_at_once, g.a_addr,
                       scratch.tile_addr, g.out_addr)
    cols = ((p.x_addr + 4 * t.row0, p.x.shape[1], p.T, t.n_rows, scratch.act_addr)
            if way.per_tile else None)
    move = ((L.gt_copy_cols, (scratch.prod_addr, p.T, t.gemm_n, g.move_to, p.width))
            if g.move_to is not None else None)
    return cols, *deq, gemm, move


def _swapped_steps(p, scratch, dnnl, R):
    """``(the call packing x16^T, the tiles' steps)`` of y^T = W x^T a tile at a time:
    x16^T packed once (after x16) into the layout of oneDNN's kernel, the GEMMs'
    weights; each tile's plain rows their A; each ``[n, T]`` product transposed into its
    columns of y."""
    L, T, k = lib(), p.T, p.k
    xt = scratch.act_addr + 2 * T * k
    if dnnl.vnni(R, k, T):  # the layout gt_rows_vnni writes, far faster than a reorder
        pack = functools.partial(L.gt_rows_vnni, scratch.act_addr, T, k, xt)
    else:
        pack = dnnl.bind_pack(R, k, T, True, scratch.act_addr, xt,
                              2 * (scratch.act.size - T * k))
    steps = [(None, L.gt_deq_tile_bf16,
              (p.type_id, p.w_addr, p.w_stride, None, t.row0, t.n_rows, 0, k,
               scratch.tile_addr, k),
              dnnl.bind_ptrs(Gemm(t.n_rows, k, T, packed=True), scratch.tile_addr, xt,
                             scratch.prod_addr),
              (L.gt_copy_cols_t, (scratch.prod_addr, t.n_rows, T, p.out_addr + 4 * t.row0,
                                  p.width)))
             for t in p.tiles(R, k, transposed=False)]
    return pack, steps


def _bind_fused(p, scratch, rounded, amx=False):
    """The callable running the product as one fused call: each core dequantizes its own
    part of W a chunk at a time and multiplies it while it is in its cache, with a GEMM
    of ours (forward as y^T = W x^T, x16^T packed once past x16 as in the swapped way).
    In a profile's split the cores' mean time dequantizing counts as "dequantize", the
    rest as "GEMM".  ``amx``: the GEMM on AMX tiles instead (``gt_qgemm_bf16_amx``);
    ``"rows"``: backward, with g's rows outermost (``gt_qgemm_bf16_amx_rows``)."""
    L, T, k = lib(), p.T, p.k
    first = [] if rounded else [_round_x(p, scratch)]
    xt = None if p.transposed else scratch.act_addr + 2 * T * k
    if xt is not None:
        first.append((L.gt_rows_vnni, (scratch.act_addr, T, k, xt)))
    args = (p.type_id, p.w_addr, p.w_stride, p.rows, k, int(p.transposed), scratch.act_addr,
            xt, T, p.out_addr, scratch.tile_addr, scratch.tile.size)
    fused = (L.gt_qgemm_bf16_amx_rows if amx == "rows" else L.gt_qgemm_bf16_amx if amx
             else L.gt_qgemm_bf16_fused)

    def run(split=None):
        for f, f_args in first:
            f(*f_args)
        if split is None:
            check(fused(*args, None), p.op)
            return
        deq, t0 = ctypes.c_double(0.0), time.perf_counter()
        check(fused(*args, ctypes.byref(deq)), p.op)
        split["dequantize"] += deq.value
        split["GEMM"] += time.perf_counter() - t0 - deq.value
    way = "amx-rows" if amx == "rows" else "amx" if amx else "fused"
    return _described(run, p, way, None, rounded, (p.x, p.w, p.out, scratch.act, scratch.tile))


def _bind_direct(p, scratch, dnnl, rounded):
    """The callable running the product as one oneDNN GEMM on W where it lies: a BF16
    W's bits are its tiles' (its rows contiguous), so nothing is dequantized or copied,
    and the GEMM streams W from memory while it computes."""
    first = [] if rounded else [_round_x(p, scratch)]
    if p.transposed:  # z [T, k] = g16 [T, rows] @ W [rows, k]
        gemm = dnnl.bind_ptrs(Gemm(p.T, p.rows, p.k), scratch.act_addr, p.w_addr, p.out_addr)
    else:  # y [T, rows] = x16 [T, k] @ W^T
        gemm = dnnl.bind_ptrs(Gemm(p.T, p.k, p.rows, True), scratch.act_addr, p.w_addr,
                              p.out_addr)

    def run(split=None):
        for f, f_args in first:
            f(*f_args)
        t0 = time.perf_counter() if split is not None else 0.0
        gemm()
        if split is not None:
            split["GEMM"] += time.perf_counter() - t0
    return _described(run, p, "direct", None, rounded, (p.x, p.w, p.out, scratch.act))


def _bind_resident(p, scratch, dnnl, rounded, resident):
    """``_bind_direct`` on W's resident bf16 copy (its bits are the tiles')."""
    copy = resident()
    run = _bind_direct(replace(p, qtype="BF16", w=copy.view(np.uint8)), scratch, dnnl, rounded)
    run.layout = "resident"
    return run


def _row_blocks(dnnl, gemm, rows_at_once, a, w, out):
    """``dnnl.bind_ptrs``' product ``gemm`` as GEMMs of ``rows_at_once`` rows at a time
    (the same rows of ``a``, bf16, and ``out``, float32): one callable."""
    if rows_at_once >= gemm.m:
        return dnnl.bind_ptrs(gemm, a, w, out)
    lda, ldc = gemm.normal().lda, gemm.normal().ldc
    calls = [dnnl.bind_ptrs(replace(gemm, m=min(rows_at_once, gemm.m - r), lda=lda, ldc=ldc),
                            a + 2 * lda * r, w, out + 4 * ldc * r)
             for r in range(0, gemm.m, rows_at_once)]

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
