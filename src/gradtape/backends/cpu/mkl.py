"""Intel MKL's bf16 GEMM (``cblas_gemm_bf16bf16f32``) through ctypes: a second provider of
the bf16 block products' GEMMs beside oneDNN, where the optional ``mkl`` wheel is installed
(``pip install gradtape[mkl]``).

Where it is installed and the CPU has AMX (and ``$GRADTAPE_ISA`` caps nothing), the plan
may time it against oneDNN at the model's shapes and hand it to the backend
(``plan.Plan.bf16_gemms``).  It takes plain row-major operands only: A ``[m, k]`` bf16
with a row stride, W ``[k, n]`` or ``[n, k]`` bf16, out float32 written or added to; no
blocked or packed layouts (its packed bf16 buffers are many times the weight's size).
MKL runs on libgomp's threads (its GNU threading layer), the OpenMP runtime oneDNN and our
kernels use, so one pool serves them all.  Failing to load is reported by
``available()`` as a reason, never raised at import; this module times nothing.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from ... import settings
from . import toolchain
from .onednn import Gemm

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS_LAYOUT, CBLAS_TRANSPOSE
_THREADING_GNU, _INTERFACE_LP64 = 3, 0  # MKL_Set_Threading_Layer, MKL_Set_Interface_Layer
_LIBRARY = "libmkl_rt.so"  # the wheel ships libmkl_rt.so.2 or .so.3 (by release)
_vp, _i = ctypes.c_void_p, ctypes.c_int


class MklError(RuntimeError):
    pass


def _library_path():
    """The ``libmkl_rt.so.N`` of the installed ``mkl`` wheel, or None."""
    try:
        import importlib.metadata as md
        dist = md.distribution("mkl")
    except Exception:  # not installed
        return None
    found = sorted(str(dist.locate_file(f)) for f in dist.files or ()
                   if Path(str(f)).name.startswith(_LIBRARY + "."))
    return found[-1] if found else None


class Mkl:
    """The loaded library: ``bind_ptrs`` binds one plain bf16 GEMM to fixed addresses."""

    provider = "MKL"

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        # before any other call: libgomp's threads, 32-bit integers (cblas' LP64)
        lib.MKL_Set_Threading_Layer.argtypes = [_i]
        lib.MKL_Set_Interface_Layer.argtypes = [_i]
        lib.MKL_Set_Threading_Layer(_THREADING_GNU)
        lib.MKL_Set_Interface_Layer(_INTERFACE_LP64)
        lib.MKL_Set_Num_Threads.argtypes = [_i]
        lib.MKL_Set_Num_Threads(settings.omp_threads())
        f = lib.cblas_gemm_bf16bf16f32
        f.argtypes = [_i, _i, _i, _i, _i, _i, ctypes.c_float, _vp, _i, _vp, _i,
                      ctypes.c_float, _vp, _i]
        f.restype = None
        self._gemm = f
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, 256)
        self.version = buf.value.decode(errors="replace").strip()
        self.path = path

    def takes(self, gemm: Gemm) -> bool:
        """Whether ``gemm`` is one MKL runs: plain bf16 operands (no int8, no blocked or
        packed weights)."""
        return not (gemm.vnni or gemm.packed or gemm.s8)

    def bind_ptrs(self, gemm: Gemm, a, w, out):
        """A callable computing ``out [m, n] (+)= a [m, k] @ op(W) [k, n]`` on raw
        addresses (``Gemm``'s meaning: W ``[n, k]`` where ``tb``, row strides ``lda``,
        ``ldc``, added where ``acc``); the memory must outlive the callable."""
        if not self.takes(gemm):
            raise MklError(f"MKL takes plain bf16 GEMMs only, not {gemm}")
        g = gemm.normal()
        args = (_ROW_MAJOR, _NO_TRANS, _TRANS if g.tb else _NO_TRANS, g.m, g.n, g.k,
                1.0, a, g.lda, w, g.k if g.tb else g.n, 1.0 if g.acc else 0.0, out, g.ldc)
        f = self._gemm

        def run():
            f(*args)
        return run

    def gemm(self, gemm: Gemm, a, w, out):
        """``bind_ptrs``' product run once now."""
        self.bind_ptrs(gemm, a, w, out)()


@functools.lru_cache(maxsize=1)
def _load():
    """``(Mkl, "")`` where it loads and may run here, else ``(None, why)``."""
    if toolchain.isa() != "native":
        return None, f"$GRADTAPE_ISA={toolchain.isa()} leaves no AMX for MKL's bf16 GEMM"
    if "amx_bf16" not in toolchain.cpu_info()["flags"]:
        return None, "this CPU has no AMX (MKL's bf16 GEMM is offered with AMX only)"
    path = _library_path()
    if path is None:
        return None, "MKL is not installed (pip install gradtape[mkl])"
    toolchain.quiet_openmp()  # libgomp's threads, shared with oneDNN and our kernels
    try:
        return Mkl(path), ""
    except (OSError, AttributeError) as e:
        return None, f"MKL could not be used ({path}: {e})"


def available():
    """``(True, "")`` where MKL's bf16 GEMM may run here, else ``(False, why)``."""
    m, why = _load()
    return m is not None, why


def mkl():
    """The library (``MklError`` saying why not)."""
    m, why = _load()
    if m is None:
        raise MklError(why)
    return m
