"""bf16 GEMM providers side by side at the 8B step's block-GEMM shapes: oneDNN (our
``onednn-cpu-gomp``), MKL's ``cblas_gemm_bf16bf16f32`` (the optional ``mkl`` wheel) and,
as the yardstick only, torch's bf16 matmul (the peer's, under autocast; bf16 output).
bf16 inputs, float32 accumulation; W stored ``[n, k]`` (GGUF's orientation) for the
forward ``x @ W^T`` (``t`` shapes), ``[k, n]`` for the backward ``dy @ W``.

Each provider runs in its own fresh process (so that no two OpenMP pools spin beside each
other), one process per provider per round, the order rotated each round; a figure is
the median GFLOP/s over rounds of each process's median call.  Shared hosts are noisy:
read the ratios, and re-measure on a quiet machine.

    python bench/bf16_providers.py [--rounds 3] [--reps 5] [--shapes 256x4096x14336t,...]
"""

import argparse
import json
import statistics
import subprocess
import sys

SHAPES = ("256x4096x4096t,256x4096x1024t,256x4096x14336t,256x14336x4096t,"
          "256x14336x4096,256x4096x14336,256x4096x256t,256x4096x4096,1024x4096x14336t")
PROVIDERS = ("onednn", "mkl", "torch")


def parse(shape):
    tb = shape.endswith("t")
    m, k, n = map(int, shape.rstrip("t").split("x"))
    return m, k, n, tb


def _time(fn, reps):
    """Median seconds of ``reps`` calls after a warm-up (``measure.call_seconds``)."""
    from gradtape.backends.cpu.measure import call_seconds
    return statistics.median(call_seconds(fn, reps))


def child(provider, shapes, reps):
    """Median seconds per shape of one provider, as JSON on stdout."""
    import numpy as np
    got = {}
    rng = np.random.default_rng(0)
    if provider == "torch":
        import torch

        from gradtape import settings
        torch.set_num_threads(settings.omp_threads())
    else:
        from gradtape.backends.cpu import mkl, onednn
        from gradtape.backends.cpu.blas import one_blas_thread
        lib = mkl.mkl() if provider == "mkl" else onednn.dnnl()
    for shape in shapes:
        m, k, n, tb = parse(shape)
        a32 = rng.standard_normal((m, k), dtype=np.float32)
        w32 = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        if provider == "torch":
            a, w = torch.from_numpy(a32).bfloat16(), torch.from_numpy(w32).bfloat16()
            if tb:
                fn = lambda: torch.nn.functional.linear(a, w)  # noqa: E731
            else:
                fn = lambda: torch.matmul(a, w)  # noqa: E731
            with torch.no_grad():
                got[shape] = _time(fn, reps)
            continue
        a, w = onednn.to_bf16(a32), onednn.to_bf16(w32)
        out = np.empty((m, n), np.float32)
        run = lib.bind_ptrs(onednn.Gemm(m, k, n, tb), a.ctypes.data, w.ctypes.data,
                            out.ctypes.data)
        with one_blas_thread():
            got[shape] = _time(run, reps)
    print(json.dumps(got))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per shape per process")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated m x k x n, t: W [n, k]")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    if args.child:
        return child(args.child, shapes, args.reps)
    from gradtape.backends.cpu import measure, mkl, onednn
    s = measure.cpu_summary()
    ok, why = mkl.available()
    print(f"CPU: {s['cpu']} ({', '.join(s['flags'])}; isa {s['isa']}); "
          f"{onednn.describe()}; MKL: {mkl.mkl().version if ok else why}")
    providers = [p for p in args.providers.split(",") if p != "mkl" or ok]
    seconds = {p: {sh: [] for sh in shapes} for p in providers}
    for r in range(args.rounds):
        order = providers[r % len(providers):] + providers[:r % len(providers)]
        for p in order:
            out = subprocess.run([sys.executable, __file__, "--child", p, "--reps",
                                  str(args.reps), "--shapes", args.shapes],
                                 capture_output=True, text=True, check=True).stdout
            for sh, t in json.loads(out.strip().splitlines()[-1]).items():
                seconds[p][sh].append(t)
    print(f"{'shape':>18}  " + "  ".join(f"{p:>7}" for p in providers)
          + "   GFLOP/s (median of rounds); ratios to torch")
    for sh in shapes:
        m, k, n, _ = parse(sh)
        rate = {p: 2 * m * k * n / statistics.median(seconds[p][sh]) / 1e9 for p in providers}
        ratios = "  ".join(f"{p}/torch {rate[p] / rate['torch']:.2f}" for p in providers
                           if p != "torch" and "torch" in rate)
        print(f"{sh:>18}  " + "  ".join(f"{rate[p]:7.0f}" for p in providers) + "   " + ratios)


if __name__ == "__main__":
    main()
