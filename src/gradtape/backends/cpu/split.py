"""float32 GEMMs in NumPy's own BLAS (OpenBLAS), split over the OpenMP threads: each
thread runs one single-threaded ``cblas_sgemm`` on its share of the output
(``csrc/split_sgemm.c``), so a float32 replay whose GEMMs run in oneDNN keeps one thread
pool while a product OpenBLAS's kernels run faster takes them (at the AVX2 class,
oneDNN's jit GEMM with a transposed, wide weight: the tied LM head).

``bind(out, a, b)`` gives a callable computing ``out = a @ b`` or None where it does not
apply.  Whether it runs instead of oneDNN's GEMM is the backend's choice, timed per
shape (``measure.split_way``); the replay keeps NumPy's BLAS on one thread meanwhile.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import blas, toolchain


def _lib():
    lib = toolchain.csrc_library(["split_sgemm.c"], "split")
    vp, lg, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.gt_split_sgemm.argtypes = [vp, i, i, i, lg, lg, lg, vp, lg, vp, lg, vp, lg]
    lib.gt_split_sgemm.restype = None
    return lib


def _layout(x):
    """``(transposed, leading dimension)`` of a 2-d float32 array BLAS can read in
    place (rows or columns contiguous), or None."""
    s0, s1 = (s // x.itemsize for s in x.strides)
    if any(s % x.itemsize for s in x.strides):
        return None
    if s1 == 1 and s0 >= max(1, x.shape[1]):
        return False, s0
    if s0 == 1 and s1 >= max(1, x.shape[0]):
        return True, s1
    return None


def bind(out, a, b):
    """A callable computing ``out = a @ b`` (2-d float32, out C order) through NumPy's
    BLAS split over the OpenMP threads, or None (another BLAS or none found, operands BLAS
    cannot read in place)."""
    found = blas.cblas()
    if found is None or blas.blas_threads() is None:
        return None
    if not (a.ndim == b.ndim == out.ndim == 2 and a.dtype == b.dtype == out.dtype
            == np.float32 and out.flags.c_contiguous):
        return None
    la, lb = _layout(a), _layout(b)
    if la is None or lb is None:
        return None
    (m, k), n = a.shape, b.shape[1]
    fn = _lib().gt_split_sgemm
    args = (found[0], int(found[2]), int(la[0]), int(lb[0]), m, n, k, a.ctypes.data, la[1],
            b.ctypes.data, lb[1], out.ctypes.data, n)

    def run():
        fn(*args)
    run.keep = (out, a, b)
    run.label = f"matmul f32 (split OpenBLAS) {a.shape} x {b.shape}"
    return run
