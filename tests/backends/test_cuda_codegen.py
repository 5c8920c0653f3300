"""The cuda backend without a GPU: the generated CUDA C and the whole lowering, run on the
CPU through ``HarnessDevice`` (the very kernel text NVRTC compiles, compiled as C with
pthread blocks and barriers; a GEMM that follows cuBLAS's column-major contract; numpy
arenas at the planned offsets).  Also: the CUDA translation unit parses as C++ against
stub CUDA declarations, arena planning, bfloat16 rounding, the capture fallback, and the
clear error without CuPy.

Tolerances (max |cuda - numpy| / max |numpy| per output), as in test_cpu_backend.py:
* float64: 1e-10 (same formulas; only summation order differs: tree reductions).
* float32: 2e-5 (libm expf instead of NumPy's, tree instead of pairwise sums, backward
  chains of 10-30 roundings), or 4x the float32 reference's own error vs float64.
* bfloat16 storage: 5e-2 vs the float64 reference.  Each stored value is rounded to 8
  significant bits (relative error up to 2^-9 = 2e-3).  With every value but the outputs
  stored as bf16 (threshold 1 element), a gradient reached through rmsnorm, rope, the
  softmax VJP (a cancelling g - sum(g*y)) and a dozen stored intermediates is off by up
  to 3.5e-2 (observed, the query weight's gradient; ~5e-3 with the default rule keeping
  small values in float32).  What we check here is the lowering, not bf16 numerics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops
from gradtape.backends import BACKENDS
from gradtape.backends.cuda import arena, devices
from gradtape.backends.cuda import backend as C
from gradtape.backends.cuda import codegen as G
from gradtape.compile.fuse import step_inputs, step_outputs
from gradtape.compile.graph import build_graph
from gradtape.compile import lower

from support import parity
from support.compare import rel_err
from test_cpu_backend import PRIM_CASES, _loss_of, _random_graph

BF16_TOL = 5e-2


def harness(**kw):
    return devices.HarnessDevice(**kw)


def cuda_program(storage="float32", bf16_min_size=1, device=None):
    """``make_program`` for the parity harness: the graph lowered onto the cuda backend
    with ``device`` (the CPU harness by default)."""
    def make(tp, outputs, updates=None):
        return lower(build_graph(tp, outputs, updates), C.CudaBackend, storage=storage,
                     device=device or harness(), bf16_min_size=bf16_min_size)
    return make


def compare(tp, outputs, updates=None, feeds_list=({},), ref64=None, storage="float32",
            bf16_min_size=1, device=None):
    """(the cuda executable, worst error against the NumPy reference); bfloat16 storage is
    held to BF16_TOL against the float64 outputs ``ref64``."""
    be = cuda_program(storage, bf16_min_size, device)(tp, outputs, updates)
    tol64 = BF16_TOL if storage == "bfloat16" else None
    return be, parity.compare(tp, outputs, be, updates, feeds_list, ref64, tol64)


def check_built(build, dtype, storage="float32", bf16_min_size=1, device=None, **kw):
    return parity.check_built(build, dtype, cuda_program(storage, bf16_min_size, device),
                              tol64=BF16_TOL if storage == "bfloat16" else None, **kw)


# --- every primitive, forward and backward ------------------------------------------------

# frozen weights kept in their stored type have no cuda kernels (yet): the backend refuses
# them by name (tests/core/test_blocks.py)
NO_CUDA = {"qmatmul", "qmatmul_t", "qtake_rows"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(set(PRIM_CASES) - NO_CUDA))
def test_primitive_parity(name, dtype):
    def build(tp):
        rng = np.random.default_rng(sorted(PRIM_CASES).index(name))
        out = PRIM_CASES[name](tp, rng)
        loss = _loss_of(tp, out, rng)
        return [out, loss, *tp.backward(loss).values()]

    check_built(build, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_graph_parity(seed):
    def build(tp):
        loss, outs = _random_graph(tp, np.random.default_rng(seed))
        return [loss, *outs, *tp.backward(loss).values()]

    be, _ = check_built(build, np.float32)
    assert be.schedule.groups


def _layers(tp):
    rng = np.random.default_rng(1)
    t, h, nh, nkv, hd, vocab = 6, 16, 4, 2, 4, 11
    x = tp.param(rng.standard_normal((t, h)))
    ones = nn.ones(tp, h)
    xn = nn.rmsnorm(tp, x, tp.param(1 + 0.1 * rng.standard_normal(h)), ones, h, 1e-5)
    wq = tp.param(rng.standard_normal((h, nh * hd)) / 4)
    wk = tp.param(rng.standard_normal((h, nkv * hd)) / 4)
    wv = tp.param(rng.standard_normal((h, nkv * hd)) / 4)
    cos, sin = nn.rope_fill(t, hd, 10000.0)
    mask = tp.const(nn.causal_mask_fill(t))
    att = nn.gqa_attention(tp, nn.linear(tp, xn, wq), nn.linear(tp, xn, wk),
                           nn.linear(tp, xn, wv), tp.const(cos), tp.const(sin), mask, t, nh,
                           nkv, hd, hd ** -0.5)
    wg = tp.param(rng.standard_normal((nh * hd, 24)) / 4)
    wu = tp.param(rng.standard_normal((nh * hd, 24)) / 4)
    mlp = nn.swiglu(tp, nn.linear(tp, att, wg), nn.linear(tp, att, wu))
    logits = nn.linear(tp, mlp, tp.param(rng.standard_normal((24, vocab)) / 4))
    targets = rng.integers(0, vocab, t)
    ids, wts = nn.ce_targets_fill(targets)
    loss = nn.cross_entropy_ids(tp, logits, tp.const(ids), tp.const(wts))
    grads = tp.backward(loss)
    return [loss, att, mlp, *grads.values()]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layers_parity(dtype):
    check_built(_layers, dtype)


def test_layers_bf16_storage():
    """bfloat16 storage for every value the rule allows (threshold 1 element): the
    loss and gradients track the float64 reference within BF16_TOL; outputs stay float32."""
    be, worst = check_built(_layers, np.float32, storage="bfloat16", bf16_min_size=1)
    assert "bf16" in be.arena.nbytes
    assert any(c == "bf16" for c in be.codes.values())
    assert all(be.codes[v] == "float32" for v in be.graph.outputs)


def test_batched_matmul_all_transposes():
    """3-d matmuls with every (ta, tb): the cuBLAS column-major argument mapping."""
    def build(tp):
        rng = np.random.default_rng(5)
        outs = []
        for ta in (False, True):
            for tb in (False, True):
                a = tp.param(rng.standard_normal((3, 4, 5) if ta else (3, 5, 4)))
                b = tp.param(rng.standard_normal((3, 6, 4) if tb else (3, 4, 6)))
                outs.append(ops.matmul(a, b, ta=ta, tb=tb))
        loss = ops.reduce_sum(ops.mul(outs[0], outs[0]))
        for o in outs[1:]:
            loss = ops.add(loss, ops.reduce_sum(ops.mul(o, o)))
        return [*outs, *tp.backward(loss).values()]

    check_built(build, np.float32)


def test_reductions_on_inner_axes():
    """softmax / logsumexp / sum over a middle or leading axis: the generic reduce kernel."""
    def build(tp):
        rng = np.random.default_rng(6)
        x = tp.param(rng.standard_normal((3, 5, 4)))
        a = ops.softmax(x, 1)
        b = ops.logsumexp(x, 0)
        c = ops.reduce_sum(x, 2, keepdims=True)
        d = ops.reduce_sum(x)
        loss = ops.add(ops.add(ops.reduce_sum(ops.mul(a, a)), ops.reduce_sum(b)),
                       ops.add(ops.reduce_sum(ops.mul(c, c)), d))
        return [a, b, c, d, *tp.backward(loss).values()]

    check_built(build, np.float32)
    check_built(build, np.float64)


def replay_case(device=None, n_feeds=4):
    """SGD as state updates over several replays (the second and later ones through the
    captured-graph path), fed leaves changing each run, an update pair that swaps two
    leaves, and an output that is an updated leaf (its value before the update).  Returns
    the executable and the number of replays."""
    rng = np.random.default_rng(3)
    tp = gt.Tape(np.float32)
    x = tp.const(rng.standard_normal((6, 5)))
    w = tp.param(rng.standard_normal((5, 5)))
    b = tp.param(rng.standard_normal(5))
    s1, s2 = tp.const(np.ones(3)), tp.const(np.zeros(3))
    y = ops.tanh(ops.add(ops.matmul(x, w), b))
    loss = ops.reduce_sum(ops.mul(y, y))
    g = tp.backward(loss)
    updates = {w: ops.sub(w, ops.scale(g[w], 0.05)), b: ops.sub(b, ops.scale(g[b], 0.05)),
               s1: s2, s2: s1}
    feeds = [{x: rng.standard_normal((6, 5))} for _ in range(n_feeds)]
    be, _ = compare(tp, [loss, w, s1], updates=updates, feeds_list=feeds, device=device)
    assert be.graph_captured, "the step was not captured as a CUDA graph"
    np.testing.assert_allclose(be.leaf_value(s1), np.ones(3) if n_feeds % 2 == 0 else 0)


def test_replay_with_feeds_and_updates():
    replay_case()


def test_capture_failure_falls_back_once():
    tp = gt.Tape(np.float32)
    x = tp.param(np.random.default_rng(0).standard_normal((4, 3)))
    loss = ops.reduce_sum(ops.exp(x))
    dev = harness(capture_fails=True)
    graph = build_graph(tp, [loss], None)
    be = lower(graph, C.CudaBackend, device=dev)
    ref = float(np.exp(x.value).sum())
    be.run({})
    with pytest.warns(RuntimeWarning, match="could not capture"):
        (r,) = be.run({})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (r2,) = be.run({})
    assert not be.graph_captured
    assert abs(float(r) - ref) < 1e-5 * ref and float(r2) == float(r)


class _HarnessBackend(C.CudaBackend):
    def __init__(self, graph, schedule, plan, execution=None):
        super().__init__(graph, schedule, plan, execution,
                         device=devices.HarnessDevice(block_elem=32, max_grid=2))


def test_train_step_matches_numpy(monkeypatch):
    """The whole LoRA training step (forward, backward, clipping, AdamW as updates) of a
    tiny LLaMA: losses and adapter weights track the numpy backend over 3 steps."""
    from gradtape.models.lora import init_adapter
    from gradtape.train.step import TrainStep
    from support.tinymodel import tiny_model

    monkeypatch.setitem(BACKENDS, "cuda-harness", f"{__name__}:_HarnessBackend")
    model = tiny_model(seed=3, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab=260,
                       n_layers=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 260, (2, 8))
    tg = np.roll(ids, -1, axis=1)
    tg[:, -1] = -100
    runs = {}
    for backend in ("numpy", "cuda-harness"):
        ad = init_adapter(model.config, 4, 8.0, seed=1)
        ts = TrainStep(model, ad, 2, 8, backend=backend)
        losses = [ts.step([(ids, tg)], i + 1, 1e-2)[0] for i in range(3)]
        runs[backend] = (losses, ts.adapter_weights())
    (l_np, w_np), (l_cu, w_cu) = runs["numpy"], runs["cuda-harness"]
    np.testing.assert_allclose(l_cu, l_np, rtol=2e-5)
    for key in w_np:
        for a, b in zip(w_cu[key], w_np[key]):
            assert rel_err(a, b) < 1e-4, key


# --- arena planning -------------------------------------------------------------------------

def _layers_backend(storage="float32", min_size=1):
    tp = gt.Tape(np.float32)
    outs = _layers(tp)
    graph = build_graph(tp, outs, None)
    return lower(graph, C.CudaBackend, storage=storage, device=harness(),
                         bf16_min_size=min_size)


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_arena_offsets(storage):
    """Every value has an aligned slot inside its arena; values live at the same time
    never overlap; leaves never share; each arena's size is what the plan lays out."""
    be = _layers_backend(storage)
    ar, codes = be.arena, be.codes
    itemsize = lambda v: np.dtype(G.STORAGE_NPTYPE[codes[v]]).itemsize  # noqa: E731

    def span(v):
        c, off = ar.loc[v]
        return c, off, off + max(v.size, 1) * itemsize(v)

    for v, (c, off) in ar.loc.items():
        assert off % 16 == 0  # cuBLAS wants 16-byte aligned operands; leaves: arena.ALIGN
        if v.is_leaf:
            assert off % arena.ALIGN == 0
        assert span(v)[2] <= ar.nbytes[c]
    # total size = sum of the aligned planned buffers, leaves and extras
    for c, total in ar.nbytes.items():
        parts = [arena._align(n) for cc, _, n in ar.buffers if cc == c]
        parts += [arena._align(max(n, 1)) for cc, _, n in ar.extra.values() if cc == c]
        assert total == sum(parts)
    # liveness: interval [def, last use] per value over the schedule's steps
    steps = be.schedule.steps
    born, last = {}, {}
    for i, s in enumerate(steps):
        for x in step_inputs(s):
            last[x] = i
        for m in step_outputs(s):
            born[m] = i
    end = len(steps)
    pinned = set(be.graph.outputs)
    live = {}
    for v in born:
        live[v] = (born[v], end if v in pinned else last.get(v, born[v]))
    for v in be.graph.leaves:
        live[v] = (-1, end)
    vals = list(live)
    for i, a in enumerate(vals):
        ca, a0, a1 = span(a)
        for b in vals[i + 1:]:
            cb, b0, b1 = span(b)
            if ca != cb or a1 <= b0 or b1 <= a0:
                continue
            (s0, e0), (s1, e1) = live[a], live[b]
            # sharing only when one is dead before the other is written (a step never
            # writes over what it reads)
            assert e0 < s1 or e1 < s0, f"{a!r} and {b!r} overlap while both live"


