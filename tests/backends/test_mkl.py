"""MKL's bf16 GEMM (``backends/cpu/mkl.py``), the second provider of the bf16 block
products' plain GEMMs, on an AMX CPU (elsewhere these skip, naming what the CPU lacks).

* The GEMM against float64 arithmetic on the bf16-rounded operands, 1e-5 relative (the
  products of bf16 values are exact in float32; what is left is float32 accumulation
  over k <= 1100 terms, about 1e-6 observed), for each layout ``onednn.Gemm`` names (W
  ``[n, k]`` or ``[k, n]``, row strides, added to out); and against the float32 product
  of the unrounded operands, an error of bf16's size (bf16 inputs: 2^-9 a value).
* The plan's ``bf16_gemms = mkl``: block-weight products offer their plain, direct and
  resident ways run by MKL too (named so); taken, they give the same 1e-5 against the
  rounded reference.
* The decision: MKL is not in question without it, and a capped ISA leaves it out.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops, plan
from gradtape.backends.cpu import measure, mkl, onednn, qgemm_tiles
from gradtape.blocks import random_blocks

from support import hardware
from support.compare import rel_err


def _b16(a):
    """``a`` rounded to bf16, as float64"""
    return onednn.from_bf16(onednn.to_bf16(a)).astype(np.float64)


@pytest.mark.parametrize("m,k,n,tb,lda,ldc,acc", [
    (7, 64, 48, False, None, None, False),
    (9, 1100, 130, True, None, None, False),
    (33, 200, 70, True, 260, 90, False),  # rows of a and out apart (a block of columns)
    (16, 96, 64, False, None, 64, True),  # added to out
])
def test_mkl_gemm_matches_rounded_reference(m, k, n, tb, lda, ldc, acc):
    lib = hardware.mkl_bf16()
    r = np.random.default_rng(m + k + n)
    a = r.standard_normal((m, lda or k), dtype=np.float32)
    w = r.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    out0 = r.standard_normal((m, ldc or n), dtype=np.float32)
    a16, w16, out = onednn.to_bf16(a), onednn.to_bf16(w), out0.copy()
    lib.bind_ptrs(onednn.Gemm(m, k, n, tb, lda=lda, ldc=ldc, acc=acc), a16.ctypes.data,
                  w16.ctypes.data, out.ctypes.data)()
    wk = (w.T if tb else w).astype(np.float64)  # [k, n]
    want = _b16(a[:, :k]) @ _b16(wk) + (out0[:, :n] if acc else 0)
    assert rel_err(out[:, :n], want) <= 1e-5
    np.testing.assert_array_equal(out[:, n:], out0[:, n:])  # past n: untouched
    # and it is bf16: against the unrounded operands, an error of bf16's size
    exact = a[:, :k].astype(np.float64) @ wk + (out0[:, :n] if acc else 0)
    assert 1e-4 < rel_err(out[:, :n], exact) < 1e-2


def test_mkl_takes_plain_gemms_only():
    lib = hardware.mkl_bf16()
    for gemm in (onednn.Gemm(4, 64, 64, vnni=True), onednn.Gemm(4, 64, 64, packed=True),
                 onednn.Gemm(4, 64, 64, s8=True)):
        assert not lib.takes(gemm)
        with pytest.raises(mkl.MklError, match="plain bf16 GEMMs only"):
            lib.bind_ptrs(gemm, 0, 0, 0)


@pytest.mark.parametrize("qtype,layout", [("Q4_K", "plain"), ("Q8_0", "plain"),
                                          ("Q4_K", "resident"), ("BF16", "direct")])
def test_block_products_with_mkl_match_rounded_reference(qtype, layout, monkeypatch):
    """The plan names MKL: each of oneDNN's plain, direct and resident ways is offered
    run by MKL as well; taken, the plain ways' tiles (3 row tiles forward, 3 column
    tiles backward), a BF16 W read in place (direct) and any other from its bf16 copy
    (resident) multiply in MKL, and the values are bf16's."""
    hardware.onednn_bf16()
    hardware.mkl_bf16()
    monkeypatch.setattr(qgemm_tiles, "BF16_TILE_ELEMS", 32 * 768)
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
    offered = {}

    def mkl_way(what, shape, runs, only=((), "")):  # the MKL way of the layout asked for
        offered.setdefault(what, []).extend(runs)
        return next(n for n in runs if n.split()[0] == layout and n.endswith(" mkl"))
    monkeypatch.setattr(measure, "fastest", mkl_way)
    r = np.random.default_rng(7)
    T, rows, k = 9, 70, 768
    bm = random_blocks(qtype, rows, k, r)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((T, k)))
    g = tp.param(r.standard_normal((T, rows)))
    w = tp.const(bm)
    y, z = ops.qmatmul(x, w), ops.qmatmul_t(g, w)
    execution = plan.for_program("cpu", "bf16").replace(
        bf16_gemms=plan.Decision("mkl", "the test's"),
        resident_weights=plan.Decision(layout == "resident", "the test's"))
    prog = tp.compile([y, z], backend="cpu", plan=execution)
    assert prog.executable.compute == "bf16"
    for ways in offered.values():  # MKL's plain ways beside each of oneDNN's
        assert {n[:-4] for n in ways if n.endswith(" mkl")} == \
            {n for n in ways if n.split()[0] in ("plain", "direct", "resident")
             and not n.endswith(" mkl")}
    assert [s.layout for s in prog.executable._steps if hasattr(s, "layout")] == [layout] * 2
    got_y, got_z = prog.run()
    deq = _b16(bm.dequantize())
    assert rel_err(got_y, _b16(x.value) @ deq.T) <= 1e-5
    assert rel_err(got_z, _b16(g.value) @ deq) <= 1e-5


