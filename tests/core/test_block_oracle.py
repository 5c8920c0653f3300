"""The LoRA LLaMA block against PyTorch float64: loss and all 14 adapter
gradients within 1e-11 relative, on several random configurations; the same block
compiled and replayed with new inputs agrees with a fresh eager tape.

block: rmsnorm -> q/k/v LoRA linears -> gqa_attention -> o LoRA linear -> residual ->
rmsnorm -> gate/up LoRA linears -> swiglu -> down LoRA linear -> residual -> final
rmsnorm -> LM-head linear -> next-token cross_entropy_rows (keep = T-1).
The torch side is written independently, in Hugging Face's conventions (torch [out, in]
weights via F.linear, rotate_half rope, repeat_kv, F.cross_entropy on shifted targets)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import gradtape as gt
from gradtape import nn, ops

from support.compare import rel_err
from support.fd import BACKENDS, replay_tol

F = torch.nn.functional

ORACLE_TOL = 1e-11
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Cfg:
    T: int
    dim: int
    nh: int
    nkv: int
    hd: int
    ffn: int
    vocab: int
    rank: int
    alpha: float
    base: float
    eps: float
    seed: int


CONFIGS = [
    Cfg(T=7, dim=16, nh=4, nkv=2, hd=4, ffn=24, vocab=11, rank=2, alpha=4.0, base=10000.0,
        eps=1e-5, seed=0),
    Cfg(T=9, dim=18, nh=3, nkv=1, hd=6, ffn=20, vocab=13, rank=3, alpha=8.0, base=500.0,
        eps=1e-6, seed=1),
    Cfg(T=5, dim=12, nh=2, nkv=2, hd=8, ffn=16, vocab=9, rank=1, alpha=2.0, base=1e5,
        eps=1e-4, seed=2),
    Cfg(T=11, dim=20, nh=6, nkv=3, hd=4, ffn=28, vocab=17, rank=4, alpha=16.0, base=1e6,
        eps=1e-5, seed=3),
    Cfg(T=13, dim=14, nh=3, nkv=3, hd=6, ffn=18, vocab=7, rank=2, alpha=3.0, base=2000.0,
        eps=1e-6, seed=4),
]


def shapes(c):
    """(in, out) of each LoRA target."""
    return {"q": (c.dim, c.nh * c.hd), "k": (c.dim, c.nkv * c.hd), "v": (c.dim, c.nkv * c.hd),
            "o": (c.nh * c.hd, c.dim), "gate": (c.dim, c.ffn), "up": (c.dim, c.ffn),
            "down": (c.ffn, c.dim)}


def make_weights(c, rng):
    """Frozen weights ([in, out]), norms, embeddings, LM head; token ids."""
    w = {}
    for name, (i, o) in shapes(c).items():
        w[name] = rng.standard_normal((i, o)) / np.sqrt(i)
    w["attn_norm"] = 1.0 + 0.1 * rng.standard_normal(c.dim)
    w["ffn_norm"] = 1.0 + 0.1 * rng.standard_normal(c.dim)
    w["final_norm"] = 1.0 + 0.1 * rng.standard_normal(c.dim)
    w["emb"] = rng.standard_normal((c.vocab, c.dim))
    w["head"] = rng.standard_normal((c.dim, c.vocab)) / np.sqrt(c.dim)
    ids = rng.integers(0, c.vocab, c.T)
    return w, ids


def make_adapters(c, rng):
    """A [in, r] and B [r, out] for every target; B non-zero so A's gradients are too."""
    ad = {}
    for name, (i, o) in shapes(c).items():
        ad[name + ".A"] = rng.standard_normal((i, c.rank)) / np.sqrt(i)
        ad[name + ".B"] = rng.standard_normal((c.rank, o)) * 0.3
    return ad


def next_token_onehot(ids, vocab):
    """Row t is the one-hot of ids[t+1]; the last row (no target) is zero."""
    oh = np.zeros((len(ids), vocab))
    oh[np.arange(len(ids) - 1), ids[1:]] = 1.0
    return oh


