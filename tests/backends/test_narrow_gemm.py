"""The float32 products with a narrow side (``backends/cpu/narrow.py``,
``csrc/narrow_gemm.c``: LoRA's rank-r GEMMs) against float64 products, at every
instruction-set class this CPU runs, threaded and on one thread; which products they
take; and that a program runs them where ``measure.narrow_way`` says, with the values
oneDNN's GEMM gives.  Sums run in another order than NumPy's: compared within float32
rounding (``rel_err`` 1e-6 against float64 sums of up to 1536 terms), never bitwise."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops, plan
from gradtape.backends.cpu import measure, narrow

from support import hardware
from support.compare import rel_err
from support.hardware import kernel_isa  # noqa: F401  (a fixture)

# (m, k, n, a transposed, b transposed): the LoRA products of a [256, 576] / [256, 1536]
# layer with r = 8 (and q/k/v's merged r = 24), and tails: rows past a multiple of 8,
# columns past a multiple of 16 and of 8, k of 1 and of NARROW
SHAPES = [(256, 8, 576, False, False), (256, 8, 576, False, True), (256, 24, 576, False, True),
          (256, 576, 8, False, False), (256, 576, 8, False, True), (1536, 256, 8, True, False),
          (576, 256, 24, True, False), (8, 256, 1536, True, False), (8, 256, 576, True, False),
          (37, 1, 29, False, False), (13, 32, 100, True, True), (70, 300, 12, False, True),
          (5, 64, 40, True, False), (3, 19, 8, False, False)]


def _operand(rng, shape, transposed):
    x = rng.standard_normal(shape[::-1] if transposed else shape, dtype=np.float32)
    return x.T if transposed else x


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("threaded", [True, False])
@pytest.mark.parametrize("m,k,n,ta,tb", SHAPES)
def test_narrow_products_equal_float64(m, k, n, ta, tb, threaded):
    rng = np.random.default_rng(m * k + n)
    a, b = _operand(rng, (m, k), ta), _operand(rng, (k, n), tb)
    out = np.full((m, n), np.nan, np.float32)
    run = narrow.bind(out, a, b, threaded=threaded)
    assert run is not None, (m, k, n, ta, tb)
    run()
    run()  # a second call writes the same (no accumulation into out)
    assert rel_err(out, a.astype(np.float64) @ b.astype(np.float64)) < 1e-6


def test_which_products_are_narrow():
    assert narrow.form(256, 8, 576) == "k"
    assert narrow.form(256, 576, 8) == "n"
    assert narrow.form(8, 256, 1536) == "m"
    assert narrow.form(256, 576, 1536) is None  # no side narrow
    assert narrow.form(256, 576, 1) is None  # a narrow n below 8 lanes: oneDNN's
    assert narrow.form(256, 33, 576) is None  # just wider than NARROW
    x = np.ones((16, 64), np.float32)
    assert narrow.bind(np.empty((16, 16)), x, np.ones((64, 16))) is None  # float64
    assert narrow.bind(np.empty((16, 16), np.float32).T, x,  # out not C order
                       np.ones((64, 16), np.float32)) is None
    big = np.ones((64, 576), np.float32).T  # narrow m with a wide b not in rows: not copied
    assert narrow.bind(np.empty((8, 64), np.float32), np.ones((8, 576), np.float32),
                       big) is None


@pytest.mark.parametrize("way", ["narrow", "narrow 1 thread", "onednn"])
def test_program_runs_the_way_measured(monkeypatch, way):
    """A bf16 program's float32 LoRA products (through oneDNN unless measured slower)
    run in the narrow loops where ``narrow_way`` says, with oneDNN's values within
    float32 rounding."""
    hardware.onednn_f32()
    asked = []

    def decide(a, b):
        asked.append((a.shape, b.shape))
        return way
    monkeypatch.setattr(measure, "narrow_way", decide)
    rng = np.random.default_rng(3)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((64, 96)).astype(np.float32))
    w0 = tp.const(rng.standard_normal((96, 80)).astype(np.float32) / 10)
    a = tp.param(rng.standard_normal((96, 8)).astype(np.float32) / 10)
    b = tp.param(rng.standard_normal((8, 80)).astype(np.float32) / 10)
    y = nn.lora_linear(tp, x, w0, a, b, 2.0)
    loss = ops.reduce_sum(y * y)
    grads = tp.backward(loss)
    outs = [loss, grads[a], grads[b]]
    prog = tp.compile(outs, backend="cpu", compute="float32", plan=_onednn_plan())
    labels = [getattr(f, "label", "") for f in prog.executable._steps]
    ours = [lab for lab in labels if "(narrow" in lab]
    assert asked and (len(ours) == len(asked) if way != "onednn" else not ours)
    assert all(("1 thread" in lab) == (way == "narrow 1 thread") for lab in ours)
    ref = tp.compile(outs, backend="numpy").run()
    for got, want in zip(prog.run(), ref):
        assert rel_err(got, want) < 1e-5


def _onednn_plan():
    return plan.for_program("cpu", "float32").replace(
        f32_gemms=plan.Decision("onednn", "the test's"))


def test_narrow_way_times_the_ways(monkeypatch, tmp_path):
    """The decision is one of the three ways, timed once per shape and layout, kept for
    the process, and read from the cache by the next."""
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    hardware.onednn_f32()
    monkeypatch.setattr(measure, "_F32_WAYS", {})
    a, b = np.ones((64, 8), np.float32), np.ones((96, 8), np.float32).T
    way = measure.narrow_way(a, b)
    assert way in ("onednn", "narrow", "narrow 1 thread")
    timed = []
    monkeypatch.setattr(measure, "seconds_in_turn", lambda fns, **k: timed.append(fns))
    assert measure.narrow_way(a, b) == way  # kept for the process
    monkeypatch.setattr(measure, "_F32_WAYS", {})
    assert measure.narrow_way(a, b) == way and not timed  # read from the cache
