"""The cpu backend's kernels for frozen weights in their stored type, against the NumPy
reference (``gguf.quants.dequantize``, then the matmul), for every ggml type we run.

* Dequantization: bit for bit (the C follows the reference's float32 operations one by
  one), on random blocks including non-finite scales.
* ``qmatmul`` / ``qmatmul_t`` / ``qtake_rows``, forward and backward through a tape, on
  several tiles (tile sizes shrunk so that rows, columns and the last partial tile are
  all exercised).  Tolerance (max |cpu - numpy| / max |numpy|): float32 2e-6 -- the same
  products summed in another order (tile by tile, BLAS's blocking), k <= 768 terms of
  float32 rounding (observed about 5e-7); float64 1e-13 (observed about 1e-15).
* bf16 tiles: dequantized and rounded to bfloat16 bit for bit as gguf rounds.
* bf16 compute (``--compute bf16``, where oneDNN has a bf16 matmul): ``qmatmul`` and
  ``qmatmul_t`` against float64 arithmetic on the bf16-rounded operands, 1e-5 relative
  (the products of bf16 values are exact in float32; what is left is float32
  accumulation over k <= 1100 terms, about 1e-6 observed), on several tiles.
* int8 compute (``--compute int8``): against a NumPy transcription of the same
  quantization (smoothing factors, scales, rounding) with the integer sums exact, 1e-4
  relative: what is left is float32 rounding of the scales' products and, rarely, a
  value on a rounding tie quantized to the neighbouring integer (about 1e-7 observed);
  and against the exact product, an error of int8's size (1e-3 to 5e-2), not bf16's.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops, plan
from gradtape.backends.cpu import blas, qgemm, qgemm_bf16, qgemm_int8, qgemm_tiles, toolchain
from gradtape.blocks import BLOCK_TYPES, BlockMatrix, random_blocks

from support import hardware
from support.hardware import kernel_isa  # noqa: F401  (a fixture)
from support.compare import rel_err

TOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}
TYPES = sorted(BLOCK_TYPES)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of at most 64 rows x 256 columns: a [70, 768] weight takes 2 x 3 tiles."""
    monkeypatch.setattr(qgemm, "TILE_ELEMS", 64 * 256)
    monkeypatch.setattr(qgemm, "TILE_ROWS", 64)


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bitwise_the_reference(qtype):
    """Random bytes everywhere (scales too: inf, NaN and subnormal halves included)."""
    r = np.random.default_rng(TYPES.index(qtype))
    t = BLOCK_TYPES[qtype]
    k = 2 * max(t.block, 32)
    data = r.integers(0, 256, (41, k // t.block * t.nbytes), dtype=np.uint8)
    bm = BlockMatrix(qtype, (41, k), data)
    ref = bm.dequantize()
    got = qgemm.deq_rows(data, qtype, k)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    ids = np.array([40, 0, 7, 7], np.int64)
    got64 = qgemm.deq_rows(data, qtype, k, ids=ids, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # signalling NaNs quieten when widened
        np.testing.assert_array_equal(got64, ref[ids].astype(np.float64))


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", TYPES)
def test_bf16_tiles_are_the_rounded_reference(qtype):
    """Tiles for bf16 compute: the reference dequantized, then rounded to bfloat16 as
    gguf (ggml) rounds float32 (nearest even), bit for bit.  The bf16 GEMMs that would
    consume them are ``--compute bf16``'s (tests/backends/test_bf16_compute.py)."""
    from gguf import GGMLQuantizationType, quants
    r = np.random.default_rng(50 + TYPES.index(qtype))
    bm = random_blocks(qtype, 33, 512, r)
    ref = quants.quantize(bm.dequantize(), GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(qgemm.deq_rows_bf16(bm.data, qtype, 512), ref)
    ids = np.array([32, 0, 4])
    np.testing.assert_array_equal(qgemm.deq_rows_bf16(bm.data, qtype, 512, ids), ref[ids])


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_plain_halves_every_bit_pattern(qtype):
    """F16 and BF16 weights go to float32 and to bf16 tiles 8 or 32 values at a time:
    every one of the 65536 bit patterns (NaNs with their payloads, infinities,
    subnormals), in rows of 1000 (a partial last vector), the float32 bitwise gguf's, the
    bf16 the reference rounded as gguf rounds; a tile from column 8 on the same."""
    from gguf import GGMLQuantizationType, quants
    halves = np.concatenate([np.arange(1 << 16), np.arange(464)]).astype(np.uint16)
    data = halves.view(np.uint8).reshape(66, 2000)
    bm = BlockMatrix(qtype, (66, 1000), data)
    ref = bm.dequantize()
    assert np.array_equal(qgemm.deq_rows(data, qtype, 1000).view(np.uint32),
                          ref.view(np.uint32))
    with np.errstate(invalid="ignore", over="ignore"):
        ref16 = quants.quantize(ref, GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(qgemm.deq_rows_bf16(data, qtype, 1000), ref16)
    tile = np.empty((66, 992), np.uint16)
    assert qgemm.lib().gt_deq_tile_bf16(BLOCK_TYPES[qtype].id, data.ctypes.data, 2000, None,
                                        0, 66, 8, 992, tile.ctypes.data, 992) == 0
    np.testing.assert_array_equal(tile, ref16[:, 8:])


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("rows", [200, 201])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_blocked_tile_is_the_plain_rows_rearranged(qtype, rows):
    """gt_deq_tile_vnni's tile, forward (B = W^T) and backward (B = W), with a partial
    last panel and K padded (an odd row count: a last pair of one row): word (p, j) of
    panel c holds B[2p, 64c + j] in its low half and B[2p + 1, 64c + j] in its high half,
    zeros past K and N, and the values are gt_deq_tile_bf16's plain rows."""
    k = 512
    bm = random_blocks(qtype, rows, k, np.random.default_rng(7))
    lib, tid = qgemm.lib(), BLOCK_TYPES[qtype].id
    plain = np.empty((rows, k), np.uint16)
    assert lib.gt_deq_tile_bf16(tid, bm.data.ctypes.data, bm.data.strides[0], None, 0, rows,
                                0, k, plain.ctypes.data, k) == 0
    for by_rows, B in ((1, plain.T), (0, plain)):  # B [K, N]
        (K, N), kp, npan = B.shape, -(-B.shape[0] // 32) * 32, -(-B.shape[1] // 64)
        tile = np.full(npan * 64 * kp, 0xFFFF, np.uint16)
        assert lib.gt_deq_tile_vnni(tid, bm.data.ctypes.data, bm.data.strides[0], 0, rows,
                                    0, k, by_rows, tile.ctypes.data) == 0
        Bp = np.zeros((kp, npan * 64), np.uint16)
        Bp[:K, :N] = B
        np.testing.assert_array_equal(
            tile, Bp.reshape(kp // 2, 2, npan, 64).transpose(2, 0, 3, 1).ravel())


@pytest.mark.parametrize("rows,k,tile,backward", [(70, 768, 32 * 768, "columns"),
                                                   (71, 768, 32 * 768, "columns"),
                                                   (1100, 512, 320 * 512, "rows")])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("layout", ["blocked", "plain", "swapped", "fused", "direct",
                                    "resident"])
def test_bf16_compute_matches_rounded_reference(qtype, rows, k, tile, backward, layout,
                                                monkeypatch):
    """bf16 compute: each tile of W dequantized into bf16, the activation rounded once,
    one oneDNN GEMM per tile (float32 accumulation).  Tiles shrunk so that a [70, 768]
    weight takes 3 row tiles forward (the last partial) and 3 column tiles backward, and
    a tall [1100, 512] one 4 row tiles both ways (backward: products summed into z); 71
    rows: an odd K backward, padded in the blocked layout.  Tiles written in oneDNN's
    blocked layout (where its kernel keeps that one) and in plain rows, and the forward
    swapped (y^T = W x^T: plain rows of W times x^T packed once, T = 9 padded); a BF16 W
    also read where it lies (direct: one GEMM, no tiles), and any W from a bf16 copy
    made once (resident, where the plan leaves room for it)."""
    from gradtape.backends.cpu import onednn
    hardware.onednn_bf16()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", tile)
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
    r = np.random.default_rng(200 + TYPES.index(qtype))
    T = 9
    bm = random_blocks(qtype, rows, k, r)
    R, C = qgemm_tiles.bf16_tile_shape(False, qtype, rows, k)
    assert C == k and -(-rows // R) in (3, 4) and rows % R
    R, C = qgemm_tiles.bf16_tile_shape(True, qtype, rows, k)
    if backward == "columns":
        assert R == rows and -(-k // C) == 3
    else:
        assert C == k and -(-rows // R) == 4
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, k)))
    g = tp.param(r.standard_normal((T, rows)))
    w = tp.const(bm)
    y, z = ops.qmatmul(x, w), ops.qmatmul_t(g, w)
    offered = _offered_ways(monkeypatch)
    execution = plan.for_program("cpu", "bf16").replace(
        resident_weights=plan.Decision(layout == "resident", "the test's"))
    prog = tp.compile([y, z], backend="cpu", plan=execution)
    assert prog.executable.compute == "bf16" and len(prog.executable._block_bf16) == 2
    layouts = [s.layout for s in prog.executable._steps if hasattr(s, "layout")]
    assert len(layouts) == 2
    if layout == "fused":  # where this build has the kernel and the shapes fit it
        fits = [qgemm.lib().gt_fused_scratch(qgemm.type_id(qtype), rows, k, T, back) > 0
                for back in (0, 1)]
        assert [lay == "fused" for lay in layouts] == fits
    elif layout == "direct":  # only a BF16 W has it (the other types' ways are timed)
        assert (layouts == ["direct"] * 2) == (qtype == "BF16")
    elif layout == "resident":  # not offered for a BF16 W, read where it lies instead
        assert (layouts == ["resident"] * 2) == (qtype != "BF16")
    elif layout == "swapped":  # the forward product (x is its GEMM's packed weights)
        swapped = any("swapped" in n for n in offered[f"qmatmul {qtype}"])
        assert (layouts[0] == "swapped") == swapped
    elif layout == "plain" or not onednn.dnnl().vnni(T, k, 64):
        assert "blocked" not in layouts
    else:  # a kernel that keeps the layout gt_deq_tile_vnni writes (all of them with
        # AVX512-BF16; another CPU's kernel may want another for some of the tiles)
        assert "blocked" in layouts
    got_y, got_z = prog.run()
    deq = _b16(bm.dequantize())
    assert rel_err(got_y, _b16(x.value) @ deq.T) <= 1e-5
    assert rel_err(got_z, _b16(g.value) @ deq) <= 1e-5
    # and it is bf16, not float32: the error against float32 inputs is bf16's
    assert rel_err(got_y, x.value.astype(np.float64) @ bm.dequantize().T) > 1e-4


@pytest.mark.parametrize("way,T", [("fused", 13), ("amx", 13), ("amx", 45)])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_fused_products_match_rounded_reference(qtype, way, T, monkeypatch):
    """The fused way (gt_qgemm_bf16_fused: each core dequantizes its own part of W a
    chunk of K at a time and multiplies it with our GEMM) at the edges of its blocking:
    forward over W [200, 768], each core's share of W's rows (in blocks of 6; two cores:
    102 and 98) in groups of 96 and the rest (a last block partial), K in chunks of 512
    and 256, T = 13 (x^T's panel padded, the sums of 13 columns moved into y), and over
    W [5, 256], one block of rows (a core without a share); backward over W [1030, 512],
    two groups of columns and W's rows in chunks of 512, 512 and 6, T = 13 (a last block
    of one row of g).  The amx way (gt_qgemm_bf16_amx: the same with its GEMM on AMX
    tiles, 32 x 32 of C at a time) the same, and at T = 45 backward (a block of 32 rows
    of g on tiles, 13 left to the vector GEMM; the last chunk's 3 pairs too)."""
    hardware.onednn_bf16()
    tid = qgemm.type_id(qtype)
    if not (qgemm.lib().gt_fused_scratch(tid, 200, 768, 13, 0) and
            qgemm.lib().gt_fused_scratch(tid, 1030, 512, 13, 1)):
        pytest.skip("no fused kernel on this CPU (it needs AVX512-BF16)")
    if way == "amx" and not qgemm.lib().gt_amx_ready():
        pytest.skip("no AMX on this CPU (or its class capped by $GRADTAPE_ISA, or Linux "
                    "refuses this process its tiles)")
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", way)
    r = np.random.default_rng(300 + TYPES.index(qtype))
    w1, w2 = random_blocks(qtype, 200, 768, r), random_blocks(qtype, 1030, 512, r)
    w3 = random_blocks(qtype, 5, 256, r)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, 768)))
    g = tp.param(r.standard_normal((T, 1030)))
    x3 = tp.param(r.standard_normal((T, 256)))
    y, z = ops.qmatmul(x, tp.const(w1)), ops.qmatmul_t(g, tp.const(w2))
    y3 = ops.qmatmul(x3, tp.const(w3))
    prog = tp.compile([y, z, y3], backend="cpu", compute="bf16")
    runs = [s for s in prog.executable._steps if hasattr(s, "layout")]
    assert [s.layout for s in runs] == [way] * 3
    got_y, got_z, got_y3 = prog.run()
    assert rel_err(got_y, _b16(x.value) @ _b16(w1.dequantize()).T) <= 1e-5
    assert rel_err(got_z, _b16(g.value) @ _b16(w2.dequantize())) <= 1e-5
    assert rel_err(got_y3, _b16(x3.value) @ _b16(w3.dequantize()).T) <= 1e-5
    # a profile's split: the cores' time dequantizing apart from the GEMM's
    split = {"dequantize": 0.0, "GEMM": 0.0}
    for run in runs:
        run(split)
    assert split["dequantize"] > 0 and split["GEMM"] > 0
    # and the widths that do not fit its blocking are not offered it
    assert qgemm.lib().gt_fused_scratch(tid, 71, 768, 13, 1) == 0  # an odd K backward
    assert qgemm.lib().gt_fused_scratch(tid, 64, 100 * 32, 13, 0) == 0  # k: not blocks


@pytest.mark.parametrize("T", [13, 45, 96])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_amx_rows_is_the_amx_ways_backward_bit_for_bit(qtype, T, monkeypatch):
    """The amx-rows way (gt_qgemm_bf16_amx_rows: backward with g's rows outermost, g's
    chunks and the sums copied into rows of their own) adds the same products in the same
    order as the amx way: the same bits, over W [1030, 512] (chunks of K 256 and a last
    of 6 values: 3 pairs, left to amx_rows) and [512, 768] (three groups of columns), at
    T = 13 (no block of 32 rows), 45 (one, and 13 rows left) and 96 (three)."""
    hardware.onednn_bf16()
    if not qgemm.lib().gt_amx_ready():
        pytest.skip("no AMX on this CPU (or its class capped by $GRADTAPE_ISA, or Linux "
                    "refuses this process its tiles)")
    out = {}
    for way in ("amx", "amx-rows"):
        monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", way)
        tp = gt.Tape(np.float32)
        zs = []
        for rows, k in ((1030, 512), (512, 768)):
            w = random_blocks(qtype, rows, k, np.random.default_rng(rows + TYPES.index(qtype)))
            g = tp.param(np.random.default_rng(T + rows).standard_normal((T, rows)))
            zs.append(ops.qmatmul_t(g, tp.const(w)))
        prog = tp.compile(zs, backend="cpu", compute="bf16")
        assert [s.layout for s in prog.executable._steps if hasattr(s, "layout")] == [way] * 2
        out[way] = prog.run()
    # bitwise: both run amx_block32 and gemm_rows over the same chunks of K in the same
    # order (only the loops around them differ), on the one CPU kind that has them
    for a, b in zip(out["amx"], out["amx-rows"]):
        assert np.array_equal(a, b)
    # and they are the product: the last, W [512, 768], against bf16 inputs in float64
    assert rel_err(out["amx-rows"][1], _b16(g.value) @ _b16(w.dequantize())) <= 1e-5


def test_amx_and_onednns_tiles_take_turns_in_the_same_threads():
    """Our AMX tiles and oneDNN's (each configures its own tiles per call) run in turn,
    as when the ways are timed, on the same OpenMP threads: each keeps giving its
    values (a call that trusted another's tile configuration would not)."""
    from gradtape.backends.cpu import onednn
    from gradtape.backends.cpu.qgemm_bf16 import Bf16Scratch, lower_bf16
    hardware.onednn_bf16()
    if not qgemm.lib().gt_amx_ready():
        pytest.skip("no AMX on this CPU (or its class capped by $GRADTAPE_ISA, or Linux "
                    "refuses this process its tiles)")
    tp, x, g, y, z, deq = _bf16_product_pair(np.random.default_rng(11), 40, 512, 768)
    for v, a, want in ((y, x, _b16(x.value) @ deq.T), (z, g, _b16(g.value) @ deq)):
        out = np.zeros(v.shape, np.float32)
        scratch = Bf16Scratch.allocate([v])
        runs = {}
        lower_bf16(v, out, (a.value, v.inputs[1].value), onednn.dnnl(), scratch,
                   lambda what, shape, offered: runs.update(offered) or "amx")
        others = [n for n in runs if n.split()[0] in ("blocked", "plain")]
        assert "amx" in runs and others
        for name in ["amx", *others, "amx", others[0], "amx"]:
            out[...] = np.nan
            runs[name]()
            assert rel_err(out, want) <= 1e-5, name


@pytest.mark.parametrize("m,k", [(9, 768), (70, 512), (64, 256)])
def test_swapped_operands_are_packed_and_products_moved_exactly(m, k):
    """A swapped product's two copies are the same values rearranged: gt_rows_vnni's
    x16^T is oneDNN's own reorder of it, bit for bit, where its kernel keeps that layout
    (rows past m zeros; a last group of fewer than 16 rows); gt_copy_cols_t writes the
    [m, n] product's transpose into columns of a wider result, touching nothing else."""
    from gradtape.backends.cpu import onednn
    hardware.onednn_bf16()
    d, L = onednn.dnnl(), qgemm.lib()
    r = np.random.default_rng(m + k)
    x16 = onednn.to_bf16(r.standard_normal((m, k), dtype=np.float32))
    room = d.packed_bytes(256, k, m)
    mine, theirs = np.full(room // 2, 7, np.uint16), np.full(room // 2, 9, np.uint16)
    if not d.vnni(256, k, m):
        pytest.skip("oneDNN's kernel keeps another layout here: its own reorder packs")
    L.gt_rows_vnni(x16.ctypes.data, m, k, mine.ctypes.data)
    d.bind_pack(256, k, m, True, x16.ctypes.data, theirs.ctypes.data, room)()
    np.testing.assert_array_equal(mine, theirs)
    prod = r.standard_normal((m, 48), dtype=np.float32)
    out = np.full((48, m + 21), -1.0, np.float32)
    L.gt_copy_cols_t(prod.ctypes.data, m, 48, out[:, 5:].ctypes.data, m + 21)
    np.testing.assert_array_equal(out[:, 5:5 + m], prod.T)
    assert (out[:, :5] == -1).all() and (out[:, 5 + m:] == -1).all()


def _offered_ways(monkeypatch):
    """``{product name: [its ways]}``, filled as compute.fastest is asked (which it
    then answers as before): a CPU whose oneDNN kernel keeps x^T in another layout for
    some shape may offer no swapped way there."""
    from gradtape.backends.cpu import measure as compute
    offered, fastest = {}, compute.fastest

    def recording(what, shape, runs, only=((), "")):
        offered.setdefault(what, []).extend(runs)
        return fastest(what, shape, runs, only)
    monkeypatch.setattr(compute, "fastest", recording)
    return offered


def _b16(a):
    """``a`` rounded to bf16, as float64"""
    from gradtape.backends.cpu import onednn
    return onednn.from_bf16(onednn.to_bf16(a)).astype(np.float64)


def _bf16_product_pair(r, T, rows, k):
    """A tape with ``y = x W^T`` and ``z = g W`` over a random Q4_K ``W [rows, k]``:
    ``(tape, x, g, y, z, W dequantized and rounded to bf16, float64)``."""
    bm = random_blocks("Q4_K", rows, k, r)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, k)))
    g = tp.param(r.standard_normal((T, rows)))
    w = tp.const(bm)
    return tp, x, g, ops.qmatmul(x, w), ops.qmatmul_t(g, w), _b16(bm.dequantize())


def test_bf16_tiles_of_each_size_and_layout_are_timed_and_the_chosen_one_runs(monkeypatch):
    """A bf16 block product is bound with its tiles of each size (bf16_tile_sizes)
    in each layout oneDNN's kernel takes; compute.fastest is asked once per product with
    all of them and the one it names runs: each gives the rounded reference's product."""
    from gradtape.backends.cpu import measure as compute
    hardware.onednn_bf16()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", 320 * 512)
    monkeypatch.setattr(qgemm_tiles, "BF16_SMALL_TILE_ELEMS", 64 * 512)
    assert qgemm_tiles.bf16_tile_sizes() == (320 * 512, 64 * 512)
    tp, x, g, y, z, deq = _bf16_product_pair(np.random.default_rng(7), 9, 1100, 512)
    asked = []
    for pick in ("plain 163840", "plain 32768", "blocked 32768", "swapped 163840",
                 "swapped 32768"):
        picked = {}

        def fastest(what, shape, runs, only=((), "")):
            asked.append((what, sorted(runs)))
            picked[what] = pick if pick in runs else next(iter(runs))
            return picked[what]
        monkeypatch.setattr(compute, "fastest", fastest)
        prog = tp.compile([y, z], backend="cpu", compute="bf16")
        tiles = [s.tile for s in prog.executable._steps if hasattr(s, "tile")]
        small = picked["qmatmul Q4_K"].endswith(" 32768")
        assert tiles[0] == ((64 if small else 320), 512)  # forward: whole rows of W
        got_y, got_z = prog.run()
        assert rel_err(got_y, _b16(x.value) @ deq.T) <= 1e-5
        assert rel_err(got_z, _b16(g.value) @ deq) <= 1e-5
    names = {n for _, ns in asked for n in ns}
    assert {"plain 163840", "plain 32768"} <= names
    assert {what for what, _ in asked} == {"qmatmul Q4_K", "qmatmul_t Q4_K"}


@pytest.mark.parametrize("k", [512, 256])
def test_small_tiles_take_the_activation_a_block_of_rows_at_a_time(k, monkeypatch):
    """Past BF16_SMALL_TILE_ROWS rows (batch 4 x 256), a small tile's GEMM runs over
    that many rows of the activation at a time, the last block shorter (here 9 rows by
    4: 4, 4, 1), in both layouts: a way of its own ("... by 4 rows", timed anew), the
    large tiles' ways unsplit; each gives the rounded reference's product, forward and
    backward (k = 256: the backward's small tile is all of W, its rows).  A swapped
    product's tiles are not split: x is its GEMM's weights."""
    from gradtape.backends.cpu import measure as compute
    hardware.onednn_bf16()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", 320 * 512)
    monkeypatch.setattr(qgemm_tiles, "BF16_SMALL_TILE_ELEMS", 64 * 512)
    monkeypatch.setattr(qgemm_tiles, "BF16_SMALL_TILE_ROWS", 4)
    tp, x, g, y, z, deq = _bf16_product_pair(np.random.default_rng(17), 9, 1100, k)
    for layout in ("plain", "blocked"):
        ran = []

        def fastest(what, shape, runs, only=((), "")):
            small = [n for n in runs if n.startswith(layout) and n.endswith("by 4 rows")]
            # (a swapped product's GEMM takes all rows of x as its N, unsplit; a fused
            # one, on AMX tiles or not, in any order, has no tiles of W)
            tiled = [n for n in runs if "swapped" not in n and n not in ("fused", "amx", "amx-rows")]
            assert {n for n in tiled if "by" not in n} == {
                n for n in tiled if n.endswith(" 163840")}
            ran.append(small[0] if small else next(iter(runs)))
            return ran[-1]
        monkeypatch.setattr(compute, "fastest", fastest)
        prog = tp.compile([y, z], backend="cpu", compute="bf16")
        got_y, got_z = prog.run()
        assert len(ran) == 2
        if layout == "plain":  # (the blocked one where oneDNN's kernel takes its layout)
            assert ran == ["plain 32768 by 4 rows"] * 2
        assert rel_err(got_y, _b16(x.value) @ deq.T) <= 1e-5
        assert rel_err(got_z, _b16(g.value) @ deq) <= 1e-5


@pytest.mark.parametrize("layout", [None, "swapped"])
def test_block_products_of_one_activation_round_it_once(layout, monkeypatch):
    """q, k, v of block weights read one x: the first product rounds it to bf16, the
    next ones of the same x read that copy (``rounded``); a backward product, or another
    activation, rounds its own.  Each gives the rounded reference's product.  Swapped
    forward products pack x^T past that copy, which the next ones still read."""
    hardware.onednn_bf16()
    if layout:
        monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
    r = np.random.default_rng(11)
    T, k = 9, 512
    bms = [random_blocks(q, rows, k, r) for q, rows in (("Q4_K", 96), ("Q6_K", 64),
                                                         ("Q4_K", 64), ("Q6_K", 32))]
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, k)))
    g = tp.param(r.standard_normal((T, 96)))
    ws = [tp.const(bm) for bm in bms]
    q, kk, v = (ops.qmatmul(x, w) for w in ws[:3])
    z = ops.qmatmul_t(g, ws[0])  # rounds g
    x2 = ops.scale(x, 0.5)
    y2 = ops.qmatmul(x2, ws[1])  # another activation: rounded anew
    y3 = ops.qmatmul(x, ws[3])  # x again, after others wrote the copy: rounded anew
    offered = _offered_ways(monkeypatch)
    prog = tp.compile([q, kk, v, z, y2, y3], backend="cpu", compute="bf16")
    runs = [s for s in prog.executable._steps if hasattr(s, "rounded")]
    assert [s.rounded for s in runs] == [False, True, True, False, False, False]
    if layout and all(any("swapped" in n for n in ways) for what, ways in offered.items()
                      if what.startswith("qmatmul ")):
        assert [s.layout for s in runs if s.label.startswith("qmatmul ")] == [layout] * 5
    got = prog.run()
    deq = [_b16(bm.dequantize()) for bm in bms]
    for out, d in zip(got[:3], deq):
        assert rel_err(out, _b16(x.value) @ d.T) <= 1e-5
    assert rel_err(got[3], _b16(g.value) @ deq[0]) <= 1e-5
    assert rel_err(got[4], _b16(0.5 * x.value) @ deq[1].T) <= 1e-5
    assert rel_err(got[5], _b16(x.value) @ deq[3].T) <= 1e-5