def build_block(tp, c, w, ad, ids, fused_ce=False):
    """Record the block on ``tp``; returns (x leaf, ids leaf, adapter params, loss)."""
    s = c.alpha / c.rank
    x = tp.const(w["emb"][ids])  # [T, dim]
    ones_d = nn.ones(tp, c.dim)
    cos, sin = nn.rope_fill(c.T, c.hd, c.base)
    cosc, sinc, mask = tp.const(cos), tp.const(sin), tp.const(nn.causal_mask_fill(c.T))
    P = {k: tp.param(v) for k, v in ad.items()}
    W = {k: tp.const(v) for k, v in w.items() if k not in ("emb",)}

    def lora(name, h):
        return nn.lora_linear(tp, h, W[name], P[name + ".A"], P[name + ".B"], s)

    h = nn.rmsnorm(tp, x, W["attn_norm"], ones_d, c.dim, c.eps)  # [T, dim]
    q, k, v = lora("q", h), lora("k", h), lora("v", h)  # [T, nh*hd], [T, nkv*hd] x2
    att = nn.gqa_attention(tp, q, k, v, cosc, sinc, mask, c.T, c.nh, c.nkv, c.hd,
                           1.0 / np.sqrt(c.hd))  # [T, nh*hd]
    x2 = ops.add(x, lora("o", att))  # [T, dim]
    h2 = nn.rmsnorm(tp, x2, W["ffn_norm"], ones_d, c.dim, c.eps)
    m = nn.swiglu(tp, lora("gate", h2), lora("up", h2))  # [T, ffn]
    x3 = ops.add(x2, lora("down", m))  # [T, dim]
    hf = nn.rmsnorm(tp, x3, W["final_norm"], ones_d, c.dim, c.eps)
    logits = nn.linear(tp, hf, W["head"])  # [T, vocab]
    if fused_ce:
        t = np.append(ids[1:], -100)
        i, wt = nn.ce_targets_fill(t)
        idv = tp.const(i)
        loss = nn.cross_entropy_ids(tp, logits, idv, tp.const(wt))
    else:
        idv = tp.const(next_token_onehot(ids, c.vocab))
        loss = nn.cross_entropy_rows(tp, logits, idv, nn.ones(tp, c.vocab), c.T - 1)
    return x, idv, P, loss


# --- the torch float64 reference ---------------------------------------------------------

