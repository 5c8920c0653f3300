"""bf16 compute (``--compute bf16``): the oneDNN GEMM, the bf16 conversion kernel, the cpu
backend's bf16 path, the decision (``backends.cpu.measure.resolve``) and its notices.

Tolerances:
* the bf16 GEMM against float64 arithmetic on the *bf16-rounded* operands: 1e-5 relative
  (the products of bf16 values are exact in float32; what is left is float32
  accumulation over k <= 1536 terms, ~1e-6 observed): this checks that the inputs are
  rounded to bf16 (nearest even) and nothing else is lost.
* a whole SmolLM2 step in bf16 against float32: loss within 1e-2 relative (the issue's
  bound; observed 1e-4 to 1e-3), the whole adapter gradient with cosine >= 0.999 (observed
  0.99975), and each of the 420 gradients >= 0.995.  The issue asks 0.999 for each; no
  scheme with bf16 GEMM inputs keeps that (``bench/bf16_cosine.py``): the smallest
  gradients (norm 0.01-0.05, a middle layer's k or up A) come out 3-8% off from GEMM
  inputs rounded by at most 2^-9, so their cosine lands between 0.997 and 0.9995 as the
  text and the rounded operands fall, not monotonically -- W rounded alone, or the forward activation
  carried in two bf16 terms (1.5x the GEMMs), gives 7-8 below 0.999 on random tokens
  where plain bf16 gives 1.  The lowest any scheme measured on three texts is 0.9973.
The oneDNN tests skip where oneDNN has no bf16 matmul for this CPU (no AVX-512, no AMX:
``support.hardware.onednn_bf16``); oneDNN itself, a dependency on Linux x86-64, must
load.
"""

from __future__ import annotations

import ctypes
import gc
import os
import warnings
import weakref

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops, plan
from gradtape.backends.cpu import blas, codegen, onednn, toolchain
from gradtape.backends.cpu import measure as compute

from support import hardware
from support.compare import rel_err


def _need_onednn():
    hardware.onednn_bf16()


def _bf16_exact(x):
    return onednn.from_bf16(onednn.to_bf16(x)).astype(np.float64)


# --- conversion -----------------------------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38,
                    # ties: the halfway cases round to the even bf16 neighbour
                    1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20],
                   np.float32)


def test_host_conversion_rounds_to_nearest_even():
    b = onednn.to_bf16(SPECIAL)
    back = onednn.from_bf16(b)
    assert back[2] == 1.0 and back[3] == -2.5 and np.isinf(back[4]) and np.isnan(back[6])
    assert back[10] == 1.0  # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even is 1
    assert back[11] == 1.0 + 2.0 ** -6  # 1 + 3*2^-8: halfway, even neighbour is up
    assert back[12] == 1.0 + 2.0 ** -7  # just above halfway: up
    assert np.signbit(back[1]) and back[1] == 0.0


def test_c_conversion_matches_host_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    src = codegen.ProgramSource()
    src.bf16_kernel(8)
    path, _ = toolchain.build(src.source(), flags=toolchain.threads_flags())
    lib = ctypes.CDLL(str(path))
    x = np.concatenate([SPECIAL, np.random.default_rng(0).standard_normal(100_000)
                        .astype(np.float32) * 1e3])
    out = np.empty(x.size, np.uint16)
    lib.gt_to_bf16(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                   ctypes.c_long(x.size))
    ref = onednn.to_bf16(x)
    assert np.array_equal(out, ref)


# --- the GEMM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("m,k,n,tb", [(256, 576, 1536, False), (64, 1536, 576, False),
                                      (33, 576, 300, True), (7, 96, 5, False)])
def test_onednn_gemm_is_bf16_inputs_float32_accumulation(m, k, n, tb):
    _need_onednn()
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    onednn.dnnl().bind(out, onednn.to_bf16(a), onednn.to_bf16(w), tb)()
    wt = _bf16_exact(w)
    ref = _bf16_exact(a) @ (wt.T if tb else wt)
    assert rel_err(out, ref) < 1e-5
    full = a.astype(np.float64) @ (w.T if tb else w).astype(np.float64)
    assert 1e-4 < rel_err(out, full) < 2e-2  # it really ran in bf16


def test_describe_names_library_and_kernel():
    _need_onednn()
    d = onednn.describe()
    assert d.startswith("oneDNN 3.") and "(" in d


# --- the cpu backend ----------------------------------------------------------------------------

def _weight_graph(tp, rng, t=24, d=288, f=320):
    """x @ W1 -> silu -> @ W2 with LoRA on W1: frozen W1, W2 big enough for bf16."""
    x = tp.const(rng.standard_normal((t, d)))
    w1 = tp.const(rng.standard_normal((d, f)) / np.sqrt(d))  # 92160 elements
    w2 = tp.const(rng.standard_normal((f, d)) / np.sqrt(f))
    a = tp.param(rng.standard_normal((d, 4)) * 0.1)
    b = tp.param(rng.standard_normal((4, f)) * 0.1)
    h = nn.silu(tp, nn.lora_linear(tp, x, w1, a, b, 2.0))
    y = nn.linear(tp, h, w2)
    loss = ops.reduce_sum(ops.mul(y, y))
    g = tp.backward(loss)
    return [loss, g[a], g[b], y], (x, w1, w2)


def test_cpu_backend_bf16_path_runs_and_stays_close():
    _need_onednn()
    tp = gt.Tape(np.float32, eager=False)
    outs, _ = _weight_graph(tp, np.random.default_rng(0))
    r32 = tp.compile(outs, backend="cpu").run()
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    assert prog.executable.compute == "bf16"
    # x @ W1, h @ W2, and the backward g @ W2^T (x is a const: no g @ W1^T)
    assert len(prog.executable._dense_bf16) == 3
    r16 = prog.run()
    assert abs(r16[0] - r32[0]) / abs(r32[0]) < 1e-2
    for g32, g16 in zip(r32[1:3], r16[1:3]):
        cos = np.dot(g32.ravel(), g16.ravel()) / np.linalg.norm(g32) / np.linalg.norm(g16)
        assert cos > 0.999


def _weight_leaves_owned(prog):
    """The float weight leaves ``prog`` keeps a private copy of (a fed or trained leaf, or
    one a C kernel reads by raw pointer and found not C-contiguous)."""
    return [x for x in prog.executable._owned if x.op == "const" and x.size >= 1 << 16]


@pytest.mark.parametrize("compute_", ["bf16", "float32"])
def test_a_transposed_weight_is_read_in_place(monkeypatch, compute_):
    """A frozen weight stored transposed (a Hugging Face ``[out, in]`` tensor seen as our
    ``[in, out]``: a Fortran-order view) gets no float32 copy in the program; under bf16
    its bf16 copy, converted a band of rows at a time (``CONVERT_BAND`` shrunk here so
    the bands are ragged), holds the C-order weight's very values, and the outputs are the
    C-order program's."""
    if compute_ == "bf16":
        _need_onednn()
    from gradtape.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "CONVERT_BAND", 4 * 320 * 7)
    runs = {}
    for order in ("C", "F"):
        tp = gt.Tape(np.float32, eager=False)
        outs, (_, w1, w2) = _weight_graph(tp, np.random.default_rng(0))
        for w in (w1, w2):
            w._value = np.asarray(w._value, order=order)
        prog = tp.compile(outs, backend="cpu", compute=compute_)
        assert prog.executable.compute == compute_
        assert w1.value.flags.f_contiguous == (order == "F")
        assert _weight_leaves_owned(prog) == []
        runs[order] = prog, prog.run()
    if compute_ == "bf16":
        copies = [[a for a, _ in runs[o][0].executable._step_weight16.values()]
                  for o in ("C", "F")]
        assert len(copies[0]) == 3
        for c, f in zip(*copies):
            np.testing.assert_array_equal(c, f)
        for c, f in zip(runs["C"][1], runs["F"][1]):  # the same GEMMs on the same copies
            np.testing.assert_array_equal(c, f)
    else:  # BLAS reads the transposed weight with its own order of sums
        for c, f in zip(runs["C"][1], runs["F"][1]):
            assert rel_err(f, c) < 2e-5


