"""NumPy's own BLAS, reached through ctypes: its CBLAS GEMMs and its thread pool.

``cblas()`` finds the library NumPy loaded among the process's mapped files (or
``$GRADTAPE_BLAS``) and the addresses of its ``cblas_sgemm`` / ``cblas_dgemm``, which the
tiled block-weight GEMMs of ``csrc/qgemm.c`` call from C.  ``one_blas_thread`` and
``park_blas_threads`` keep OpenBLAS's idle workers off the cores that OpenMP work (our
kernels, oneDNN) needs: after each call they poll for up to about 0.1 s, on those cores.

This module runs no GEMM itself and decides nothing about which library runs one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

from ... import settings
from pathlib import Path

_BLAS = "unset"  # cblas()'s answer, found once


def cblas():
    """``(sgemm address, dgemm address, ilp64, library)`` of the CBLAS NumPy's BLAS
    library exports, or None.  The library is found among the process's mapped files
    (NumPy loaded it); ``$GRADTAPE_BLAS`` names another library."""
    global _BLAS
    if _BLAS != "unset":
        return _BLAS
    _BLAS = None
    candidates = [settings.get("GRADTAPE_BLAS")] if settings.get("GRADTAPE_BLAS") else []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if "blas" in Path(path).name.lower() and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    names = [("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", 1),
             ("cblas_sgemm64_", "cblas_dgemm64_", 1), ("cblas_sgemm", "cblas_dgemm", 0)]
    for path in candidates:
        try:
            so = ctypes.CDLL(path)
        except OSError:
            continue
        for sgemm, dgemm, ilp64 in names:
            try:
                fs, fd = getattr(so, sgemm), getattr(so, dgemm)
            except AttributeError:
                continue
            _BLAS = (ctypes.cast(fs, ctypes.c_void_p).value,
                     ctypes.cast(fd, ctypes.c_void_p).value, ilp64, so)
            return _BLAS
    return _BLAS


@functools.lru_cache(maxsize=1)
def blas_threads():
    """``(get, set)``: NumPy's OpenBLAS thread count, read and set at run time, or None
    where the library exports neither (another BLAS)."""
    found = cblas()
    if found is None:
        return None
    for get, set_ in (("scipy_openblas_get_num_threads64_",
                       "scipy_openblas_set_num_threads64_"),
                      ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                      ("openblas_get_num_threads", "openblas_set_num_threads")):
        try:
            g, s = getattr(found[3], get), getattr(found[3], set_)
        except AttributeError:
            continue
        g.restype, g.argtypes = ctypes.c_int, []
        s.restype, s.argtypes = None, [ctypes.c_int]
        return g, s
    return None


@functools.lru_cache(maxsize=1)
def core() -> str:
    """The kernels NumPy's OpenBLAS chose when it loaded, by its core name ("Haswell",
    "SkylakeX", ...: ``$OPENBLAS_CORETYPE`` or this CPU's), or "" (another BLAS)."""
    found = cblas()
    for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                 "openblas_get_corename"):
        fn = getattr(found[3], name, None) if found is not None else None
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_char_p, []
            return (fn() or b"").decode(errors="replace").strip()
    return ""


@functools.lru_cache(maxsize=1)
def _blas_shutdown():
    found = cblas()
    for name in ("blas_thread_shutdown_", "scipy_blas_thread_shutdown_"):
        fn = getattr(found[3], name, None) if found is not None else None
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return fn
    return None


def park_blas_threads():
    """Stop NumPy's OpenBLAS worker threads now (no-op with another BLAS); OpenBLAS
    starts them again at its next threaded call, which costs tens of microseconds.  Call
    it before a long OpenMP region (the fused attention): left alone, they poll for up to
    2^28 cycles (~0.1 s) after each GEMM on the cores its threads need.  Only where no
    other thread can be inside a BLAS call meanwhile: gradtape replays a program's steps
    on one thread."""
    fn = _blas_shutdown()
    if fn is not None:
        fn()


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's BLAS on one thread inside the block, its own count again after it (also
    after an exception).  For work whose threads are OpenMP's (oneDNN, our kernels):
    OpenBLAS's idle threads spin on the cores those threads need, so the ones a GEMM
    before the block left spinning are parked on entry (a timing made right after a
    NumPy GEMM would otherwise measure bf16 at half its rate)."""
    threads = blas_threads()
    if threads is None:
        yield
        return
    get, set_ = threads
    n = get()
    set_(1)
    park_blas_threads()
    try:
        yield
    finally:
        set_(n)
