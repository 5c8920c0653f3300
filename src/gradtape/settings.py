"""The one place gradtape reads environment variables.

Every variable the package honours is a row of ``SETTINGS``: its name, its default and
what it does (the README's table lists the same rows; a test holds the two together).
Values are read when asked for, not at import, so a test or a launcher may set one just
before the work that reads it.  Nothing else in the package touches ``os.environ``,
except ``omp_wait_policy``, which hands libgomp its spin policy through the environment
(the only way libgomp takes it) before the first OpenMP library loads, and
``cap_libraries``, which hands oneDNN and OpenBLAS the instruction-set cap
(``$GRADTAPE_ISA``) the same way before they load.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

from .errors import GradtapeError


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # "" where unset means "decided by the code"
    help: str


SETTINGS = {s.name: s for s in (
    Setting("GRADTAPE_CACHE", "~/.cache/gradtape",
            "folder of compiled C kernels and of the measured per-CPU decisions"),
    Setting("GRADTAPE_DECISIONS", "$GRADTAPE_CACHE/compute-decisions.json",
            "the file of the measured per-CPU decisions (a test session keeps its own)"),
    Setting("GRADTAPE_CC", "cc", "the C compiler that builds the generated kernels"),
    Setting("GRADTAPE_ISA", "native",
            "avx2 | avx512 | avx512bf16 | native: build and run every kernel (and cap "
            "oneDNN and OpenBLAS) as if the CPU had no more than that instruction set"),
    Setting("GRADTAPE_THREADS", "",
            "threads of the decode kernels (default: the CPUs this process may use)"),
    Setting("GRADTAPE_DECODE_DOTS", "q8",
            "q8 | float: the C decode step's products quantize their input row to 8 bits "
            "and sum in integers, and its KV cache holds halves, as llama.cpp does (its "
            "prompt prefill's products too where an integer GEMM takes the type), or keep "
            "rows and cache float32 (closer to the float graph, slower)"),
    Setting("GRADTAPE_ATTENTION", "",
            "fused | composed: the training attention at 129-256 rows, instead of timing "
            "both"),
    Setting("GRADTAPE_BF16_LAYOUT", "",
            "blocked | plain | swapped | fused | amx | amx-rows | direct | resident: keep "
            "only that way of a block-weight bf16 product, instead of timing them"),
    Setting("GRADTAPE_BF16_TILE", "",
            "a tile size (\"1M\"): keep only the bf16 tiles of that size"),
    Setting("GRADTAPE_QGEMM_LAYOUT", "transposed",
            "transposed | direct: how the float32 block-weight GEMMs write each product "
            "block"),
    Setting("GRADTAPE_DNNL", "", "path of libdnnl (default: the onednn-cpu-gomp wheel's)"),
    Setting("GRADTAPE_BLAS", "",
            "path of the BLAS library whose threads are parked during bf16 replays "
            "(default: the one NumPy loaded)"),
    Setting("GRADTAPE_MEM_AVAILABLE", "",
            "bytes of memory to plan for (default: the kernel's MemAvailable)"),
    Setting("GRADTAPE_DEBUG", "", "1: the CLI prints tracebacks with its errors"),
    Setting("GRADTAPE_CUBLAS", "", "path of libcublas for the cuda backend"),
    Setting("GRADTAPE_CUDA_STORAGE", "float32",
            "float32 | bfloat16: storage of the cuda backend's values"),
    Setting("GRADTAPE_CUDA_GRAPH", "1", "0: the cuda backend never captures a CUDA graph"),
    Setting("CUDA_PATH", "", "CUDA toolkit folder searched for libcublas (also CUDA_HOME)"),
    Setting("CUDA_HOME", "", "CUDA toolkit folder searched for libcublas"),
    Setting("OMP_NUM_THREADS", "",
            "OpenMP threads of the C kernels and oneDNN (default: the CPUs this process "
            "may use)"),
    # set by MPI launchers in every rank (MPICH / Intel MPI, Open MPI, PMIx): read only
    # to tell a run under mpiexec from a plain one
    *(Setting(name, "", "set by mpiexec: a multi-rank run") for name in (
        "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
        "MPI_LOCALNRANKS", "PMI_FD", "PMIX_NAMESPACE")),
)}
LAUNCHER = tuple(name for name, s in SETTINGS.items() if s.help.startswith("set by mpiexec"))


def get(name: str) -> str:
    """The value of setting ``name``: the environment's, else "" (the code's default
    applies; ``Setting.default`` says what it is)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a gradtape setting (settings.SETTINGS)")
    return os.environ.get(name, "")