@pytest.mark.parametrize("fused_head", [False, True])
def test_a_transposed_models_lora_step_keeps_no_float_weight_copy(monkeypatch, fused_head):
    """A LoRA ``TrainStep`` and its eval program under bf16 on a model whose matrices are
    Fortran-order views (a Hugging Face folder's linears are, ``models/load_hf.py``):
    neither program keeps a float32 copy of a weight; the losses are the C-order model's;
    with the LM head fused with the loss too (its table, the tied embedding, converted a
    block of rows at a time)."""
    _need_onednn()
    from gradtape.models import graph
    from gradtape.models.lora import init_adapter
    from gradtape.train.step import TrainStep

    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, "the test's"))
    monkeypatch.setattr(graph, "HEAD_FUSE_MIN", 0 if fused_head else graph.HEAD_FUSE_MIN)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 512, (1, 64))
    batch = [(ids, np.c_[ids[:, 1:], [[-100]]])]
    losses = {}
    for order in ("C", "F"):
        m = _wide_model()
        m.weights = {k: np.asarray(w, order=order) for k, w in m.weights.items()}
        st = TrainStep(m, init_adapter(m.config, 4, 8.0, seed=1), 1, 64, backend="cpu",
                       compute="bf16")
        assert st.compute == "bf16"
        assert fused_head == any(v.op.startswith("head_nll") for v in st.program.graph.ops)
        losses[order] = st.step(batch, 1, 1e-3)[0], st.eval_loss(_Rows(batch))
        for prog in (st.program, st.eval_program):
            assert _weight_leaves_owned(prog) == []
    # k and v are too narrow for bf16: BLAS reads them transposed, in its own order
    for c, f in zip(losses["C"], losses["F"]):
        assert abs(f - c) < 2e-5 * abs(c)


def _trained_plan():
    """A bf16 program's plan whose trained weights (params) take bf16 too, as a full
    fine-tuning step's (``TrainStep``: ``Plan.trained_bf16``)."""
    return plan.for_program("cpu", "bf16").replace(trained_bf16=plan.Decision(True, "test"))


def test_trained_weight_products_and_gradient_read_bf16_rounded_operands():
    """A trained weight W (a param): ``x @ W``, ``dY @ W^T`` and its gradient ``x^T dY``
    equal float64 arithmetic on the bf16-rounded operands (1e-5: the module docstring),
    and the copy of W they read follows its update: the largest weight's copy written by
    its update, the other's rounded into the scratch before each product."""
    _need_onednn()
    rng = np.random.default_rng(7)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((32, 256)))
    w1, w2 = tp.param(rng.standard_normal((256, 256)) * 0.1), tp.param(
        rng.standard_normal((256, 384)) * 0.1)
    c = tp.const(rng.standard_normal((32, 384)))
    h = ops.matmul(x, w1)
    loss = ops.reduce_sum(ops.mul(ops.matmul(h, w2), c))
    g = tp.backward(loss)
    updates = {w: ops.sub(w, ops.scale(g[w], 1e-2)) for w in (w1, w2)}
    dh = next(v for v in tp.vars if v.op == "matmul" and v.attrs.get("tb"))  # dY W2^T
    prog = tp.compile([h, dh, g[w1], g[w2]], backend="cpu", plan=_trained_plan(),
                      updates=updates)
    ex = prog.executable
    assert ex.compute == "bf16" and set(ex._trained16) == {w2} and set(ex._scratch16) == {w1}
    # x W1 and dY W2^T (dY = c; the loss, not an output, leaves h W2 pruned), h^T c, x^T dh
    assert len(ex._dense_bf16) == 2 and len(ex._grad_bf16) == 2
    xb, cb = _bf16_exact(x._value), _bf16_exact(c._value)
    for _ in range(2):  # the second replay reads the updated weights
        v1, v2 = (prog.state(w) for w in (w1, w2))
        got_h, got_dh, got_g1, got_g2 = prog.run()
        assert rel_err(got_h, xb @ _bf16_exact(v1)) < 1e-5
        assert rel_err(got_dh, cb @ _bf16_exact(v2).T) < 1e-5
        # each gradient from the program's own float32 operands, rounded
        assert rel_err(got_g2, _bf16_exact(got_h).T @ cb) < 1e-5
        assert rel_err(got_g1, xb.T @ _bf16_exact(got_dh)) < 1e-5


def test_params_stay_float32_unless_the_plan_says_trained():
    """A LoRA program's params (the adapter) keep float32 products under bf16 compute,
    however big: only a full step's plan sends trained weights to bf16."""
    _need_onednn()
    rng = np.random.default_rng(8)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((32, 256)))
    w = tp.param(rng.standard_normal((256, 512)))
    loss = ops.reduce_sum(ops.matmul(x, w))
    prog = tp.compile([loss, tp.backward(loss)[w]], backend="cpu", compute="bf16")
    assert not prog.executable._dense_bf16 and not prog.executable._grad_bf16


def _wide_model():
    """A random 2-layer model whose matrices are big enough for bf16 GEMMs."""
    from support.tinymodel import tiny_model

    return tiny_model(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab=512, tied=True)


@pytest.mark.parametrize("fused_head", [False, True])
def test_a_full_step_in_bf16_stays_within_the_gate(monkeypatch, fused_head):
    """Every weight's gradient with the trained weights' products in bf16 against
    float32: loss within 1e-2 relative, the whole gradient's cosine >= 0.999, each
    weight's >= 0.995 (the gates of the module docstring); with the LM head fused with
    the loss too, whose table's (the tied embedding's) gradient then takes bf16."""
    _need_onednn()
    from gradtape.models import graph
    from gradtape.train import full

    monkeypatch.setattr(graph, "HEAD_FUSE_MIN", 0 if fused_head else graph.HEAD_FUSE_MIN)
    m = _wide_model()
    ids = np.random.default_rng(0).integers(0, 512, 64)
    tp = gt.Tape(np.float32, eager=False)
    W = full.weight_params(tp, m)
    last = graph.record_forward(tp, m.config, W, tp.const(ids), 1, {}, 1.0, head=False)
    tid, wt = (tp.const(a) for a in nn.ce_targets_fill(np.r_[ids[1:], -100]))
    loss = graph.head_loss(tp, m.config, W, last, tid, wt)
    g = tp.backward(loss)
    assert fused_head == any(v.op == "head_nll_grad_w" for v in tp.vars)
    outs = [loss] + [g[w] for w in W.values()]
    r32 = tp.compile(outs, backend="cpu").run()
    p16 = tp.compile(outs, backend="cpu", plan=_trained_plan())
    assert p16.executable._grad_bf16  # the weights' gradients run bf16
    r16 = p16.run()
    assert abs(r16[0] - r32[0]) / abs(r32[0]) < 1e-2
    each = [_cos(a, b) for a, b in zip(r32[1:], r16[1:])]
    assert len(each) == len(m.weights) and min(each) >= 0.995
    assert _cos(np.concatenate([a.ravel() for a in r32[1:]]),
                np.concatenate([b.ravel() for b in r16[1:]])) >= 0.999


