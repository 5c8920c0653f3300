"""The low-bit types of llama.cpp's smaller files (Q2_K, Q3_K as in Q3_K_S/M/L, the IQ2,
IQ3 and IQ4 types), kept as stored: a tiny llama GGUF whose matrices are random valid
blocks of one type, loaded with ``keep_quantized=True`` against the same file dequantized
to float32 by gguf at load.  Their blocks dequantize bit for bit as gguf's
(tests/backends/test_qgemm.py, test_ggml_vec.py); here the whole model agrees: logits,
one LoRA step's gradients on the cpu backend in float32 and in bf16 compute (the
block-weight GEMMs' tiles), and greedy generation through the C decoder that reads the
blocks."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix

from support import hardware
from support.adapters import lora_grads, random_adapter
from support.compare import rel_err
from support.filebuilders import write_tiny_gguf
from support.greedy import assert_greedy_equal
from support.tinymodel import tiny_model

TYPES = ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
         "IQ3_S"]


@pytest.fixture(scope="module", params=TYPES)
def pair(request, tmp_path_factory):
    """(the model kept in ``qtype`` blocks, the same file dequantized to float32)"""
    qtype = request.param
    m = tiny_model(seed=3, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab=258)
    path = write_tiny_gguf(m, tmp_path_factory.mktemp(qtype) / f"{qtype}.gguf", qtype=qtype,
                           rng=np.random.default_rng(TYPES.index(qtype)))
    return llama.load(path, keep_quantized=True), llama.load(path)


def test_kept_as_stored(pair):
    q, f = pair
    w = q.weights["layers.1.down"]
    assert isinstance(w, BlockMatrix) and w.qtype in TYPES
    np.testing.assert_array_equal(w.dequantize().T, f.weights["layers.1.down"])
    ids = np.arange(40) * 7 % 256
    assert rel_err(q.logits(ids), f.logits(ids)) <= 1e-5


def _grads(model, compute_kind):
    """One LoRA step's loss and adapter gradients (flattened), on the cpu backend."""
    ids = (np.arange(33) * 11 % 256).astype(np.int64)
    out = lora_grads(model, random_adapter(model.config, b_scale=0.02, seed=1), ids[:32],
                     ids[1:], "cpu", compute=compute_kind)
    return float(out[0]), np.concatenate([a.ravel() for a in out[1:]])


@pytest.mark.parametrize("compute_kind", ["float32", "bf16"])
def test_a_lora_step_matches_the_dequantized_model(pair, compute_kind):
    if compute_kind == "bf16":  # asked for by name: runs wherever oneDNN has bf16
        hardware.onednn_bf16()
    q, f = pair
    (lq, gq), (lf, gf) = _grads(q, compute_kind), _grads(f, compute_kind)
    # float32: the same products summed in another order (tiles against one GEMM);
    # bf16: the same rounded weights either way, the gate of bf16 compute
    if compute_kind == "float32":
        assert abs(lq - lf) <= 1e-5 * abs(lf) and rel_err(gq, gf) <= 1e-5
    else:
        gq, gf = gq.astype(np.float64), gf.astype(np.float64)
        assert abs(lq - lf) <= 1e-2 * abs(lf)
        assert gq @ gf / np.linalg.norm(gq) / np.linalg.norm(gf) >= 0.999


def test_greedy_generation_matches(pair):
    """The same tokens, though the decoders may sum in another order: compared where the
    float32 graph's top two logits lie further apart than the two models' logits do
    (1e-5 of the largest, ``test_kept_as_stored``; about 1e-6 measured)."""
    q, f = pair
    ids = list(np.arange(20) * 5 % 256)
    a = q.generate(ids, 6, stop_ids=())
    ref = f.logits(ids + a[:-1])[len(ids) - 1:]
    assert_greedy_equal(ref, a, f.generate(ids, 6, stop_ids=()), 1e-5)
