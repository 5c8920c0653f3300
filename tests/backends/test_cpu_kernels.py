"""The cpu backend's single-op C kernels (softmax and sums over the last axis of any rank,
full sums, the fused next-token loss and its gradient, transposes) and its threaded
loops, against the NumPy reference; and that those ops really run in C.

Tolerances as in test_cpu_backend.py (float64 1e-10: same formulas, only the summation
order differs; float32 2e-5: our exp polynomial and double row sums, ~1e-6 observed).
Sizes here are above ``codegen.OMP_MIN_WORK`` where the threaded path is meant, so both
the split loops and the single-thread ones are exercised.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.backends.cpu import codegen, toolchain

from support import hardware
from support.hardware import kernel_isa  # noqa: F401  (a fixture)
from support.compare import rel_err
from support.parity import TOL
from test_cpu_backend import DTYPES, _loss_of


def _python_steps(prog):
    """The ops of a cpu program that run as NumPy calls (not in C, not BLAS)."""
    ex = prog.executable
    return [s.op for s in ex.schedule.steps
            if s not in ex._kernel_of and getattr(s, "op", None) != "matmul"]


def _check(build, dtype, seed=0):
    tp = gt.Tape(dtype)
    rng = np.random.default_rng(seed)
    out = build(tp, rng)
    loss = _loss_of(tp, out, rng)
    outputs = [out, loss, *tp.backward(loss).values()]
    ref = tp.compile(outputs, backend="numpy").run()
    prog = tp.compile(outputs, backend="cpu")
    got = prog.run()
    for k, (a, b) in enumerate(zip(got, ref)):
        assert rel_err(a, b) <= TOL[tp.dtype], f"output {k}: {rel_err(a, b):.3g}"
    return prog


CASES = {
    # the attention softmax: last axis of a 3-d batch; its VJP sums a 3-d row
    "softmax3d": lambda tp, r: ops.softmax(tp.param(r.standard_normal((3, 40, 300)) * 3), 2),
    "softmax3d-small": lambda tp, r: ops.softmax(tp.param(r.standard_normal((2, 3, 5))), -1),
    "sum-last-3d": lambda tp, r: ops.reduce_sum(tp.param(r.standard_normal((3, 50, 301))), 2),
    "sum-all": lambda tp, r: ops.reduce_sum(ops.mul(tp.param(r.standard_normal((300, 200))),
                                                    tp.param(r.standard_normal((300, 200))))),
    "nll": lambda tp, r: ops.nll_ids(tp.param(r.standard_normal((64, 1000)) * 4),
                                     tp.const(r.integers(0, 1000, 64))),
    "nll-grad": lambda tp, r: ops.nll_ids_grad(
        tp.param(r.standard_normal((64, 1))), tp.param(r.standard_normal((64, 1000)) * 4),
        tp.const(r.integers(0, 1000, 64))),
    "transpose-5d": lambda tp, r: ops.transpose(
        tp.param(r.standard_normal((2, 40, 3, 3, 16))), (0, 2, 3, 1, 4)),
    "broadcast": lambda tp, r: ops.broadcast_to(tp.param(r.standard_normal((3, 1, 5))), (2, 3, 4, 5)),
    "transpose-4d-inner": lambda tp, r: ops.transpose(
        tp.param(r.standard_normal((2, 30, 4, 17))), (0, 3, 1, 2)),
    "elementwise-wide": lambda tp, r: ops.sigmoid(ops.mul(
        tp.param(r.standard_normal((300, 200))), tp.param(r.standard_normal((200,))))),
    "elementwise-flat": lambda tp, r: ops.exp(ops.scale(
        tp.param(r.standard_normal((70000,))), 0.5)),
    "rowreduce-wide": lambda tp, r: ops.logsumexp(ops.scale(
        tp.param(r.standard_normal((300, 200))), 2.0), 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_parity(name, dtype):
    prog = _check(CASES[name], dtype, seed=sorted(CASES).index(name))
    assert prog.backend == "cpu"


def test_loss_softmax_and_transposes_run_in_c():
    """The ops that used to be NumPy calls between the GEMMs of a training step."""
    prog = _check(lambda tp, r: ops.nll_ids(
        ops.reshape(ops.transpose(ops.softmax(tp.param(r.standard_normal((2, 8, 16))), 2),
                                  (1, 0, 2)), (8, 32)),
        tp.const(r.integers(0, 32, 8))), np.float32)
    assert _python_steps(prog) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_tables_two_gradients_add_without_the_scatters_zeros(dtype):
    """A table read by ``take_rows`` and by a product (a tied embedding): the add of its
    scatter's gradient and the product's runs as one kernel (``scatter_add_body``, no
    ``[n, d]`` of zeros), the NumPy reference's two ops (float64: bit for bit): repeated
    ids summed in the same order, a negative id counted from the end as ``np.add.at``."""
    table0 = np.random.default_rng(0).standard_normal((500, 48)).astype(dtype)
    ids = np.array([3, 7, 3, -1, 499, 3, 7, 0] * 40, np.int64)  # above OMP_MIN_WORK
    got = {}
    for backend in ("numpy", "cpu"):
        tp = gt.Tape(dtype, eager=False)
        table = tp.param(table0)
        x = ops.take_rows(table, tp.const(ids))  # [320, 48]
        y = ops.matmul(ops.matmul(x, tp.const(np.full((48, 48), 0.1, dtype))),
                       ops.transpose(table, (1, 0)))  # [320, 500]
        loss = ops.reduce_sum(ops.mul(y, y))
        prog = tp.compile([tp.backward(loss)[table]], backend=backend)
        if backend == "cpu":
            assert len(prog.executable._scatter_add) == 1
        got[backend] = prog.run()[0]
    if dtype == np.float64:  # both products in NumPy's BLAS: the same sums throughout
        assert np.array_equal(got["numpy"], got["cpu"])
    else:  # the product may run in oneDNN, in its own order
        assert rel_err(got["cpu"], got["numpy"]) < TOL[np.dtype(dtype)]


def test_threaded_kernels_use_openmp_where_available(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    flags = toolchain.threads_flags()
    assert flags[:len(toolchain.isa_flags())] == toolchain.isa_flags()
    body = codegen.row_kernel_body(_softmax_var((3, 100, 200)), np.float32)
    assert "#pragma omp parallel for" in body
    small = codegen.row_kernel_body(_softmax_var((2, 3, 5)), np.float32)
    assert "omp parallel" not in small  # too little work to pay for a parallel region


def _softmax_var(shape):
    tp = gt.Tape(np.float32, eager=False)
    return ops.softmax(tp.const(np.zeros(shape)), -1)


def _tile_args(rng, dtype, cap, masked):
    """One attention score tile ``[nkv=2, g*n = 2*6, 20]`` and which keys its rows see:
    all (None), ranges of columns (causal and window limits), or ranges and a mask."""
    from gradtape import tiled

    s = (rng.standard_normal((2, 12, 20)) * 4).astype(dtype)
    if not masked:
        return s, None
    lo = np.array([0, 3, 0, 7, 5, 9], np.int64)
    hi = np.array([20, 11, 1, 20, 5, 16], np.int64)  # row 4 sees nothing in this tile
    mask = rng.random((6, 20)) < 0.7 if masked == "mask" else None
    if mask is not None:
        mask[np.arange(6), lo] = True  # every row with a range sees a key
    return s, tiled.Visible(lo, hi, mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap, masked", [(0.0, None), (0.0, "ranges"), (0.0, "mask"),
                                         (5.0, "ranges"), (5.0, "mask")])
def test_tile_kernels_equal_the_numpy_reference(dtype, cap, masked):
    """csrc/tiled.c against tiled.NumpyTiles, method by method: the scores' online softmax,
    the recomputed probabilities, their gradient and the fused head's two blocks, with and
    without visible ranges, a mask and a soft-cap (hidden entries exactly 0 in both)."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    ref, c = tiled.NUMPY_TILES, CTiles(dtype)
    tol = 1e-13 if dtype == np.float64 else 2e-5
    rng = np.random.default_rng(int(cap) + len(masked or ""))
    s, vis = _tile_args(rng, dtype, cap, masked)
    state = lambda: [np.full((2, 12, 1), -1.0, dtype), np.full((2, 12, 1), 3.0, dtype),
                     np.ones((2, 12, 8), dtype)]
    got, want = [s.copy()] + state(), [s.copy()] + state()
    c.attn_fwd(*got, 0.3, cap, vis, 2)
    ref.attn_fwd(*want, 0.3, cap, vis, 2)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    if vis is not None:
        assert not got[0].reshape(2, 2, 6, 20)[:, :, ~vis.dense(20)].any()
    lse = rng.standard_normal((2, 12, 1)).astype(dtype) + 3
    gp, wp = s.copy(), s.copy()
    gt_, wt = np.zeros_like(s), np.zeros_like(s)
    c.attn_p(gp, gt_, lse, 0.3, cap, vis, 2)
    ref.attn_p(wp, wt, lse, 0.3, cap, vis, 2)
    assert rel_err(gp, wp) <= tol and rel_err(gt_, wt) <= tol
    D = rng.standard_normal((2, 12, 1)).astype(dtype)
    dp = rng.standard_normal(s.shape).astype(dtype)
    gd, wd = dp.copy(), dp.copy()
    c.attn_ds(gd, gp, gt_, D, 0.3, cap)
    ref.attn_ds(wd, wp, wt, D, 0.3, cap)
    assert rel_err(gd, wd) <= tol
    # the fused head: a [7, 20] block of vocabulary rows 40.. (ids in and out of it)
    z = (rng.standard_normal((7, 20)) * 4).astype(dtype)
    ids = np.array([40, 59, 3, 45, 60, 41, 50])
    hs = lambda: [np.full(7, 1.0, dtype), np.full(7, 2.0, dtype), np.zeros(7, dtype)]
    gz, wz, gs, ws = z.copy(), z.copy(), hs(), hs()
    c.head_fwd(gz, *gs, ids, 40, cap)
    ref.head_fwd(wz, *ws, ids, 40, cap)
    for a, b in zip([gz] + gs, [wz] + ws):
        assert rel_err(a, b) <= tol
    a_, b_ = rng.random(7).astype(dtype), rng.random(7).astype(dtype)
    lz = rng.standard_normal(7).astype(dtype) + 4
    gz, wz = z.copy(), z.copy()
    c.head_dz(gz, lz, a_, b_, ids, 40, cap)
    ref.head_dz(wz, lz, a_, b_, ids, 40, cap)
    assert rel_err(gz, wz) <= tol