@pytest.mark.parametrize("kw", [{}, {"grad_accum": 2, "grad_checkpoint": "on"}])
def test_a_full_trainstep_runs_bf16_and_its_eval_reads_the_new_weights(monkeypatch, kw):
    """``TrainStep(fine_tune_type="full")`` under bf16 compute: the plan says so, and
    after each step the step's and the eval program's losses stay within 1e-2 of a
    float32 step's run alongside (a stale bf16 copy would leave the eval loss where it
    was); with micro-batches accumulated and every layer recomputed too."""
    _need_onednn()
    from gradtape.train.step import TrainStep

    # bf16 wherever oneDNN has it (the measurement at these small shapes may say no)
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, "the test's"))
    m = _wide_model()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 512, (1, 64))
    batch = [(ids, np.c_[ids[:, 1:], [[-100]]])] * kw.get("grad_accum", 1)
    steps = {c: TrainStep(m, None, 1, 64, backend="cpu", compute=c, fine_tune_type="full",
                          **kw) for c in ("float32", "bf16")}
    assert steps["bf16"].compute == "bf16" and steps["bf16"].plan.trained_bf16.value
    assert not steps["float32"].plan.trained_bf16.value
    seqs = _Rows(batch)
    evals = []
    for k in range(1, 4):
        losses = {c: st.step(batch, k, 1e-3)[0] for c, st in steps.items()}
        assert abs(losses["bf16"] - losses["float32"]) < 1e-2 * losses["float32"]
        evals.append({c: st.eval_loss(seqs) for c, st in steps.items()})
        assert abs(evals[-1]["bf16"] - evals[-1]["float32"]) < 1e-2 * evals[-1]["float32"]
    assert evals[-1]["bf16"] < evals[0]["bf16"] - 0.1  # it learns


def test_a_full_steps_update_kernels_write_the_weights_bf16_copies(monkeypatch):
    """Each trained weight's bf16 copy is written by its AdamW update kernel (no
    conversion pass): after every step it holds the new weights' rounding bit for bit,
    the eval program reads it as is, and a state set from outside (``--resume``) is
    converted again before the next replay."""
    _need_onednn()
    from gradtape.train.step import TrainStep

    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, "the test's"))
    m = _wide_model()
    ids = np.random.default_rng(2).integers(0, 512, (1, 64))
    batch = [(ids, np.c_[ids[:, 1:], [[-100]]])]
    st = TrainStep(m, None, 1, 64, backend="cpu", compute="bf16", fine_tune_type="full")
    ex = st.program.executable
    assert ex._trained16 and ex._written16 == set(ex._trained16)

    def copies_hold_the_params():
        for w, rec in ex._trained16.items():
            assert np.array_equal(rec.array, onednn.to_bf16(st.program.state(w))), w

    for k in range(1, 3):
        st.step(batch, k, 1e-3)
        copies_hold_the_params()
        st.eval_loss(_Rows(batch))
        copies_hold_the_params()
    w = next(iter(ex._trained16))
    st.program.set_state({w: st.program.state(w) * 0.5})
    loss = st.eval_loss(_Rows(batch))  # the eval program converts the new values
    copies_hold_the_params()
    assert np.isfinite(loss)
    st.step(batch, 3, 1e-3)
    copies_hold_the_params()


def test_a_resumed_full_bf16_step_ends_bitwise_the_same(monkeypatch):
    """A full step under bf16 compute resumed from its state after 2 steps (a new
    ``TrainStep``, its bf16 copies converted from the loaded weights) ends 2 steps later
    with every weight and moment bit for bit as the run that went on."""
    _need_onednn()
    from gradtape.train.step import TrainStep

    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, "the test's"))
    m = _wide_model()
    ids = np.random.default_rng(3).integers(0, 512, (1, 64))
    batch = [(ids, np.c_[ids[:, 1:], [[-100]]])]

    def new():
        return TrainStep(m, None, 1, 64, backend="cpu", compute="bf16",
                         fine_tune_type="full")

    whole = new()
    for k in range(1, 5):
        whole.step(batch, k, 1e-3)
    first = new()
    for k in range(1, 3):
        first.step(batch, k, 1e-3)
    saved = {k: np.array(v) for k, v in first.state_arrays().items()}
    del first
    resumed = new()
    resumed.load_state_arrays(saved)
    for k in range(3, 5):
        resumed.step(batch, k, 1e-3)
    a, b = whole.state_arrays(), resumed.state_arrays()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


class _Rows:
    """``data.Sequences``' two members ``eval_loss`` reads, over one batch."""

    def __init__(self, batch):
        self.batch_ = batch[0]

    def __len__(self):
        return len(self.batch_[0])

    def batch(self, sl):
        return [x[sl] for x in self.batch_]


def _cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return a @ b / np.linalg.norm(a) / np.linalg.norm(b)


def test_a_dropped_program_frees_its_arena():
    """The oneDNN GEMMs bound to a program's arrays hold them as long as the program
    does, no longer: a process that builds programs and drops them (the attention
    probe's, a chat's prompt sizes) gets their memory back (an 8B's probe at batch 4
    held 2.6 GB for the rest of the run before)."""
    _need_onednn()
    tp = gt.Tape(np.float32, eager=False)
    outs, _ = _weight_graph(tp, np.random.default_rng(0))
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    prog.run()
    assert prog.executable._dense_gemms  # GEMMs bound to views of the arena

    def memory(a):
        while a.base is not None:
            a = a.base
        return weakref.ref(a)
    arenas = [memory(b) for b in prog.executable._buffers]
    del prog
    gc.collect()
    assert arenas and all(r() is None for r in arenas)


def test_bf16_forward_equals_bf16_rounded_operands():
    """y = x @ W2 for a const x: exactly the GEMM of the bf16-rounded operands."""
    _need_onednn()
    rng = np.random.default_rng(1)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((16, 300)))
    w = tp.const(rng.standard_normal((300, 400)))
    y = ops.matmul(x, w)
    got = tp.compile([y], backend="cpu", compute="bf16").run()[0]
    ref = _bf16_exact(x._value) @ _bf16_exact(w._value)
    assert rel_err(got, ref) < 1e-5


def test_fed_weight_is_converted_again():
    _need_onednn()
    rng = np.random.default_rng(2)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((8, 256)))
    w = tp.const(rng.standard_normal((256, 256)))
    prog = tp.compile([ops.matmul(x, w)], backend="cpu", compute="bf16")
    w2 = rng.standard_normal((256, 256)).astype(np.float32)
    got = prog.run({w: w2})[0]
    assert rel_err(got, _bf16_exact(x._value) @ _bf16_exact(w2)) < 1e-5


def test_programs_share_a_weight_copy_until_one_is_fed():
    _need_onednn()
    rng = np.random.default_rng(4)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.const(rng.standard_normal((8, 256)))
    w = tp.const(rng.standard_normal((256, 256)))
    y = ops.matmul(x, w)
    p1 = tp.compile([y], backend="cpu", compute="bf16")
    p2 = tp.compile([ops.scale(y, 2.0)], backend="cpu", compute="bf16")
    assert p1.executable._weight_copies[w] is p2.executable._weight_copies[w]
    w2 = rng.standard_normal((256, 256)).astype(np.float32)
    p1.run({w: w2})
    ref = _bf16_exact(x._value) @ _bf16_exact(w._value)
    assert rel_err(p2.run()[0], 2 * ref) < 1e-5  # p2 still multiplies by the recorded w


