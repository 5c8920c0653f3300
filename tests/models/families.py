"""Small random models of each family, made with ``transformers``, for the family tests.

``make_folder(family, path)`` builds a small model of that family (two layers, or as many
as its layer pattern needs) from a config with its non-default options switched on
(llama3 rope scaling, q/k/v biases, q/k norm with an explicit head_dim, a sliding window
shorter than the test sequence, fused projections, Gemma 2's soft-capping and
alternating windows, Gemma 3's five local layers to one global with their own rope bases
and linear scaling, SmolLM3's layer without rope), randomises every weight (norms and
biases included, so none is a no-op), and saves it with a small tokenizer of the kind the
family's real models ship (a byte-level BPE with the family's pre-tokenizer split, or a
sentencepiece ``tokenizer.model`` with the tokenizer files transformers makes of it) and
its chat template, as a Hugging Face folder.
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

# Gemma 3's: no system role, a system message goes in front of the first user turn
_GEMMA3_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
                    "{% set first = messages[0]['content'] + '\n\n' %}"
                    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}"
                    "{% set turns = messages %}{% endif %}{% for m in turns %}<start_of_turn>"
                    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                    "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n"
                    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

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
                "spm-llama", ("<s>", "</s>", ["[INST]", "[/INST]"]), _MISTRAL_TEMPLATE),
    "phi3": ("Phi3Config", dict(_COMMON, sliding_window=6, rope_theta=10000.0,
                                tie_word_embeddings=False, pad_token_id=None),
             "spm-llama", ("<s>", "<|end|>", ["<|user|>", "<|assistant|>", "<|end|>"]),
             _PHI3_TEMPLATE),
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=4, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, rope_theta=10000.0,
                                    hidden_activation="gelu_pytorch_tanh",
                                    tie_word_embeddings=True, pad_token_id=None),
               "spm-gemma", ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
               _GEMMA_TEMPLATE),
    # six layers: five local (window 4, rope base 10k) and one global (base 1e6, linear
    # rope scaling), q/k norms, a query scale other than head_dim, final soft-capping
    "gemma3": ("Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, pad_token_id=None,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "spm-gemma", ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
        _GEMMA3_TEMPLATE),
    # four layers, the fourth without rope
    "smollm3": ("SmolLM3Config", dict(_COMMON, num_hidden_layers=4, rope_theta=5e4,
                                      tie_word_embeddings=True, pad_token_id=None),
                "llama-bpe", (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]), _CHATML),
}
# Options llama.cpp's GGUF cannot describe, changed in the folder its converter takes
# (llama.cpp's gemma2 scales attention by head_dim: it has no query_pre_attn_scalar)
GGUF_VARIANTS = {"gemma2": {"query_pre_attn_scalar": 16},
                 "gemma3": {"query_pre_attn_scalar": 16}}
GGUF_FAMILIES = list(FAMILIES)
# The families the C decode step runs (infer.block_decoder.supported), and the option their
# decode test models change: hidden 64 over 4 heads gives head_dim 16, the C kernels'
# row granule (the folders above have head_dim 12 where they do not set it)
C_DECODE_FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "phi3", "smollm3", "gemma2",
                     "gemma3")
C_DECODE_KW = {"hidden_size": 64}

_CORPUS = ["The quick brown fox jumps over the lazy dog.",
           "Fine-tuning small models with LoRA adapters: q, k, v, o, gate, up, down.",
           "Numbers 1234 and 56789, symbols {\"a\": 1}; punctuation?! Yes.",
           "def f(x):\n    return x * 2  # code\n\nUnicode: café, naïve, 東京."] * 4
TEXT = "The lazy fox writes {\"a\": 12} in code: café."


# The tokenizer suite: unicode, runs of spaces, tabs, newlines, digits, chat markers.
TEXT_SUITE = [TEXT, "Hello world", " leading space", "  two leading", "trailing  ",
              "a   b    c     d", "tabs\tand\t\tnewlines\n\nend\n", "x\n  y\n\t z",
              "digits 0 12 345 6789 3.14159", "東京 café naïve Ωmega ß 🙂 \u00a0nbsp",
              "[INST] Hi there [/INST] Hello</s>", "<|user|>\nHi<|end|>\n<|assistant|>\n",
              "<start_of_turn>user\nHi  there<end_of_turn>\n<start_of_turn>model\n", ""]


def family_vocab_size():
    return 512


def spm_kind(vocab):
    """The sentencepiece layout of a vocabulary kind (``spm-llama``: unk, bos, eos first and
    a dummy prefix space; ``spm-gemma``: pad, eos, bos, unk, no prefix, user-defined
    whitespace runs), or None for a byte-level BPE."""
    return vocab[4:] if vocab.startswith("spm-") else None


# Gemma's user-defined pieces: runs of spaces, always emitted whole
_SPM_USER_DEFINED = ("\u2581\u2581", "\u2581\u2581\u2581")


def train_sentencepiece(layout, control):
    """A sentencepiece BPE model (the bytes of a ``tokenizer.model``) trained on the test
    corpus: byte fallback, identity normalization, no whitespace removal, digits split,
    ``control`` as control pieces; the ids and spellings of the family's real vocabulary."""
    import io

    import sentencepiece as spm

    if layout == "llama":
        kw = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True)
    else:
        kw = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                  bos_piece="<bos>", add_dummy_prefix=False,
                  user_defined_symbols=list(_SPM_USER_DEFINED))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 8 + TEXT_SUITE), model_writer=buf,
        vocab_size=family_vocab_size() - 40, model_type="bpe", minloglevel=2,
        hard_vocab_limit=False, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        control_symbols=list(control), **kw)
    return buf.getvalue()