ATTN_CASES = [
    (300, 9, 3, 64, 0.0, 0, 1, None, 0),  # SmolLM2's heads: two key tiles, many units
    (67, 4, 4, 32, 5.0, 0, 1, None, 0),  # no GQA, soft-capped
    (200, 8, 2, 96, 0.0, 37, 1, None, 0),  # Phi-3's head dim, a sliding window
    (130, 6, 2, 16, 0.0, 0, 3, None, 0),  # three sequences, a head narrower than a panel
    (100, 4, 2, 64, 0.0, 0, 1, "runs", 0),  # packed examples: column ranges
    # examples of 300 rows: a block of rows holds both sides of a boundary, and the later
    # rows see none of the first key tile (they crashed flash.c: a negative memset)
    (1200, 4, 2, 64, 0.0, 0, 1, "runs", 0),
    (40, 4, 2, 64, 0.0, 0, 1, None, 13),  # keys cached before the query rows
    (1, 2, 1, 8, 0.0, 0, 1, None, 0),  # one row
    (520, 2, 1, 80, 2.0, 300, 1, None, 0),  # a window across key tiles, capped
    (33, 3, 1, 6, 0.0, 0, 1, None, 0),  # odd rows and keys: bf16 pairs padded with a zero
]
# bf16 GEMM inputs: each operand rounded to 8 significant bits (relative 2^-9), and the
# backward chains three rounded products (p or dS from scores, then dV, dK, dQ): a bound
# of 8 * 2^-9; observed at most 1.8e-3 (forward) and 4.7e-3 (gradients)
BF16_ATTN_TOL = 8 * 2.0 ** -9


