"""Micro-benchmark: replaying one transformer block's forward + backward on the NumPy
reference backend vs the fast cpu backend, side by side (alternating runs, medians).

The graph is attention-like at SmolLM2's shapes by default: rmsnorm, q/k/v projections,
rope, grouped-query attention with a causal mask (softmax over [T, T] per head), the
output projection, a residual, rmsnorm, a SwiGLU MLP, a residual, and the backward of
a weighted sum of the block's output with respect to the input and the norm weights
(frozen projections, as in LoRA fine-tuning).

    .venv/bin/python bench/bench_tape.py [--T 256] [--dtype float32] [--reps 7] [--profile]

Prints the median replay time of each backend and the ratio numpy / cpu.  ``--profile``
adds the cpu backend's time per step kind (BLAS matmuls, C kernels, other NumPy ops).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

import gradtape as gt
from gradtape import nn, ops


def build_block(tp, T, dim, nh, nkv, hd, ffn, rng):
    def w(*shape):
        return tp.const((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(tp.dtype))

    x = tp.param(rng.standard_normal((T, dim)))
    g1 = tp.param(1 + 0.1 * rng.standard_normal(dim))
    g2 = tp.param(1 + 0.1 * rng.standard_normal(dim))
    ones = nn.ones(tp, dim)
    cos, sin = nn.rope_fill(T, hd, 1e5)
    cosc, sinc = tp.const(cos), tp.const(sin)
    mask = tp.const(nn.causal_mask_fill(T))
    h = nn.rmsnorm(tp, x, g1, ones, dim, 1e-5)
    q, k, v = nn.linear(tp, h, w(dim, nh * hd)), nn.linear(tp, h, w(dim, nkv * hd)), \
        nn.linear(tp, h, w(dim, nkv * hd))
    att = nn.gqa_attention(tp, q, k, v, cosc, sinc, mask, T, nh, nkv, hd, hd ** -0.5)
    x2 = ops.add(x, nn.linear(tp, att, w(nh * hd, dim)))
    h2 = nn.rmsnorm(tp, x2, g2, ones, dim, 1e-5)
    mlp = nn.swiglu(tp, nn.linear(tp, h2, w(dim, ffn)), nn.linear(tp, h2, w(dim, ffn)))
    out = ops.add(x2, nn.linear(tp, mlp, w(ffn, dim)))
    loss = ops.reduce_sum(ops.mul(out, tp.const(rng.standard_normal((T, dim)))))
    grads = tp.backward(loss)
    return [loss, *grads.values()]


def profile_numpy(prog, reps):
    """Seconds per replay of the NumPy backend in matmuls and in everything else."""
    ex = prog.executable
    mm = other = 0.0
    for _ in range(reps):
        for v, (f, o, i, a) in zip(prog.graph.ops, ex._steps):
            t0 = time.perf_counter()
            f(o, *i, **a)
            dt = time.perf_counter() - t0
            if v.op == "matmul":
                mm += dt
            else:
                other += dt
    return mm / reps, other / reps


def profile(prog, reps):
    """Seconds per replay spent in each kind of cpu-backend step."""
    ex = prog.executable
    kinds = []
    for f in ex._steps:
        fn = getattr(f, "func", None)
        if fn is np.matmul:
            kinds.append("matmul (BLAS)")
        elif fn is not None and getattr(fn, "__name__", "") == "gt_run":
            kinds.append("C kernels")
        else:
            name = getattr(fn, "__name__", "?").lstrip("_")
            kinds.append(f"numpy {name}")
    tot = {}
    for _ in range(reps):
        for k, f in zip(kinds, ex._steps):
            t0 = time.perf_counter()
            f()
            tot[k] = tot.get(k, 0.0) + time.perf_counter() - t0
    counts = {k: kinds.count(k) for k in tot}
    return {k: (v / reps, counts[k]) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    tp = gt.Tape(np.dtype(a.dtype), eager=False)
    outs = build_block(tp, a.T, a.dim, a.heads, a.kv_heads, a.head_dim, a.ffn,
                       np.random.default_rng(0))
    t0 = time.perf_counter()
    p_np = tp.compile(outs, backend="numpy")
    t1 = time.perf_counter()
    p_cpu = tp.compile(outs, backend="cpu")
    t2 = time.perf_counter()
    ex = p_cpu.executable
    print(f"graph: {len(p_np.graph.ops)} ops; cpu: {len(ex.schedule.groups)} fused groups, "
          f"{ex.n_kernels} distinct kernels, {len(ex._steps)} replay steps; "
          f"compile numpy {t1 - t0:.2f}s cpu {t2 - t1:.2f}s (C cache hit: {ex.cache_hit})")
    print(f"buffers: numpy {p_np.memory.nbytes / 2**20:.1f} MiB, "
          f"cpu {p_cpu.memory.nbytes / 2**20:.1f} MiB")
    r_np, r_cpu = p_np.run(), p_cpu.run()  # warm-up, and a parity check
    err = max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))
              for x, y in zip(r_cpu, r_np))
    times = {"numpy": [], "cpu": []}
    for _ in range(a.reps):
        for name, p in (("numpy", p_np), ("cpu", p_cpu)):
            t = time.perf_counter()
            p.run()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"T={a.T} {a.dtype}: numpy {med['numpy'] * 1e3:.1f} ms, cpu {med['cpu'] * 1e3:.1f} ms,"
          f" ratio numpy/cpu = {med['numpy'] / med['cpu']:.2f}x (max rel diff {err:.1e})")
    if a.profile:
        prof = profile(p_cpu, a.reps)
        for k, (s, n) in prof.items():
            print(f"  cpu {k:28s} {s * 1e3:8.2f} ms  ({n} steps)")
        mm, other = profile_numpy(p_np, a.reps)
        cpu_other = sum(s for k, (s, n) in prof.items() if not k.startswith("matmul"))
        print(f"  numpy matmul {mm * 1e3:.2f} ms, everything else {other * 1e3:.2f} ms")
        print(f"  non-matmul work: numpy {other * 1e3:.2f} ms / cpu {cpu_other * 1e3:.2f} ms"
              f" = {other / max(cpu_other, 1e-12):.1f}x")
    return med


if __name__ == "__main__":
    main()