def _write_spm_tokenizer(path, layout, bos, eos, extra):
    """``tokenizer.model`` and the Hugging Face files transformers makes of it (its
    generic sentencepiece converter, which follows the model's own settings), with
    ``added_tokens_decoder`` listing the control and user-defined pieces as real folders
    do (llama.cpp's converter types them from it)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    (path / "tokenizer.model").write_bytes(train_sentencepiece(layout, extra))
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(path))
    # the BOS the real folders' tokenizer.json adds (and sentencepiece models expect)
    from tokenizers import Tokenizer, processors
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.piece_to_id(bos))])
    tk.save(str(path / "tokenizer.json"))
    added = {}
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or (layout == "gemma" and piece in _SPM_USER_DEFINED):
            added[str(i)] = {"content": piece, "special": bool(sp.is_control(i)),
                             "normalized": False, "lstrip": False, "rstrip": False,
                             "single_word": False}
    return sp, added


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


def make_folder(family, path, seed=0, kw_override=None):
    """Build, randomise and save a small model of ``family`` (its config options updated
    by ``kw_override``); returns the path."""
    import torch
    import transformers

    cls_name, kw, vocab_kind, (bos, eos, extra), template = FAMILIES[family]
    kw = {**kw, **(kw_override or {})}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = family_vocab_size()
    layout, added = spm_kind(vocab_kind), None
    if layout:
        sp, added = _write_spm_tokenizer(path, layout, bos, eos, extra)
        assert sp.get_piece_size() <= vocab
        ids = {"bos_token_id": sp.piece_to_id(bos), "eos_token_id": sp.piece_to_id(eos)}
    else:
        tk = _tokenizer(vocab_kind, bos, eos, extra)
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
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
    model.save_pretrained(str(path), safe_serialization=True)
    if layout:
        tc = json.loads((path / "tokenizer_config.json").read_text())
        tc["added_tokens_decoder"] = added
    else:
        tk.save(str(path / "tokenizer.json"))
        tc = {"tokenizer_class": "PreTrainedTokenizerFast"}
    tc.update({"chat_template": template, "eos_token": eos, "clean_up_tokenization_spaces": False,
               "model_max_length": kw["max_position_embeddings"]})
    if bos:
        tc["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
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



def spm_reference(sp, text):
    """Sentencepiece's own ids of ``text``, as a model's tokenizer gives them: BOS, then
    the text split at the control pieces written in it (each one id) and every stretch
    between them encoded by ``sp`` (with its dummy prefix where the model has one)."""
    import re

    control = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i)}
    pattern = "(" + "|".join(re.escape(t) for t in sorted(control, key=len, reverse=True)) + ")"
    out = [sp.bos_id()]
    for part in re.split(pattern, text):
        if part in control:
            out.append(control[part])
        elif part:
            out += sp.encode(part)
    return out
