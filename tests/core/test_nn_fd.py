"""Finite-difference dot-product checks (float64) for every differentiable layer of
``gradtape.nn``, with inputs that exercise them: large and small norms, masked rows,
every GQA grouping.  First order for all; second order for the layers whose gradients a
training step could differentiate again (cheap here, and it catches VJP-of-VJP bugs)."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape import nn

from support.fd import FD_TOL, Const, check_fd, ids

GQA = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (6, 2), (6, 3)]


def _onehot(rng, T, V):
    oh = np.zeros((T, V))
    oh[np.arange(T), rng.integers(0, V, T)] = 1.0
    return oh


def _gqa_case(rng, nh, nkv, T=5, hd=4, base=10000.0):
    cos, sin = nn.rope_fill(T, hd, base)
    mask = nn.causal_mask_fill(T)

    def build(tp, q, k, v, c, s, m):
        return nn.gqa_attention(tp, q, k, v, c, s, m, T, nh, nkv, hd, 1.0 / np.sqrt(hd))
    return build, [rng.standard_normal((T, nh * hd)), rng.standard_normal((T, nkv * hd)),
                   rng.standard_normal((T, nkv * hd)), Const(cos), Const(sin), Const(mask)]


def layer_cases():
    """(case id, builder(tp, *vars), inputs) for every differentiable layer."""
    r = np.random.default_rng(99)
    T, H, O, R = 5, 6, 4, 2
    out = []

    def case(cid, build, *inputs):
        out.append((cid, build, list(inputs)))

    def ones_col(tp, n):
        return nn.ones(tp, n)

    case("linear", lambda tp, x, w: nn.linear(tp, x, w), r.standard_normal((T, H)),
         r.standard_normal((H, O)))
    case("linear_bias", lambda tp, x, w, b: nn.linear_bias(tp, x, w, b),
         r.standard_normal((T, H)), r.standard_normal((H, O)), r.standard_normal(O))
    case("lora_linear", lambda tp, x, w0, a, b: nn.lora_linear(tp, x, w0, a, b, 16.0 / R),
         r.standard_normal((T, H)), r.standard_normal((H, O)), r.standard_normal((H, R)),
         r.standard_normal((R, O)))
    case("lora_linear_frozen_w0", lambda tp, x, w0, a, b: nn.lora_linear(tp, x, w0, a, b, 0.5),
         r.standard_normal((T, H)), Const(r.standard_normal((H, O))),
         r.standard_normal((H, R)), r.standard_normal((R, O)))
    for name, sc in (("unit", 1.0), ("large", 1e3), ("small", 1e-3)):
        eps = 1e-5
        case(f"rmsnorm_{name}",
             lambda tp, x, w, eps=eps: nn.rmsnorm(tp, x, w, ones_col(tp, H), H, eps),
             r.standard_normal((T, H)) * sc, r.standard_normal(H))
        # a row offset (large mean) makes the centring matter
        case(f"layernorm_{name}",
             lambda tp, x, w, b, eps=eps: nn.layernorm(tp, x, w, b, ones_col(tp, H), H, eps),
             (r.standard_normal((T, H)) + 3.0) * sc, r.standard_normal(H),
             r.standard_normal(H))
    case("silu", lambda tp, x: nn.silu(tp, x), r.standard_normal((T, H)) * 3)
    case("swiglu", lambda tp, g, u: nn.swiglu(tp, g, u), r.standard_normal((T, H)) * 3,
         r.standard_normal((T, H)))
    case("gelu_tanh", lambda tp, x: nn.gelu_tanh(tp, x), r.standard_normal((T, H)) * 3)
    case("geglu", lambda tp, g, u: nn.geglu(tp, g, u), r.standard_normal((T, H)) * 3,
         r.standard_normal((T, H)))
    case("softcap", lambda tp, x: nn.softcap(tp, x, 2.5), r.standard_normal((T, H)) * 4)
    for ax in (0, 1):
        case(f"softmax_axis{ax}", lambda tp, x, ax=ax: nn.softmax(tp, x, ax),
             r.standard_normal((T, H)) * 2)
    for hd, base in ((4, 10000.0), (8, 100.0)):
        cos, sin = nn.rope_fill(T, hd, base)
        case(f"rope_hd{hd}", lambda tp, h, c, s, hd=hd: nn.rope(tp, h, c, s, T, hd),
             r.standard_normal((T, hd)), Const(cos), Const(sin))
    case("head", lambda tp, q: nn.head(tp, q, T, 1, 4), r.standard_normal((T, 3 * 4)))
    for nh, nkv in GQA:
        build, inputs = _gqa_case(r, nh, nkv)
        case(f"gqa_{nh}_{nkv}", build, *inputs)
    # the attention core with soft-capped scores and a sliding-window mask (Gemma 2)
    hd, nh, nkv = 4, 4, 2
    win = Const(np.tile(nn.causal_mask_fill(T, window=2), (1, 1)))
    case("attention_softcap_window",
         lambda tp, q, k, v, m: nn.attention(tp, q, k, v, m, nh, nkv, hd, 0.5, softcap=3.0),
         r.standard_normal((T, nh * hd)) * 2, r.standard_normal((T, nkv * hd)) * 2,
         r.standard_normal((T, nkv * hd)), win)
    V = 7
    case("cross_entropy",
         lambda tp, lg, oh: nn.cross_entropy(tp, lg, oh, ones_col(tp, V)),
         r.standard_normal((T, V)) * 2, Const(_onehot(r, T, V)))
    for keep in (1, T - 1, T):
        case(f"cross_entropy_rows_keep{keep}",
             lambda tp, lg, oh, keep=keep: nn.cross_entropy_rows(tp, lg, oh, ones_col(tp, V),
                                                                 keep),
             r.standard_normal((T, V)) * 2, Const(_onehot(r, T, V)))
    tg = ids(r, T, V)
    tg[1] = tg[3] = -100  # ignored rows
    cid, w = nn.ce_targets_fill(tg)
    case("cross_entropy_ids", lambda tp, lg, i, w: nn.cross_entropy_ids(tp, lg, i, w),
         r.standard_normal((T, V)) * 2, cid, Const(w))
    case("cross_entropy_ids_large_logits",
         lambda tp, lg, i, w: nn.cross_entropy_ids(tp, lg, i, w),
         r.standard_normal((T, V)) * 30 + 500, cid, Const(w))
    return out


CASES = layer_cases()
IDS = [c[0] for c in CASES]

# layers whose second-order check runs too (GQA's are the largest graphs: two groupings)
SECOND_ORDER = {c for c in IDS if not c.startswith("gqa_")} | {"gqa_2_1", "gqa_6_3"}


def test_every_layer_is_covered():
    layers = {"linear", "linear_bias", "lora_linear", "rmsnorm", "layernorm", "silu",
              "swiglu", "gelu_tanh", "geglu", "softcap", "softmax", "rope", "head", "gqa",
              "attention", "cross_entropy",
              "cross_entropy_rows", "cross_entropy_ids"}
    covered = {c.split("_axis")[0].split("_hd")[0].split("_keep")[0] for c in IDS}
    covered |= {c.rsplit("_", 1)[0] for c in IDS} | {c.split("_")[0] for c in IDS}
    assert layers <= covered, sorted(layers - covered)
    assert {f"gqa_{a}_{b}" for a, b in GQA} <= set(IDS)


@pytest.mark.parametrize("cid,build,inputs", CASES, ids=IDS)
def test_layer_fd_first_order(cid, build, inputs):
    err = check_fd(build, inputs, order=1)
    assert err <= FD_TOL[1], f"{cid}: first-order FD error {err:.3e}"


@pytest.mark.parametrize("cid,build,inputs", [c for c in CASES if c[0] in SECOND_ORDER],
                         ids=[c for c in IDS if c in SECOND_ORDER])
def test_layer_fd_second_order(cid, build, inputs):
    err = check_fd(build, inputs, order=2)
    assert err <= FD_TOL[2], f"{cid}: second-order FD error {err:.3e}"
