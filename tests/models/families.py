"""Small random models of each family, made with ``transformers``, for the family tests.

``make_folder(family, path)`` builds a two-layer model of that family from a config with
its non-default options switched on (llama3 rope scaling, q/k/v biases, q/k norm with an
explicit head_dim, a sliding window shorter than the test sequence, fused projections,
Gemma 2's soft-capping and alternating windows), randomises every weight (norms and
biases included, so none is a no-op), and saves it with a small byte-level BPE tokenizer
(the family's pre-tokenizer split and chat template) as a Hugging Face folder.
``run_converters`` runs llama.cpp's own ``convert_hf_to_gguf.py`` / ``convert_lora_to_gguf.py``
on such folders in one subprocess, with the pre-tokenizer check pinned
(``convert_pinned.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 12  # the test sequence: longer than the sliding windows below

# family -> (transformers config class, config kwargs, pre-tokenizer kind, chat template)
_LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start_header_id|>assistant"
                    "<|end_header_id|>\n\n{% endif %}")
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_PHI3_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                     "[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}"
                     "{{ eos_token }}{% endif %}{% endfor %}")
_GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                   "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                   "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                   "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

_COMMON = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, initializer_range=0.1)

FAMILIES = {
    "llama3": ("LlamaConfig", dict(
        _COMMON, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "llama-bpe", ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>",
                                                         "<|end_header_id|>"]),
        _LLAMA3_TEMPLATE),
    "qwen2": ("Qwen2Config", dict(_COMMON, rope_theta=1e6, tie_word_embeddings=True),
              "qwen2", (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]), _CHATML),
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=16, rope_theta=1e6,
                                  tie_word_embeddings=False),
              "qwen2", (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]), _CHATML),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=5, rope_theta=1e6,
                                      tie_word_embeddings=False),
                "llama-bpe", ("<s>", "</s>", ["[INST]", "[/INST]"]), _MISTRAL_TEMPLATE),
    "phi3": ("Phi3Config", dict(_COMMON, sliding_window=6, rope_theta=10000.0,
                                tie_word_embeddings=False, pad_token_id=None),
             "llama-bpe", ("<s>", "<|end|>", ["<|user|>", "<|assistant|>", "<|endoftext|>"]),
             _PHI3_TEMPLATE),
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=4, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, rope_theta=10000.0,
                                    hidden_activation="gelu_pytorch_tanh",
                                    tie_word_embeddings=True, pad_token_id=None),
               "llama-bpe", ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
               _GEMMA_TEMPLATE),
}
# Gemma 2's GGUF converter reads only a sentencepiece tokenizer.model (which gradtape does
# not read from GGUF yet), and llama.cpp's gemma2 has no query_pre_attn_scalar (it uses
# head_dim): its GGUF test uses a variant folder (make_gemma2_spm_folder)
GGUF_FAMILIES = [f for f in FAMILIES if f != "gemma2"]

_CORPUS = ["The quick brown fox jumps over the lazy dog.",
           "Fine-tuning small models with LoRA adapters: q, k, v, o, gate, up, down.",
           "Numbers 1234 and 56789, symbols {\"a\": 1}; punctuation?! Yes.",
           "def f(x):\n    return x * 2  # code\n\nUnicode: café, naïve, 東京."] * 4
TEXT = "The lazy fox writes {\"a\": 12} in code: café."


def family_vocab_size():
    return 384


def _tokenizer(pre_kind, bos, eos, extra):
    """A byte-level BPE with the family's pre-tokenizer split, trained on a tiny corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from gradtape.models.tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    split = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[pre_kind]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    specials = [t for t in (bos, eos, *extra) if t]
    trainer = trainers.BpeTrainer(vocab_size=family_vocab_size() - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(_CORPUS, trainer)
    if bos:
        from tokenizers import processors
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tk.token_to_id(bos))])
    return tk


