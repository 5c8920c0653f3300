"""``backends.cpu.tiled.flash_gemms`` lists the GEMMs csrc/flash.c performs: held to the
calls a build of flash.c with ``-DFA_GEMM_LOG`` logs, for the fused attention's cases of
``test_cpu_kernels.py`` (GQA, windows, packed examples, cached keys, several sequences),
forward and backward, at every instruction-set class this CPU runs (the panel width
moves where a window's first key tile starts)."""

from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
import pytest

from gradtape import tiled
from gradtape.backends.cpu import toolchain
from gradtape.backends.cpu.tiled import _lib, flash_gemms

from support.hardware import kernel_isa  # noqa: F401  (a fixture)
from test_cpu_kernels import ATTN_CASES

LOG = 1 << 16  # calls a log holds: more than any case makes

_L = ctypes.c_long


def _logging_lib():
    path, _ = toolchain.build_csrc(["flash.c"], flags=(*toolchain.threads_flags(),
                                                       f"-DFA_GEMM_LOG={LOG}"),
                                   prefix="tiled-log")
    return ctypes.CDLL(str(path))


def _logged(lib):
    """The calls logged since the last read, as ``Counter((kind, m, n, k))``."""
    buf = np.zeros((LOG, 4), np.int64)
    lib.gt_flash_gemm_log.restype = _L
    n = lib.gt_flash_gemm_log(ctypes.c_void_p(buf.ctypes.data), _L(LOG))
    assert n <= LOG
    return Counter(map(tuple, buf[:n].tolist()))


def _listed(gemms):
    """``flash_gemms``' entries as the log's ``(kind, m, n, k)``: kind 0 for ``A B^T``,
    2 for ``A^T B``, 1 for ``A B``."""
    out = Counter()
    for m, k, n, ta, tb in gemms:
        out[(0 if tb else 2 if ta else 1, m, n, k)] += 1
    return out


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("t, nh, nkv, hd, cap, window, n_seq, seg, past", ATTN_CASES)
def test_listed_gemms_are_the_calls_flash_makes(t, nh, nkv, hd, cap, window, n_seq, seg,
                                                past):
    lib = _logging_lib()
    assert lib.gt_flash_panel() == _lib().gt_flash_panel()  # the same class as the list's
    rng = np.random.default_rng(0)
    n, nk = n_seq * t, n_seq * (t + past)
    q = rng.standard_normal((n, nh * hd), dtype=np.float32)
    k, v = (rng.standard_normal((nk, nkv * hd), dtype=np.float32) for _ in range(2))
    gy = rng.standard_normal((n, nh * hd + nh), dtype=np.float32)
    starts = (tiled.run_starts(np.repeat(np.arange(4), t // 4), t) if seg else None)
    spec = tiled.AttentionSpec(nh, nkv, hd, hd ** -0.5, cap, window, n_seq)
    p = (lambda a: ctypes.c_void_p(0 if a is None else a.ctypes.data))
    dims = (_L(n_seq), _L(n), _L(nk), _L(nh), _L(nkv), _L(hd), ctypes.c_double(hd ** -0.5),
            ctypes.c_double(cap), _L(window))
    y = np.empty((n, nh * hd + nh), np.float32)
    g = np.empty(n * nh * hd + 2 * nk * nkv * hd, np.float32)
    _logged(lib)  # clear
    assert lib.gt_flash_fwd_f32(p(y), p(q), p(k), p(v), p(starts), *dims) == 0
    fwd = _logged(lib)
    assert lib.gt_flash_bwd_f32(p(g), p(gy), p(q), p(k), p(v), p(y), p(starts), *dims) == 0
    bwd = _logged(lib)
    assert fwd == _listed(flash_gemms(spec, n, nk, starts))
    assert bwd == _listed(flash_gemms(spec, n, nk, starts, grad=True))
    # and the FLOPs: the forward's two products per tile, the backward's five
    flops = (lambda c: sum(2 * m * n_ * k_ * c_ for (_, m, n_, k_), c_ in c.items()))
    assert flops(bwd) == 5 * flops(fwd) // 2


def test_smollm2_at_256_rows():
    """SmolLM2's heads at T=256: 8 units of 32 rows (96 with the 3 heads of a kv head)
    per kv head, each one key tile of the rows it reaches (32, 64, ... 256 keys)."""
    spec = tiled.AttentionSpec(9, 3, 64, 0.125)
    fwd = flash_gemms(spec, 256, 256)
    assert len(fwd) == 2 * 8 * 3
    assert sorted({g[2] for g in fwd if g[4]}) == list(range(32, 257, 32))
    assert sum(2 * m * k * n for m, k, n, _, _ in fwd) == 2 * 2 * 96 * 64 * 32 * 36 * 3
