"""The C toolchain of the cpu backend, and what it needs to know about the machine.

The compiler (``$GRADTAPE_CC``, default ``cc``) and its flags; ``build`` compiles a C
source into a shared library cached on disk by a hash of everything that shapes the
binary (source, included files, flags, compiler version, CPU features); ``build_csrc``
builds the hand-written sources of ``csrc/`` the same way; ``threads_flags`` adds OpenMP
where it works, and ``quiet_openmp`` sets libgomp's idle policy before anything loads it.
``cpu_info`` and ``csrc_version`` say what a cached timing (``measure.py``) was made on.
``isa`` is the instruction-set class in force (``$GRADTAPE_ISA``): ``isa_flags`` build
for it and ``cpu_info`` hides what a CPU of that class lacks, so every kernel is built
and chosen as on such a CPU.

This module generates no kernel text (``codegen.py`` does) and loads no library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ... import settings
from ...errors import GradtapeError

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-ffp-contract=off", "-fopenmp-simd",
         # on an AVX-512 CPU, 512-bit vectors where GCC would pick 256 for -march=native
         # (no effect elsewhere): the row kernels' loops run at twice the width
         "-mprefer-vector-width=512")

CSRC = Path(__file__).with_name("csrc")

# what a capped build compiles for: a CPU of each class of ``settings.ISA_CLASSES`` (the
# same binary on every machine), and the /proc/cpuinfo flags such a CPU has among those
# of the AVX-512 / AMX / VNNI families (the others of those families are hidden under the
# cap).  A CPU runs a class where it has every flag of ``ISA_NEEDS``.
ISA_MARCH = {"avx2": "-march=haswell", "avx512": "-march=skylake-avx512",
             "avx512bf16": "-march=cooperlake"}
_AVX512 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
ISA_KEEPS = {"avx2": (), "avx512": _AVX512,
             "avx512bf16": (*_AVX512, "avx512_vnni", "avx512_bf16")}
ISA_NEEDS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx2", "fma", "f16c", *_AVX512),
             "avx512bf16": ("avx2", "fma", "f16c", *_AVX512, "avx512_vnni", "avx512_bf16")}
_CAPPED_FAMILIES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")


def isa() -> str:
    """The instruction-set class the kernels are built and chosen for: ``$GRADTAPE_ISA``
    (default "native": whatever this CPU has).  A class this CPU cannot run is a
    ``GradtapeError`` naming what it lacks (its kernels would stop on an illegal
    instruction; a silent fall-back would time or test another class than asked)."""
    want = settings.isa()
    if want != "native":
        flags = _cpu_flags()[1]
        missing = [f for f in ISA_NEEDS[want] if f not in flags]
        if missing:
            raise GradtapeError(
                f"$GRADTAPE_ISA={want}: this CPU ({_cpu_flags()[0]}) lacks "
                f"{', '.join(missing)}; use a class it has ({' | '.join(isa_classes())})")
    return want


def isa_classes() -> tuple:
    """The classes this CPU can run, lowest first, ending with "native"."""
    flags = _cpu_flags()[1]
    return (*(c for c, need in ISA_NEEDS.items() if all(f in flags for f in need)),
            "native")


def isa_flags() -> tuple:
    """``FLAGS`` for the class in force: ``-march=native``, or a CPU of the capped class."""
    cap = isa()
    if cap == "native":
        return FLAGS
    return tuple(ISA_MARCH[cap] if f == "-march=native" else f for f in FLAGS)


class CompilerMissing(RuntimeError):
    pass


_VERSIONS = {}  # compiler command -> its version line
_THREADS = {}  # (compiler, version) -> whether it builds and runs OpenMP


def threads_flags(flags=None):
    """``flags`` (default ``isa_flags()``, the class in force) plus ``-fopenmp`` where
    the compiler and its runtime support it (the row and elementwise loops then split
    over the cores), else ``flags`` unchanged.

    Before the first OpenMP library is loaded, libgomp's idle-thread policy is set
    (``quiet_openmp``): by default idle threads spin for milliseconds after each
    parallel loop, taking a core from the OpenBLAS threads of the GEMM that follows, and
    with other processes on the cores a spinning team slows a step severalfold; a
    sleeping one costs a wake-up of microseconds per loop, a short spin neither where
    every thread is OpenMP's."""
    flags = isa_flags() if flags is None else flags
    cc, version = compiler()
    if (cc, version) not in _THREADS:
        probe = "int gt_probe(float *x, long n) {\n#pragma omp parallel for\n" \
                "for (long i = 0; i < n; i++) x[i] += 1.0f;\nreturn 0; }\n"
        try:
            build(probe, flags + ("-fopenmp",), prefix="probe")
            ok = True
        except RuntimeError:
            ok = False
        _THREADS[(cc, version)] = ok
    if not _THREADS[(cc, version)]:
        return tuple(flags)
    quiet_openmp()
    return tuple(flags) + ("-fopenmp",)


# GOMP_SPINCOUNT: idle OpenMP threads spin this long, so the next parallel region of a
# replay (there are thousands) finds them awake instead of paying a futex wake-up.  Every
# thread of a step is OpenMP's (our kernels, oneDNN's bf16 GEMMs and its float32 ones
# wherever measured within measure.F32_POOL_GAIN of NumPy's BLAS, NumPy's BLAS idle or
# on one thread), on every CPU class: sleeping threads cost an AVX2 float32 step as much
# as its C kernels.  Much longer spins (libgomp's default) slow steps beside other
# processes.
SPIN = "5000"


def quiet_openmp():
    """Set libgomp's idle-thread policy before anything loads it (our kernels, oneDNN:
    it is read once): a short spin (``SPIN``).  A user's ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is left alone."""
    settings.omp_wait_policy(SPIN)