def test_bf16_rule():
    be = _layers_backend("bfloat16", min_size=40)
    for v, c in be.codes.items():
        if v.dtype == np.float32:
            want = v.size >= 40 and v not in be.graph.outputs
            assert (c == "bf16") == want, (v, c)
        else:
            assert c == "int64"


# --- bfloat16 rounding ---------------------------------------------------------------------

def test_bf16_host_rounding_matches_torch():
    import torch
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 10000), np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
                                   3.3895314e38], np.float32)])
    x = x.astype(np.float32)
    ours = arena.bf16_bits_to_f32(arena.f32_to_bf16_bits(x))
    ref = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours, ref)
    assert np.isnan(arena.bf16_bits_to_f32(arena.f32_to_bf16_bits(np.array([np.nan], np.float32))))


def test_bf16_device_rounding_matches_host():
    """The kernels' gt_f2bf (a cast kernel run in the harness) rounds like the host."""
    rng = np.random.default_rng(1)
    n = 999
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    src = G.ProgramSource()
    k = src.add(G.cast_kernel("float32", "bf16", n))
    dev = harness()
    dev.load(src)
    a, o = dev.alloc(4 * n), dev.alloc(2 * n)
    dev.upload(a, x)
    dev.kernel(k, 5, 8, [a, o])()
    got = dev.download(o, 2 * n, np.uint16, n)
    np.testing.assert_array_equal(got, arena.f32_to_bf16_bits(x))


