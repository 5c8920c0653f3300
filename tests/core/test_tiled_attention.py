"""Tiled attention (``ops.attn``, ``nn.tiled_attention``) equals the composed attention
(``nn.gqa_attention_seqs`` / ``nn.gqa_attention`` / ``nn.attention`` with additive masks):
values and every gradient, float64 and float32, with causal masks, sliding windows, GQA,
soft-capping, packed segments and cached keys before the query rows; and it never visits
a key tile that no query of a tile sees."""

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops, tiled

from support.compare import rel_err
from support.fd import BACKENDS, FD_TOL, check_fd

# Another summation order (tiles, an online softmax rescaled as the row max grows):
TOL = {np.float64: 1e-12,  # float64 rounding over a few hundred terms
       np.float32: 2e-5}  # float32 eps 6e-8 times softmax conditioning and ~1e2 terms


def _qkv(r, n, nh, nkv, hd, dtype):
    return [(r.standard_normal((n, m * hd))).astype(dtype) for m in (nh, nkv, nkv)]


def _compare(tp, fused, ref, params, dtype):
    u = tp.const(np.random.default_rng(9).standard_normal(fused.shape).astype(dtype))
    gf = tp.backward(ops.reduce_sum(ops.mul(fused, u)))
    gr = tp.backward(ops.reduce_sum(ops.mul(ref, u)))
    assert rel_err(fused.value, ref.value) <= TOL[dtype]
    for p in params:
        assert rel_err(gf[p].value, gr[p].value) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n_seq, t, nh, nkv, hd, window, cap, tile", [
    (1, 13, 4, 2, 8, 0, 0.0, 4),  # GQA, a partial last tile
    (2, 9, 3, 1, 4, 0, 0.0, 3),  # two sequences, one kv head for three query heads
    (1, 16, 2, 2, 4, 5, 0.0, 4),  # a sliding window: far tiles skipped
    (2, 11, 4, 2, 6, 4, 30.0, 4),  # window and soft-capping (Gemma 2)
    (1, 7, 2, 1, 4, 0, 2.0, 16),  # a single tile, a strong cap
])
def test_tiled_attention_equals_composed(dtype, n_seq, t, nh, nkv, hd, window, cap, tile):
    r = np.random.default_rng(t * 10 + nh)
    tp = gt.Tape(dtype)
    q, k, v = (tp.param(a) for a in _qkv(r, n_seq * t, nh, nkv, hd, dtype))
    c, s = nn.rope_fill(t, hd, 1e4)
    cc, sc = tp.const(c), tp.const(s)
    spec = tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, cap, window, n_seq, tile)
    fused = nn.tiled_attention(tp, q, k, v, cc, sc, spec)
    mask = tp.const(nn.causal_mask_fill(t, window=window))
    ref = nn.gqa_attention_seqs(tp, q, k, v, cc, sc, mask, spec)
    _compare(tp, fused, ref, (q, k, v), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seg", [[0] * 5 + [1] * 2 + [2] * 7,  # packed: runs (column ranges)
                                 [0] * 3 + [1] * 4 + [0] * 3 + [2] * 4])  # an id twice: a mask
def test_tiled_attention_with_packed_segments(dtype, seg):
    """Examples packed into one row: key j is seen by query i iff j <= i and both are in
    the same example; equal to the composed attention with that additive mask, whether the
    layout takes the examples' limits as column ranges (contiguous runs) or as a mask."""
    r = np.random.default_rng(3)
    t, nh, nkv, hd = 14, 4, 2, 4
    seg = np.array(seg)
    tp = gt.Tape(dtype)
    q, k, v = (tp.param(a) for a in _qkv(r, t, nh, nkv, hd, dtype))
    c, s = nn.rope_fill(t, hd, 1e4)
    cc, sc = tp.const(c), tp.const(s)
    spec = tiled.AttentionSpec(nh, nkv, hd, 0.5, tile=4)
    fused = nn.tiled_attention(tp, q, k, v, cc, sc, spec, segments=tp.const(seg))
    mask = nn.causal_mask_fill(t) + np.where(seg[:, None] == seg[None, :], 0.0,
                                             nn.MASK_VALUE)
    ref = nn.gqa_attention(tp, q, k, v, cc, sc, tp.const(mask), t, nh, nkv, hd, 0.5)
    _compare(tp, fused, ref, (q, k, v), dtype)