def make_folder(family, path, seed=0):
    """Build, randomise and save a small model of ``family``; returns the path."""
    import torch
    import transformers

    cls_name, kw, pre_kind, (bos, eos, extra), template = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tk = _tokenizer(pre_kind, bos, eos, extra)
    vocab = family_vocab_size()
    assert tk.get_vocab_size() <= vocab
    ids = {"bos_token_id": tk.token_to_id(bos) if bos else None,
           "eos_token_id": tk.token_to_id(eos)}
    cfg = getattr(transformers, cls_name)(vocab_size=vocab, **kw, **ids)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_((0.0 if family == "gemma2" else 1.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
    model.save_pretrained(str(path), safe_serialization=True)
    tk.save(str(path / "tokenizer.json"))
    # Phi-3's converter reads a sentencepiece tokenizer.model unless the class says GPT-2
    cls = "GPT2Tokenizer" if family == "phi3" else "PreTrainedTokenizerFast"
    tc = {"tokenizer_class": cls, "chat_template": template,
          "eos_token": eos, "clean_up_tokenization_spaces": False,
          "model_max_length": kw["max_position_embeddings"]}
    if bos:
        tc["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return path


def make_gemma2_spm_folder(path, seed=0):
    """The Gemma 2 test model as llama.cpp's converter can take it: the same options but
    query_pre_attn_scalar = head_dim (llama.cpp's rule), and a sentencepiece
    ``tokenizer.model`` trained on the test corpus instead of tokenizer.json."""
    import io

    import sentencepiece as spm
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kw = dict(FAMILIES["gemma2"][1], query_pre_attn_scalar=16)
    cfg = transformers.Gemma2Config(vocab_size=family_vocab_size(), bos_token_id=2,
                                    eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path), safe_serialization=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_CORPUS * 8), model_writer=buf,
                                   vocab_size=200, model_type="bpe", minloglevel=2,
                                   hard_vocab_limit=False)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    return path


# --- llama.cpp's converter ------------------------------------------------------------------

def converter_dir():
    """The folder holding llama.cpp's ``convert_hf_to_gguf.py`` (with ``conversion/`` and
    ``gguf-py/``): ``$GRADTAPE_LLAMA_CPP_CONVERT``, else ``.venv/llama.cpp-convert`` (where
    ``make test`` extracts it from the llama-cpp-python source package); None if absent."""
    for cand in (os.environ.get("GRADTAPE_LLAMA_CPP_CONVERT"),
                 REPO / ".venv" / "llama.cpp-convert"):
        if cand and (Path(cand) / "convert_hf_to_gguf.py").is_file():
            return Path(cand)
    return None


def run_converters(jobs, workdir):
    """Run llama.cpp's converters on ``jobs`` (``[script, pre_kind, *args]``, script
    ``convert_hf_to_gguf.py`` or ``convert_lora_to_gguf.py``), each with the pre-tokenizer
    pinned to ``pre_kind``, in one subprocess of this Python."""
    wrapper = Path(__file__).with_name("convert_pinned.py")
    spec = Path(workdir) / "convert_jobs.json"
    spec.write_text(json.dumps([[str(x) for x in job] for job in jobs]))
    r = subprocess.run([sys.executable, str(wrapper), str(converter_dir()), str(spec)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"llama.cpp's converter failed ({r.returncode}):\n{r.stderr[-3000:]}")


def model_job(folder, out, pre_kind):
    """A job: the float32 GGUF llama.cpp's converter makes of a model folder."""
    return ["convert_hf_to_gguf.py", pre_kind, folder, "--outfile", out, "--outtype", "f32"]


def lora_job(adapter_dir, base_folder, out, pre_kind):
    """A job: the float32 LoRA GGUF llama.cpp's converter makes of a PEFT adapter folder."""
    return ["convert_lora_to_gguf.py", pre_kind, "--base", base_folder, "--outfile", out,
            "--outtype", "f32", adapter_dir]


def rel(ours, ref):
    """max |ours - ref| / max |ref|: the error measure of every family test."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
