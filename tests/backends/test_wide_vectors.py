"""The 16-lane (AVX-512) paths of the C kernels, run on any CPU: built with
``-DGV_EMULATE=16``, ``csrc/gv_simd.h`` gives them GCC's generic 16-float vectors, so
what differs from the 8-lane (AVX2) paths (panel widths, nibble halves, register blocks)
is tested on machines without AVX-512 too.  Only the intrinsics themselves are not: they
are one-to-one with the emulation's operations.  The checks are the usual ones, on the
emulated libraries (the decode step's: tests/models/test_decode_engine.py)."""

from __future__ import annotations

import pytest

import numpy as np

from support.compare import rel_err
from support.lanes import emulate_sixteen_lanes, sixteen_lanes  # noqa: F401 (a fixture)
from test_cpu_kernels import _fused_attention
from test_cpu_kernels import test_bf16_fused_attention_is_within_bf16_rounding as bf16_check
from test_cpu_kernels import test_fused_attention_equals_the_walk as fused_attention_check
from test_ggml_vec import test_matmul_against_dequantize as matmul_check
from test_ggml_vec import test_matvec_against_dequantize as matvec_check


@pytest.mark.parametrize("t, nh, nkv, hd, cap, window, n_seq, seg, past", [
    (300, 9, 3, 64, 0.0, 0, 1, None, 0),  # two key tiles; a 32-float panel per 2 vectors
    (200, 8, 2, 96, 0.0, 37, 1, None, 0),  # 96 = three 32-column panels
    (130, 6, 2, 16, 2.0, 0, 3, None, 0),  # a head narrower than one panel, capped
    (100, 4, 2, 64, 0.0, 0, 1, "runs", 0),  # packed examples
])
def test_fused_attention_on_16_lanes(sixteen_lanes, t, nh, nkv, hd, cap, window, n_seq, seg,
                                     past):
    fused_attention_check(t, nh, nkv, hd, cap, window, n_seq, seg, past)


@pytest.mark.parametrize("case", [(300, 9, 3, 64, 0.0, 0, 1, None, 0),
                                  (33, 3, 1, 6, 2.0, 0, 1, None, 0)])
def test_bf16_fused_attention_on_16_lanes(sixteen_lanes, case):
    """The plain-C block of the bf16 GEMMs (what runs without AVX512-BF16)."""
    bf16_check(*case)


def test_bf16_instructions_equal_their_plain_c_block(monkeypatch):
    """AVX512-BF16's vdpbf16ps against the plain-C block over the same bf16 pairs: the same
    products summed in another order, so float32 rounding apart, except where a p or dS
    then rounds to the other bf16 neighbour (2^-8 of that one value, carried into the
    sums it enters): 1e-4 allows those; observed 7e-8 (forward) and 1.2e-5."""
    from gradtape.backends.cpu.tiled import CTiles

    if not CTiles(np.float32, True).bf16_native:
        pytest.skip("no AVX512-BF16 on this CPU: only the plain-C block is built")
    case = (300, 9, 3, 64, 0.0, 0, 1, None, 0)
    native = _fused_attention(*case, bf16=True)[0]
    emulate_sixteen_lanes(monkeypatch)
    assert not CTiles(np.float32, True).bf16_native
    emulated = _fused_attention(*case, bf16=True)[0]
    for a, b in zip(native, emulated):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("T", [1, 3])
def test_ggml_products_on_16_lanes(sixteen_lanes, qtype, T):
    matvec_check(qtype, T)
    matmul_check(qtype, T, 512)

