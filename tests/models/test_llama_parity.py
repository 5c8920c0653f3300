"""Parity of our SmolLM2 with Hugging Face transformers loading the same GGUF.

Weights (after our q/k un-permutation), logits in float32 and float64, greedy
generation, and the KV-cached path against the full-sequence graph.  Errors are
``max|ours - ref| / max|ref|`` over all logits of a 40+ token sequence.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from gradtape import Tape
from gradtape.infer.decode_step import DecodeStep
from gradtape.infer.kv_cache import KVCache, forward_cached
from gradtape.llama import Llama
from gradtape.models import graph as M
from gradtape.models.lora import TARGETS

from support.adapters import random_adapter
from support.compare import rel_err
from support.greedy import assert_greedy_equal

pytestmark = [pytest.mark.model, pytest.mark.slow]  # needs the embedded SmolLM2 GGUF

TEXT = ("The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean "
        "blue with 3 ships and about 90 men.\n  def square(x):\n      return x ** 2  # ok")

TOL = {np.float32: 1e-4, np.float64: 1e-9}
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


@pytest.fixture(scope="module")
def ids(smollm2):
    out = smollm2.tokenizer.encode(TEXT)
    assert len(out) >= 40
    return out


def hf_logits(hf, ids):
    import torch
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def hf_ref32(hf_smollm2, ids):
    return hf_logits(hf_smollm2, ids)


@pytest.fixture(scope="module")
def hf_ref64(hf_smollm2, hf_float64, ids):
    """The reference in float64: a copy of the HF model with its float32 casts fixed
    (see ``conftest.hf_float64_reference``)."""
    hf = hf_float64(copy.deepcopy(hf_smollm2))
    out = hf_logits(hf, ids)
    del hf
    return out


def test_config(smollm2):
    c = smollm2.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim,
            c.vocab_size) == (576, 30, 9, 3, 64, 1536, 49152)
    assert c.rope_base == 1e5 and abs(c.norm_eps - 1e-5) < 1e-10 and c.tie_embeddings
    assert "lm_head" not in smollm2.weights
    assert smollm2.name and smollm2.tokenizer.eos_id == 2


def test_weights_equal_hf(smollm2, hf_smollm2):
    """Every weight equals transformers' dequantized tensor exactly (q/k un-permuted)."""
    sd = {k: v.numpy() for k, v in hf_smollm2.state_dict().items()}
    for name, w in smollm2.weights.items():
        assert w.dtype == np.float32 and w.flags.c_contiguous
        if name == "tok_embd":
            ref = sd["model.embed_tokens.weight"]
        elif name == "norm":
            ref = sd["model.norm.weight"]
        else:
            _, i, t = name.split(".")
            ref = sd[f"model.layers.{i}.{HF_NAMES[t]}.weight"]
            if t in TARGETS:
                ref = ref.T  # HF [out, in] -> ours [in, out]
        np.testing.assert_array_equal(w, ref, err_msg=name)


def test_logits_float32(smollm2, ids, hf_ref32):
    ours = smollm2.logits(ids)
    assert ours.shape == (len(ids), 49152) and ours.dtype == np.float32
    err = rel_err(ours, hf_ref32)
    print(f"float32 logits rel err vs HF: {err:.3g}")
    assert err <= TOL[np.float32]


def test_logits_float64(smollm2, ids, hf_ref64):
    ours = smollm2.logits(ids, dtype=np.float64)
    assert ours.dtype == np.float64
    err = rel_err(ours, hf_ref64)
    print(f"float64 logits rel err vs HF: {err:.3g}")
    assert err <= TOL[np.float64]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_record_forward_matches_hf(smollm2, ids, hf_ref32, hf_ref64, dtype):
    """The trainer's graph (one tape, gqa_attention) against the reference."""
    tp = Tape(dtype)
    W = M.weight_consts(tp, smollm2)
    if dtype == np.float32:
        assert W["tok_embd"].value is smollm2.weights["tok_embd"]  # shared, not copied
    out = M.record_forward(tp, smollm2.config, W, tp.const(np.array(ids)), 1).value
    ref = hf_ref32 if dtype == np.float32 else hf_ref64
    assert rel_err(out, ref) <= TOL[dtype]


def test_kv_cache_equals_full_sequence(smollm2, ids):
    """Decoding one row at a time through the cache gives the full-sequence logits."""
    n = 24
    tp = Tape(np.float64)
    full = M.record_forward(tp, smollm2.config, M.weight_consts(tp, smollm2),
                            tp.const(np.array(ids[:n])), 1).value
    W64 = {k: w.astype(np.float64) for k, w in smollm2.weights.items()}
    cache = KVCache.empty(smollm2.config)
    rows = [forward_cached(smollm2.config, W64, ids[:10], cache, dtype=np.float64)]
    rows += [forward_cached(smollm2.config, W64, [t], cache, dtype=np.float64)
             for t in ids[10:n]]
    assert cache.length == n and cache.k[0].shape == (n, 3 * 64)
    assert rel_err(np.concatenate(rows), full) <= 1e-12

    # the replayed one-token step, from the prompt's cache, growing its capacity once
    cache = KVCache.empty(smollm2.config)
    forward_cached(smollm2.config, W64, ids[:10], cache, dtype=np.float64)
    step = DecodeStep(smollm2.config, W64, None, 1.0, np.float64, cap=14)
    step.load(cache)
    rows = []
    for t in ids[10:n]:
        if step.length == step.cap:
            bigger = DecodeStep(smollm2.config, W64, None, 1.0, np.float64, cap=n)
            bigger.take(step)
            step = bigger
        rows.append(step(t))
    assert step.cap == n
    assert rel_err(np.stack(rows), full[10:]) <= 1e-12