def test_one_operand_of_several_bf16_gemms_is_rounded_once():
    """q, k, v (gate, up) read one x: its bf16 copy is made once and read by the GEMMs
    that follow it, until another operand is rounded; the products are those of
    rounding it for each (the same bits)."""
    _need_onednn()
    rng = np.random.default_rng(4)
    tp = gt.Tape(np.float32, eager=False)
    x = tp.param(rng.standard_normal((24, 288)).astype(np.float32))
    ws = [rng.standard_normal((288, n)).astype(np.float32) / 17 for n in (288, 320, 320)]
    q, k, v = (ops.matmul(x, tp.const(w)) for w in ws)
    h = ops.matmul(ops.mul(q, q), tp.const(ws[0]))  # another operand, then x's GEMMs done
    prog = tp.compile([q, k, v, h], backend="cpu", compute="bf16")
    ex = prog.executable
    assert ex.compute == "bf16" and len(ex._dense_bf16) == 4
    labels = [label for _, label, _ in ex.kernel_calls()]
    # x once; q * q by the kernel that computes it (``_act_writers``)
    assert labels.count("bf16 conversion [24, 288]") == 1 and len(ex._act_writer) == 1
    got = prog.run()
    x16 = _bf16_exact(x.value)
    for out, w in zip(got[:3], ws):
        assert rel_err(out, x16 @ _bf16_exact(w)) < 1e-5
    assert rel_err(got[3], _bf16_exact(got[0] * got[0]) @ _bf16_exact(ws[0])) < 1e-5
    qq = _bf16_exact(got[0].astype(np.float64) ** 2)
    assert rel_err(got[3], qq @ _bf16_exact(ws[0])) < 1e-5


def test_a_kernel_rounding_its_output_gives_the_conversions_bits(monkeypatch):
    """A fused group writing the bf16 rounding of the activation the next GEMM reads
    (``_act_writers``) gives that GEMM the very bits a conversion pass would: the
    products are bitwise those of a program converting it (the same GEMM, same inputs)."""
    _need_onednn()
    from gradtape.backends.cpu.backend import CpuBackend

    def run():
        rng = np.random.default_rng(5)
        tp = gt.Tape(np.float32, eager=False)
        x = tp.const(rng.standard_normal((24, 288)).astype(np.float32))
        w = tp.const(rng.standard_normal((288, 288)).astype(np.float32) / 17)
        h = ops.mul(ops.matmul(x, w), ops.sigmoid(x))
        prog = tp.compile([ops.matmul(h, w), h], backend="cpu", compute="bf16")
        return prog.executable, prog.run()

    ex, fused = run()
    assert len(ex._act_writer) == 1
    monkeypatch.setattr(CpuBackend, "_act_writers", lambda self: {})
    ex, converted = run()
    assert not ex._act_writer
    for a, b in zip(fused, converted):
        assert np.array_equal(a, b)


def _both_ways(tp, rng):
    """``y = x @ W`` and its gradient through ``dY @ W^T``: one weight read both ways."""
    x = tp.param(rng.standard_normal((40, 320)))
    w = tp.const(rng.standard_normal((320, 288)) / np.sqrt(320))
    y = ops.matmul(x, w)
    g = tp.backward(ops.reduce_sum(ops.mul(y, y)))
    return [y, g[x]], w


def test_packed_weights_give_the_plain_copys_products(monkeypatch):
    """Where oneDNN's kernel keeps its weights in a layout of its own, each direction's
    copy is packed into it once (where packs are asked for: on AMX they are measured
    slower); the products are those of the plain copy (float32 sums of bf16 products,
    1e-5), and no plain copy is kept once every GEMM reads a pack."""
    _need_onednn()
    from gradtape.backends.cpu import backend as cpu

    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", "blocked")

    tp = gt.Tape(np.float32, eager=False)
    outs, w = _both_ways(tp, np.random.default_rng(5))
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    ex = prog.executable
    assert len(ex._dense_bf16) == 2
    d = onednn.dnnl()
    zeros = np.zeros(w.shape, np.uint16)
    kernel_packs = [d.pack(*s.inputs[0].shape, s.shape[1], bool(s.attrs.get("tb")),
                           zeros)[0] is not None for s in ex._dense_bf16]
    assert [packed for _, packed in ex._step_weight16.values()] == kernel_packs
    copies = ex._weight_copies[w]
    assert len(copies.packs) == sum(kernel_packs)
    assert (copies.plain is None) == all(kernel_packs)
    assert {id(a) for a in ex.bf16_weights()} == {id(a) for a in copies.arrays()}
    got = prog.run()

    monkeypatch.setattr(cpu, "PACK_SHARE", 0.0)  # no room for packs: the plain copy
    tp2 = gt.Tape(np.float32, eager=False)
    outs2, w2 = _both_ways(tp2, np.random.default_rng(5))
    plain = tp2.compile(outs2, backend="cpu", compute="bf16")
    assert not any(packed for _, packed in plain.executable._step_weight16.values())
    assert plain.executable._weight_copies[w2].packs == []
    for a, b in zip(got, plain.run()):
        assert rel_err(a, b) < 1e-5
    x16 = _bf16_exact(outs[0].inputs[0]._value)
    assert rel_err(got[0], x16 @ _bf16_exact(w._value)) < 1e-5


def test_a_weight_that_cannot_be_packed_runs_from_the_plain_copy(monkeypatch):
    _need_onednn()

    def refuse(*args, **kwargs):
        raise onednn.DnnlError("oneDNN reorder failed (status 3)")
    monkeypatch.setattr(onednn._Dnnl, "pack", refuse)
    tp = gt.Tape(np.float32, eager=False)
    outs, w = _both_ways(tp, np.random.default_rng(5))
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    assert not any(packed for _, packed in prog.executable._step_weight16.values())
    x16 = _bf16_exact(outs[0].inputs[0]._value)
    assert rel_err(prog.run()[0], x16 @ _bf16_exact(w._value)) < 1e-5


def test_a_packed_weight_fed_twice_follows_each_feed(monkeypatch):
    _need_onednn()
    monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", "blocked")
    rng = np.random.default_rng(6)
    tp = gt.Tape(np.float32, eager=False)
    outs, w = _both_ways(tp, rng)
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    x = outs[0].inputs[0]._value
    for _ in range(2):
        w2 = rng.standard_normal(w.shape).astype(np.float32)
        y, gx = prog.run({w: w2})
        w16 = _bf16_exact(w2)
        assert rel_err(y, _bf16_exact(x) @ w16) < 1e-5
        assert rel_err(gx, _bf16_exact(2 * y) @ w16.T) < 1e-5


