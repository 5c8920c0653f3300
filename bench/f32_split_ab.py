"""A float32 step's GEMMs through oneDNN against NumPy's OpenBLAS split over OpenMP's
threads: each OpenMP thread runs a single-threaded ``cblas_sgemm`` on its share of the
output's columns (rows where it has few columns), so every thread of a replay stays
OpenMP's as with oneDNN, while OpenBLAS's own kernels do the work.  A candidate
provider for the AVX2 class, where oneDNN 3.2's float32 matmul is its jit GEMM (no
brgemm below AVX-512) and OpenBLAS's Haswell kernels are faster alone.  The two sides
alternate call by call in this process; GFLOP/s of the best of ``--reps`` calls, and
the largest difference between their products relative to the largest value.

    GRADTAPE_ISA=avx2 python bench/f32_split_ab.py [--reps 15] [--shapes 256x576x1536,...]

A shape is ``m x k x n`` with an optional ``t`` suffix: B stored ``[n, k]`` (read
transposed).  The defaults are the SmolLM2 LoRA step's GEMMs at T=256.
"""

import argparse
import ctypes
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the class before NumPy loads)
import numpy as np

from gradtape.backends.cpu import blas, onednn, toolchain
from gradtape.backends.cpu.blas import one_blas_thread

SHAPES = ("256x576x1536,256x1536x576,256x576x576,256x1536x576t,256x576x1536t,"
          "256x576x49152t,256x49152x576,256x8x1536,256x1536x8")

# C[m, n] = A[m, k] op(B) (row-major; op(B) = B^T where tb): the columns of C split over
# the OpenMP threads in multiples of 16 (the rows, in multiples of 8, where split_m), one
# single-threaded cblas_sgemm (ILP64, as NumPy's OpenBLAS exports it) each
SOURCE = r"""
#include <stdint.h>
#include <omp.h>
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *,
                          int64_t, const float *, int64_t, float, float *, int64_t);
void split_sgemm(void *fn, int tb, long m, long n, long k, const float *a, long lda,
                 const float *b, long ldb, float *c, long ldc, int split_m) {
    #pragma omp parallel
    {
        const long nt = omp_get_num_threads(), id = omp_get_thread_num();
        const long total = split_m ? m : n, unit = split_m ? 8 : 16;
        const long per = ((total + nt - 1) / nt + unit - 1) / unit * unit;
        const long p0 = id * per, p1 = p0 + per < total ? p0 + per : total;
        if (p1 > p0) {
            if (split_m)
                ((sgemm64_t)fn)(101, 111, tb ? 112 : 111, p1 - p0, n, k, 1.0f, a + p0 * lda,
                                lda, b, ldb, 0.0f, c + p0 * ldc, ldc);
            else
                ((sgemm64_t)fn)(101, 111, tb ? 112 : 111, m, p1 - p0, k, 1.0f, a, lda,
                                tb ? b + p0 * ldb : b + p0, ldb, 0.0f, c + p0, ldc);
        }
    }
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated m x k x n[t]")
    args = ap.parse_args()
    found = blas.cblas()
    if found is None or not found[2]:
        raise SystemExit("NumPy's BLAS exports no ILP64 cblas_sgemm here")
    path, _ = toolchain.build(SOURCE, flags=toolchain.threads_flags(), prefix="bench_split")
    lib = ctypes.CDLL(str(path))
    L, P = ctypes.c_long, ctypes.c_void_p
    lib.split_sgemm.argtypes = [P, ctypes.c_int, L, L, L, P, L, P, L, P, L, ctypes.c_int]
    d = onednn.library()
    print(f"CPU: {toolchain.cpu_info()['model']} (class {toolchain.isa()}); "
          f"BLAS: {', '.join(blas_info())}")
    rng = np.random.default_rng(0)
    with one_blas_thread():  # OpenBLAS single-threaded inside each OpenMP thread
        for shape in args.shapes.split(","):
            tb = shape.endswith("t")
            m, k, n = map(int, shape.rstrip("t").split("x"))
            a = rng.standard_normal((m, k), dtype=np.float32)
            bs = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
            b = bs.T if tb else bs
            ref, out = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
            dnnl = d.bind_f32(ref, a, b)

            def split(a=a, bs=bs, out=out, m=m, n=n, k=k, tb=tb):
                lib.split_sgemm(found[0], int(tb), m, n, k, a.ctypes.data, k,
                                bs.ctypes.data, bs.shape[1], out.ctypes.data, n,
                                int(n < 64))
            best = {"oneDNN": np.inf, "split OpenBLAS": np.inf}
            dnnl(), split()
            for _ in range(args.reps):
                for name, fn in (("oneDNN", dnnl), ("split OpenBLAS", split)):
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
            flops = 2 * m * k * n
            rel = float(np.abs(ref - out).max() / np.abs(ref).max())
            print(f"{shape:>16s}: " + "  ".join(f"{name} {flops / s / 1e9:6.1f} GFLOP/s"
                                                for name, s in best.items())
                  + f"  split/oneDNN {best['oneDNN'] / best['split OpenBLAS']:.2f}x"
                  + f"  max diff {rel:.1e}")


def blas_info():
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["threadpoolctl not installed"]
    return [f"{i['internal_api']} {i['version']} ({i.get('architecture')})"
            for i in threadpool_info() if i["user_api"] == "blas"]


if __name__ == "__main__":
    main()
