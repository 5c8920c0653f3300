"""Short rows (two query tiles, 129-256) take the fused attention where it measured
faster than the composed one on this CPU (``attention_choice.attention_from``), its products kept
float32 in a bf16 program (``ops.attn(f32=True)``): the step trains as the composed one
does, to float32 rounding."""

from types import SimpleNamespace

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.backends.cpu import onednn
from gradtape.models import attention_choice as M
from gradtape.models import graph
from gradtape.models.lora import init_adapter
from gradtape.plan import Decision
from gradtape.tiled import AttentionSpec
from gradtape.train import step as step_module
from gradtape.train.step import TrainStep

from support import hardware
from support.compare import rel_err
from support.tinymodel import tiny_model


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "library", lambda: SimpleNamespace(version="3.2.0"))


def test_the_faster_attention_is_measured_once_per_cpu_for_two_query_tiles(cache,
                                                                           monkeypatch):
    monkeypatch.delenv("GRADTAPE_ATTENTION", raising=False)
    cfg = tiny_model().config
    timed = []
    verdict = {"seconds": (0.2, 0.1)}  # composed, fused

    def time_attention(cfg_, n_seq, t, compute):
        timed.append((n_seq, t, compute))
        return verdict["seconds"]
    monkeypatch.setattr(M, "_time_attention", time_attention)
    assert tuple(M.attention_from(cfg, 2, 256, "cpu", "bf16")) == (
        256, "fused (fused 100.0 vs composed 200.0 ms at 256 rows, timed on this CPU)")
    rows, why = M.attention_from(cfg, 2, 256, "cpu", "bf16")  # from the cache
    assert rows == 256 and "timed before on this CPU" in why
    assert timed == [(2, 256, "bf16")]
    verdict["seconds"] = (0.1, 0.2)
    rows, why = M.attention_from(cfg, 2, 160, "cpu", "float32")
    assert rows == graph.ATTN_TILED_MIN and why.startswith("composed (")
    # one query tile (nothing to skip), other backends, long rows: never timed
    for args in ((2, 128, "cpu"), (2, 256, "numpy"), (1, 1024, "cpu")):
        assert tuple(M.attention_from(cfg, *args, "float32")) == (graph.ATTN_TILED_MIN, "")
    # $GRADTAPE_ATTENTION decides without timing
    for forced, want in (("fused", 200), ("composed", graph.ATTN_TILED_MIN)):
        monkeypatch.setenv("GRADTAPE_ATTENTION", forced)
        assert tuple(M.attention_from(cfg, 2, 200, "cpu", "int8")) == (
            want, f"{forced} ($GRADTAPE_ATTENTION)")
    assert len(timed) == 2
    monkeypatch.setenv("GRADTAPE_ATTENTION", "flash")  # neither: said, then timed
    with pytest.warns(RuntimeWarning, match="neither fused nor composed"):
        assert M.attention_from(cfg, 2, 200, "cpu", "bf16").value == graph.ATTN_TILED_MIN
    assert len(timed) == 3


def test_both_attentions_are_timed_for_real(cache):
    composed, fused = M._time_attention(tiny_model().config, 1, 160, "float32")
    assert 0 < composed < 10 and 0 < fused < 10


def _steps(model, fused, monkeypatch, t=160):
    monkeypatch.setattr(step_module, "attention_from", lambda cfg, n_seq, t_, backend, compute:
                        Decision(t_ if fused else graph.ATTN_TILED_MIN, ""))
    ts = TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1), 2, t, backend="cpu",
                   compute="float32")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (2, t))
    tg = np.roll(ids, -1, axis=1)
    losses = [ts.step([(ids, tg)], i + 1, 1e-2) for i in range(3)]
    ops_ = [v.op for v in ts.program.graph.ops]
    return ops_, losses, ts.adapter_weights()


def test_a_step_with_the_fused_attention_trains_as_the_composed_one(monkeypatch):
    model = tiny_model(seed=3, n_layers=2)
    ops_c, l_c, w_c = _steps(model, False, monkeypatch)
    ops_f, l_f, w_f = _steps(model, True, monkeypatch)
    assert "attn" not in ops_c and ops_f.count("attn") == 2
    assert rel_err(np.array(l_f), np.array(l_c)) <= 1e-5
    for key in w_c:
        for a, b in zip(w_f[key], w_c[key]):
            assert rel_err(a, b) <= 1e-4, key


def test_f32_keeps_the_fused_attentions_products_float32_in_a_bf16_program():
    """In a bf16 program (here a frozen weight's GEMM beside the attention) the fused
    attention takes bf16 inputs too, unless ``f32``: then it is the float32 program's,
    to float32 rounding."""
    hardware.onednn_bf16()
    rng = np.random.default_rng(2)
    n, nh, nkv, hd = 160, 4, 2, 16
    got = {}
    for f32 in (False, True):
        tp = gt.Tape(np.float32, eager=False)
        q, k, v = (tp.param(rng.standard_normal((n, h * hd)).astype(np.float32))
                   for h in (nh, nkv, nkv))
        y = ops.matmul(tp.param(rng.standard_normal((n, 256)).astype(np.float32)),
                       tp.const(rng.standard_normal((256, 256)).astype(np.float32)))
        o = ops.attn(q, k, v, AttentionSpec(nh, nkv, hd, 0.25), f32=f32)
        for compute in ("float32", "bf16"):
            prog = tp.compile([o, y], backend="cpu", compute=compute)
            assert prog.executable.compute == compute
            got[compute] = prog.run()[0].copy()
        err = rel_err(got["bf16"], got["float32"])
        assert err < 1e-6 if f32 else err > 1e-4
