"""What the machine running the tests lacks, said once: the skips a test may take, and an
emulated AVX2-only CPU to check that such a machine skips only those.

A test skips only for hardware: a CPU without bf16 matrix instructions (oneDNN has no
bf16 matmul there), without AVX512-BF16 or int8 dot products, or without a GPU.  Every
package ``make test`` installs is imported plainly, so a broken install fails.

``emulate_avx2()`` (``pytest --cpu=avx2``, see ``tests/conftest.py``) makes this process
look like an AVX2-only x86-64 such as AMD Zen 3: ``cpu_info()`` without the AVX-512,
AMX and VNNI flags, oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, read when it loads),
and the C kernels compiled for ``-march=haswell`` (a compiler wrapper named by
``$GRADTAPE_CC``), so that their 8-lane paths run.
"""

from __future__ import annotations

import functools
import os
import platform
import stat
import sys
from pathlib import Path

import pytest

# the flags an AVX2-only CPU lacks (prefixes of /proc/cpuinfo's names)
_AVX2_LACKS = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")

ONEDNN_PLATFORM = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


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


def emulate_avx2(workdir):
    """From now on in this process (and the environment its subprocesses inherit), an
    AVX2-only CPU: see the module's docstring.  ``workdir``: where the compiler wrapper
    goes.  Call it before oneDNN loads."""
    from gradtape.backends.cpu import measure as compute, toolchain as _cgen

    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    cc = os.environ.get("GRADTAPE_CC", "cc")
    wrapper = Path(workdir) / "cc-haswell"
    # the last -march wins over the kernels' -march=native
    wrapper.write_text(f'#!/bin/sh\nexec {cc} "$@" -march=haswell -mtune=generic\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    os.environ["GRADTAPE_CC"] = str(wrapper)
    real = _cgen.cpu_info()

    @functools.lru_cache(maxsize=1)  # as the real one (tests clear it)
    def cpu_info():
        return {"model": f"{real['model']} (emulating AVX2 only)",
                "flags": frozenset(f for f in real["flags"] if not f.startswith(_AVX2_LACKS))}
    _cgen.cpu_info = compute.cpu_info = cpu_info