@pytest.mark.parametrize("in_onednn", [True, False])
def test_float32_gemms_run_where_measured(monkeypatch, in_onednn):
    """A float32 program's matmuls go to oneDNN or NumPy's BLAS as ``f32_onednn``
    decides at the shape that carries most of their FLOPs (three [256, 512, 384]
    products, not the one bigger [256, 512, 1024]), with the same float32 products
    either way."""
    if in_onednn:
        hardware.onednn_f32()
    asked = []

    def decide(shape):
        asked.append(shape)
        return in_onednn, "test"
    monkeypatch.setattr(compute, "f32_onednn", decide)
    rng = np.random.default_rng(7)
    tp = gt.Tape(np.float32, eager=False)
    outs = [ops.matmul(tp.const(rng.standard_normal((256, 512))),
                       tp.const(rng.standard_normal((512, n)) / 20)) for n in (384,) * 3]
    outs.append(ops.matmul(tp.const(rng.standard_normal((256, 512))),
                           tp.const(rng.standard_normal((512, 1024)) / 20)))
    prog = tp.compile(outs, backend="cpu", compute="float32")
    assert asked == [(256, 512, 384)]
    assert prog.executable._f32_dnnl is in_onednn
    # in the oneDNN program a product may run NumPy's BLAS split over OpenMP's threads
    # instead, where it times faster (``measure.split_way``): one thread pool either way
    labels = [getattr(f, "label", "") for f in prog.executable._steps]
    pooled = sum("oneDNN" in lab or "split OpenBLAS" in lab for lab in labels)
    assert pooled == (4 if in_onednn else 0), labels
    for a, b in zip(prog.run(), tp.compile(outs, backend="numpy").run()):
        assert rel_err(a, b) < 1e-5

    small = gt.Tape(np.float32, eager=False)  # too small to measure: NumPy's BLAS
    out = ops.matmul(small.const(np.ones((8, 16))), small.const(np.ones((16, 8))))
    assert not small.compile([out], backend="cpu").executable._f32_dnnl
    assert len(asked) == 1


def test_f32_onednn_measures_once_and_says_what(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    hardware.onednn_f32()
    fast, why = compute.f32_onednn((64, 256, 320))
    assert isinstance(fast, bool)
    assert why.endswith("GFLOP/s at 64x256x320 alone, measured on this CPU)")
    assert ("in oneDNN, one thread pool" in why) is fast
    again, why = compute.f32_onednn((64, 256, 320))
    assert again is fast and why.endswith("measured before on this CPU)")


def test_float64_tape_ignores_bf16():
    _need_onednn()
    tp = gt.Tape(np.float64, eager=False)
    outs, _ = _weight_graph(tp, np.random.default_rng(3))
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    assert prog.executable.compute == "float32"


# --- the decision and its notices --------------------------------------------------------------

def test_resolve_float32_and_bad_names():
    assert plan.resolve_compute("float32") == "float32"
    with pytest.raises(ValueError, match="compute must be one of float32, bf16, int8, auto"):
        plan.resolve_compute("fp8")
    tp = gt.Tape(np.float32)
    with pytest.raises(ValueError, match="compile: compute must be"):
        tp.compile([tp.const(np.ones(2))], compute="auto")


def _no_bf16_cpu(monkeypatch):
    monkeypatch.setattr(compute, "cpu_info", lambda: {"model": "test", "flags": frozenset(
        {"avx2", "fma"})})
    monkeypatch.setattr(plan, "_WARNED", set())


def test_bf16_without_fast_bf16_says_so_once_and_runs_float32(monkeypatch):
    _no_bf16_cpu(monkeypatch)
    with pytest.warns(RuntimeWarning, match="bf16 compute asked for, running float32: this "
                                            "CPU has no bf16 matrix instructions"):
        assert plan.resolve_compute("bf16") == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.resolve_compute("bf16") == "float32"  # once
        assert plan.resolve_compute("auto") == "float32"  # auto: silently


def test_bf16_without_onednn_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(compute, "cpu_info", lambda: {"model": "test", "flags": frozenset(
        {"avx512_bf16", "amx_bf16", "amx_tile"})})
    monkeypatch.setattr(plan, "_WARNED", set())
    bogus = tmp_path / "libdnnl.so.3"
    bogus.write_bytes(b"not a library")
    monkeypatch.setenv("GRADTAPE_DNNL", str(bogus))
    onednn._library.cache_clear()
    onednn._load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="oneDNN could not be used"):
            assert plan.resolve_compute("bf16") == "float32"
    finally:
        monkeypatch.delenv("GRADTAPE_DNNL")
        onednn._library.cache_clear()
        onednn._load.cache_clear()


def test_trainstep_on_numpy_backend_runs_float32_with_a_notice(monkeypatch):
    from gradtape.models.lora import init_adapter
    from gradtape.train.step import TrainStep
    from support.tinymodel import tiny_model

    monkeypatch.setattr(plan, "_WARNED", set())
    m = tiny_model()
    with pytest.warns(RuntimeWarning, match="apply to float32 steps on the cpu backend"):
        st = TrainStep(m, init_adapter(m.config, 2, 4.0), 1, 8, backend="numpy",
                       compute="bf16")
    assert st.compute == "float32"


