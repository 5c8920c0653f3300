"""The precision of the big frozen-weight GEMMs (``--compute``), and what this CPU offers.

``float32`` (the default) keeps every GEMM in float32.  ``bf16`` asks for the frozen-weight
matmuls (``x @ W0``, ``dY @ W0^T``, the LM head and its transpose) to take bf16 inputs and
accumulate in float32; LoRA A/B, their gradients, norms, softmax, the loss and AdamW stay
float32 either way.  bf16 only pays where the CPU has AMX (``amx_bf16`` in
/proc/cpuinfo: 3-4x float32 sgemm, DESIGN.md section 5); with AVX512-BF16 alone it was
measured slower than float32.  ``auto`` picks bf16 only where it is faster.  Asking for
bf16 where it is not fast says so once (a RuntimeWarning) and runs float32.

This module decides; it runs nothing.  ``cpu_summary()`` is what ``gradtape bench``
prints beside its figures.
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
    """``(True, "")`` where bf16 GEMMs beat float32 on this CPU, else ``(False, why)``."""
    flags = cpu_info()["flags"]
    if "amx_bf16" in flags and "amx_tile" in flags:
        return True, ""
    if "avx512_bf16" in flags:
        return False, ("this CPU has AVX512-BF16 but no AMX; bf16 GEMMs measured slower "
                       "than float32 there")
    return False, "this CPU has no bf16 matrix instructions (no AMX, no AVX512-BF16)"


def resolve(requested: str) -> str:
    """The precision that will run for ``requested`` (one of COMPUTE_CHOICES): "float32"
    or "bf16".  ``bf16`` where it is not fast warns once and gives "float32"."""
    if requested not in COMPUTE_CHOICES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, "
                         f"got {requested!r}")
    if requested == "float32":
        return "float32"
    fast, why = bf16_fast()
    if fast:
        from .bf16 import available  # the kernels: an optional accelerator
        ok, why = available()
        if ok:
            return "bf16"
    if requested == "bf16" and why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"gradtape: bf16 compute asked for, running float32: {why}",
                      RuntimeWarning, stacklevel=3)
    return "float32"