def test_the_fastest_way_is_measured_once_per_cpu_and_env_leaves_only_what_it_names(
        monkeypatch, tmp_path):
    """compute.fastest times every way in turn once per product and shape on this CPU
    (then reads the cache file) and names the fastest; $GRADTAPE_BF16_LAYOUT and
    $GRADTAPE_BF16_TILE (read by the plan) keep only the ways they name, untimed when one is left; the
    swapped layout, only forward products have, leaves the others all timed."""
    import time
    from types import SimpleNamespace

    from gradtape import plan
    from gradtape.backends.cpu import measure as compute, onednn
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    for var in ("GRADTAPE_BF16_LAYOUT", "GRADTAPE_BF16_TILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(onednn, "library", lambda: SimpleNamespace(version="3.2.0"))
    # 20 ms apart: a loaded machine's late wake-ups do not reorder them
    seconds = {"blocked 16M": 0.05, "plain 16M": 0.07, "blocked 1M": 0.01, "plain 1M": 0.03}
    calls = []

    def way(name):
        def run():
            calls.append(name)
            time.sleep(seconds[name])
        return run
    runs = {n: way(n) for n in seconds}

    def only():  # what the plan leaves, from the two variables
        execution = plan.for_program("cpu", "bf16")
        return execution.product_ways, execution.product_tile
    assert compute.fastest("qmatmul Q4_K", (256, 64, 32), runs, only()) == "blocked 1M"
    assert set(calls) == set(seconds)
    calls.clear()
    assert compute.fastest("qmatmul Q4_K", (256, 64, 32), runs, only()) == "blocked 1M"
    assert calls == []  # from the cache
    monkeypatch.setenv("GRADTAPE_BF16_TILE", "16M")
    assert compute.fastest("qmatmul Q6_K", (256, 64, 32), runs, only()) == "blocked 16M"
    assert set(calls) == {"blocked 16M", "plain 16M"}
    calls.clear()
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", "plain")
    assert compute.fastest("qmatmul_t Q6_K", (256, 64, 32), runs, only()) == "plain 16M"
    assert calls == []  # one way left: taken untimed
    monkeypatch.setenv("GRADTAPE_BF16_TILE", "2M")  # names no way: said, then all timed
    with pytest.warns(RuntimeWarning, match=r"GRADTAPE_BF16_TILE=2M names none"):
        assert compute.fastest("qmatmul_t Q4_K", (256, 64, 32), runs, only()) == "plain 1M"
    # a layout only forward products have: the others' ways all timed, without a word
    monkeypatch.delenv("GRADTAPE_BF16_TILE")
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", "swapped")
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute.fastest("qmatmul_t Q4_K", (256, 32, 64), runs, only()) == "blocked 1M"
        assert compute.fastest("head Q6_K", (256, 32, 64), runs, only()) == "blocked 1M"
    assert set(calls) == set(seconds)


def _lowered_qmatmul(r, bm, choose=None):
    """``(run, x, out, scratch, want)``: ``qmatmul`` of a random ``x [9, 512]`` by ``bm``
    (``[96, 512]``) lowered to bf16 GEMMs (``choose`` as lower_bf16 takes it), and the
    float64 product it should give."""
    from types import SimpleNamespace

    from gradtape.backends.cpu import onednn
    hardware.onednn_bf16()
    x = r.standard_normal((9, 512), dtype=np.float32)
    out = np.empty((9, 96), np.float32)
    v = SimpleNamespace(op="qmatmul", attrs=dict(qtype=bm.qtype, rows=96, k=512),
                        inputs=[x], shape=out.shape)
    act, tile, prod = qgemm_tiles.bf16_scratch_elems([v])
    scratch = [np.empty(act, np.uint16), np.empty(tile, np.uint16),
               np.empty(prod, np.float32) if prod else None]
    run = qgemm_bf16.lower_bf16(v, out, (x, bm.data), onednn.dnnl(),
                                qgemm_bf16.Bf16Scratch(*scratch), choose=choose)
    return run, x, out, scratch, x.astype(np.float64) @ bm.dequantize().T


def test_a_lowered_block_product_keeps_its_buffers_alive():
    """lower_bf16's callable holds raw addresses of its operands and scratch; it keeps
    the arrays alive itself, so a caller that drops its own references (a benchmark,
    a test) cannot leave it writing into freed memory."""
    import gc
    import weakref

    def lowered():
        run, x, out, scratch, want = _lowered_qmatmul(r, bm)
        return run, [weakref.ref(a) for a in (x, out, *scratch) if a is not None], want
    r = np.random.default_rng(5)
    bm = random_blocks("Q4_K", 96, 512, r)
    run, refs, want = lowered()
    gc.collect()
    assert all(ref() is not None for ref in refs)
    run()
    assert rel_err(refs[1](), want) < 1e-2  # bf16 inputs


def test_only_the_chosen_way_of_a_block_product_is_bound(monkeypatch):
    """lower_bf16 binds a way's GEMMs (a oneDNN memory object per operand and tile) when
    it first runs: where the decision is cached, only the chosen way ever is."""
    from gradtape.backends.cpu import onednn
    hardware.onednn_bf16()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", 1 << 16)
    monkeypatch.setattr(qgemm_tiles, "BF16_SMALL_TILE_ELEMS", 1 << 14)
    bound, seen = [], {}
    dnnl = onednn.dnnl()
    real = dnnl.bind_ptrs
    monkeypatch.setattr(dnnl, "bind_ptrs", lambda *a, **kw: bound.append(a) or real(*a, **kw))

    def choose(what, shape, runs):  # the small tiles, plain rows
        seen.update(runs)
        return [name for name in runs if name.startswith("plain")][-1]
    r = np.random.default_rng(6)
    bm = random_blocks("Q4_K", 96, 512, r)
    run, _, out, _, want = _lowered_qmatmul(r, bm, choose)
    assert len(seen) >= 2
    assert run.tile == qgemm_tiles.bf16_tile_shape(False, "Q4_K", 96, 512, 1 << 14)
    assert len(bound) == -(-96 // run.tile[0])  # the chosen way's tiles, no others
    run()
    assert rel_err(out, want) < 1e-2


def _program_outputs(tp, outs):
    a = tp.compile(outs, backend="numpy").run()
    p = tp.compile(outs, backend="cpu")
    assert p.backend == "cpu"
    return a, p.run()


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("layout", ["transposed", "direct"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_forward_backward_matches_reference(qtype, dtype, layout, small_tiles,
                                                    monkeypatch):
    monkeypatch.setenv("GRADTAPE_QGEMM_LAYOUT", layout)
    r = np.random.default_rng(100 + TYPES.index(qtype))
    rows, k = 70, 768
    bm = random_blocks(qtype, rows, k, r)
    assert qgemm.tile_shape(qtype, rows, k) == (64, 256)
    tp = gt.Tape(dtype)
    x = tp.param(r.standard_normal((9, k)))
    w = tp.const(bm)
    y = ops.qmatmul(x, w)  # [9, rows]
    u = tp.const(r.standard_normal((9, rows)))
    loss = ops.reduce_sum(ops.mul(ops.mul(y, y), u))
    gx = tp.backward(loss)[x]  # 2 u y @ deq(w): through qmatmul_t
    assert gx.op == "qmatmul_t" or any(v.op == "qmatmul_t" for v in tp.vars)
    emb = ops.qtake_rows(w, tp.const(np.array([69, 0, 5, 5, 64])))
    ref, got = _program_outputs(tp, [y, gx, emb])
    # the reference itself: dequantize, then the matmul
    deq = bm.dequantize().astype(dtype)
    np.testing.assert_array_equal(ref[0], x.value @ deq.T)
    np.testing.assert_array_equal(ref[2], deq[[69, 0, 5, 5, 64]])
    for a, b in zip(got[:2], ref[:2]):
        assert rel_err(a, b) <= TOL[np.dtype(dtype)]
    np.testing.assert_array_equal(got[2], ref[2])  # a gather of dequantized rows: exact


def test_tiled_path_without_cblas(monkeypatch, small_tiles):
    """Where NumPy's BLAS exports no CBLAS symbol we can find, tiles go through np.matmul."""
    monkeypatch.setattr(blas, "_BLAS", None)
    r = np.random.default_rng(7)
    bm = random_blocks("Q4_K", 70, 768, r)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((5, 768)))
    y = ops.qmatmul(x, tp.const(bm))
    gx = ops.qmatmul_t(y, tp.const(bm))
    ref, got = _program_outputs(tp, [y, gx])
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= TOL[np.dtype(np.float32)]


def test_one_scratch_tile_per_program():
    """The scratch is allocated once at compile, sized for the largest tile."""
    r = np.random.default_rng(3)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((4, 512)))
    a, b = random_blocks("Q8_0", 96, 512, r), random_blocks("Q6_K", 40, 512, r)
    h = ops.qmatmul(x, tp.const(a))  # [4, 96]
    out = ops.qmatmul(ops.qmatmul_t(h, tp.const(a)), tp.const(b))
    p = tp.compile([out], backend="cpu")
    s = p.executable._tile_scratch
    assert s.dtype == np.float32 and s.size == max(96 * 512 + 512 * 4, 40 * 512 + 512 * 4)
    first = p.run()[0]
    np.testing.assert_array_equal(p.run()[0], first)  # replay: same buffers, same result


def test_parked_blas_threads_come_back():
    """park_blas_threads stops OpenBLAS's workers; its next GEMM starts them again, with
    the same thread count and result (before the fused attention, cpu/tiled.py)."""
    a = np.random.default_rng(0).standard_normal((400, 300)).astype(np.float32)
    want = a @ a.T
    threads = blas.blas_threads()
    before = threads[0]() if threads else None
    blas.park_blas_threads()
    assert rel_err(a @ a.T, want) <= 1e-6
    assert (threads[0]() if threads else None) == before


def test_one_blas_thread_parks_the_workers_a_gemm_left_spinning():
    """Inside one_blas_thread no OpenBLAS worker is left from a GEMM before it (they spin
    on the cores OpenMP's threads need: bf16_fast measured bf16 at half its rate); after
    it, BLAS runs on its own thread count again and its next GEMM starts its workers.
    The process's threads by id (/proc/self/task): which ones stopped and started, so
    that another thread starting meanwhile in a whole suite (a count once failed so)
    changes nothing."""
    threads = blas.blas_threads()
    if threads is None or threads[0]() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("NumPy's BLAS is not a multithreaded OpenBLAS here")

    def tasks():
        return {int(t) for t in os.listdir("/proc/self/task")}
    a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    a @ a  # the workers run, then spin
    with_workers, n = tasks(), threads[0]()
    with blas.one_blas_thread():
        inside = tasks()
        assert threads[0]() == 1
    assert with_workers - inside  # the workers the GEMM left are stopped
    assert threads[0]() == n
    a @ a
    assert tasks() - inside  # and the next GEMM starts them again


# --- int8 compute ---------------------------------------------------------------------------

def _need_int8():  # int8 compute is bf16 compute with int8 block products
    hardware.onednn_bf16()
    hardware.int8_dots()


def _q8(v):
    """v (float32, |v| <= 127.5) rounded half away from zero, as the C kernels do"""
    return np.trunc(v + np.copysign(np.float32(0.5), v).astype(np.float32)).astype(np.int64)


def _quant_rows(a):
    """(integers, scale per row) of a float32 [m, n]: each row's max / 127"""
    mx = np.abs(a).max(1, keepdims=True)
    inv = np.zeros_like(mx)
    np.divide(np.float32(127), mx, out=inv, where=mx > 0)
    return _q8(a * inv), (mx / np.float32(127)).astype(np.float64)


def _int8_reference(x, g, W):
    """y = x W^T and z = g W as ``qgemm_int8.lower_int8`` computes them, in NumPy: forward,
    x's columns divided and W's multiplied by c = sqrt(max|x_j| / max|W_j|), then a scale
    per row of each; backward, g a scale per row, W a scale per column; exact integer
    sums, scaled in float64."""
    aw, ax = np.abs(W).max(0), np.abs(x).max(0)
    c = np.ones_like(aw)
    np.divide(ax ** np.float32(0.5), aw ** np.float32(0.5), out=c, where=(ax > 0) & (aw > 0))
    qx, sx = _quant_rows(x * (np.float32(1) / c))
    qw, sw = _quant_rows(W * c)
    y = (qx @ qw.T) * sx * sw.T
    inv = np.zeros_like(aw)
    np.divide(np.float32(127), aw, out=inv, where=aw > 0)
    qg, sg = _quant_rows(g)
    z = (qg @ _q8(W * inv)) * sg * (aw / np.float32(127)).astype(np.float64)
    return y, z


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", TYPES)
def test_int8_tiles_are_the_quantized_reference(qtype):
    """Tiles for int8 compute, bit for bit: the reference dequantized, then rounded
    (half away from zero) to a scale per row, or times a factor per column (the column
    scales: in AVX-512 registers for Q4_K and Q6_K, plain C for the rest)."""
    r = np.random.default_rng(70 + TYPES.index(qtype))
    rows, k = 33, 512
    bm = random_blocks(qtype, rows, k, r)
    w = bm.dequantize()
    lib, tid = qgemm.lib(), qgemm.type_id(qtype)
    tile, rs = np.empty((rows, k), np.int8), np.empty(rows, np.float32)
    inv = (127 / np.abs(w).max(0) * r.uniform(0.5, 1, k)).astype(np.float32)
    assert lib.gt_deq_tile_s8(tid, bm.data.ctypes.data, bm.data.strides[0], 0, rows, 0, k,
                              inv.ctypes.data, None, tile.ctypes.data, k, None) == 0
    np.testing.assert_array_equal(tile, _q8(w * inv))
    assert lib.gt_deq_tile_s8(tid, bm.data.ctypes.data, bm.data.strides[0], 0, rows, 0, k,
                              None, None, tile.ctypes.data, k, rs.ctypes.data) == 0
    q, s = _quant_rows(w)
    np.testing.assert_array_equal(tile, q)
    np.testing.assert_array_equal(rs, s.ravel().astype(np.float32))


@pytest.mark.parametrize("rows,k,tile,backward", [(70, 768, 32 * 768, "columns"),
                                                   (71, 768, 32 * 768, "columns"),
                                                   (1100, 512, 320 * 512, "rows")])
@pytest.mark.parametrize("qtype", TYPES)
def test_int8_compute_matches_its_quantization(qtype, rows, k, tile, backward, monkeypatch):
    """int8 compute, on the tiles of the bf16 test: 3 row tiles forward (the last
    partial, each its rows' scales), 3 column tiles backward (each its columns' scales)
    or 4 row tiles summed in int32 into z and scaled once.  Tiles in plain rows and in
    oneDNN's blocked layout (the activation as u8): the same integer sums, so the same
    bits."""
    from gradtape.backends.cpu import onednn
    _need_int8()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", tile)
    r = np.random.default_rng(300 + TYPES.index(qtype))
    T = 9
    bm = random_blocks(qtype, rows, k, r)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, k)) * np.where(np.arange(k) % 97 == 0, 30, 1))
    g = tp.param(r.standard_normal((T, rows)))
    w = tp.const(bm)
    y, z = ops.qmatmul(x, w), ops.qmatmul_t(g, w)
    runs = {}
    for layout in ("plain", "blocked"):
        monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
        prog = tp.compile([y, z], backend="cpu", compute="int8")
        assert prog.executable.compute == "int8" and len(prog.executable._block_int8) == 2
        blocked = [s.blocked for s in prog.executable._steps if hasattr(s, "blocked")]
        if layout == "plain" or not onednn.dnnl().vnni(T, k, 64, s8=True):
            assert blocked == [False, False]
        elif "amx_int8" not in toolchain.cpu_info()["flags"]:
            # AVX512-VNNI's kernels keep the layout gt_deq_tile_s8_vnni writes (measured);
            # AMX's may take it for some products only: there, the bits below suffice
            assert any(blocked)
        runs[layout] = prog.run()
    got_y, got_z = runs["plain"]
    np.testing.assert_array_equal(got_y, runs["blocked"][0])
    np.testing.assert_array_equal(got_z, runs["blocked"][1])
    deq = bm.dequantize()
    ref_y, ref_z = _int8_reference(x.value, g.value, deq)
    assert rel_err(got_y, ref_y) <= 1e-4
    assert rel_err(got_z, ref_z) <= 1e-4
    exact_y, exact_z = (x.value.astype(np.float64) @ deq.T, g.value.astype(np.float64) @ deq)
    assert 1e-3 < rel_err(got_y, exact_y) < 5e-2
    assert 1e-3 < rel_err(got_z, exact_z) < 5e-2


