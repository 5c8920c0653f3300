"""Fused / batched layer variants equal their composed versions (values and gradients)."""

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops

from support.fd import BACKENDS


@pytest.mark.parametrize("n_seq, t, nh, nkv, hd", [
    (1, 5, 4, 2, 8), (3, 7, 6, 2, 4), (2, 4, 3, 3, 6), (2, 5, 3, 1, 4), (1, 1, 2, 1, 2)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_attention_equals_per_sequence_gqa(n_seq, t, nh, nkv, hd, backend):
    r = np.random.default_rng(n_seq * 100 + t)
    tp = gt.Tape(np.float64)
    q = tp.param(r.standard_normal((n_seq * t, nh * hd)))
    k = tp.param(r.standard_normal((n_seq * t, nkv * hd)))
    v = tp.param(r.standard_normal((n_seq * t, nkv * hd)))
    c, s = nn.rope_fill(t, hd, 31337.0)
    cc, sc, m = tp.const(c), tp.const(s), tp.const(nn.causal_mask_fill(t))
    iscale = hd ** -0.5
    fused = nn.gqa_attention_seqs(tp, q, k, v, cc, sc, m,
                                  nn.AttentionSpec(nh, nkv, hd, iscale, n_seq=n_seq))
    rows = lambda x, i: ops.slice_(x, 0, i * t, (i + 1) * t)
    ref = ops.concat([nn.gqa_attention(tp, rows(q, i), rows(k, i), rows(v, i), cc, sc, m, t,
                                       nh, nkv, hd, iscale) for i in range(n_seq)], 0)
    u = tp.const(r.standard_normal(fused.shape))
    gf = tp.backward(ops.reduce_sum(fused * u))
    gr = tp.backward(ops.reduce_sum(ref * u))
    outs = tp.compile([fused, ref] + [gf[x] for x in (q, k, v)] + [gr[x] for x in (q, k, v)],
                      backend=backend).run()
    # the same math in another association order: float64 rounding only
    tol = 1e-13
    assert np.abs(outs[0] - outs[1]).max() <= tol * np.abs(outs[1]).max()
    for a, b in zip(outs[2:5], outs[5:8]):
        assert np.abs(a - b).max() <= tol * np.abs(b).max()


def test_batched_attention_rejects_bad_heads():
    tp = gt.Tape()
    q, k = tp.param(np.zeros((4, 12))), tp.param(np.zeros((4, 8)))
    c, s = nn.rope_fill(4, 4, 1e4)
    with pytest.raises(ValueError, match="nh=3 is not a multiple of nkv=2"):
        nn.gqa_attention_seqs(tp, q, k, k, tp.const(c), tp.const(s),
                              tp.const(nn.causal_mask_fill(4)), nn.AttentionSpec(3, 2, 4, 0.5))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_is_its_composed_form_bit_for_bit(dtype, backend):
    """``ops.rope`` (one op forward and backward) against the slices, products and
    concat it replaces, autodiff'd: the same products summed in the same pairs, so the
    same bits, the gradients of the tables included."""
    from gradtape.ops.rotary import _composed

    r = np.random.default_rng(5)
    tp = gt.Tape(dtype)
    x = tp.param(r.standard_normal((12, 8)))
    c, s = (tp.param(r.standard_normal((12, 4))) for _ in range(2))
    u = tp.const(r.standard_normal((12, 8)))
    outs = []
    for y in (ops.rope(x, c, s), _composed(tp, x, c, s)):
        g = tp.backward(ops.reduce_sum(ops.mul(y, u)))
        outs.append([y, g[x], g[c], g[s]])
    got = tp.compile(outs[0] + outs[1], backend=backend).run()
    for a, b in zip(got[:4], got[4:]):
        np.testing.assert_array_equal(a, b)


def test_rope_decomposes_for_a_backend_without_kernel(monkeypatch):
    """A backend with no rope kernel (cuda) runs the composed form: no rope op left, the
    same bits forward and backward."""
    from gradtape.backends.numpy import NumpyBackend

    r = np.random.default_rng(6)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((6, 4)))
    c, s = (tp.const(r.standard_normal((6, 2))) for _ in range(2))
    y = ops.rope(x, c, s)
    outs = [y, tp.backward(ops.reduce_sum(ops.mul(y, y)))[x]]
    want = [v.value for v in outs]
    monkeypatch.setattr(NumpyBackend, "has_kernel", staticmethod(lambda op: False))
    prog = tp.compile(outs, backend="numpy")
    assert not [v for v in prog.graph.ops if v.op == "rope"]
    for a, b in zip(prog.run(), want):
        np.testing.assert_array_equal(a, b)
