"""Every layer of ``gradtape.nn`` against a PyTorch float64 implementation written here
(independently: torch's own layer_norm, silu, softmax, cross_entropy and scaled-dot-product
attention where they exist, Hugging Face's rotate_half rope), forward and gradients via
torch.autograd.  Metric: max |ours - torch| / max |torch| <= 1e-11 (float64 rounding of
these small graphs stays near 1e-15; 1e-11 is the issue's contract)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtape as gt
from gradtape import nn

from support.compare import rel_err
from support.fd import Const

F = torch.nn.functional

ORACLE_TOL = 1e-11


def ours(build, inputs, u):
    """Our forward value and the gradients of sum(out * u) for the float (non-Const)
    inputs, in input order."""
    tp = gt.Tape()
    vs, params = [], []
    for a in inputs:
        if isinstance(a, Const):
            vs.append(tp.const(a.value))
        elif np.issubdtype(np.asarray(a).dtype, np.integer):
            vs.append(tp.const(a))
        else:
            vs.append(tp.param(a))
            params.append(vs[-1])
    out = build(tp, *vs)
    loss = gt.ops.reduce_sum(gt.ops.mul(out, tp.const(u)))
    g = tp.backward(loss)
    return out.value, [g[p].value for p in params]


def theirs(fn, inputs, u):
    """torch float64: forward of ``fn(*tensors)`` and gradients of sum(out * u)."""
    ts, params = [], []
    for a in inputs:
        if isinstance(a, Const):
            ts.append(torch.tensor(a.value, dtype=torch.float64))
        elif np.issubdtype(np.asarray(a).dtype, np.integer):
            ts.append(torch.tensor(a, dtype=torch.long))
        else:
            ts.append(torch.tensor(a, dtype=torch.float64, requires_grad=True))
            params.append(ts[-1])
    out = fn(*ts)
    out.backward(torch.tensor(u, dtype=torch.float64))
    return out.detach().numpy(), [p.grad.numpy() for p in params]


def compare(build, fn, inputs, seed=0):
    """Worst relative error over the forward value and every gradient."""
    rng = np.random.default_rng(seed)
    tp = gt.Tape()
    shape = build(tp, *[tp.const(a.value) if isinstance(a, Const) else tp.const(np.asarray(a))
                        for a in inputs]).shape
    u = rng.standard_normal(shape)
    o1, g1 = ours(build, inputs, u)
    o2, g2 = theirs(fn, inputs, u)
    assert len(g1) == len(g2)
    return max([rel_err(o1, o2)] + [rel_err(a, b) for a, b in zip(g1, g2)])


# --- torch references, written from the math (Hugging Face conventions) --------------------

def t_rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def t_rope_tables(t, hd, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)  # [t, hd/2]
    return freqs.cos(), freqs.sin()


def t_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def t_rope(h, cos, sin):
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # [t, hd]
    return h * cos2 + t_rotate_half(h) * sin2


def t_gqa(q, k, v, t, nh, nkv, hd, base):
    cos, sin = t_rope_tables(t, hd, base)
    q = q.view(t, nh, hd).transpose(0, 1)  # [nh, t, hd]
    k = k.view(t, nkv, hd).transpose(0, 1)
    v = v.view(t, nkv, hd).transpose(0, 1)
    q, k = t_rope(q, cos, sin), t_rope(k, cos, sin)
    k = k.repeat_interleave(nh // nkv, dim=0)  # HF repeat_kv: head qi uses qi // group
    v = v.repeat_interleave(nh // nkv, dim=0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / hd ** 0.5)
    return o.transpose(0, 1).reshape(t, nh * hd)


def _onehot(targets, V):
    oh = np.zeros((len(targets), V))
    oh[np.arange(len(targets)), targets] = 1.0
    return oh


R = np.random.default_rng(2024)
T, H, O, RK = 7, 10, 6, 3


def _n(*s, scale=1.0):
    return R.standard_normal(s) * scale


def layer_cases():
    cases = []

    def case(cid, build, fn, *inputs):
        cases.append((cid, build, fn, list(inputs)))

    case("linear", lambda tp, x, w: nn.linear(tp, x, w), lambda x, w: x @ w, _n(T, H), _n(H, O))
    case("linear_bias", lambda tp, x, w, b: nn.linear_bias(tp, x, w, b),
         lambda x, w, b: F.linear(x, w.T, b), _n(T, H), _n(H, O), _n(O))
    s = 16.0 / RK
    case("lora_linear", lambda tp, x, w0, a, b: nn.lora_linear(tp, x, w0, a, b, s),
         lambda x, w0, a, b: x @ w0 + s * ((x @ a) @ b),
         _n(T, H), Const(_n(H, O)), _n(H, RK), _n(RK, O))
    for name, sc, eps in (("unit", 1.0, 1e-5), ("large", 1e3, 1e-6), ("small", 1e-3, 1e-5)):
        case(f"rmsnorm_{name}",
             lambda tp, x, w, eps=eps: nn.rmsnorm(tp, x, w, nn.ones(tp, H), H, eps),
             lambda x, w, eps=eps: t_rmsnorm(x, w, eps), _n(T, H, scale=sc), _n(H))
        case(f"layernorm_{name}",
             lambda tp, x, w, b, eps=eps: nn.layernorm(tp, x, w, b, nn.ones(tp, H), H, eps),
             lambda x, w, b, eps=eps: F.layer_norm(x, (H,), w, b, eps),
             (_n(T, H) + 2.0) * sc, _n(H), _n(H))
    case("silu", lambda tp, x: nn.silu(tp, x), F.silu, _n(T, H, scale=4))
    case("swiglu", lambda tp, g, u: nn.swiglu(tp, g, u), lambda g, u: F.silu(g) * u,
         _n(T, H, scale=3), _n(T, H))
    case("gelu_tanh", lambda tp, x: nn.gelu_tanh(tp, x),
         lambda x: F.gelu(x, approximate="tanh"), _n(T, H, scale=4))
    case("geglu", lambda tp, g, u: nn.geglu(tp, g, u),
         lambda g, u: F.gelu(g, approximate="tanh") * u, _n(T, H, scale=3), _n(T, H))
    case("softcap", lambda tp, x: nn.softcap(tp, x, 5.0), lambda x: torch.tanh(x / 5.0) * 5.0,
         _n(T, H, scale=10))
    for ax in (0, 1):
        case(f"softmax_axis{ax}", lambda tp, x, ax=ax: nn.softmax(tp, x, ax),
             lambda x, ax=ax: torch.softmax(x, ax), _n(T, H, scale=3))
    for hd, base in ((4, 10000.0), (8, 100000.0), (6, 500.0)):
        cos, sin = nn.rope_fill(T, hd, base)
        case(f"rope_hd{hd}", lambda tp, h, c, s_, hd=hd: nn.rope(tp, h, c, s_, T, hd),
             lambda h, c, s_, hd=hd, base=base: t_rope(h, *t_rope_tables(T, hd, base)),
             _n(T, hd), Const(cos), Const(sin))
    case("head", lambda tp, q: nn.head(tp, q, T, 2, 3), lambda q: q[:, 6:9], _n(T, 12))
    for nh, nkv in ((1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (6, 2), (6, 3)):
        hd, base = (4, 10000.0) if nh != 3 else (6, 1000.0)
        cos, sin = nn.rope_fill(T, hd, base)
        mask = nn.causal_mask_fill(T)
        case(f"gqa_{nh}_{nkv}",
             lambda tp, q, k, v, c, s_, m, nh=nh, nkv=nkv, hd=hd: nn.gqa_attention(
                 tp, q, k, v, c, s_, m, T, nh, nkv, hd, 1.0 / np.sqrt(hd)),
             lambda q, k, v, c, s_, m, nh=nh, nkv=nkv, hd=hd, base=base: t_gqa(
                 q, k, v, T, nh, nkv, hd, base),
             _n(T, nh * hd), _n(T, nkv * hd), _n(T, nkv * hd), Const(cos), Const(sin),
             Const(mask))
    V = 9
    tg = R.integers(0, V, T)
    oh = _onehot(tg, V)
    tgt = torch.tensor(tg)
    case("cross_entropy", lambda tp, lg, o: nn.cross_entropy(tp, lg, o, nn.ones(tp, V)),
         lambda lg, o: F.cross_entropy(lg, tgt), _n(T, V, scale=2), Const(oh))
    for keep in (1, 4, T):
        case(f"cross_entropy_rows_keep{keep}",
             lambda tp, lg, o, keep=keep: nn.cross_entropy_rows(tp, lg, o, nn.ones(tp, V), keep),
             lambda lg, o, keep=keep: F.cross_entropy(lg[:keep], tgt[:keep]),
             _n(T, V, scale=2), Const(oh))
    ign = tg.copy()
    ign[[1, 4]] = -100
    ids, w = nn.ce_targets_fill(ign)
    case("cross_entropy_ids", lambda tp, lg, i, w_: nn.cross_entropy_ids(tp, lg, i, w_),
         lambda lg, i, w_: F.cross_entropy(lg, torch.tensor(ign), ignore_index=-100),
         _n(T, V, scale=2), ids, Const(w))
    case("cross_entropy_ids_large_logits",
         lambda tp, lg, i, w_: nn.cross_entropy_ids(tp, lg, i, w_),
         lambda lg, i, w_: F.cross_entropy(lg, torch.tensor(ign), ignore_index=-100),
         _n(T, V, scale=20) + 800.0, ids, Const(w))
    return cases


CASES = layer_cases()


@pytest.mark.parametrize("cid,build,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_layer_vs_torch_float64(cid, build, fn, inputs):
    err = compare(build, fn, inputs)
    assert err <= ORACLE_TOL, f"{cid}: relative error {err:.3e} vs torch float64"


@pytest.mark.parametrize("t,hd,base,start", [(7, 4, 10000.0, 0), (33, 64, 1e5, 0),
                                              (5, 8, 500.0, 11)])
def test_rope_fill_vs_torch(t, hd, base, start):
    cos, sin = nn.rope_fill(t, hd, base, start=start)
    tc, ts = t_rope_tables(start + t, hd, base)
    assert cos.shape == sin.shape == (t, hd // 2)
    assert rel_err(cos, tc[start:].numpy()) <= ORACLE_TOL
    assert rel_err(sin, ts[start:].numpy()) <= ORACLE_TOL
    # in-place filling into caller arrays (float32 too)
    co, so = np.empty((t, hd // 2), np.float32), np.empty((t, hd // 2), np.float32)
    rc, rs = nn.rope_fill(t, hd, base, cos_out=co, sin_out=so, start=start)
    assert rc is co and rs is so
    np.testing.assert_array_equal(co, cos.astype(np.float32))


def test_causal_mask_fill():
    m = nn.causal_mask_fill(4)
    ref = torch.triu(torch.full((4, 4), -1e9, dtype=torch.float64), diagonal=1).numpy()
    np.testing.assert_array_equal(m, ref)
    out = np.empty((3, 5))
    assert nn.causal_mask_fill(3, out=out, past=2) is out
    np.testing.assert_array_equal(out, np.triu(np.full((3, 5), -1e9), k=3))


def test_causal_mask_fill_sliding_window():
    """Row i (at position past + i) sees keys j with past + i - window < j <= past + i:
    transformers' sliding-window rule (kv_idx > q_idx - window, and causal)."""
    for t, past, window in ((6, 0, 2), (3, 5, 4), (4, 2, 1), (5, 0, 9)):
        q = np.arange(past, past + t)[:, None]
        k = np.arange(past + t)[None, :]
        seen = (k <= q) & (k > q - window)
        np.testing.assert_array_equal(nn.causal_mask_fill(t, past=past, window=window),
                                      np.where(seen, 0.0, -1e9))