def test_finetune_cli_rejects_an_unknown_compute(tmp_path):
    import subprocess
    import sys

    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    res = subprocess.run([sys.executable, "-m", "gradtape.cli", "finetune", "--data", str(data),
                          "--out", str(tmp_path / "o"), "--compute", "fp8"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "gradtape finetune: error: --compute must be one of float32, bf16, int8, auto, got 'fp8'"]


# --- SmolLM2 -------------------------------------------------------------------------------

def _adapter_and_text(m, tokens):
    """A rank-8 adapter on all 7 targets with B drawn small and non-zero (so every A gets
    a gradient), and ``tokens`` ids of an English text."""
    from gradtape.models.lora import init_adapter

    rng = np.random.default_rng(0)
    ad = init_adapter(m.config, 8, 16.0, seed=0)
    ad.weights = {k: (a, (rng.standard_normal(b.shape) * 0.02).astype(np.float32))
                  for k, (a, b) in ad.weights.items()}
    text = ("The quick brown fox jumps over the lazy dog. Training a small language model "
            "on a laptop CPU is slow but it works, one step at a time. ") * 12
    ids = np.array(m.tokenizer.encode(text)[:tokens])
    assert len(ids) == tokens
    return ad, ids


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("tokens", [64, 300])
def test_smollm2_step_in_bf16_matches_float32(smollm2, monkeypatch, tokens):
    """Loss within 1e-2 relative, the whole adapter gradient with cosine >= 0.999, each
    gradient >= 0.995 (see the module docstring; B drawn small and non-zero so every A
    gets a gradient).  At 300 tokens the long-context kernels run, with their bf16
    GEMMs: the tiled attention fused in C and the LM head fused with the loss (its
    threshold lowered to these rows)."""
    _need_onednn()
    from gradtape.models import graph
    from support.tinymodel import lora_loss_outputs

    long = tokens > graph.ATTN_TILED_MIN
    monkeypatch.setattr(graph, "HEAD_FUSE_MIN", 0)
    m = smollm2
    ad, ids = _adapter_and_text(m, tokens)
    tp = gt.Tape(np.float32, eager=False)
    outs, keys = lora_loss_outputs(tp, m.config, m.weights, ad, ids, head_loss=long)
    if long:
        assert {"attn", "head_nll_e"} <= {v.op for v in tp.vars}
    r32 = tp.compile(outs, backend="cpu").run()
    p16 = tp.compile(outs, backend="cpu", compute="bf16")
    assert p16.executable.compute == "bf16"
    r16 = p16.run()
    assert abs(r16[0] - r32[0]) / abs(r32[0]) < 1e-2
    def cos(a, b):
        a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
        return a @ b / np.linalg.norm(a) / np.linalg.norm(b)

    each = [cos(a, b) for a, b in zip(r32[1:], r16[1:])]
    assert len(each) == 2 * len(keys) and min(each) >= 0.995
    assert cos(np.concatenate([g.ravel() for g in r32[1:]]),
               np.concatenate([g.ravel() for g in r16[1:]])) >= 0.999


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_full_step_in_bf16_matches_float32(smollm2, request):
    """Full fine-tuning on the real model: every weight's gradient with the trained
    weights' products and gradients in bf16, within the gates of LoRA's above (loss
    1e-2 relative, whole cosine >= 0.999, each weight's >= 0.995), or for a weight
    below 0.995 an error (1 - cosine) within 4 times the one torch's autocast gives the
    same weight on this CPU.  Layer 24's attention norm has a gradient that is a sum
    over the tokens that mostly cancels, so bf16's rounding moves it like noise: ours
    0.9953 / 0.991 / 0.994 on AMX / AVX512-BF16 / AVX-512, torch's 0.9987 / 0.979 /
    0.997."""
    _need_onednn()
    from gradtape.models.graph import head_loss, record_forward
    from gradtape.train import full

    m = smollm2
    _, ids = _adapter_and_text(m, 64)
    tp = gt.Tape(np.float32, eager=False)
    W = full.weight_params(tp, m)
    last = record_forward(tp, m.config, W, tp.const(ids), 1, {}, 1.0, head=False)
    tid, wt = (tp.const(a) for a in nn.ce_targets_fill(np.r_[ids[1:], -100]))
    loss = head_loss(tp, m.config, W, last, tid, wt)
    g = tp.backward(loss)
    outs = [loss] + [g[w] for w in W.values()]
    r32 = tp.compile(outs, backend="cpu").run()
    r16 = tp.compile(outs, backend="cpu", plan=_trained_plan()).run()
    assert abs(r16[0] - r32[0]) / abs(r32[0]) < 1e-2
    each = dict(zip(W, (_cos(a, b) for a, b in zip(r32[1:], r16[1:]))))
    assert len(each) == len(m.weights)
    below = {k: c for k, c in each.items() if c < 0.995}
    if below:
        peer = _autocast_cosines(request.getfixturevalue("hf_smollm2"), m, ids)
        assert all(1 - c <= 4 * (1 - peer[k]) for k, c in below.items()), {
            k: (c, peer[k]) for k, c in below.items()}
    assert _cos(np.concatenate([a.ravel() for a in r32[1:]]),
                np.concatenate([b.ravel() for b in r16[1:]])) >= 0.999


def _autocast_cosines(hf, m, ids):
    """Each weight's gradient cosine, torch's autocast bf16 against its float32, of the
    next-token loss over ``ids`` (transformers' model ``hf`` of our ``m``, by our weight
    names: ``export.hf_plan``'s)."""
    import torch
    from gradtape.models.export import hf_plan

    ours = {hf_name: name for name, (hf_name, _, _) in
            zip(m.weights, hf_plan(m.config, m.weights))}
    x = torch.tensor(np.asarray(ids)[None])
    grads = []
    for autocast in (False, True):
        hf.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        grads.append({n: q.grad.double().numpy().copy() for n, q in hf.named_parameters()
                      if q.grad is not None})
    hf.zero_grad(set_to_none=True)
    return {ours[name]: _cos(grads[0][name], grads[1][name]) for name in grads[0]}


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_step_in_int8_stays_near_float32(smollm2_gguf):
    """int8 is not exact, and this test pins how far it goes, on the real weights kept
    in their blocks (Q4_1): the loss within 5e-2 relative and the whole adapter gradient
    at cosine >= 0.97 to float32's, short of bf16's 1e-2 and 0.999.  Observed over the
    six texts of ``bench/bf16_cosine.py --int8``: loss 1e-4 to 3.3e-2 off, cosine
    0.978-0.994 (here: 2.8e-3, 0.987).  The LM head's products stay bf16 (``precise``):
    with them in int8, the cosine fell to 0.33-0.91."""
    _need_onednn()
    hardware.int8_dots()
    from gradtape import llama
    from support.tinymodel import lora_loss_outputs

    m = llama.load(smollm2_gguf, keep_quantized=True)
    ad, ids = _adapter_and_text(m, 64)
    tp = gt.Tape(np.float32, eager=False)
    outs, _ = lora_loss_outputs(tp, m.config, m.weights, ad, ids)
    r32 = tp.compile(outs, backend="cpu").run()
    p8 = tp.compile(outs, backend="cpu", compute="int8")
    ex = p8.executable
    assert ex.compute == "int8"  # asked for by name: with bf16 and int8 dot products
    assert len(ex._block_int8) == 2 * 7 * m.config.n_layers - 3  # less layer 0's unused q/k/v dX
    assert {s.attrs["rows"] for s in ex._block_bf16} == {m.config.vocab_size}  # the head
    r8 = p8.run()
    assert abs(r8[0] - r32[0]) / abs(r32[0]) < 5e-2
    a, b = (np.concatenate([g.ravel() for g in r[1:]]).astype(np.float64) for r in (r32, r8))
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= 0.97


def test_auto_follows_the_measurement_without_amx(monkeypatch):
    # AVX512-BF16 alone: auto is bf16 where the bf16 GEMMs measured faster, else float32,
    # silently either way
    monkeypatch.setattr(compute, "cpu_info", lambda: {"model": "test", "flags": frozenset(
        {"avx512_bf16", "avx512f"})})
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, ""))
    assert plan.resolve_compute("auto") == "bf16"
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (False, "slower here"))
    monkeypatch.setattr(plan, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.resolve_compute("auto") == "float32"


def test_int8_runs_only_when_asked_for_and_faster(monkeypatch):
    """int8 is never auto's choice; asked for, it runs where the CPU has int8 dot
    products and they measured faster than bf16, else it says so once and runs bf16 (or
    float32, where bf16 is not fast either)."""
    monkeypatch.setattr(plan, "_WARNED", set())
    flags = {"avx512_bf16", "avx512f", "avx512_vnni"}
    monkeypatch.setattr(compute, "cpu_info", lambda: {"model": "test",
                                                      "flags": frozenset(flags)})
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, "bf16 fast"))
    monkeypatch.setattr(compute, "rates", lambda kind, shape, measure: ((100e9, 200e9), True))
    assert plan.resolve_compute("auto") == "bf16"
    precision, why = plan.decide_compute("int8")
    assert precision == "int8" and why.startswith("int8 200 vs bf16 100 GFLOP/s")
    monkeypatch.setattr(compute, "rates", lambda kind, shape, measure: ((100e9, 105e9), True))
    with pytest.warns(RuntimeWarning, match="int8 compute asked for, running bf16: int8 "
                                            "GEMMs are not faster here"):
        assert plan.resolve_compute("int8") == "bf16"
    flags.discard("avx512_vnni")
    with pytest.warns(RuntimeWarning, match="running bf16: this CPU has no int8 dot products"):
        assert plan.resolve_compute("int8") == "bf16"
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (False, "slower here"))
    with pytest.warns(RuntimeWarning, match="int8 compute asked for, running float32: slower"):
        assert plan.resolve_compute("int8") == "float32"


