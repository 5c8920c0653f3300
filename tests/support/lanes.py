"""``sixteen_lanes``: the C kernels rebuilt with ``-DGV_EMULATE=16`` for one test, so
their 16-lane (AVX-512) paths run on any CPU (``csrc/gv_simd.h``: GCC's generic
vectors in place of the intrinsics, one operation for one)."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape.backends.cpu import ggml_vec, toolchain
from gradtape.backends.cpu import tiled as tiled_c

EMULATED = ("-DGV_EMULATE=16", "-Wno-psabi")


@pytest.fixture
def sixteen_lanes(monkeypatch):
    emulate_sixteen_lanes(monkeypatch)


def emulate_sixteen_lanes(monkeypatch):
    """From here to the end of the test, the kernels built with ``-DGV_EMULATE=16`` (their
    flags are in the cache key: the shared cache keeps them beside the native ones)."""
    isa_flags = toolchain.isa_flags
    # every library is loaded once per set of flags: these get libraries of their own
    monkeypatch.setattr(toolchain, "isa_flags", lambda: isa_flags() + EMULATED)
    assert tiled_c.CTiles(np.float32).lanes == 16 and ggml_vec.lib().gv_lanes() == 16
