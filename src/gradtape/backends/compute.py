"""The precision of the big frozen-weight GEMMs (``--compute``), and what this CPU offers.

``float32`` (the default) keeps every GEMM in float32.  ``bf16`` asks for the frozen-weight
matmuls (``x @ W0``, ``dY @ W0^T``, the LM head and its transpose) to take bf16 inputs and
accumulate in float32; LoRA A/B, their gradients, norms, softmax, the loss and AdamW stay
float32 either way.  The GEMMs run in oneDNN (``backends/onednn.py``, an optional extra).
bf16 pays where the CPU has AMX (``amx_bf16`` in /proc/cpuinfo: 3-4x float32 sgemm,
``docs/benchmarks.md``); with AVX512-BF16 alone it was measured slower than float32 on some
CPUs and 2x faster on others (AMD Zen 5), so there it is measured once per process.
``auto`` picks bf16 only where it is faster.  Asking for bf16 where it is not fast, or
without oneDNN, says so once (a RuntimeWarning) and runs float32.

This module decides and runs nothing but that one measurement.  ``cpu_summary()`` is what
``gradtape bench`` prints beside its figures.
"""

from __future__ import annotations

import functools
import platform
import warnings

COMPUTE_CHOICES = ("float32", "bf16", "auto")

_WARNED = set()


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """``{"model": str, "flags": frozenset}`` from /proc/cpuinfo (empty where absent)."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and val.strip():
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(val.split())
    except OSError:
        pass
    return {"model": model, "flags": flags}


def cpu_summary() -> dict:
    """The CPU model and the flags that decide the GEMM paths."""
    info = cpu_info()
    wanted = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
    return {"cpu": info["model"], "flags": [f for f in wanted if f in info["flags"]]}


def bf16_fast() -> tuple:
    """``(True, "")`` where bf16 GEMMs (oneDNN) beat float32 (NumPy's BLAS) on this CPU,
    else ``(False, why)``.  AMX: yes.  AVX512-BF16 alone: measured once per process at
    one of the model's shapes (it is 2x on AMD Zen 5, slower than float32 on CPUs that
    split 512-bit instructions).  Neither: no."""
    flags = cpu_info()["flags"]
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False, "this CPU has no bf16 matrix instructions (no AMX, no AVX512-BF16)"
    from . import onednn
    ok, why = onednn.available()
    if not ok:
        return False, why
    if "amx_bf16" in flags and "amx_tile" in flags:
        return True, ""
    f32, bf16 = measured_rates()
    if bf16 > 1.1 * f32:
        return True, ""
    return False, (f"bf16 GEMMs run slower than float32 here (AVX512-BF16 without AMX: "
                   f"{bf16 / 1e9:.0f} vs {f32 / 1e9:.0f} GFLOP/s measured)")


@functools.lru_cache(maxsize=1)
def call_seconds(fn, reps):
    """The seconds each of ``reps`` calls of ``fn`` took, after one warm-up call."""
    import time

    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def measured_rates(m=256, k=576, n=1536, reps=7):
    """(float32 NumPy matmul, bf16 oneDNN matmul) FLOP/s at one of SmolLM2's shapes, the
    best of ``reps`` (the best resists other processes' noise)."""
    import numpy as np

    from . import onednn

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    a16, w16 = onednn.to_bf16(a), onednn.to_bf16(w)
    gemm16 = onednn.dnnl().bind(out, a16, w16, False)

    def best(fn):
        return 2 * m * k * n / min(call_seconds(fn, reps))

    # bf16 first, with NumPy's BLAS on one thread as in a bf16 replay (qgemm.one_blas_thread)
    from .qgemm import one_blas_thread
    with one_blas_thread():
        bf16 = best(gemm16)
    return best(lambda: np.matmul(a, w, out=out)), bf16


def resolve(requested: str, applies=True) -> str:
    """The precision that will run for ``requested`` (one of COMPUTE_CHOICES): "float32"
    or "bf16".  ``bf16`` where its GEMMs are not fast (or oneDNN is missing) warns once and
    gives "float32"; ``auto`` gives bf16 where they are fast (``bf16_fast``), silently:
    with AVX512-BF16 alone (AMD Zen 5, `gradtape bench`) the SmolLM2 step ran 0.46 s vs
    0.51 s in float32, and the 8B Q4_K_M step about 2x faster.  ``applies``: False,
    or a string saying why, where the caller has no bf16 path at all (another backend,
    a float64 step, generation)."""
    if requested not in COMPUTE_CHOICES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, "
                         f"got {requested!r}")
    if requested == "float32":
        return "float32"
    if applies is True:
        fast, why = bf16_fast()
    else:
        fast, why = False, applies or ("bf16 compute applies to float32 steps on the cpu "
                                       "backend only")
    if fast:
        return "bf16"
    if requested == "bf16" and why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"gradtape: bf16 compute asked for, running float32: {why}",
                      RuntimeWarning, stacklevel=3)
    return "float32"