# --- the CUDA source itself -----------------------------------------------------------------

CUDA_STUBS = r"""
#include <cmath>
using std::exp; using std::log; using std::sqrt; using std::tanh; using std::pow;
struct gt_uint3 { unsigned int x, y, z; };
extern gt_uint3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
void __syncthreads();
unsigned int __float_as_uint(float);
float __uint_as_float(unsigned int);
float __int_as_float(int);
double __longlong_as_double(long long);
float atomicAdd(float *, float);
double atomicAdd(double *, double);
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to parse C++")
def test_cuda_source_parses_as_cpp(tmp_path):
    """The NVRTC translation unit (CUDA prelude + kernels) is valid C++ against stub CUDA
    declarations: extern "C" kernels, __restrict__, the intrinsics the prelude uses."""
    be = _layers_backend("bfloat16")
    text = be.source.cuda_source()
    assert text.count('extern "C" __global__') == 1  # the GT_KERNEL macro
    assert text.count("GT_KERNEL void k") == be.n_kernels
    assert "#include" not in text  # NVRTC gets no system headers
    f = tmp_path / "k.cu.cpp"
    f.write_text(CUDA_STUBS + text)
    r = subprocess.run(["g++", "-std=c++14", "-fsyntax-only", "-Wall", "-Wno-unused-variable",
                        "-Wno-unused-function", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr, r.stderr[-3000:]


def test_gemm_args_shapes():
    # C[2, 3] = A[2, 4] @ B[4, 3] row-major: cuBLAS computes C^T = B^T A^T
    args = devices.RowMajorGemm(2, 3, 4, 1, False, False, 10, 20, 30, "float32", "float32",
                                "float32").cublas_args()
    assert args[:5] == (devices.CUBLAS_OP_N, devices.CUBLAS_OP_N, 3, 2, 4)
    assert args[5] == 20 and args[7] == 3 and args[9] == 10 and args[11] == 4
    assert args[13] == 30 and args[15] == 3


# --- registry and the clear error ------------------------------------------------------------

def test_registered():
    assert BACKENDS["cuda"] == "gradtape.backends.cuda.backend:CudaBackend"
    assert "cuda-bf16" in BACKENDS


def test_clear_error_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    tp = gt.Tape(np.float32)
    x = tp.param(np.ones((2, 2)))
    with pytest.raises(devices.CudaUnavailable, match=r"pip install 'gradtape\[cuda\]'.*cupy-cuda12x"):
        tp.compile([ops.reduce_sum(x)], backend="cuda")
    assert issubclass(devices.CudaUnavailable, RuntimeError)


def test_cupy_not_a_base_dependency():
    from pathlib import Path
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, the same parser (a test dependency)
        import tomli as tomllib
    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert not any("cupy" in d for d in meta["project"]["dependencies"])
    assert meta["project"]["optional-dependencies"]["cuda"] == ["cupy-cuda12x"]