def cpu_info() -> dict:
    """``{"model": str, "flags": frozenset}`` from /proc/cpuinfo (empty where absent), as
    a CPU of the class in force (``isa``) has them: under a cap, the model says so and
    the flags above the class are left out."""
    return _capped(*_cpu_flags(), isa())


@functools.lru_cache(maxsize=8)
def _capped(model, flags, cap):
    if cap == "native":
        return {"model": model, "flags": flags}
    keep = ISA_KEEPS[cap]
    return {"model": f"{model} (capped at {cap})",
            "flags": frozenset(f for f in flags
                               if f in keep or not f.startswith(_CAPPED_FAMILIES))}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> tuple:
    """``(model, flags)`` of this CPU, from /proc/cpuinfo."""
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
    return model, flags


def compiler():
    """The C compiler command ($GRADTAPE_CC, default ``cc``) and its version line;
    raises CompilerMissing when it cannot run."""
    cc = settings.get("GRADTAPE_CC") or "cc"
    if cc not in _VERSIONS:
        try:
            r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise CompilerMissing(f"C compiler {cc!r} not usable: {e}") from None
        if r.returncode != 0:
            raise CompilerMissing(f"C compiler {cc!r} not usable: {r.stderr.strip()[:200]}")
        _VERSIONS[cc] = (r.stdout.strip().splitlines() or [""])[0]
    return cc, _VERSIONS[cc]


def _csrc_texts():
    return [p.read_text() for p in sorted(CSRC.glob("*.[ch]"))]


_CSRC_LIBS = {}  # (files, prefix, build flags) -> the loaded library


def csrc_library(names, prefix):
    """The library of csrc ``names`` with OpenMP, built for the instruction-set class in
    force (``build_csrc``) and loaded once per class in this process."""
    key = (tuple(names), prefix, isa_flags())
    if key not in _CSRC_LIBS:
        path, _ = build_csrc(list(names), flags=threads_flags(), prefix=prefix)
        _CSRC_LIBS[key] = ctypes.CDLL(str(path))
    return _CSRC_LIBS[key]


def build_csrc(names, flags=None, prefix="gt"):
    """The files ``names`` of ``csrc/`` compiled as one translation unit (each includes
    the headers it needs; each also compiles alone), cached like ``build``: the key
    covers every file in ``csrc/``.  The unit starts with ``iq_tables``."""
    unit = iq_tables() + "".join(f'#include "{name}"\n' for name in names)
    flags = isa_flags() if flags is None else flags
    return build(unit, (*flags, f"-I{CSRC}"), prefix, depends=_csrc_texts(),
                 announce=f"C kernels ({prefix})")


@functools.cache
def iq_tables():
    """C definitions of the tables the IQ2 / IQ3 types index (``GB_IQ_TABLES`` in
    ``csrc/ggml_blocks.h``): the sign bytes and value grids as gguf's own dequantizer
    builds them, so that the C blocks index the very tables gguf.quants does."""
    from gguf import quants

    def array(name, a):  # a 1-d or 2-d array of bytes
        rows = [",".join(map(str, r)) for r in a.reshape(-1, a.shape[-1])]
        body = rows[0] if a.ndim == 1 else ",\n".join("{" + r + "}" for r in rows)
        dims = "".join(f"[{n}]" for n in a.shape)
        return f"static const uint8_t {name}{dims} = {{\n{body}}};\n"

    out = ["#include <stdint.h>\n#define GB_IQ_TABLES 1\n",
           array("gb_ksigns", np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))]
    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"):
        t = getattr(quants, name)  # gguf's dequantizer of the type (gguf >= 0.10)
        t.init_grid()
        grid = t.grid.reshape(t.grid_shape)
        assert np.array_equal(grid, grid.astype(np.uint8)), name  # small whole values
        out.append(array(f"gb_grid_{name.lower()}", grid.astype(np.uint8)))
    return "".join(out)


@functools.cache
def csrc_version():
    """A short hash of every file in ``csrc/``: what a cached timing of these kernels
    (``measure.rates``) was measured with."""
    return hashlib.sha256("\0".join(_csrc_texts()).encode()).hexdigest()[:12]


def cache_dir():
    d = settings.get("GRADTAPE_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "gradtape"


def _cpu_signature():
    # -march=native: a shared cache directory must not serve a build for another CPU
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return os.uname().machine


def build(source, flags=None, prefix="gt", directory=None, depends=(), announce=None):
    """Compile ``source`` to a shared library, or reuse the cached one.

    Returns ``(path, hit)``.  The cache key hashes the source, the texts of the files it
    includes (``depends``), the flags (default ``isa_flags()``), the compiler's version
    line and the CPU's feature flags; the library is written under a temporary name and
    renamed into place, so concurrent builds never see a torn file.  ``announce`` names
    what a build compiles, for a line on a terminal's stderr (a large library's first
    build takes seconds, with nothing else to show).
    """
    flags = isa_flags() if flags is None else flags
    cc, version = compiler()
    key = hashlib.sha256("\0".join([source, *depends, " ".join(flags), cc, version,
                                    _cpu_signature()]).encode()).hexdigest()[:32]
    d = Path(directory) if directory else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{prefix}_{key}.so"
    if path.exists():
        return path, True
    if announce and sys.stderr.isatty():
        print(f"gradtape: compiling {announce} for this CPU (once; kept in {d})",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = Path(tmp) / "k.c"
        src.write_text(source)
        so = Path(tmp) / "k.so"
        r = subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"gradtape: compiling generated C ({prefix}) failed:\n"
                               f"{r.stderr[-4000:]}")
        (d / f"{prefix}_{key}.c").write_text(source)  # kept beside the library to read
        os.replace(so, path)
    return path, False
