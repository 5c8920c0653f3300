"""oneDNN's bf16 matmul by the layout of its weights W, at a model's shapes: W ``[k, n]``
read in place, W stored ``[n, k]`` read in place, and W packed once into the layout the
kernel keeps (``onednn.pack``); GFLOP/s, the best of ``--reps`` calls on random operands,
NumPy's BLAS on one thread (as in a bf16 replay).  The figures behind
``compute.packed_weights`` and ``compute.blocked_faster`` (docs/benchmarks.md).

    python bench/gemm_layouts.py [--reps 20] [--shapes 256x576x1536,256x4096x14336]
"""

import argparse

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape.backends.cpu import measure as compute, onednn
from gradtape.backends.cpu.blas import one_blas_thread

SHAPES = "256x576x1536,256x1536x576,256x576x49152,256x4096x4096,256x4096x14336,256x14336x4096"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated m x k x n")
    args = ap.parse_args()
    d = onednn.dnnl()
    summary = compute.cpu_summary()
    print(f"CPU: {summary['cpu']} ({', '.join(summary['flags'])}); {onednn.describe()}")
    rng = np.random.default_rng(0)
    with one_blas_thread():
        for shape in args.shapes.split(","):
            m, k, n = map(int, shape.split("x"))
            a = onednn.to_bf16(rng.standard_normal((m, k), dtype=np.float32))
            w = onednn.to_bf16(rng.standard_normal((k, n), dtype=np.float32))
            wt = np.ascontiguousarray(w.T)
            out = np.empty((m, n), np.float32)
            runs = {"W [k, n]": d.bind(out, a, w, False), "W [n, k]": d.bind(out, a, wt, True)}
            pack, _ = d.pack(m, k, n, False, w)
            if pack is not None:
                runs["packed"] = d.bind(out, a, pack, False, packed=True)
            flops = 2 * m * k * n
            print(f"{shape:>16}  " + "  ".join(
                f"{name} {flops / min(compute.call_seconds(run, args.reps)) / 1e9:.0f}" for name, run in runs.items()))


if __name__ == "__main__":
    main()