def test_rope_fill_frequency_factors():
    """Factors divide each frequency (Llama 3.1 scaling): the angle table of base**(-2j/hd)
    / f_j, as transformers applies its scaled inv_freq."""
    t, hd, base = 9, 8, 10000.0
    f = np.array([1.0, 1.7, 4.0, 8.0])
    cos, sin = nn.rope_fill(t, hd, base, factors=f)
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)) / torch.tensor(f)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    assert rel_err(cos, ang.cos().numpy()) <= ORACLE_TOL
    assert rel_err(sin, ang.sin().numpy()) <= ORACLE_TOL


def test_leaf_helpers():
    tp = gt.Tape()
    c = nn.const(tp, np.arange(6), 2, 3)
    p = nn.param(tp, np.arange(3), 0, 3)
    o = nn.ones(tp, 4)
    assert c.shape == (2, 3) and not c.requires_grad
    assert p.shape == (3,) and p.requires_grad
    assert o.shape == (4, 1) and np.all(o.value == 1.0)


@pytest.mark.parametrize("keep", [1, 5, 8])
def test_cross_entropy_ids_equals_rows(keep):
    """(d) the fused cross-entropy over ids, with ce_targets_fill ignoring the rows past
    ``keep``, equals the composed one-hot cross_entropy_rows: value and gradients."""
    rng = np.random.default_rng(keep)
    Tn, V = 8, 11
    logits = rng.standard_normal((Tn, V)) * 3
    tg = rng.integers(0, V, Tn)
    res = []
    for fused in (False, True):
        tp = gt.Tape()
        lg = tp.param(logits)
        if fused:
            t = tg.copy()
            t[keep:] = -100
            i, w = nn.ce_targets_fill(t)
            loss = nn.cross_entropy_ids(tp, lg, tp.const(i), tp.const(w))
        else:
            loss = nn.cross_entropy_rows(tp, lg, tp.const(_onehot(tg, V)), nn.ones(tp, V), keep)
        res.append((loss.value, tp.backward(loss)[lg].value))
    assert rel_err(res[1][0], res[0][0]) <= 1e-14
    assert rel_err(res[1][1], res[0][1]) <= 1e-14


def test_ce_targets_fill():
    ids, w = nn.ce_targets_fill([3, -100, 2, -1, 0])
    np.testing.assert_array_equal(ids, [3, 0, 2, 0, 0])
    np.testing.assert_array_equal(w[:, 0], [1 / 3, 0, 1 / 3, 0, 1 / 3])
    assert ids.dtype == np.int64 and w.shape == (5, 1)
    _, w2 = nn.ce_targets_fill([1, 2, -100], denominator=10)  # shared token count
    np.testing.assert_array_equal(w2[:, 0], [0.1, 0.1, 0.0])
    _, w3 = nn.ce_targets_fill([-100, -100])  # nothing counted: zero weights, no nan
    np.testing.assert_array_equal(w3, np.zeros((2, 1)))
