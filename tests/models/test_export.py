"""Interop: merging an adapter into its base, the merged model as a Hugging Face
folder and as a GGUF, and the adapter as a llama.cpp LoRA GGUF.

Merged and unmerged models must give the same logits: float32, within 1e-4 relative to
the largest logit (the merged weight is rounded once to float32, the unmerged path adds
``x @ w0`` and ``s * (x @ A) @ B`` in float32: both differ from exact by float32 rounding,
about 1e-6 here).  Most checks use the tiny random model; one uses the real SmolLM2.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

from gradtape import llama
from gradtape.cli import main
from gradtape.errors import GradtapeError
from gradtape.models import export
from gradtape.models.load_gguf import unpermute_rope_rows
from gradtape.models.lora import load_adapter
from support.adapters import random_adapter
from support.tinymodel import tiny_model, write_hf_folder
from support.compare import rel_err

F32_REL = 1e-4  # the bound for merged vs unmerged, float32
# float16 weights carry a relative rounding error up to 2**-11 ~ 5e-4 each; through two
# layers of the tiny model that moves logits by a few 1e-3 of their scale
F16_REL = 2e-2


def _have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


IDS = [3, 17, 101, 44, 200, 9, 65, 66, 67, 250, 31, 12]


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def tiny_setup(request, tmp_path):
    """A tiny model saved as a Hugging Face folder, loaded back, and a PEFT adapter with
    random B saved next to it; the reference logits of the unmerged model + adapter."""
    base = write_hf_folder(tiny_model(seed=1, tied=request.param), tmp_path / "base")
    model = llama.load(base)
    ad = random_adapter(model.config, b_scale=0.3)
    ad.save(tmp_path / "adapter")
    ad = load_adapter(tmp_path / "adapter", model)
    ref = model.logits(IDS, adapter=ad)
    assert rel_err(model.logits(IDS), ref) > 100 * F32_REL  # the adapter really moves logits
    return model, ad, ref, tmp_path


# --- merge is a pure function -------------------------------------------------------------

def test_merge_is_pure_and_exact():
    m = tiny_model(seed=2)
    ad = random_adapter(m.config, rank=3, alpha=5.0, b_scale=0.3)
    w_before = {k: v.copy() for k, v in m.weights.items()}
    ad_before = {k: (a.copy(), b.copy()) for k, (a, b) in ad.weights.items()}
    merged = export.merge(m.weights, ad)
    # inputs untouched
    assert set(m.weights) == set(w_before)
    for k, v in w_before.items():
        assert np.array_equal(m.weights[k], v), k
    for k, (a, b) in ad_before.items():
        assert np.array_equal(ad.weights[k][0], a) and np.array_equal(ad.weights[k][1], b)
    assert merged is not m.weights and set(merged) == set(m.weights)
    # the math: w0 + (alpha / r) * A @ B, rounded once to float32
    for (layer, target), (a, b) in ad.weights.items():
        name = f"layers.{layer}.{target}"
        want = m.weights[name].astype(np.float64) + 5.0 / 3 * (a.astype(np.float64) @ b)
        assert merged[name].dtype == np.float32
        assert np.allclose(merged[name], want, rtol=1e-6, atol=1e-7)
        assert merged[name] is not m.weights[name]
    assert merged["tok_embd"] is m.weights["tok_embd"]  # untouched tensors are shared
    # merging twice gives the same (inputs were not changed by the first call)
    again = export.merge(m.weights, ad)
    assert all(np.array_equal(again[k], merged[k]) for k in merged)


def test_merge_rslora_scale():
    m = tiny_model(seed=2)
    ad = random_adapter(m.config, rank=4, alpha=6.0, b_scale=0.3)
    ad.scale_override = 6.0 / math.sqrt(4)
    merged = export.merge(m.weights, ad)
    a, b = ad.weights[(1, "v")]
    want = m.weights["layers.1.v"] + 3.0 * (a.astype(np.float64) @ b)
    assert np.allclose(merged["layers.1.v"], want, rtol=1e-6, atol=1e-7)


def test_merge_rejects_an_adapter_for_another_model():
    small = tiny_model(seed=0, dim=32)
    other = random_adapter(tiny_model(seed=0, dim=16, n_heads=2, n_kv_heads=1).config,
                           b_scale=0.3)
    with pytest.raises(GradtapeError, match=r"merge: layers\.0\.down \[48, 32\]: adapter "
                                            r"A \[48, 4\] / B \[4, 16\] do not fit"):
        export.merge(small.weights, other)
    deeper = random_adapter(tiny_model(seed=0, n_layers=3).config, b_scale=0.3)
    with pytest.raises(GradtapeError, match=r"layers\.2\..* which the model lacks"):
        export.merge(small.weights, deeper)


# --- merged Hugging Face folder -----------------------------------------------------------

def test_merged_hf_folder_loads_in_transformers_and_gradtape(tiny_setup):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, ad, ref, tmp = tiny_setup
    out = tmp / "merged"
    assert main(["merge", "--model", str(tmp / "base"), "--adapter", str(tmp / "adapter"),
                 "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}

    ours = llama.load(out)
    assert ours.config == model.config
    assert rel_err(ours.logits(IDS), ref) < F32_REL

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].numpy()
    assert rel_err(theirs, ref) < F32_REL

    tk = AutoTokenizer.from_pretrained(str(out))
    text = "héllo <world>!"
    assert tk.encode(text) == model.tokenizer.encode(text) == ours.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def test_merged_hf_folder_float16(tiny_setup):
    model, ad, ref, tmp = tiny_setup
    out = export.save_hf_folder(export.merged_model(model, ad), tmp / "m16", "float16")
    from safetensors.numpy import load_file
    assert all(v.dtype == np.float16 for v in load_file(str(out / "model.safetensors")).values())
    assert rel_err(llama.load(out).logits(IDS), ref) < F16_REL
    # written atomically, yet with the mode a plain open() gives (not mkstemp's 0600)
    umask = os.umask(0)
    os.umask(umask)
    gg = export.save_gguf(export.merged_model(model, ad), tmp / "m.gguf")
    for p in [*out.iterdir(), gg]:
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, p.name
    assert not [p for p in tmp.iterdir() if p.name.endswith(".tmp")]


# --- merged GGUF --------------------------------------------------------------------------

def test_merged_gguf_reads_back(tiny_setup, capsys):
    model, ad, ref, tmp = tiny_setup
    out = tmp / "merged.gguf"
    assert main(["merge", "--model", str(tmp / "base"), "--adapter", str(tmp / "adapter"),
                 "--out", str(out)]) == 0  # .gguf implies --format gguf
    back = llama.load(out)
    assert back.config.dim == model.config.dim and \
        back.config.tie_embeddings == model.config.tie_embeddings
    assert rel_err(back.logits(IDS), ref) < F32_REL
    # the tiny model's regex-free byte tokenizer has no GGUF spelling: said, not hidden
    assert "written without one" in capsys.readouterr().err

    from gguf import GGUFReader
    r = GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["general.type"].contents() == "model"
    assert {t.tensor_type.name for t in r.tensors} == {"F32"}
    # the q rows are in llama.cpp's interleaved order: un-permuting gives ours back
    q = next(t for t in r.tensors if t.name == "blk.1.attn_q.weight")
    merged = export.merge(model.weights, ad)
    assert np.array_equal(unpermute_rope_rows(np.asarray(q.data), model.config.n_heads),
                          merged["layers.1.q"].T)


def test_merged_gguf_loads_in_transformers(tiny_setup):
    import torch
    from transformers import AutoModelForCausalLM

    model, ad, ref, tmp = tiny_setup
    out = tmp / "gg"
    assert main(["merge", "--model", str(tmp / "base"), "--adapter", str(tmp / "adapter"),
                 "--out", str(out), "--format", "gguf"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="model.gguf",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].numpy()
    assert rel_err(theirs, ref) < F32_REL


def test_merged_gguf_float16(tiny_setup):
    model, ad, ref, tmp = tiny_setup
    out = tmp / "m16.gguf"
    assert main(["merge", "--model", str(tmp / "base"), "--adapter", str(tmp / "adapter"),
                 "--out", str(out), "--dtype", "float16"]) == 0
    from gguf import GGUFReader
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert rel_err(llama.load(out).logits(IDS), ref) < F16_REL


# --- llama.cpp LoRA GGUF ------------------------------------------------------------------

@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gguf_lora_file_matches_the_adapter(tiny_setup, outtype):
    from gguf import GGUFReader

    model, ad, ref, tmp = tiny_setup
    cfg = model.config
    out = tmp / f"lora-{outtype}.gguf"
    assert main(["export-gguf-lora", "--adapter", str(tmp / "adapter"), "--model",
                 str(tmp / "base"), "--out", str(out), "--outtype", outtype]) == 0
    r = GGUFReader(str(out))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama"
    assert meta["general.type"] == "adapter"
    assert meta["adapter.type"] == "lora"
    assert meta["adapter.lora.alpha"] == pytest.approx(ad.alpha)
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * len(ad.weights) == 2 * 7 * cfg.n_layers
    heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}
    tol = 0 if outtype == "f32" else 1e-3
    for (layer, target), (a, b) in ad.weights.items():
        fin, fout = a.shape[0], b.shape[1]
        ta = tensors[f"blk.{layer}.{names[target]}.weight.lora_a"]
        tb = tensors[f"blk.{layer}.{names[target]}.weight.lora_b"]
        assert ta.tensor_type.name == tb.tensor_type.name == outtype.upper()
        # ggml order (fastest first): lora_a [in, r], lora_b [r, out], like the base
        # tensor's [in, out], which is what llama.cpp checks
        assert list(ta.shape) == [fin, ad.rank] and list(tb.shape) == [ad.rank, fout]
        la = np.asarray(ta.data, np.float32).reshape(ad.rank, fin)
        lb = np.asarray(tb.data, np.float32).reshape(fout, ad.rank)
        assert np.allclose(la, a.T, rtol=tol, atol=tol)
        if target in heads:  # rows permuted into llama.cpp's interleaved rope layout
            assert not np.allclose(lb, b.T, rtol=tol, atol=tol)
            lb = unpermute_rope_rows(lb, heads[target])
        assert np.allclose(lb, b.T, rtol=tol, atol=tol)


def test_tokenizer_metadata_rebuilt_from_tokenizer_json():
    """A llama-3-style byte-level BPE (regex split, then byte level) survives
    tokenizer -> GGUF metadata -> tokenizer, specials and merges included."""
    from gradtape.models.tokenizer import Tokenizer, _bytes_to_unicode

    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + ["he", "ll", "hell", "Ġw", "<|end|>", "<|start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "Ġ w"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 1,
            "tokenizer.ggml.eos_token_id": len(tokens) - 2,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": "{{ x }}"}
    tok = Tokenizer.from_gguf(meta, "test")
    fields = export._derived_tokenizer_fields(tok)
    back_meta = {k: v for k, v, *_ in fields}
    assert back_meta["tokenizer.ggml.pre"] == "llama-bpe"
    assert back_meta["tokenizer.ggml.tokens"] == tokens
    assert back_meta["tokenizer.ggml.token_type"] == types
    back = Tokenizer.from_gguf(back_meta, "rebuilt")
    text = "hello world<|end|> héllo 12345"
    assert back.encode(text) == tok.encode(text)
    assert back.encode(text)[0] == len(tokens) - 1  # the BOS the model asks for
    assert back.eos_id == tok.eos_id and back.chat_template == "{{ x }}"


def test_gguf_lora_rslora_alpha(tmp_path):
    m = tiny_model(seed=4)
    ad = random_adapter(m.config, rank=4, alpha=6.0, b_scale=0.3)
    ad.scale_override = 6.0 / 2.0  # rsLoRA: alpha / sqrt(r)
    export.save_gguf_lora(ad, m.config, tmp_path / "rs.gguf")
    from gguf import GGUFReader
    alpha = GGUFReader(str(tmp_path / "rs.gguf")).fields["adapter.lora.alpha"].contents()
    assert alpha / ad.rank == pytest.approx(ad.scale)  # llama.cpp scales by alpha / r


def test_cli_errors(tiny_setup, capsys):
    model, ad, ref, tmp = tiny_setup
    base, adir = str(tmp / "base"), str(tmp / "adapter")
    assert main(["export-gguf-lora", "--adapter", adir, "--model", base, "--out",
                 str(tmp)]) == 1
    assert "is a folder" in capsys.readouterr().err
    assert main(["merge", "--model", base, "--adapter", adir, "--out", str(tmp / "x.gguf"),
                 "--format", "hf"]) == 1
    assert "writes a folder" in capsys.readouterr().err
    other = tmp / "other"
    random_adapter(tiny_model(n_layers=3).config, b_scale=0.3).save(other)
    assert main(["merge", "--model", base, "--adapter", str(other), "--out",
                 str(tmp / "o")]) == 1
    assert "layer 2" in capsys.readouterr().err
    assert not (tmp / "o").exists()


# --- the real model -----------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_merged_hf_folder_and_gguf(smollm2, tmp_path):
    """SmolLM2 + a random rank-4 adapter on every linear: the merged Hugging Face folder
    in transformers (weights and tokenizer) and the merged float32 GGUF (tokenizer
    metadata copied from the base GGUF) give the unmerged logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ad = random_adapter(smollm2.config, rank=4, alpha=8.0, b_scale=0.02)
    text = "The capital of France is Paris, and"
    ids = smollm2.tokenizer.encode(text)
    ref = smollm2.logits(ids, adapter=ad)
    assert rel_err(smollm2.logits(ids), ref) > 100 * F32_REL

    merged = export.merged_model(smollm2, ad)
    folder = export.save_hf_folder(merged, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    err_hf = rel_err(theirs, ref)
    tk = AutoTokenizer.from_pretrained(str(folder))
    assert tk.encode(text) == ids
    msgs = [{"role": "user", "content": "Hi there"}]
    assert tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    del hf

    # the tokenizer metadata rebuilt from tokenizer.json (for a Hugging Face base) is
    # what the base GGUF holds, the pre-tokenizer's name aside (both mean GPT-2's regex)
    copied = {k: v for k, v, *_ in export._copied_tokenizer_fields(smollm2.source)}
    derived = {k: v for k, v, *_ in export._derived_tokenizer_fields(smollm2.tokenizer)}
    copied.pop("tokenizer.ggml.add_space_prefix")
    assert (copied.pop("tokenizer.ggml.pre"), derived.pop("tokenizer.ggml.pre")) == \
        ("smollm", "gpt2")
    assert derived == copied

    path = export.save_gguf(merged, tmp_path / "merged.gguf")
    back = llama.load(path)
    err_gguf = rel_err(back.logits(ids), ref)
    assert back.tokenizer.encode(text) == ids
    assert back.tokenizer.chat_template == smollm2.tokenizer.chat_template
    print(f"SmolLM2 merged vs unmerged, max |diff| / max |logit|: transformers on the HF "
          f"folder {err_hf:.2e}, gradtape on the GGUF {err_gguf:.2e}")
    assert err_hf < F32_REL and err_gguf < F32_REL


@pytest.mark.slow
@pytest.mark.skipif(not _have("llama_cpp"), reason="llama-cpp-python not installed "
                    "(make test does not install it: a 10-minute build)")
def test_llama_cpp_runs_the_exported_lora(smollm2, tmp_path):
    """llama.cpp on an F32 copy of the base (on the Q4_1 file its quantized arithmetic
    hides a wrong q/k layout), with and without the exported LoRA: its logits move the
    way ours do."""
    from llama_cpp import Llama as CppLlama

    ad = random_adapter(smollm2.config, rank=4, alpha=8.0, b_scale=0.02)
    ad.save(tmp_path / "adapter")
    base = export.save_gguf(smollm2, tmp_path / "base-f32.gguf")
    lora = export.save_gguf_lora(ad, smollm2.config, tmp_path / "lora.gguf")
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and")

    def cpp_logits(**kw):
        llm = CppLlama(model_path=str(base), n_ctx=64, logits_all=True, verbose=False,
                       n_threads=2, **kw)
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], np.float64)

    ours_base, ours_lora = smollm2.logits(ids), smollm2.logits(ids, adapter=ad)
    cpp_base, cpp_lora = cpp_logits(), cpp_logits(lora_path=str(lora))
    d_ours, d_cpp = ours_lora - ours_base, cpp_lora - cpp_base
    # llama.cpp's own F32 arithmetic (different summation order, its softmax) is close to
    # ours but not bitwise; a wrong layout would move the logits by O(1) of the change
    assert rel_err(cpp_base, ours_base) < 1e-2
    assert rel_err(d_cpp, d_ours) < 5e-2
    assert np.corrcoef(d_cpp.ravel(), d_ours.ravel())[0, 1] > 0.99