def test_int8_follows_a_fed_weight_and_leaves_long_sums_to_bf16(monkeypatch):
    """A block weight fed anew gets new column scales; a product summing more terms than
    int32 holds at int8's largest products runs in bf16 (here: the limit lowered)."""
    _need_int8()
    r = np.random.default_rng(9)
    a, b = (random_blocks("Q4_K", 64, 512, r) for _ in range(2))
    tp = gt.Tape(np.float32)
    x, g = tp.param(r.standard_normal((8, 512))), tp.param(r.standard_normal((8, 64)))
    w = tp.const(a)
    prog = tp.compile([ops.qmatmul(x, w), ops.qmatmul_t(g, w)], backend="cpu",
                      compute="int8")
    for bm in (a, b, a):
        got = prog.run({w: bm.data})
        for out, ref in zip(got, _int8_reference(x.value, g.value, bm.dequantize())):
            assert rel_err(out, ref) <= 1e-4
    monkeypatch.setattr(qgemm_int8, "INT8_MAX_TERMS", 100)  # 512 terms forward, 64 backward
    ex = tp.compile([ops.qmatmul(x, w), ops.qmatmul_t(g, w)], backend="cpu",
                    compute="int8").executable
    assert [s.op for s in ex._block_int8] == ["qmatmul_t"]
    assert [s.op for s in ex._block_bf16] == ["qmatmul"]


