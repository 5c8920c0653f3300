"""bench/quant_bench.py on a shrunken shape: the Q4_K_M layout of the generated file, that
it loads kept quantized, and that our side of the benchmark trains on it.  (The 8B run
itself belongs to the benchmark, not to the test suite.)"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "quant_bench.py"


@pytest.fixture
def qb(monkeypatch, tmp_path):
    mod = runpy.run_path(str(SCRIPT))
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    return mod


def test_q4_k_m_layout_follows_llama_cpp(qb):
    more = [i for i in range(32) if qb["use_more_bits"](i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    plan = {name: (qtype, rows, k) for name, qtype, rows, k in qb["tensor_plan"](32)}
    assert plan["output.weight"] == ("Q6_K", 49152, 4096)
    assert plan["token_embd.weight"] == ("Q4_K", 49152, 4096)
    assert plan["blk.0.ffn_down.weight"] == ("Q6_K", 4096, 14336)
    assert plan["blk.4.attn_v.weight"] == ("Q4_K", 1024, 4096)
    assert plan["blk.5.attn_q.weight"] == ("Q4_K", 4096, 4096)
    n = sum(rows * k for qtype, rows, k in plan.values() if rows)
    assert 7.3e9 < n < 7.5e9  # Llama-3-8B's blocks with a 49152-token vocabulary


@pytest.mark.model
@pytest.mark.slow
def test_small_shape_file_loads_quantized_and_trains(qb, smollm2_gguf, monkeypatch):
    shape = dict(qb["SHAPE"], dim=256, n_heads=2, n_kv_heads=1, head_dim=128, ffn=512)
    run_gradtape, model_file = qb["run_gradtape"], qb["model_file"]
    run_gradtape.__globals__["SHAPE"] = shape  # the functions read the module globals
    run_gradtape.__globals__["T"] = 16
    path = model_file(2, log=lambda *a: None)
    assert model_file(2, log=lambda *a: None) == path  # cached
    m = llama.load(path, keep_quantized=True)
    assert (m.config.dim, m.config.n_layers, m.config.vocab_size) == (256, 2, 49152)
    w = m.weights
    assert isinstance(w["layers.1.down"], BlockMatrix) and w["layers.1.down"].qtype == "Q6_K"
    assert w["lm_head"].qtype == "Q6_K" and w["layers.0.down"].qtype == "Q4_K"
    assert 0.005 < float(np.std(w["layers.1.up"].dequantize())) < 0.1
    res = run_gradtape(path, 0, 2, "cpu")
    assert len(res["step_times"]) == 2 and res["estimate_gb"] > 0
    # the default precision and why; one step's time split by kind of work
    assert res["compute"] in ("float32", "bf16") and res["compute_why"]
    assert res["split_s"] and all(v >= 0 for v in res["split_s"].values())