def launcher() -> dict:
    """The MPI launcher's variables that are set, ``{name: value}``."""
    return {name: os.environ[name] for name in LAUNCHER if name in os.environ}


def integer(name: str, minimum: int = 1) -> int | None:
    """Setting ``name`` as a whole number of at least ``minimum``, or None where unset;
    anything else is a ``GradtapeError`` naming the variable."""
    raw = get(name)
    if not raw:
        return None
    try:
        value = int(raw.split(",")[0]) if name == "OMP_NUM_THREADS" else int(raw)
    except ValueError:
        raise GradtapeError(f"${name} must be a whole number, got {raw!r}") from None
    if value < minimum:
        raise GradtapeError(f"${name} must be at least {minimum}, got {raw!r}")
    return value


def flag(name: str) -> bool:
    """Setting ``name`` as a switch: set to anything but "" or "0"."""
    return get(name) not in ("", "0")


# the instruction-set classes $GRADTAPE_ISA takes, lowest first, each with the values
# that cap the libraries at it: oneDNN's ISA name and OpenBLAS's core type (both read
# once, when the library loads); "native" caps nothing
ISA_CLASSES = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "OPENBLAS_CORETYPE": "Haswell"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "OPENBLAS_CORETYPE": "SkylakeX"},
    "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                   "OPENBLAS_CORETYPE": "Cooperlake"},
    "native": {},
}


def isa() -> str:
    """The instruction-set class ``$GRADTAPE_ISA`` names (default "native"); anything
    else is a ``GradtapeError`` listing the classes.  Whether this CPU has the class is
    ``toolchain.isa``'s question."""
    raw = get("GRADTAPE_ISA").strip().lower() or "native"
    if raw not in ISA_CLASSES:
        raise GradtapeError(f"$GRADTAPE_ISA must be one of {' | '.join(ISA_CLASSES)}, "
                            f"got {get('GRADTAPE_ISA')!r}")
    return raw


def cap_libraries():
    """Hand oneDNN and OpenBLAS the cap of ``$GRADTAPE_ISA`` (``ISA_CLASSES``) through the
    variables they read when they load: call it before NumPy (OpenBLAS) and oneDNN load
    (``import gradtape`` does, first; where NumPy came first it warns: OpenBLAS is not
    capped).  A variable the user set is left alone; a bad value sets nothing here
    (``isa()`` reports it where a kernel is built)."""
    try:
        cap = isa()
    except GradtapeError:
        return
    for name, value in ISA_CLASSES[cap].items():
        if name == "OPENBLAS_CORETYPE" and name not in os.environ and "numpy" in sys.modules:
            warnings.warn(f"$GRADTAPE_ISA={cap}: NumPy was imported before gradtape, so "
                          "its OpenBLAS runs this CPU's own kernels (it reads its cap, "
                          f"OPENBLAS_CORETYPE={value}, when it loads): import gradtape "
                          "first, or set OPENBLAS_CORETYPE too", RuntimeWarning, stacklevel=2)
        os.environ.setdefault(name, value)


DECODE_DOTS = ("q8", "float")


def decode_dots() -> str:
    """How the C decode step (and its AMX prefill) multiplies (``$GRADTAPE_DECODE_DOTS``, default "q8"); anything
    else is a ``GradtapeError`` listing the choices."""
    raw = get("GRADTAPE_DECODE_DOTS").strip().lower() or "q8"
    if raw not in DECODE_DOTS:
        raise GradtapeError(f"$GRADTAPE_DECODE_DOTS must be one of {' | '.join(DECODE_DOTS)}, "
                            f"got {get('GRADTAPE_DECODE_DOTS')!r}")
    return raw


def cpus() -> int:
    """The CPUs this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def omp_threads() -> int:
    """The threads an OpenMP region takes by default: ``$OMP_NUM_THREADS`` (its first
    number), else the CPUs this process may use."""
    try:
        return integer("OMP_NUM_THREADS") or cpus()
    except GradtapeError:  # libgomp ignores a value it cannot read, and so do we
        return cpus()


def omp_wait_policy(spin: str | None):
    """Hand libgomp its wait policy before it loads: ``GOMP_SPINCOUNT=spin`` where
    ``spin`` is given, else ``OMP_WAIT_POLICY=passive``.  A user's own
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if spin is not None:
        os.environ["GOMP_SPINCOUNT"] = spin
    else:
        os.environ["OMP_WAIT_POLICY"] = "passive"