def torch_block(c, w, ad, ids):
    """Loss and adapter gradients in torch float64 (HF/PEFT conventions: [out, in] weights,
    lora_B(lora_A(x)) * scale)."""
    d = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ad.items()}
    s = c.alpha / c.rank

    def lora(name, h):
        # torch orientation: weight [out, in], lora_A [r, in], lora_B [out, r]
        return (F.linear(h, d(w[name].T))
                + F.linear(F.linear(h, P[name + ".A"].T), P[name + ".B"].T) * s)

    def rms(x, g):
        var = x.pow(2).mean(-1, keepdim=True)
        return g * (x * torch.rsqrt(var + c.eps))

    def rotate_half(x):
        return torch.cat((-x[..., c.hd // 2:], x[..., : c.hd // 2]), dim=-1)

    inv_freq = 1.0 / (c.base ** (torch.arange(0, c.hd, 2, dtype=torch.float64) / c.hd))
    freqs = torch.outer(torch.arange(c.T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # [T, hd]

    x = d(w["emb"])[torch.tensor(ids)]
    h = rms(x, d(w["attn_norm"]))
    q = lora("q", h).view(c.T, c.nh, c.hd).transpose(0, 1)  # [nh, T, hd]
    k = lora("k", h).view(c.T, c.nkv, c.hd).transpose(0, 1)
    v = lora("v", h).view(c.T, c.nkv, c.hd).transpose(0, 1)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(c.nh // c.nkv, dim=0)
    v = v.repeat_interleave(c.nh // c.nkv, dim=0)
    scores = q @ k.transpose(1, 2) / np.sqrt(c.hd)
    causal = torch.triu(torch.ones(c.T, c.T, dtype=torch.bool), diagonal=1)
    att = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
    att = att.transpose(0, 1).reshape(c.T, c.nh * c.hd)
    x2 = x + lora("o", att)
    h2 = rms(x2, d(w["ffn_norm"]))
    x3 = x2 + lora("down", F.silu(lora("gate", h2)) * lora("up", h2))
    logits = F.linear(rms(x3, d(w["final_norm"])), d(w["head"].T))
    loss = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    loss.backward()
    return loss.item(), {k: p.grad.numpy() for k, p in P.items()}


def block_errors(c):
    """Relative errors of the loss and each of the 14 adapter gradients vs torch."""
    rng = np.random.default_rng(c.seed)
    w, ids = make_weights(c, rng)
    ad = make_adapters(c, rng)
    tp = gt.Tape()
    _, _, P, loss = build_block(tp, c, w, ad, ids)
    grads = tp.backward(loss)
    ref_loss, ref_grads = torch_block(c, w, ad, ids)
    errs = {"loss": rel_err(loss.value, ref_loss)}
    assert set(grads) == set(P.values())  # all 14 adapters reach the loss
    for name, p in P.items():
        assert np.max(np.abs(ref_grads[name])) > 1e-6  # non-trivial, A's included
        errs[name] = rel_err(grads[p].value, ref_grads[name])
    return errs


@pytest.mark.parametrize("c", CONFIGS, ids=[f"T{c.T}_nh{c.nh}_nkv{c.nkv}_hd{c.hd}_r{c.rank}"
                                             for c in CONFIGS])
def test_block_vs_torch_float64(c):
    errs = block_errors(c)
    assert len(errs) == 1 + 2 * len(TARGETS)
    bad = {k: e for k, e in errs.items() if e > ORACLE_TOL}
    assert not bad, f"relative errors above {ORACLE_TOL}: {bad}"


@pytest.mark.parametrize("c", CONFIGS[:3], ids=[f"cfg{c.seed}" for c in CONFIGS[:3]])
def test_block_fused_ce_equals_rows(c):
    """cross_entropy_ids over next-token ids (last row ignored) equals the one-hot
    cross_entropy_rows(keep=T-1) in the full block: loss and every adapter gradient."""
    rng = np.random.default_rng(c.seed)
    w, ids = make_weights(c, rng)
    ad = make_adapters(c, rng)
    res = []
    for fused in (False, True):
        tp = gt.Tape()
        _, _, P, loss = build_block(tp, c, w, ad, ids, fused_ce=fused)
        g = tp.backward(loss)
        res.append([loss.value] + [g[P[k]].value for k in sorted(P)])
    for a, b in zip(*res):
        assert rel_err(b, a) <= 1e-13


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c,dtype", [(CONFIGS[0], np.float64), (CONFIGS[1], np.float64),
                                     (CONFIGS[3], np.float32)],
                         ids=["cfg0-float64", "cfg1-float64", "cfg3-float32"])
def test_block_compiled_replay_matches_fresh_eager(backend, c, dtype):
    """(c) compile loss + 14 gradients once; replay with new tokens and new adapter values;
    each replay agrees with a fresh eager tape built on those values."""
    rng = np.random.default_rng(100 + c.seed)
    w, ids = make_weights(c, rng)
    ad = make_adapters(c, rng)
    tp = gt.Tape(dtype)
    x, tgt, P, loss = build_block(tp, c, w, ad, ids)
    grads = tp.backward(loss)
    names = sorted(P)
    prog = tp.compile([loss] + [grads[P[k]] for k in names], backend=backend)
    for _ in range(2):
        new_ids = rng.integers(0, c.vocab, c.T)
        new_ad = make_adapters(c, rng)
        feeds = {x: w["emb"][new_ids], tgt: next_token_onehot(new_ids, c.vocab)}
        feeds.update({P[k]: new_ad[k] for k in names})
        got = prog.run(feeds)
        tp2 = gt.Tape(dtype)
        _, _, P2, loss2 = build_block(tp2, c, w, new_ad, new_ids)
        g2 = tp2.backward(loss2)
        ref = [loss2.value] + [g2[P2[k]].value for k in names]
        tol = replay_tol(backend, dtype)
        for a, b in zip(got, ref):
            assert a.dtype == np.dtype(dtype)
            if tol == 0.0:
                np.testing.assert_array_equal(a, b)
            else:
                assert rel_err(a, b) <= tol
    # and the replay still matches torch on the last inputs
    ref_loss, _ = torch_block(c, w, new_ad, new_ids)
    # float32: rounding of ~1e3-term sums at eps 6e-8 (a float32 tape rounds its inputs too)
    assert rel_err(got[0], ref_loss) <= (ORACLE_TOL if dtype == np.float64 else 1e-4)
