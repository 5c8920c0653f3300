"""float32 GEMMs in NumPy's BLAS split over the OpenMP threads (``backends/cpu/split.py``,
``csrc/split_sgemm.c``) against float64 products, in every layout and both splits
(columns; rows where the output is narrow); that a float32 program whose GEMMs run in
oneDNN takes them where ``measure.split_way`` says, with NumPy's BLAS on one thread in
its replay; and that the decision is timed once.  Each product is one BLAS call per
share: compared within float32 rounding, never bitwise against another path."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops, plan
from gradtape.backends.cpu import blas, measure, split

from support import hardware
from support.compare import rel_err

# (m, k, n, a transposed, b transposed): SmolLM2's tied LM head and its backward, an FFN
# product, and tails: columns past a multiple of 16, a narrow output (its rows split)
SHAPES = [(256, 576, 4096, False, True), (256, 4096, 576, False, False),
          (64, 576, 1536, True, False), (37, 29, 100, True, True), (100, 70, 12, False, False),
          (9, 5, 3, False, True)]


def _operand(rng, shape, transposed):
    x = rng.standard_normal(shape[::-1] if transposed else shape, dtype=np.float32)
    return x.T if transposed else x


@pytest.mark.parametrize("m,k,n,ta,tb", SHAPES)
def test_split_products_equal_float64(m, k, n, ta, tb):
    rng = np.random.default_rng(m + k * n)
    a, b = _operand(rng, (m, k), ta), _operand(rng, (k, n), tb)
    out = np.full((m, n), np.nan, np.float32)
    run = split.bind(out, a, b)
    assert run is not None, (m, k, n, ta, tb)
    with blas.one_blas_thread():
        run()
        run()  # a second call writes the same (no accumulation into out)
    assert rel_err(out, a.astype(np.float64) @ b.astype(np.float64)) < 1e-6


def test_what_split_takes():
    x = np.ones((16, 64), np.float32)
    assert split.bind(np.empty((16, 16)), x, np.ones((64, 16))) is None  # float64
    assert split.bind(np.empty((16, 16), np.float32).T, x,  # out not C order
                      np.ones((64, 16), np.float32)) is None
    every_other = np.ones((64, 32), np.float32)[:, ::2]  # neither rows nor columns packed
    assert split.bind(np.empty((16, 16), np.float32), x, every_other) is None


@pytest.mark.parametrize("way", ["split", "onednn"])
def test_program_runs_the_way_measured(monkeypatch, way):
    """A float32 program whose GEMMs run in oneDNN takes NumPy's BLAS split over the
    OpenMP threads where ``split_way`` says (NumPy's BLAS on one thread in its replay),
    with the NumPy reference's values within float32 rounding."""
    hardware.onednn_f32()
    asked = []

    def decide(a, b):
        asked.append((a.shape, b.shape))
        return way
    monkeypatch.setattr(measure, "split_way", decide)
    rng = np.random.default_rng(5)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((64, 96)).astype(np.float32))
    w0 = tp.const(rng.standard_normal((96, 80)).astype(np.float32) / 10)
    w1 = tp.param(rng.standard_normal((80, 96)).astype(np.float32) / 10)
    y = nn.linear(tp, nn.linear(tp, x, w0), w1)
    loss = ops.reduce_sum(y * y)
    outs = [loss, tp.backward(loss)[w1]]
    f32 = plan.for_program("cpu", "float32").replace(
        f32_gemms=plan.Decision("onednn", "the test's"))
    prog = tp.compile(outs, backend="cpu", compute="float32", plan=f32)
    labels = [getattr(f, "label", "") for f in prog.executable._steps]
    ours = [lab for lab in labels if "(split" in lab]
    assert asked and (len(ours) == len(asked) if way == "split" else not ours)
    assert prog.executable._split_bound == (way == "split")
    ref = tp.compile(outs, backend="numpy").run()
    for got, want in zip(prog.run(), ref):
        assert rel_err(got, want) < 1e-5


def test_split_way_times_the_ways(monkeypatch, tmp_path):
    """The decision is one of the two ways, timed once per shape and layout, kept for
    the process, and read from the cache by the next."""
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    hardware.onednn_f32()
    monkeypatch.setattr(measure, "_F32_WAYS", {})
    a, b = np.ones((64, 96), np.float32), np.ones((128, 96), np.float32).T
    way = measure.split_way(a, b)
    assert way in ("onednn", "split")
    timed = []
    monkeypatch.setattr(measure, "seconds_in_turn", lambda fns, **k: timed.append(fns))
    assert measure.split_way(a, b) == way  # kept for the process
    monkeypatch.setattr(measure, "_F32_WAYS", {})
    assert measure.split_way(a, b) == way and not timed  # read from the cache
