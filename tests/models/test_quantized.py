"""SmolLM2 kept in its stored type (``llama.load(..., keep_quantized=True)``: the Q4_1 /
Q8_0 blocks of the embedded GGUF, memory-mapped, never expanded) against the same model
dequantized to float32 at load: logits, one LoRA step's adapter gradients, generation.

Tolerance 1e-5 relative (max |a - b| / max |b|), float32 compute, on the numpy backend:
there the block primitives are dequantize-then-matmul with the very same float32 values
(agreement is exact in practice).  On the cpu backend the tiled GEMMs sum the same
products in another order than one dense GEMM, and 30 layers of float32 backward amplify
any rounding: two float32 evaluations of this gradient differ by up to 3e-5 whatever the
weights' storage (the float32 model's own error against float64 reaches 3.1e-5 on the
smallest adapter gradients).  There the test holds the quantized path to the float32
model's own accuracy: its errors against the float64 evaluation of the same graph may
be at most twice the dense path's (median and worst; observed 4.8e-6 / 3.0e-5 against
4.3e-6 / 3.1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix
from gradtape.models.lora import init_adapter

from support.adapters import lora_grads
from support.compare import rel_err
from support.greedy import assert_greedy_equal

pytestmark = [pytest.mark.model, pytest.mark.slow]
TOL = 1e-5


def _maps_file(a):
    """Whether array ``a`` is a view of a memory-mapped file."""
    import mmap
    while isinstance(a, np.ndarray):
        if isinstance(a, np.memmap):
            return True
        a = a.base
    return isinstance(a, mmap.mmap)


@pytest.fixture(scope="module")
def smollm2_q(smollm2_gguf):
    return llama.load("smollm2", keep_quantized=True)


def test_matrices_stay_blocks_mapped_from_the_file(smollm2_q, smollm2):
    w = smollm2_q.weights
    cfg = smollm2_q.config
    mats = [k for k, v in smollm2.weights.items() if v.ndim == 2]
    assert all(isinstance(w[k], BlockMatrix) for k in mats)
    assert w["tok_embd"].qtype == "Q8_0" and w["layers.0.up"].qtype == "Q4_1"
    assert w["layers.3.down"].shape == (cfg.dim, cfg.ffn_dim)  # [out, in] as stored
    # a view of the file's memory map (no copy); q / k rows were permuted into a copy
    assert _maps_file(w["layers.0.up"].data) and _maps_file(w["tok_embd"].data)
    assert not _maps_file(w["layers.0.q"].data)
    kept = sum(v.nbytes for v in w.values())
    f32 = sum(v.nbytes for v in smollm2.weights.values())
    assert kept < f32 / 4  # Q4_1 / Q8_0 against float32
    # the blocks dequantize to exactly the float32 model's weights
    np.testing.assert_array_equal(w["layers.2.q"].dequantize().T, smollm2.weights["layers.2.q"])
    np.testing.assert_array_equal(w["tok_embd"].dequantize(), smollm2.weights["tok_embd"])


def test_logits_equal_the_dequantized_model(smollm2_q, smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and the capital of")
    a, b = smollm2_q.logits(ids), smollm2.logits(ids)
    assert rel_err(a, b) <= TOL


def _case(smollm2):
    adapter = init_adapter(smollm2.config, rank=4, alpha=8.0, seed=1, base_model="smollm2")
    r = np.random.default_rng(0)
    for key, (a, b) in adapter.weights.items():  # B != 0: A gets a gradient too
        b[...] = r.standard_normal(b.shape).astype(np.float32) * 0.02
    ids = np.asarray(smollm2.tokenizer.encode("Hello there! How are you today? I am fine,"
                                              " thank you very much."), np.int64)[:16]
    return adapter, ids, np.concatenate([ids[1:], [-100]])


def test_lora_gradients_equal_the_dequantized_model(smollm2_q, smollm2):
    adapter, ids, targets = _case(smollm2)
    got = lora_grads(smollm2_q, adapter, ids, targets, "numpy")
    ref = lora_grads(smollm2, adapter, ids, targets, "numpy")
    assert len(got) == 1 + 2 * 7 * smollm2.config.n_layers
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= TOL


def test_lora_gradients_on_the_cpu_backend(smollm2_q, smollm2):
    adapter, ids, targets = _case(smollm2)
    q = lora_grads(smollm2_q, adapter, ids, targets, "cpu")
    dense = lora_grads(smollm2, adapter, ids, targets, "cpu")
    ref64 = lora_grads(smollm2, adapter, ids, targets, "numpy", np.float64)
    assert rel_err(q[0], ref64[0]) <= TOL  # the loss
    eq = np.array([rel_err(a, r) for a, r in zip(q, ref64)])
    ed = np.array([rel_err(a, r) for a, r in zip(dense, ref64)])
    assert np.median(eq) <= 2 * np.median(ed) and eq.max() <= 2 * ed.max(), \
        (np.median(eq), np.median(ed), eq.max(), ed.max())


def test_generate_on_the_quantized_base(smollm2_q, smollm2):
    """Prefill and one decode step pick the float32 model's tokens, where the float32
    graph's top two logits lie further apart than the C decoder's logits may lie from
    the graph's (2e-4 on SmolLM2: tests/models/test_decode_engine.py)."""
    ids = smollm2.tokenizer.encode("The capital of France is")
    a = smollm2_q.generate(ids, 2)
    ref = smollm2.logits(ids + a[:-1])[len(ids) - 1:]
    assert_greedy_equal(ref, a, smollm2.generate(ids, 2), 2e-4)
