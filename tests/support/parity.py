"""The backend-parity harness: a program under test against the NumPy reference.

``compare`` replays both on the same feeds and checks every output within the dtype's
tolerance; ``check_built`` builds a graph on a fresh tape, with the float64 evaluation of
the same build as a second reference for float32.  Each backend's tests pass the program
under test (``make_program(tp, outputs, updates)``): the cpu backend compiled by name,
the cuda backend lowered onto the CPU harness device or onto a real GPU.
"""

from __future__ import annotations

import numpy as np

import gradtape as gt

from .compare import rel_err

# reassociated sums and fused kernels against NumPy's order of operations
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-5}


def compare(tp, outputs, program, updates=None, feeds_list=({},), ref64=None, tol64=None):
    """The worst relative error of ``program``'s outputs against the NumPy reference over
    ``feeds_list``.  float32 also accepts up to 4x the reference's own rounding error,
    measured against ``ref64`` (the same graph's float64 outputs) when given: a long
    backward chain ending in a sum that cancels is only as accurate as float32 itself, on
    either side.  ``tol64``: compare against ``ref64`` alone with this tolerance (bf16
    storage, which is only as good as bf16)."""
    p_np = tp.compile(outputs, backend="numpy", updates=updates)
    worst = 0.0
    for feeds in feeds_list:
        got, want = program.run(dict(feeds)), p_np.run(dict(feeds))
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape
            if tol64 is not None:
                e, bound = rel_err(a, ref64[k]), tol64
            else:
                e, bound = rel_err(a, b), TOL[tp.dtype]
                if ref64 is not None and tp.dtype == np.float32:
                    bound = max(bound, 4 * rel_err(b, ref64[k]))
            worst = max(worst, e)
            assert e <= bound, f"output {k} ({outputs[k]!r}): rel err {e:.3g} > {bound:.3g}"
    return worst


def check_built(build, dtype, make_program, **kw):
    """``build(tp) -> outputs`` on a tape of ``dtype`` through ``make_program`` against
    the reference; returns (program, worst error)."""
    tp = gt.Tape(dtype)
    outputs = build(tp)
    ref64 = None
    if np.dtype(dtype) == np.float32:
        tp64 = gt.Tape(np.float64)
        ref64 = tp64.compile(build(tp64), backend="numpy").run()
    program = make_program(tp, outputs, kw.get("updates"))
    return program, compare(tp, outputs, program, ref64=ref64, **kw)
