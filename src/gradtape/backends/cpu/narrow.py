"""float32 GEMMs with one side of at most ``NARROW`` (LoRA's rank-r products and their
gradients) in our own C (``csrc/narrow_gemm.c``), on the OpenMP threads oneDNN and the
generated kernels use.

``bind(out, a, b)`` gives a callable computing ``out = a @ b`` for 2-d float32 operands of
any element strides, or None where no loop of that file fits (no side narrow, out not C
order, a wide operand whose rows are not contiguous).  Whether it runs instead of
oneDNN's GEMM is the backend's choice, timed per shape (``measure.fastest``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import toolchain

NARROW = 32  # csrc/narrow_gemm.c's NARROW: the widest narrow side

def _lib():
    lib = toolchain.csrc_library(["narrow_gemm.c"], "narrow")
    vp, lg = ctypes.c_void_p, ctypes.c_long
    lib.gt_narrow.argtypes = [vp, vp, lg, lg, vp, lg, lg, lg, lg, lg, vp, ctypes.c_int]
    lib.gt_narrow.restype = None
    return lib


def _strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def form(m, k, n):
    """Which side of ``[m, k] @ [k, n]`` the narrow loops take ("k", "n", "m"), or None
    (none narrow, or a narrow n below one vector of 8 lanes: the loops' scalar tail)."""
    if k <= NARROW:
        return "k"
    if 8 <= n <= NARROW:
        return "n"
    if m <= NARROW and n >= 8:
        return "m"
    return None


def bind(out, a, b, threaded=True):
    """A callable computing ``out = a @ b`` (float32, 2-d, out C order) in
    ``csrc/narrow_gemm.c``, its tiles split over the OpenMP threads where ``threaded``
    (else all on the calling thread), or None where it has no loop for these operands."""
    if not (a.ndim == b.ndim == out.ndim == 2 and a.dtype == b.dtype == out.dtype
            == np.float32 and out.flags.c_contiguous):
        return None
    if any(s % 4 for x in (a, b) for s in x.strides):
        return None
    (m, k), n = a.shape, b.shape[1]
    kind = form(m, k, n)
    sam, sak = _strides(a)
    sbk, sbn = _strides(b)
    if kind is None or kind == "m" and sbn != 1:  # (a wide b is not copied)
        return None
    fn = _lib().gt_narrow
    scratch = np.empty(k * n if sbn != 1 else 1, np.float32)  # b's rows made contiguous
    args = (out.ctypes.data, a.ctypes.data, sam, sak, b.ctypes.data, sbk, sbn, m, k, n,
            scratch.ctypes.data, int(bool(threaded)))

    def run():
        fn(*args)
    run.keep = (out, a, b, scratch)
    run.label = (f"matmul f32 (narrow {kind}{'' if threaded else ', 1 thread'}) "
                 f"{a.shape} x {b.shape}")
    return run