def test_int8_without_int8_dot_products_runs_bf16(monkeypatch):
    """Asked for int8 where the CPU has no int8 dot products, a program runs its block
    products in bf16 and says why once: oneDNN's int8 GEMM would saturate there."""
    from gradtape.backends.cpu import measure

    hardware.onednn_bf16()
    monkeypatch.setattr(measure, "cpu_info", lambda: {"model": "test", "flags": frozenset(
        {"avx2", "fma", "avx512f", "avx512_bf16"})})
    monkeypatch.setattr(measure, "_WARNED", set())
    r = np.random.default_rng(9)
    tp = gt.Tape(np.float32)
    x, w = tp.param(r.standard_normal((8, 512))), tp.const(random_blocks("Q4_K", 64, 512, r))
    with pytest.warns(RuntimeWarning, match="int8 compute asked for, running bf16: this "
                                            "CPU has no int8 dot products"):
        ex = tp.compile([ops.qmatmul(x, w)], backend="cpu", compute="int8").executable
    assert ex.compute == "bf16" and not ex._block_int8 and len(ex._block_bf16) == 1


def test_a_fed_block_weight_refreshes_its_resident_copy(monkeypatch):
    """A block weight fed to a program that reads it from a resident bf16 copy: the next
    run reads the new values (a copy of the program's own, the shared one untouched)."""
    hardware.onednn_bf16()
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", "resident")
    r = np.random.default_rng(21)
    a, b = random_blocks("Q4_K", 64, 256, r), random_blocks("Q4_K", 64, 256, r)
    tp = gt.Tape(np.float32)
    x, w = tp.param(r.standard_normal((9, 256))), tp.const(a)
    execution = plan.for_program("cpu", "bf16").replace(
        resident_weights=plan.Decision(True, "the test's"))
    prog = tp.compile([ops.qmatmul(x, w)], backend="cpu", plan=execution)
    other = tp.compile([ops.qmatmul(x, w)], backend="cpu", plan=execution)
    assert [s.layout for s in prog.executable._steps if hasattr(s, "layout")] == ["resident"]
    for bm in (a, b, a):
        got = prog.run({w: bm.data})[0]
        assert rel_err(got, _b16(x.value) @ _b16(bm.dequantize()).T) <= 1e-5
    got = other.run()[0]  # never fed: still the recorded weight
    assert rel_err(got, _b16(x.value) @ _b16(a.dequantize()).T) <= 1e-5