def _fused_attention(t, nh, nkv, hd, cap, window, n_seq, seg, past, bf16):
    """``((y, g) from csrc/flash.c, (y, g) of tiled.py's walk in float64)``: the forward
    and the VJP, the fused ones in float32 data with float32 or ``bf16`` GEMMs."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    rng = np.random.default_rng(t + nh)
    n, nk = n_seq * t, n_seq * (t + past)
    q = rng.standard_normal((n, nh * hd))
    k, v = (rng.standard_normal((nk, nkv * hd)) for _ in range(2))
    gy = rng.standard_normal((n, nh * hd + nh))
    segs = (np.repeat(np.arange(4), t // 4),) if seg else ()
    spec = tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, cap, window, n_seq, tile=128)
    kw = dict(spec=spec)
    y64, g64 = np.empty((n, nh * hd + nh)), np.empty(n * nh * hd + 2 * nk * nkv * hd)
    tiled.fwd_attn(y64, q, k, v, *segs, **kw)
    tiled.fwd_attn_grad(g64, gy, q, k, v, y64, *segs, **kw)
    f32 = [a.astype(np.float32) for a in (gy, q, k, v)]
    c = CTiles(np.float32, bf16)
    lay = tiled.AttnLayout(n, nk, n_seq, window, segs[0] if segs else None, 128)
    y32 = np.empty(y64.shape, np.float32)
    assert c.fused_attn(y32, *f32[1:], lay, spec)  # taken, not the walk
    g32 = np.empty(g64.shape, np.float32)
    tiled.fwd_attn_grad(g32, *f32, y32, *segs, **kw, kern=c)
    return (y32, g32), (y64, g64)


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("t, nh, nkv, hd, cap, window, n_seq, seg, past", ATTN_CASES)
def test_fused_attention_equals_the_walk(t, nh, nkv, hd, cap, window, n_seq, seg, past):
    """csrc/flash.c (float32, the whole attention and its VJP in one call each) against
    the tiled walk of tiled.py in float64: within float32 rounding (~5e-7 observed)."""
    (y32, g32), (y64, g64) = _fused_attention(t, nh, nkv, hd, cap, window, n_seq, seg,
                                              past, bf16=False)
    assert rel_err(y32, y64) <= 2e-5 and rel_err(g32, g64) <= 2e-5


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("t, nh, nkv, hd, cap, window, n_seq, seg, past", ATTN_CASES)
def test_bf16_fused_attention_is_within_bf16_rounding(t, nh, nkv, hd, cap, window, n_seq,
                                                       seg, past):
    """The fused attention with bf16 GEMM inputs (--compute bf16) against the float64
    walk: within the rounding of its inputs, and not float32's result (bf16 ran)."""
    (y16, g16), (y64, g64) = _fused_attention(t, nh, nkv, hd, cap, window, n_seq, seg,
                                              past, bf16=True)
    for got, want in ((y16, y64), (g16, g64)):
        assert 1e-5 < rel_err(got, want) <= BF16_ATTN_TOL


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_attention_backward_is_the_same_in_every_call(bf16):
    """dK and dV sum over units in per-thread buffers: with the units taken as threads
    came free, each call grouped the terms otherwise (every call differed at T=600); a
    resumed run must equal an uninterrupted one, so each thread's units are fixed."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    t, nh, nkv, hd = 600, 9, 3, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((t, nh * hd), dtype=np.float32)
    k, v = (rng.standard_normal((t, nkv * hd), dtype=np.float32) for _ in range(2))
    gy = rng.standard_normal((t, nh * hd + nh), dtype=np.float32)
    kw = dict(spec=tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, tile=128))
    c = CTiles(np.float32, bf16)
    y = np.empty((t, nh * hd + nh), np.float32)
    tiled.fwd_attn(y, q, k, v, **kw, kern=c)
    first = None
    for _ in range(5):
        g = np.empty(t * nh * hd + 2 * t * nkv * hd, np.float32)
        tiled.fwd_attn_grad(g, gy, q, k, v, y, **kw, kern=c)
        if first is None:
            first = g
        assert np.array_equal(g, first)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_fused_attention_keeps_an_attention_sinks_gradient(seed):
    """Most rows put p ~ 0.99 on key 0: its dS = p (dP - D) is a small difference of
    large terms, exact only if D = rowsum(dO O) equals sum_j p_j dP_j as the bf16 GEMMs
    make them (flash.c: D from dO rounded as dP's GEMM rounds it, O from bf16 p plus the
    remainder of each large p).  With D from the float32 dO and O from p rounded once,
    the sink's dK row came out 1.9-2.6e-2 off; now 4-7e-3 (the same with every p's
    remainder added)."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    t, nh, nkv, hd = 256, 4, 2, 64
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, nh * hd))
    k, v = (rng.standard_normal((t, nkv * hd)) for _ in range(2))
    u = rng.standard_normal(hd)
    u /= np.linalg.norm(u)
    q += 4.0 * np.tile(u, nh)  # every query's score with key 0: about 4 * 20 / 8 = 10
    k[0] = 20.0 * np.tile(u, nkv)
    gy = np.zeros((t, nh * hd + nh))
    gy[:, :nh * hd] = rng.standard_normal((t, nh * hd))
    kw = dict(spec=tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, tile=128))
    got = []
    for kern, dt in ((tiled.NUMPY_TILES, np.float64), (CTiles(np.float32, True), np.float32)):
        a = [x.astype(dt) for x in (gy, q, k, v)]
        y, g = np.empty((t, nh * hd + nh), dt), np.empty(t * nh * hd + 2 * t * nkv * hd, dt)
        tiled.fwd_attn(y, *a[1:], **kw, kern=kern)
        tiled.fwd_attn_grad(g, *a, y, **kw, kern=kern)
        got.append((g[:t * nh * hd], g[t * nh * hd:(t * nh + t * nkv) * hd].reshape(t, -1)))
    (dq64, dk64), (dq, dk) = got
    assert np.median(np.exp(q[:, :hd] @ k[0, :hd] * hd ** -0.5 - y[:, nh * hd])) > 0.95
    assert rel_err(dq, dq64) <= 1.2e-2 and rel_err(dk, dk64) <= 1e-2
    assert np.linalg.norm(dk[0] - dk64[0]) / np.linalg.norm(dk64[0]) <= 1e-2