def test_auto_measures_at_the_models_shape_once_per_cpu(monkeypatch, tmp_path):
    """The decision times both precisions at the shape asked for, writes the rates to the
    cache file, and reads them from there next time (another process, the same CPU and
    libraries); another shape, another CPU or an unreadable file measures again.  The
    reason names the rates."""
    from types import SimpleNamespace

    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    cpu = {"model": "Test CPU", "flags": frozenset({"avx512_bf16", "avx512f"})}
    monkeypatch.setattr(compute, "cpu_info", lambda: cpu)
    monkeypatch.setattr(onednn, "available", lambda: (True, ""))
    monkeypatch.setattr(onednn, "library", lambda: SimpleNamespace(version="3.2.0"))
    monkeypatch.setattr(onednn, "describe", lambda shape: "oneDNN 3.2.0 (test kernel)")
    measured = []

    def rates(m, k, n):
        measured.append((m, k, n))
        return 100e9, (250e9 if n == 1536 else 90e9)

    monkeypatch.setattr(compute, "measured_rates", rates)
    got = plan.decide_compute("auto", shape=(256, 576, 1536))
    assert got == ("bf16", "oneDNN 3.2.0 (test kernel): bf16 250 vs float32 100 GFLOP/s at "
                           "256x576x1536, measured on this CPU")
    assert plan.decide_compute("auto", shape=(256, 576, 1536))[1].endswith("measured before "
                                                                      "on this CPU")
    assert measured == [(256, 576, 1536)]
    assert plan.decide_compute("auto", shape=(256, 576, 64))[0] == "float32"  # slower there
    cpu = {**cpu, "model": "Other CPU"}
    plan.decide_compute("auto", shape=(256, 576, 1536))
    (tmp_path / "compute-decisions.json").write_text("{not json")
    plan.decide_compute("auto", shape=(256, 576, 1536))
    assert measured == [(256, 576, 1536), (256, 576, 64)] + [(256, 576, 1536)] * 2


def test_tile_layout_is_the_faster_one_measured_once_per_cpu(monkeypatch, tmp_path):
    """compute.blocked_faster times the blocked and the plain product once per product
    and shape on this CPU (then from the cache file), and picks the faster;
    $GRADTAPE_BF16_LAYOUT decides without timing."""
    from types import SimpleNamespace

    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.delenv("GRADTAPE_BF16_LAYOUT", raising=False)
    monkeypatch.setattr(onednn, "library", lambda: SimpleNamespace(version="3.2.0"))
    calls = []
    seconds = {"blocked": 0.02, "plain": 0.01}

    def runner(name):
        def run():
            calls.append(name)
            import time
            time.sleep(seconds[name])
        return run

    blocked, plain = runner("blocked"), runner("plain")
    assert compute.blocked_faster("qmatmul Q4_K", (256, 64, 32), blocked, plain) is False
    assert set(calls) == {"blocked", "plain"}
    calls.clear()
    assert compute.blocked_faster("qmatmul Q4_K", (256, 64, 32), blocked, plain) is False
    assert calls == []  # from the cache
    seconds.update(blocked=0.001)
    assert compute.blocked_faster("qmatmul_t Q4_K", (256, 64, 32), blocked, plain) is True
    calls.clear()
    for layout in ("blocked", "plain"):  # the plan's way, from $GRADTAPE_BF16_LAYOUT
        monkeypatch.setenv("GRADTAPE_BF16_LAYOUT", layout)
        execution = plan.for_program("cpu", "bf16")
        assert execution.product_ways == (layout,)
        only = (execution.product_ways, execution.product_tile)
        assert compute.blocked_faster("qmatmul Q6_K", (1, 2, 3), blocked, plain,
                                      only) is (layout == "blocked")
    assert calls == []


def test_paths_are_timed_in_turn_so_that_noise_falls_on_both(monkeypatch):
    """seconds_in_turn warms each path once, then calls them in turn, round after round:
    a slow spell of the machine (here the second round) slows both alike, and a single
    call caught faster than its path runs (the third round's b) does not decide.  The
    clock is the test's: each call advances it by the seconds it stands for."""
    import time
    calls, clock = [], [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def runner(name, seconds, slow=0.0, lucky=0.0):
        def run():
            calls.append(name)
            spell = slow if len(calls) in (5, 6) else 0.0  # round 2: both slowed
            fast = lucky if len(calls) == 8 else 0.0  # round 3: b's call only
            clock[0] += seconds + spell - fast
        return run

    took = compute.seconds_in_turn((runner("a", 0.004, slow=0.02),
                                    runner("b", 0.002, slow=0.02)), rounds=3)
    assert calls == ["a", "b"] * 4
    # each round's calls relative to the round's mean (3, 23, 3 ms): a 4/3 of it in
    # rounds 1 and 3, b 2/3; the medians times the mean of the means (29/3 ms)
    assert took == pytest.approx([4 / 3 * 29e-3 / 3, 2 / 3 * 29e-3 / 3])
    calls.clear()
    took = compute.seconds_in_turn((runner("a", 0.003), runner("b", 0.006, lucky=0.005)),
                                   rounds=3)
    assert took[0] < took[1]  # b's one lucky call (1 ms) beat all of a's, and lost


def test_dense_weights_are_packed_only_where_measured_faster(monkeypatch, tmp_path):
    """A dense bf16 weight is packed into its kernel's layout where timing says the
    pack is faster than the plain copy read in place, and kept plain where not (AMX:
    the pack ran at half the rate); the products agree either way."""
    _need_onednn()
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.delenv("GRADTAPE_BF16_LAYOUT", raising=False)
    asked = []

    def faster(what, shape, blocked, plain, only=((), "")):
        asked.append((what, shape))
        blocked(), plain()  # both run: the packed and the in-place product
        return verdict
    monkeypatch.setattr(compute, "blocked_faster", faster)
    results = []
    for verdict in (True, False):
        tp = gt.Tape(np.float32, eager=False)
        outs, w = _both_ways(tp, np.random.default_rng(5))
        prog = tp.compile(outs, backend="cpu", compute="bf16")
        packs = [packed for _, packed in prog.executable._step_weight16.values()]
        kernel_packs = [  # where the kernel keeps its weights in a layout of its own
            onednn.dnnl().pack(*s.inputs[0].shape, s.shape[1], bool(s.attrs.get("tb")),
                               np.zeros(w.shape, np.uint16))[0] is not None
            for s in prog.executable._dense_bf16]
        assert packs == (kernel_packs if verdict else [False] * len(packs))
        results.append(prog.run())
    assert {what for what, _ in asked} <= {"pack W", "pack W^T"}
    assert bool(asked) == any(kernel_packs)  # timed only where there is a pack to time
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-5


def test_a_pack_decision_read_from_the_cache_makes_no_operands(monkeypatch, tmp_path):
    """packed_weights times the packed and the in-place GEMM on random operands only
    when its decision is not cached yet: a model's build with dense weights then costs
    no random matrices (62 weights of 8B-sized layers: 15.6 s); where the kernel reads W
    in place (``Dnnl.packs`` False) nothing is timed at all."""
    _need_onednn()
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.delenv("GRADTAPE_BF16_LAYOUT", raising=False)
    shape = (64, 256, 128, True)
    first = compute.packed_weights(*shape)
    assert first is False or onednn.dnnl().packs(*shape)

    def no_operands(*a, **kw):
        raise AssertionError("random operands made for a cached decision")
    monkeypatch.setattr(np.random, "default_rng", no_operands)
    assert compute.packed_weights(*shape) is first


def test_cached_decisions_are_parsed_once_while_the_file_stays(monkeypatch, tmp_path):
    """``rates`` reads the cache file once while it is unchanged (an 8B step's first run
    looks up 447 decisions), and reads it again when another process changed it."""
    import json

    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda text: parsed.append(1) or real(text))
    assert compute.rates("test", (2, 3), lambda a, b: (a, b)) == ((2.0, 3.0), False)
    for _ in range(5):
        assert compute.rates("test", (2, 3), lambda a, b: 1 / 0) == ((2.0, 3.0), True)
    assert len(parsed) == 1
    path = tmp_path / "compute-decisions.json"
    table = real(path.read_text())
    table[next(iter(table))] = [5.0, 7.0, 0.0]  # another process's writing, longer
    path.write_text(json.dumps(table))
    assert compute.rates("test", (2, 3), lambda a, b: 1 / 0, n=3) == ((5.0, 7.0, 0.0), True)


