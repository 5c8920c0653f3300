"""The long-context kernels alone, float32 against bf16 GEMM inputs: the fused attention
(``csrc/flash.c``) and the fused LM head + loss (``tiled.fwd_head_nll_e``) at SmolLM2's
shapes, each the median of ``--reps`` calls, with the bf16 results' error against the
float32 ones.

    python bench/long_kernels.py [--seq-len 2048] [--reps 5] [--heads 32,8,128]

The attention is one layer's (by default SmolLM2's 9 query heads, 3 KV heads, head dim
64; causal), with its rate counting the causal half of the products (the backward's as
2.5 forwards); the head is [T, 576] against a 49152-row table.  bf16 needs a CPU with
AVX512-BF16 for the attention's instructions (plain C otherwise: slow, for the tests)
and oneDNN for the head.
"""

from __future__ import annotations

import argparse
import statistics

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import tiled
from gradtape.backends.cpu.measure import call_seconds, cpu_summary
from gradtape.backends.cpu.tiled import CTiles


def median_s(fn, reps):
    return statistics.median(call_seconds(fn, reps))


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heads", default="9,3,64",
                    help="the attention's query heads, KV heads and head dim (default "
                         "SmolLM2's 9,3,64; an 8B LLaMA's: 32,8,128)")
    args = ap.parse_args()
    nh, nkv, hd = (int(x) for x in args.heads.split(","))
    t, d, vocab = args.seq_len, 576, 49152
    flop = 2 * t * t * hd * nh  # QK^T and PV, the causal half of each
    rng = np.random.default_rng(0)
    q = rng.standard_normal((t, nh * hd), dtype=np.float32)
    k, v = (rng.standard_normal((t, nkv * hd), dtype=np.float32) for _ in range(2))
    gy = rng.standard_normal((t, nh * hd + nh), dtype=np.float32)
    x = rng.standard_normal((t, d), dtype=np.float32)
    w = (rng.standard_normal((vocab, d)) * 0.05).astype(np.float32)
    ids = rng.integers(0, vocab, t)
    kw = dict(spec=tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, tile=128))
    print(f"CPU: {cpu_summary()}; T={t}, median of {args.reps}")
    got = {}
    for bf16 in (False, True):
        c = CTiles(np.float32, bf16)
        y = np.empty((t, nh * hd + nh), np.float32)
        g = np.empty(t * nh * hd + 2 * t * nkv * hd, np.float32)
        h = np.empty((t, 2 + d), np.float32)
        fwd = median_s(lambda: tiled.fwd_attn(y, q, k, v, **kw, kern=c), args.reps)
        bwd = median_s(lambda: tiled.fwd_attn_grad(g, gy, q, k, v, y, **kw, kern=c),
                       args.reps)
        head = median_s(lambda: tiled.fwd_head_nll_e(h, x, w, ids, tiled.head_chunk(t, vocab),
                                                     kern=c), args.reps)
        got[bf16] = (y, g, h)
        name = "bf16" if bf16 else "float32"
        print(f"{name:8s} attention forward {fwd * 1e3:.1f} ms ({flop / fwd / 1e9:.0f} "
              f"GFLOP/s), backward {bwd * 1e3:.1f} ms ({2.5 * flop / bwd / 1e9:.0f}); "
              f"head + loss {head * 1e3:.0f} ms")
    errs = [rel(a, b) for a, b in zip(got[True], got[False])]
    print("bf16 against float32 (max |diff| / max |float32|): attention {:.1e}, its "
          "gradient {:.1e}, head {:.1e}".format(*errs))


if __name__ == "__main__":
    main()