def test_the_plan_names_mkl_only_for_bf16_cpu_products(monkeypatch):
    monkeypatch.setattr(measure, "bf16_provider", lambda shape: ("mkl", "timed faster"))
    bf16 = plan.Decision("bf16", "")
    assert plan.bf16_gemms(bf16, "cpu", (256, 64, 128)) == ("mkl", "timed faster")
    assert plan.bf16_gemms(plan.Decision("int8", ""), "cpu", (256, 64, 128)).value == "mkl"
    assert plan.bf16_gemms(plan.Decision("float32", ""), "cpu", (256, 64, 128)) == \
        ("onednn", "")
    assert plan.bf16_gemms(bf16, "numpy", (256, 64, 128)) == ("onednn", "")
    said = plan.Plan(compute=bf16, bf16_gemms=plan.Decision("mkl", "timed faster"))
    assert "bf16 GEMMs: mkl (timed faster)" in said.describe()


def test_a_capped_isa_leaves_mkl_out(monkeypatch):
    monkeypatch.setenv("GRADTAPE_ISA", "avx2")
    mkl._load.cache_clear()
    try:
        ok, why = mkl.available()
        assert not ok and "GRADTAPE_ISA=avx2" in why
        assert measure.bf16_provider((256, 64, 128)) == ("onednn", "")
    finally:
        monkeypatch.delenv("GRADTAPE_ISA")
        mkl._load.cache_clear()


def test_a_plan_naming_mkl_where_it_cannot_run_runs_onednn_and_says_so(monkeypatch):
    hardware.onednn_bf16()

    def missing():
        raise mkl.MklError("MKL is not installed (pip install gradtape[mkl])")
    monkeypatch.setattr(mkl, "mkl", missing)
    r = np.random.default_rng(3)
    tp = gt.Tape(np.float32)
    x = tp.param(r.standard_normal((9, 256)))
    y = ops.qmatmul(x, tp.const(random_blocks("Q8_0", 64, 256, r)))
    execution = plan.for_program("cpu", "bf16").replace(
        bf16_gemms=plan.Decision("mkl", "the test's"))
    with pytest.warns(RuntimeWarning, match="names MKL for the bf16 GEMMs, running oneDNN"):
        prog = tp.compile([y], backend="cpu", plan=execution)
    assert prog.execution.bf16_gemms == ("onednn", "MKL is not installed (pip install "
                                                   "gradtape[mkl])")