def test_bf16_fused_attention_adds_the_remainder_of_every_large_p():
    """The forward's P V under bf16 takes p rounded to bf16 plus, for each p above 1/16
    of its row's sum, the remainder p - bf16(p) (flash.c's fa_pv_remainder), so that
    the backward's D = rowsum(dO O) matches its float32 p.  With q, k and v already bf16
    values and every p of a row within a factor e^0.4 of the others (8 keys at most,
    scores within +-0.2), every p is large: O comes out as exact as float32's rounding,
    where p rounded once would leave it about 2^-9 off."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    def bf16_values(a):  # float32 values with 8 significant bits, exact in bf16
        u = a.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        return u.view(np.float32)

    t, nh, nkv, hd = 8, 4, 2, 64
    rng = np.random.default_rng(0)
    q = bf16_values(rng.uniform(-1, 1, (t, nh * hd)) / 8)
    k = bf16_values(rng.uniform(-1, 1, (t, nkv * hd)) / 8)
    v = bf16_values(rng.standard_normal((t, nkv * hd)))
    kw = dict(spec=tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, tile=128))
    y64 = np.empty((t, nh * hd + nh))
    tiled.fwd_attn(y64, *(a.astype(np.float64) for a in (q, k, v)), **kw)
    scores = [q[:, h * hd:(h + 1) * hd].astype(np.float64) @ k[:, h // 2 * hd:][:, :hd].T
              for h in range(nh)]
    assert max(np.abs(s).max() for s in scores) * hd ** -0.5 <= 0.2
    y = np.empty(y64.shape, np.float32)
    c = CTiles(np.float32, True)
    assert c.fused_attn(y, q, k, v, tiled.AttnLayout(t, t, 1, 0, None, 128), kw["spec"])
    assert rel_err(y, y64) <= 1e-5


def test_fused_attention_leaves_masked_segments_to_the_walk():
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles

    seg = np.array([0, 0, 1, 1, 0, 0])  # id 0 twice: a mask, not column ranges
    lay = tiled.AttnLayout(6, 6, 1, 0, seg, 128)
    x = np.zeros((6, 4), np.float32)
    spec = tiled.AttentionSpec(nh=1, nkv=1, hd=4, iscale=1.0)
    assert not CTiles(np.float32).fused_attn(np.empty((6, 5), np.float32), x, x, x, lay,
                                              spec)
    assert not CTiles(np.float64).fused_attn(None, x, x, x, tiled.AttnLayout(
        6, 6, 1, 0, None, 128), spec)


@pytest.mark.parametrize("qtype", [None, "Q4_K"])
def test_bf16_head_gemms_are_within_bf16_rounding(qtype):
    """The fused head's products with bf16 inputs (cpu.tiled.Bf16HeadGemms, --compute bf16)
    against NumPy's in float64: the loss, lse, E and the gradient w.r.t. x, over a float
    table and one kept in Q4_K blocks, the vocabulary in blocks with a narrower last one
    (its logits a block of columns of the scratch); within the bound of the attention's
    (BF16_ATTN_TOL: each product's inputs rounded to 8 bits), and not float32's."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles
    from gradtape.blocks import dequantize, random_blocks

    hardware.onednn_bf16()
    rng = np.random.default_rng(5)
    t, d, v, chunk = 40, 256, 700, 256  # blocks of 256, 256, 188 vocabulary rows
    x = rng.standard_normal((t, d)).astype(np.float32)
    if qtype:
        w = random_blocks(qtype, v, d, rng, std=0.1).data
        w64 = dequantize(w, qtype).astype(np.float64)
    else:
        w = (rng.standard_normal((v, d)) * 0.1).astype(np.float32)
        w64 = w.astype(np.float64)
    ids = rng.integers(0, v, t)
    g = rng.standard_normal((t, 2))
    want = np.empty((t, 2 + d))
    tiled.fwd_head_nll_e(want, x.astype(np.float64), w64, ids, chunk)
    want_gx = np.empty((t, d))
    tiled.fwd_head_nll_grad_x(want_gx, g, x.astype(np.float64), w64, ids, want, 3.0, chunk)
    got = np.empty((t, 2 + d), np.float32)
    k16 = CTiles(np.float32, bf16=True)
    tiled.fwd_head_nll_e(got, x, w, ids, chunk, qtype=qtype, kern=k16)
    got_gx = np.empty((t, d), np.float32)
    tiled.fwd_head_nll_grad_x(got_gx, g.astype(np.float32), x, w, ids, got, 3.0, chunk,
                              qtype=qtype, kern=k16)
    for a, b in ((got[:, :2], want[:, :2]), (got[:, 2:], want[:, 2:]), (got_gx, want_gx)):
        assert 1e-5 < rel_err(a, b) <= BF16_ATTN_TOL


@pytest.mark.parametrize("qtype", [None, "Q4_K"])
def test_onednn_head_gemms_equal_numpys(qtype, monkeypatch):
    """The fused head's float32 products in oneDNN (cpu.tiled.OnednnHeadGemms, a float32
    step whose GEMMs run there) against NumPy's HeadGemms: the loss, lse, E, the
    gradient w.r.t. x and, for a float table (a trained one), w.r.t. the table, the
    vocabulary in blocks with a narrower last one (its logits a block of columns of the
    scratch); float32 sums in another order, within 1e-5."""
    from gradtape import tiled
    from gradtape.backends.cpu import onednn
    from gradtape.backends.cpu.tiled import CTiles, OnednnHeadGemms
    from gradtape.blocks import random_blocks

    hardware.onednn_f32()
    rng = np.random.default_rng(6)
    t, d, v, chunk = 40, 256, 700, 256
    x = rng.standard_normal((t, d)).astype(np.float32)
    w = (random_blocks(qtype, v, d, rng, std=0.1).data if qtype
         else (rng.standard_normal((v, d)) * 0.1).astype(np.float32))
    ids = rng.integers(0, v, t)
    g = rng.standard_normal((t, 2)).astype(np.float32)
    ran = []
    real = onednn._Dnnl.matmul_f32

    def counted(self, out, a, b):
        ran.append(real(self, out, a, b))
        return ran[-1]
    monkeypatch.setattr(onednn._Dnnl, "matmul_f32", counted)
    outs = []
    for kern in (CTiles(np.float32), CTiles(np.float32, f32_onednn=True)):
        e = np.empty((t, 2 + d), np.float32)
        tiled.fwd_head_nll_e(e, x, w, ids, chunk, qtype=qtype, kern=kern)
        gx = np.empty((t, d), np.float32)
        tiled.fwd_head_nll_grad_x(gx, g, x, w, ids, e, 3.0, chunk, qtype=qtype, kern=kern)
        outs.append((e, gx))
        if qtype is None:
            gw = np.empty((v, d), np.float32)
            tiled.fwd_head_nll_grad_w(gw, g, x, w, ids, e, 3.0, chunk, kern=kern)
            outs[-1] += (gw,)
    kern = CTiles(np.float32, f32_onednn=True)
    assert kern.head_gemms is OnednnHeadGemms and kern.grad_w_gemms is OnednnHeadGemms
    assert ran and all(ran)  # every block's products in oneDNN
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_head_keeps_its_scratch_between_calls(bf16):
    """A program's CTiles keep the fused head's scratch (the logits block, the products,
    a block table's dequantized rows) for the next call instead of new arrays each step:
    the second call of a shape reuses the first's memory, a larger one grows it, and every
    result equals that of kernels that never ran before, bit for bit (the same kernels on
    the same shapes and page-aligned buffers, summing in the same order: nothing of an
    earlier call may leak in).  A block table's rows come from the C kernels, gguf's bits."""
    from gradtape import tiled
    from gradtape.backends.cpu.tiled import CTiles
    from gradtape.blocks import dequantize, random_blocks

    if bf16:
        hardware.onednn_bf16()
    rng = np.random.default_rng(8)
    d, v, chunk = 256, 700, 256
    w = random_blocks("Q4_K", v, d, rng, std=0.1).data
    kept = CTiles(np.float32, bf16)

    def head(kern, t):
        x = np.random.default_rng(t).standard_normal((t, d)).astype(np.float32)
        ids = np.random.default_rng(t + 1).integers(0, v, t)
        e = np.empty((t, 2 + d), np.float32)
        tiled.fwd_head_nll_e(e, x, w, ids, chunk, qtype="Q4_K", kern=kern)
        gx = np.empty((t, d), np.float32)
        g = np.ones((t, 2), np.float32)
        tiled.fwd_head_nll_grad_x(gx, g, x, w, ids, e, 0.0, chunk, qtype="Q4_K", kern=kern)
        return e, gx

    for t in (40, 40, 72, 24):
        before = {name: a.ctypes.data for name, a in kept._buffers.items()}
        for a, b in zip(head(kept, t), head(CTiles(np.float32, bf16), t)):
            np.testing.assert_array_equal(a, b)
        if t == 40 and before:  # the second call of a shape: the same memory
            assert {name: a.ctypes.data for name, a in kept._buffers.items()} == before
    assert "head logits" in kept._buffers
    rows = kept.table_rows(w, 100, 356, "Q4_K", d, np.float32)
    np.testing.assert_array_equal(rows, dequantize(w[100:356], "Q4_K"))


def test_bf16_head_takes_a_block_table_in_either_layout(monkeypatch, tmp_path):
    """Under bf16 compute the fused head dequantizes a block table's rows either into
    plain rows or straight into the blocked layout of both its products (``compute.
    fastest`` picks; ``$GRADTAPE_BF16_LAYOUT`` leaves one way): the outputs agree (the
    same bf16 operands, float32 sums), only the chosen way's scratch is kept, and the
    choice is made once, on the first block."""
    from gradtape import tiled
    from gradtape import plan
    from gradtape.backends.cpu import measure as compute
    from gradtape.backends.cpu.tiled import Bf16HeadGemms, CTiles
    from gradtape.blocks import random_blocks

    hardware.onednn_bf16()
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    rng = np.random.default_rng(9)
    t, d, v, chunk = 48, 256, 768, 256  # whole blocks, each of the probed shape
    w = random_blocks("Q6_K", v, d, rng, std=0.1).data
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = rng.integers(0, v, t)
    g = rng.standard_normal((t, 2)).astype(np.float32)
    probe = Bf16HeadGemms(x, w, "Q6_K", CTiles(np.float32, True))
    if not probe._blocks(chunk):
        pytest.skip("oneDNN's bf16 kernel here keeps its weights in another layout")
    asked, real = [], compute.fastest
    monkeypatch.setattr(compute, "fastest",
                        lambda what, shape, runs, only=((), ""): asked.append(what)
                        or real(what, shape, runs, only))
    outs = {}
    for layout in ("blocked", "plain"):
        monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
        execution = plan.for_program("cpu", "bf16")  # the way the plan leaves
        kern = CTiles(np.float32, True, only=(execution.product_ways, execution.product_tile))
        e = np.empty((t, 2 + d), np.float32)
        tiled.fwd_head_nll_e(e, x, w, ids, chunk, qtype="Q6_K", kern=kern)
        gx = np.empty((t, d), np.float32)
        tiled.fwd_head_nll_grad_x(gx, g, x, w, ids, e, 0.0, chunk, qtype="Q6_K", kern=kern)
        outs[layout] = e, gx
        kept = set(kern._buffers)
        assert ("head rows16 W^T" in kept) == (layout == "blocked")
        assert ("head rows16" in kept) == (layout == "plain")
    assert asked == ["head Q6_K"] * 4  # each walk decided on its first block
    for a, b in zip(*outs.values()):
        assert rel_err(a, b) < 1e-5