def test_record_forward_batches_sequences(smollm2, ids):
    """n_seq sequences at once equal each sequence alone (attention stays per sequence)."""
    a, b = ids[:12], ids[12:24]
    tp = Tape(np.float64)
    W = M.weight_consts(tp, smollm2)
    both = M.record_forward(tp, smollm2.config, W, tp.const(np.array(a + b)), 2).value
    for k, seq in enumerate((a, b)):
        one = M.record_forward(tp, smollm2.config, W, tp.const(np.array(seq)), 1).value
        assert rel_err(both[12 * k:12 * (k + 1)], one) <= 1e-12
    with pytest.raises(ValueError, match="equal sequences"):
        M.record_forward(tp, smollm2.config, W, tp.const(np.array(a[:11] + b)), 2)


def test_generate_greedy_matches_hf(smollm2, hf_smollm2):
    """Our decoding and transformers' pick the same tokens wherever the reference's top
    two logits (transformers' full forward along our tokens) lie further apart than our
    decoder's logits may lie from them: our graph's float32 tolerance (TOL) plus the C
    decoder's 2e-4 against our graph (tests/models/test_decode_engine.py)."""
    import torch
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}],
        add_generation_prompt=True))
    n = 20
    streamed = []
    ours = smollm2.generate(prompt, n, stream=streamed.append)
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=sorted(smollm2.stop_ids), pad_token_id=2)
    ref = ref[0, len(prompt):].tolist()
    assert len(ours) >= 16
    z = hf_logits(hf_smollm2, prompt + ours[:-1])[len(prompt) - 1:]
    assert_greedy_equal(z, ours, ref, TOL[np.float32] + 2e-4)
    assert len(ours) == len(ref), (tok.decode(ours), tok.decode(ref))
    assert streamed == ours


def test_generate_stops_and_samples(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("The capital of France is")
    greedy = smollm2.generate(prompt, 6)
    assert tok.decode(greedy).startswith(" Paris")
    # a tiny nucleus keeps only the top token: sampling equals greedy
    assert smollm2.generate(prompt, 6, temperature=1.0, top_p=1e-6, seed=3) == greedy
    s1 = smollm2.generate(prompt, 6, temperature=1.5, seed=7)
    assert s1 == smollm2.generate(prompt, 6, temperature=1.5, seed=7)  # seeded
    # stops at (and includes) an end-of-sequence token
    first = greedy[0]
    assert smollm2.generate(prompt, 6, stop_ids={first}) == [first]
    assert smollm2.generate(prompt, 0) == []


def test_adapter_equals_merged_weights(smollm2, ids):
    """logits with an adapter == logits of the base with W + scale * A @ B merged."""
    cfg = smollm2.config
    ad = random_adapter(cfg, layers=(0, 7, 29), seed=0)
    merged = {k: w.astype(np.float64) for k, w in smollm2.weights.items()}
    for (i, t), (a, b) in ad.weights.items():
        merged[f"layers.{i}.{t}"] += ad.scale * (a.astype(np.float64) @ b)
    base = Llama(cfg, merged, smollm2.tokenizer)
    ids = ids[:20]
    ours = smollm2.logits(ids, adapter=ad, dtype=np.float64)
    assert rel_err(ours, base.logits(ids, dtype=np.float64)) <= 1e-10
    assert rel_err(ours, smollm2.logits(ids, dtype=np.float64)) > 1e-3  # it does something
    # the trainer's graph gives the same with lora consts
    tp = Tape(np.float64)
    lora = {k: (tp.const(a), tp.const(b)) for k, (a, b) in ad.weights.items()}
    rec = M.record_forward(tp, cfg, M.weight_consts(tp, smollm2), tp.const(np.array(ids)), 1,
                           lora=lora, lora_scale=ad.scale).value
    assert rel_err(rec, ours) <= 1e-12
    assert len(smollm2.generate(ids, 3, adapter=ad)) == 3


def test_adapter_for_another_model_is_refused(smollm2):
    from gradtape.errors import GradtapeError
    ad = random_adapter(smollm2.config, targets="q", layers=(0,), seed=0)
    a, b = ad.weights[(0, "q")]
    ad.weights[(0, "q")] = (a[:100], b)
    with pytest.raises(GradtapeError, match="another base model"):
        smollm2.logits([1, 2, 3], adapter=ad)
    ad.weights = {(30, "q"): (a, b)}
    with pytest.raises(GradtapeError, match="30 layers"):
        smollm2.logits([1, 2, 3], adapter=ad)


def test_bad_ids(smollm2):
    from gradtape.errors import GradtapeError
    with pytest.raises(GradtapeError, match="out of range"):
        smollm2.logits([1, 49152])
    with pytest.raises(GradtapeError, match="at least one"):
        smollm2.logits([])