@pytest.mark.parametrize("window", [0, 6])
def test_tiled_attention_after_cached_keys(window):
    """Query rows after ``past`` cached keys (a prefill chunk): ``ops.attn`` on roped rows
    equals ``nn.attention`` with ``causal_mask_fill(t, past=...)``."""
    r = np.random.default_rng(4)
    t, past, nh, nkv, hd = 5, 8, 4, 2, 4
    tp = gt.Tape()
    q = tp.param(r.standard_normal((t, nh * hd)))
    k, v = (tp.param(r.standard_normal((past + t, nkv * hd))) for _ in range(2))
    out = ops.attn(q, k, v, tiled.AttentionSpec(nh, nkv, hd, 0.4, window=window, tile=3))
    fused = ops.slice_(out, 1, 0, nh * hd)
    ref = nn.attention(tp, q, k, v, tp.const(nn.causal_mask_fill(t, past=past, window=window)),
                       nh, nkv, hd, 0.4)
    _compare(tp, fused, ref, (q, k, v), np.float64)


@pytest.mark.parametrize("cap, window, seg", [(0.0, 0, False), (1.5, 3, True)])
def test_tiled_attention_finite_differences(cap, window, seg):
    """Both parts of the output (the heads' values and the rows' logsumexp) against
    finite differences, through several tiles."""
    r = np.random.default_rng(5)
    n, nh, nkv, hd = 7, 2, 1, 3
    q, k, v = _qkv(r, n, nh, nkv, hd, np.float64)
    ids = np.array([0, 0, 0, 1, 1, 1, 1])

    def build(tp, q, k, v, *s):
        return ops.attn(q, k, v, tiled.AttentionSpec(nh, nkv, hd, 0.7, cap, window, tile=2),
                        *s)

    assert check_fd(build, [q, k, v] + [ids] * seg) <= FD_TOL[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiled_attention_replays(backend):
    r = np.random.default_rng(6)
    t, nh, nkv, hd = 10, 4, 2, 4
    tp = gt.Tape()
    q, k, v = (tp.param(a) for a in _qkv(r, t, nh, nkv, hd, np.float64))
    c, s = nn.rope_fill(t, hd, 1e4)
    spec = tiled.AttentionSpec(nh, nkv, hd, 0.5, window=6, tile=4)
    out = nn.tiled_attention(tp, q, k, v, tp.const(c), tp.const(s), spec)
    loss = ops.reduce_sum(ops.mul(out, out))
    g = tp.backward(loss)
    prog = tp.compile([out, g[q], g[k], g[v]], backend=backend)
    new = _qkv(r, t, nh, nkv, hd, np.float64)
    got = prog.run(dict(zip((q, k, v), new)))
    tp2 = gt.Tape()
    q2, k2, v2 = (tp2.param(a) for a in new)
    out2 = nn.tiled_attention(tp2, q2, k2, v2, tp2.const(c), tp2.const(s), spec)
    g2 = tp2.backward(ops.reduce_sum(ops.mul(out2, out2)))
    want = [out2.value, g2[q2].value, g2[k2].value, g2[v2].value]
    for a, b in zip(got, want):
        # numpy: the very same forwards in the same order; cpu: the same NumPy forwards
        # for the tiled ops, C kernels around them
        assert rel_err(a, b) <= (0.0 if backend == "numpy" else 1e-13)


def _visited(n, tile, window=0, seg=None, n_seq=1, ktile=None):
    lay = tiled.AttnLayout(n, n, n_seq, window, seg, tile, ktile)
    return {(q0, k0) for q0, q1, b in lay.q_tiles() for k0, _, _ in lay.k_tiles(q0, q1, b)}


def test_tiles_outside_the_mask_are_skipped():
    # causal: the 4 x 4 tiles on and below the diagonal only
    assert _visited(16, 4) == {(i, j) for i in range(0, 16, 4) for j in range(0, i + 1, 4)}
    # a window of 4: each query tile sees its own and the previous tile
    assert _visited(16, 4, window=4) == {(0, 0)} | {(i, j) for i in (4, 8, 12)
                                                    for j in (i - 4, i)}
    # two packed examples of 8 rows: no tile pairs rows of different examples
    seg = np.array([0] * 8 + [1] * 8)
    assert _visited(16, 4, seg=seg) == {(0, 0), (4, 0), (4, 4), (8, 8), (12, 8), (12, 12)}
    # packed runs not on tile edges: a query tile's keys start at the query tile edge
    # before its first row's example (rows 8-11 are in the example from row 6: keys from
    # 4), in key tiles of 8 from there
    seg = np.array([0] * 2 + [1] * 4 + [2] * 10)
    assert tiled.run_starts(seg, 16).tolist() == [0] * 2 + [2] * 4 + [6] * 10
    assert _visited(16, 4, seg=seg, ktile=8) == {(0, 0), (4, 0), (8, 4), (12, 4), (12, 12)}
    lay = tiled.AttnLayout(16, 16, 1, 0, seg, 4, 8)
    assert [(k0, k1) for k0, k1, _ in lay.k_tiles(8, 12, 0)] == [(4, 12)]
    lay = tiled.AttnLayout(16, 16, 1, 0, seg, 4, 4)
    assert [(k0, k1) for k0, k1, _ in lay.k_tiles(12, 16, 0)] == [(4, 8), (8, 12), (12, 16)]
    (k0, k1, vis), = [x for x in lay.k_tiles(12, 16, 0) if x[0] == 4]
    assert vis.mask is None and vis.lo.tolist() == [2] * 4 and vis.hi.tolist() == [4] * 4
    # an id in two runs: a mask
    assert tiled.run_starts(np.array([0, 0, 1, 0]), 4) is None
    # two stacked sequences: the second's tiles start at its own rows
    assert _visited(8, 4, n_seq=2) == {(0, 0), (4, 4)}
    # key tiles of 8 over query tiles of 4: a tile ends at the query tile's last row
    assert _visited(16, 4, ktile=8) == {(0, 0), (4, 0), (8, 0), (8, 8), (12, 0), (12, 8)}


def test_visible_ranges_are_the_causal_window_mask():
    """Each key tile's ``Visible`` marks exactly the keys ``causal_mask`` leaves at 0."""
    n, past = 13, 4
    for window in (0, 5):
        want = tiled.causal_mask(n, past, window) == 0  # [n, past + n]
        lay = tiled.AttnLayout(n, n + past, 1, window, None, 3, 6)
        got = np.zeros_like(want)
        for q0, q1, b in lay.q_tiles():
            for k0, k1, vis in lay.k_tiles(q0, q1, b):
                got[q0:q1, k0:k1] = True if vis is None else vis.dense(k1 - k0)
        assert (got == want).all()


def test_tiled_attention_shape_errors():
    tp = gt.Tape()
    q, k = tp.param(np.zeros((6, 8))), tp.param(np.zeros((6, 4)))
    with pytest.raises(ValueError, match=r"attn\(\[6, 8\], \[6, 4\], \[6, 4\].*"
                                         r"q\[6, 8\] must be \[N, nh\*hd = 12\]"):
        ops.attn(q, k, k, tiled.AttentionSpec(nh=3, nkv=1, hd=4, iscale=0.5))
    with pytest.raises(ValueError, match="nh=3 is not a multiple of nkv=2"):
        ops.attn(q, k, k, tiled.AttentionSpec(nh=3, nkv=2, hd=2, iscale=0.5))
    with pytest.raises(ValueError, match=r"segment ids\[5\] need \[N\]"):
        ops.attn(q, k, k, tiled.AttentionSpec(nh=2, nkv=1, hd=4, iscale=0.5),
                 tp.const(np.zeros(5, np.int64)))
    with pytest.raises(ValueError, match="6 query rows and 6 key rows do not split into 4"):
        ops.attn(q, k, k, tiled.AttentionSpec(nh=2, nkv=1, hd=4, iscale=0.5, n_seq=4))