def test_rates_are_measured_at_a_few_row_counts():
    """A GEMM rate is measured with its rows rounded up to a power of two, at most
    MEASURED_ROWS: a model's prompts and batches take a few timings, and a handful of
    rows is not timed alone (noise)."""
    got = [compute.measured_shape((m, 576, 1536))[0] for m in (1, 12, 16, 17, 256, 707, 4096)]
    assert got == [1, 16, 16, 32, 256, 512, 512] and compute.MEASURED_ROWS == 512
    assert compute.measured_shape((300, 4096, 14336)) == (512, 4096, 14336)


def test_cached_decisions_are_timed_again_when_the_kernels_change(monkeypatch, tmp_path):
    """A cached figure that times our C kernels (a tile's dequantization, the attention:
    ``kernels=True``) is measured anew, once, after they change (``toolchain.
    csrc_version``); the libraries' own GEMM rates are not."""
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    for kernels in (True, False):
        assert compute.rates(f"test {kernels}", (2, 3), lambda a, b: (a, b),
                             kernels=kernels) == ((2.0, 3.0), False)
    monkeypatch.setattr(toolchain, "csrc_version", lambda: "other")
    assert compute.rates("test True", (2, 3), lambda a, b: (b, a),
                         kernels=True) == ((3.0, 2.0), False)
    assert compute.rates("test True", (2, 3), lambda a, b: 1 / 0,
                         kernels=True) == ((3.0, 2.0), True)
    assert compute.rates("test False", (2, 3), lambda a, b: 1 / 0) == ((2.0, 3.0), True)


def test_float32_matmuls_of_a_bf16_program_run_in_onednn_exactly_as_float32():
    """In a bf16 program the float32 matmuls left (LoRA, attention) run in oneDNN's float32
    matmul (one OpenMP thread pool with the bf16 GEMMs): transposed operands and batches
    included, they agree with NumPy's to float32 rounding (1e-6 relative)."""
    _need_onednn()
    r = np.random.default_rng(5)
    d = onednn.dnnl()
    for a_shape, b_shape, ta, tb in [((64, 48), (48, 40), False, False),
                                     ((48, 64), (48, 40), True, False),
                                     ((64, 48), (40, 48), False, True),
                                     ((3, 32, 16), (3, 32, 24), True, False),
                                     ((3, 16, 32), (3, 24, 32), False, True)]:
        a = r.standard_normal(a_shape).astype(np.float32)
        b = r.standard_normal(b_shape).astype(np.float32)
        av, bv = (np.swapaxes(a, -1, -2) if ta else a), (np.swapaxes(b, -1, -2) if tb else b)
        ref = np.matmul(av.astype(np.float64), bv.astype(np.float64))
        out = np.zeros(ref.shape, np.float32)
        run = d.bind_f32(out, av, bv)
        assert run is not None
        run()
        assert rel_err(out, ref) < 1e-6
    # what oneDNN does not take (mixed batch shapes, float64) is left to NumPy
    assert d.bind_f32(np.zeros((2, 4, 4), np.float32), np.ones((2, 4, 4), np.float32),
                      np.ones((1, 4, 4), np.float32)) is None
    assert d.bind_f32(np.zeros((4, 4)), np.ones((4, 4)), np.ones((4, 4))) is None


def test_a_bf16_replay_gives_numpys_blas_its_threads_back(monkeypatch):
    """During a bf16 replay NumPy's BLAS runs on one thread (its idle threads would spin on
    oneDNN's cores); afterwards, and after a replay that fails, it has its threads back."""
    _need_onednn()
    threads = blas.blas_threads()
    if threads is None:
        pytest.skip("NumPy's BLAS exports no thread control")
    get, set_ = threads
    before = get()
    tp = gt.Tape(np.float32, eager=False)
    outs, _ = _weight_graph(tp, np.random.default_rng(1))
    prog = tp.compile(outs, backend="cpu", compute="bf16")
    ex = prog.executable
    seen = []
    ex._steps.insert(0, lambda: seen.append(get()))
    prog.run()
    assert seen == [1] and get() == before

    def fail():
        raise RuntimeError("a step failed")
    ex._steps.insert(1, fail)
    with pytest.raises(RuntimeError, match="a step failed"):
        prog.run()
    assert get() == before


@pytest.mark.parametrize("flags", [{"avx512_bf16", "avx512f"}, {"amx_bf16", "avx512_bf16"},
                                   {"avx2", "fma"}])
def test_openmp_wait_policy_is_a_short_spin(monkeypatch, flags):
    """Before libgomp loads: a short spin on every CPU class (every thread of a step is
    OpenMP's); a user's setting stays."""
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(toolchain, "cpu_info",
                        lambda: {"model": "test", "flags": frozenset(flags)})
    toolchain.quiet_openmp()
    var = "GOMP_SPINCOUNT"
    assert os.environ.get(var) == toolchain.SPIN
    assert [v for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if v in os.environ] == [var]
    monkeypatch.delenv(var)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    toolchain.quiet_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "active" and "GOMP_SPINCOUNT" not in os.environ


def test_a_timing_taken_under_load_is_timed_again_by_the_next_run(monkeypatch, tmp_path):
    """A decision timed while other processes used the cores serves the rest of this
    process (an 8B step looks up hundreds) but is marked in the cache file and timed
    again by the next process; a quiet timing is then cached for good."""
    import json

    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.setattr(compute, "_BUSY_TIMINGS", {})
    used = iter([0.0, 1e9])  # another process took cores throughout the timing
    monkeypatch.setattr(compute, "others_core_seconds", lambda: next(used))
    assert compute.rates("busy", (2, 3), lambda a, b: (a, b)) == ((2.0, 3.0), False)
    assert compute.rates("busy", (2, 3), lambda a, b: 1 / 0) == ((2.0, 3.0), True)
    entry, = json.loads((tmp_path / "compute-decisions.json").read_text()).values()
    assert entry["rates"] == [2.0, 3.0] and entry["cores used by other processes"] > 1

    monkeypatch.setattr(compute, "_BUSY_TIMINGS", {})  # the next process
    monkeypatch.setattr(compute, "others_core_seconds", lambda: 5.0)  # quiet
    assert compute.rates("busy", (2, 3), lambda a, b: (b, a)) == ((3.0, 2.0), False)
    assert compute.rates("busy", (2, 3), lambda a, b: 1 / 0) == ((3.0, 2.0), True)
    monkeypatch.setattr(compute, "_BUSY_TIMINGS", {})
    assert compute.rates("busy", (2, 3), lambda a, b: 1 / 0) == ((3.0, 2.0), True)

