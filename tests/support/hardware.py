"""What the machine running the tests lacks, said once: the skips a test may take, and the
instruction-set classes the kernel parity tests run at.

A test skips only for hardware: a CPU without bf16 matrix instructions (oneDNN has no
bf16 matmul there), without AVX512-BF16, int8 dot products or AMX-INT8, or without a GPU.  Every
package ``make test`` installs is imported plainly, so a broken install fails.

``pytest --cpu=avx2`` (``tests/conftest.py``) runs a whole session as on an AVX2-only
x86-64 such as AMD Zen 3, through the package's own cap (``$GRADTAPE_ISA``: the kernels
built for ``-march=haswell``, ``cpu_info()`` without the AVX-512, AMX and VNNI flags,
oneDNN capped at AVX2).  ``kernel_isa``, a fixture the kernel parity files use, runs
each of their tests at every class this CPU can execute (``KERNEL_CLASSES``).
"""

from __future__ import annotations

import platform
import sys

import pytest

from gradtape.backends.cpu import toolchain

# the flags an AVX2-only CPU lacks (prefixes of /proc/cpuinfo's names)
_AVX2_LACKS = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")

ONEDNN_PLATFORM = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def mkl_bf16():
    """MKL with its bf16 GEMM (``backends.cpu.mkl``), or a skip naming what this CPU
    lacks (AMX; or a ``$GRADTAPE_ISA`` cap hiding it).  MKL is a test dependency on Linux
    x86-64 (``mkl``): not loading there, on an AMX CPU, fails."""
    from gradtape.backends.cpu import mkl

    if not ONEDNN_PLATFORM:
        pytest.skip(f"the mkl wheel is tested on Linux x86-64 only, not "
                    f"{sys.platform} {platform.machine()}")
    if toolchain.isa() != "native" or "amx_bf16" not in toolchain.cpu_info()["flags"]:
        pytest.skip("this CPU has no AMX (or $GRADTAPE_ISA caps it): MKL's bf16 GEMM is "
                    "offered with AMX only")
    ok, why = mkl.available()
    if not ok:
        pytest.fail(f"MKL is a test dependency on Linux x86-64 and does not load: {why}")
    return mkl.mkl()


def amx_int8():
    """A skip naming what is missing for the prefill's integer GEMM on AMX tiles
    (``ggml_vec.amx_int8``): AMX-INT8 in this CPU (or under the ``$GRADTAPE_ISA`` cap),
    or the tile state, which Linux grants from 5.16 on.  On such a CPU and kernel at the
    native class, a build without it fails."""
    from gradtape.backends.cpu import ggml_vec

    if toolchain.isa() != "native" or "amx_int8" not in toolchain.cpu_info()["flags"]:
        pytest.skip("this CPU has no AMX-INT8 (or $GRADTAPE_ISA caps it): the prefill's "
                    "integer GEMM runs on AMX tiles only")
    if not ggml_vec.amx_int8():
        if ggml_vec.lib().gq_amx_build() and not ggml_vec.lib().gq_amx_ready():
            pytest.skip("Linux does not grant this process the AMX tile state (kernel < 5.16)")
        pytest.fail("this CPU has AMX-INT8 but the native build of csrc/q8_amx.c lacks it")


# the AVX2 prefill GEMM's types (the 32-element ones at the AVX2 class only)
Q80_GEMM = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
AVX2_GEMM = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
             "IQ3_S", "IQ4_XS") + Q80_GEMM


def int8_gemm(qtype):
    """A skip naming why ``qtype``'s prefill products have no integer GEMM here
    (``ggml_vec.gemm_q8_types``): the 32-element types have one on AMX tiles or at the
    AVX2 class (IQ4_NL at the AVX2 class only); the K-quants and the IQ types wherever the
    build has AVX2 (so on x86-64 its absence fails)."""
    from gradtape.backends.cpu import ggml_vec

    if qtype in ggml_vec.gemm_q8_types():
        return
    if qtype in ("Q2_K", "Q3_K") and ggml_vec.amx_int8():
        pytest.skip(f"{qtype}'s prefill GEMM is the AVX2 one: with AMX the prefill keeps "
                    "float32 rows for it")
    if qtype in Q80_GEMM and ggml_vec.lib().gv_lanes() == 16:
        pytest.skip(f"{qtype}'s integer prefill GEMM runs on AMX tiles or at the AVX2 class: "
                    "the AVX-512 class keeps float32 rows for it (the avx2 class runs this)")
    if qtype not in AVX2_GEMM:
        amx_int8()
    if platform.machine() in ("x86_64", "AMD64"):
        pytest.fail(f"{qtype} has no integer GEMM in an x86-64 build (csrc/q8_gemm.c)")
    pytest.skip(f"{qtype}'s integer prefill GEMM needs AVX2 or AMX (x86-64)")


def onednn_bf16():
    """oneDNN with its bf16 matmul, or a skip naming what this CPU lacks.  oneDNN is a
    dependency on Linux x86-64 (``onednn-cpu-gomp``): not loading there fails."""
    from gradtape.backends.cpu import onednn

    if not ONEDNN_PLATFORM:
        pytest.skip(f"oneDNN (onednn-cpu-gomp) ships for Linux x86-64 only, not "
                    f"{sys.platform} {platform.machine()}")
    try:
        onednn.library()
    except onednn.DnnlError as e:
        pytest.fail(f"oneDNN is a dependency on Linux x86-64 and does not load: {e}")
    ok, why = onednn.available()
    if not ok:
        pytest.skip(f"this CPU has no oneDNN bf16 matmul (it needs AVX-512 or AMX): {why}")
    return onednn.dnnl()


def int8_dots():
    """A skip where this CPU has no int8 dot products (AVX512-VNNI, AMX-INT8; or
    ``$GRADTAPE_ISA`` caps them): int8 compute runs bf16 there."""
    from gradtape.backends.cpu import measure

    dots, why = measure.int8_dots()
    if not dots:
        pytest.skip(f"{why}: int8 compute runs bf16 here (oneDNN's int8 sums saturate)")


def onednn_f32():
    """oneDNN for its float32 matmul (any x86-64), or a skip off Linux x86-64."""
    from gradtape.backends.cpu import onednn

    if not ONEDNN_PLATFORM:
        pytest.skip(f"oneDNN (onednn-cpu-gomp) ships for Linux x86-64 only, not "
                    f"{sys.platform} {platform.machine()}")
    try:
        return onednn.library()
    except onednn.DnnlError as e:
        pytest.fail(f"oneDNN is a dependency on Linux x86-64 and does not load: {e}")


def kernel_classes():
    """The instruction-set classes the kernels' parity tests run at: "native", and each
    lower class this CPU can run whose kernels take other paths (the 8-lane AVX2 ones,
    AVX-512 without bf16 instructions); none but "native" under ``--cpu`` or a set
    ``$GRADTAPE_ISA`` (the session is capped already)."""
    from gradtape import settings

    if settings.get("GRADTAPE_ISA") or platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    runs = toolchain.isa_classes()[:-1]  # lowest first, "native" left out
    # the highest class this CPU runs takes the paths native does
    return [*runs[:-1], "native"] if runs else ["native"]


KERNEL_CLASSES = kernel_classes()


@pytest.fixture(params=KERNEL_CLASSES)
def kernel_isa(request, monkeypatch):
    """The test runs with the kernels built for one instruction-set class
    (``$GRADTAPE_ISA``; each class's libraries are loaded once, beside the others)."""
    if request.param != "native":
        monkeypatch.setenv("GRADTAPE_ISA", request.param)
    return request.param
