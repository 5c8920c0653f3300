"""Interop: fold a LoRA adapter into its base model, and write models and adapters in
the formats other tools run (Hugging Face folders, GGUF models, llama.cpp LoRA GGUFs).

``merge(weights, adapter)`` is a pure function: it returns a new weights dict with
``w0 + scale * A @ B`` (our ``[in, out]`` orientation) for every adapted linear and
leaves its inputs untouched.  The writers translate our names and orientation at the
boundary: Hugging Face keeps ``[out, in]`` linears and half-split rope rows; GGUF keeps
``[out, in]`` in numpy order (``[in, out]`` in ggml's fastest-first order) with the rows
of ``attn_q``/``attn_k`` (and of LoRA ``lora_b`` for q/k) permuted into llama.cpp's
interleaved rope layout, the inverse of what ``load_gguf`` undoes.
Every file is written atomically (a temporary file, fsync, rename).  This module does not
run the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import numpy as np

from ..blocks import is_block_matrix
from ..errors import GradtapeError
from ..io import atomic_path, atomic_write_bytes
from .arch import ARCHS, HF_ACT, LINEARS
from .dora import fold_magnitude
from .load_gguf import permute_rope_rows

_DTYPES = {"float32": np.float32, "float16": np.float16, "f32": np.float32, "f16": np.float16}


def _np_dtype(dtype):
    try:
        return np.dtype(_DTYPES[dtype] if isinstance(dtype, str) else dtype)
    except (KeyError, TypeError):
        raise GradtapeError(f"dtype must be float32 or float16, got {dtype!r}") from None


# --- merge --------------------------------------------------------------------------------

def merge(weights: dict, adapter) -> dict:
    """A new weights dict with the adapter folded in: ``W = w0 + scale * A @ B`` (DoRA:
    each column then scaled to its magnitude) for each ``(layer, target)`` the adapter holds (``A [in, r]``, ``B [r, out]``, ``scale`` =
    alpha / r, or alpha / sqrt(r) for rsLoRA).  The sum is formed in float64 and rounded
    once to the weight's dtype.  Neither ``weights`` nor ``adapter`` is modified; tensors
    the adapter does not touch are shared with ``weights``, not copied."""
    out = dict(weights)
    for (layer, target), _ in sorted(adapter.weights.items()):
        name = f"layers.{layer}.{target}"
        if name not in weights:
            raise GradtapeError(f"merge: the adapter adapts {name}, which the model lacks "
                                "(adapter made for another base model?)")
        out[name] = merged_tensor(weights, adapter, name)
    return out


def dense(weights, name):
    """``weights[name]`` as a float array in our orientation; a block matrix (a weight kept
    in its stored type, ``[out, in]``) is dequantized to float32 here, one tensor."""
    w = weights[name]
    if not is_block_matrix(w):
        return w
    d = w.dequantize()
    return d.T if name.rsplit(".", 1)[-1] in LINEARS else d


def merged_tensor(weights, adapter, name):
    """``weights[name]`` with the adapter folded in when it adapts ``name`` (else as
    ``dense`` gives it): ``w0 + scale * A @ B`` (DoRA: times ``m / ||w0 + scale * A @ B||``
    per output column) formed in float64 and rounded once to
    float32 (the base's dtype, or float32 for a base kept in its stored type: merging
    back into quantized blocks is not done)."""
    w0 = dense(weights, name)
    key = None
    if name.startswith("layers."):
        _, i, target = name.split(".")
        key = (int(i), target)
    if adapter is None or key not in adapter.weights:
        return w0
    a, b = adapter.weights[key]
    want_a, want_b = (w0.shape[0], adapter.rank), (adapter.rank, w0.shape[1])
    if a.shape != want_a or b.shape != want_b:
        raise GradtapeError(f"merge: {name} [{w0.shape[0]}, {w0.shape[1]}]: adapter A "
                            f"{list(a.shape)} / B {list(b.shape)} do not fit (need A "
                            f"{list(want_a)}, B {list(want_b)})")
    w = np.asarray(a, np.float64) @ np.asarray(b, np.float64)  # [in, out]
    w *= float(adapter.scale)
    w += w0  # in place: one float64 temporary per tensor
    if key in adapter.magnitudes:  # DoRA: each column rescaled to its magnitude
        fold_magnitude(w, adapter.magnitudes[key])
    return w.astype(w0.dtype)


def merged_model(model, adapter):
    """A model of ``model``'s class (a ``Model`` record or the ``llama.Llama`` facade) with
    ``merge(model.weights, adapter)``; ``model`` is unchanged."""
    from .lora import check_adapter_fits

    check_adapter_fits(adapter, model.config, "adapter")
    return dataclasses.replace(model, weights=merge(model.weights, adapter))


# --- Hugging Face folder ------------------------------------------------------------------

def _hf_rope(cfg):
    """The global layers' rope parameters in transformers' spelling."""
    if cfg.rope_scaling:
        f, lo, hi, orig = cfg.rope_scaling
        return {"rope_type": "llama3", "rope_theta": cfg.rope_base, "factor": f,
                "low_freq_factor": lo, "high_freq_factor": hi,
                "original_max_position_embeddings": int(orig)}
    if cfg.rope_linear:
        return {"rope_type": "linear", "rope_theta": cfg.rope_base, "factor": cfg.rope_linear}
    if cfg.rope_factors:
        raise GradtapeError("hf_config: this model's rope frequency factors came without "
                            "their llama3 parameters (a GGUF rope_freqs tensor); a Hugging "
                            "Face config cannot describe them")
    return {"rope_type": "default", "rope_theta": cfg.rope_base}


def hf_config(cfg, dtype="float32") -> dict:
    """A transformers ``config.json`` of the model's family for ``cfg``, spelled as its
    row of ``models.arch`` says; rope settings in both the 4.x (``rope_theta`` /
    ``rope_scaling`` / ``rope_local_base_freq``) and 5.x (``rope_parameters``, per layer
    type where local layers differ) spellings."""
    arch = ARCHS[cfg.arch]
    rope = _hf_rope(cfg)
    act = HF_ACT[cfg.act]
    d = {
        "architectures": [arch.hf_class], "model_type": arch.hf_types[0],
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "rope_parameters": rope,
        "hidden_act": act, arch.act_key: act, "attention_dropout": 0.0,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": None,
        "use_cache": True, "torch_dtype": str(_np_dtype(dtype)), "dtype": str(_np_dtype(dtype)),
        "attn_logit_softcapping": cfg.attn_softcap or None,
        "final_logit_softcapping": cfg.final_softcap or None,
    }
    if rope["rope_type"] != "default":
        d["rope_scaling"] = rope
    if cfg.rope_local_base:
        d["rope_local_base_freq"] = cfg.rope_local_base
        d["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_base}}
    d.update({k: cfg.max_seq_len for k in arch.hf_ctx_keys})
    biases = set(cfg.biases)
    if arch.attention_bias:
        d["attention_bias"] = "o" in biases
    if arch.mlp_bias:
        d["mlp_bias"] = "down" in biases
    types = ["sliding_attention" if cfg.window(i) else "full_attention"
             for i in range(cfg.n_layers)]
    d["sliding_window"] = cfg.sliding_window or None
    if arch.hf_window == "qwen":
        d.update(use_sliding_window=bool(cfg.sliding_window), layer_types=types,
                 max_window_layers=cfg.n_layers)
    elif arch.hf_window == "pattern":
        d["layer_types"] = types
    if arch.query_scale:
        d["query_pre_attn_scalar"] = _int_if_whole(cfg.query_scale or cfg.head_dim)
    if arch.nope_step:
        d["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)]
    elif cfg.nope_layers:
        raise GradtapeError(f"hf_config: {cfg.arch} has no config key for layers without rope")
    return d


def _int_if_whole(x):
    return int(x) if float(x).is_integer() else x  # transformers types some fields int


def hf_plan(cfg, weights, dtype="float32", adapter=None) -> list:
    """``[(hf name, shape, make)]``: our weights under the family's Hugging Face names,
    linears ``[out, in]``; ``make()`` builds one tensor (dequantizing a block matrix,
    folding in ``adapter`` when given), so a writer holds one tensor at a time."""
    dt = _np_dtype(dtype)
    theirs = {ours: hf for hf, ours in ARCHS[cfg.arch].hf_block.items()}
    top = {"tok_embd": "model.embed_tokens.weight", "norm": "model.norm.weight",
           "lm_head": "lm_head.weight"}
    shapes = cfg.weight_shapes()

    def make(name, linear):
        x = merged_tensor(weights, adapter, name)
        return np.ascontiguousarray(x.T if linear else x, dtype=dt)

    out = []
    for name in weights:
        if name.startswith("layers."):
            _, i, ours = name.split(".", 2)
            hf = f"model.layers.{i}.{theirs[ours]}"
        else:
            ours, hf = name, top[name]
        linear = ours in LINEARS  # [out, in]
        shape = tuple(reversed(shapes[name])) if linear else tuple(shapes[name])
        out.append((hf, shape, functools.partial(make, name, linear)))
    return out


def write_safetensors(path, plan, dtype, metadata):
    """A safetensors file written one tensor at a time from ``plan`` (``[(name, shape,
    make)]``, every tensor of ``dtype``): the header is known from the shapes alone."""
    dt = np.dtype(dtype)
    code = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
            np.dtype(np.float64): "F64"}[dt]
    header, off = {"__metadata__": metadata}, 0
    for name, shape, _ in plan:
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, make in plan:
            arr = make()
            assert arr.shape == tuple(shape) and arr.dtype == dt, (name, arr.shape, shape)
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


def save_hf_folder(model, folder, dtype="float32", adapter=None) -> Path:
    """Write ``model`` (config, weights, tokenizer) as a Hugging Face folder that
    transformers' ``AutoModelForCausalLM.from_pretrained`` and ``llama.load`` read:
    ``config.json``, ``generation_config.json``, ``model.safetensors`` and, when the
    model has a tokenizers-backed tokenizer, ``tokenizer.json`` + ``tokenizer_config.json``
    (with the chat template).  ``adapter``: folded in tensor by tensor while writing
    (``merged_tensor``), so a base kept in its stored type is never expanded whole."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise GradtapeError(f"{folder}: exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if adapter is not None:
        from .lora import check_adapter_fits
        check_adapter_fits(adapter, cfg, "adapter")
    write_safetensors(folder / "model.safetensors", hf_plan(cfg, model.weights, dtype, adapter),
                       _np_dtype(dtype), {"format": "pt"})
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "hf_files"):
        for fname, text in tok.hf_files(model_max_length=cfg.max_seq_len).items():
            atomic_write_bytes(folder / fname, text.encode("utf-8"))
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_id), ("eos_token_id", _eos(model)))
           if v is not None}
    atomic_write_bytes(folder / "generation_config.json",
                       (json.dumps(gen, indent=2) + "\n").encode())
    # config.json last: a folder with a config.json is a model folder to our loader
    atomic_write_bytes(folder / "config.json",
                       (json.dumps(hf_config(cfg, dtype), indent=2) + "\n").encode())
    return folder


def _eos(model):
    tok = getattr(model, "tokenizer", None)
    eos = getattr(tok, "eos_id", None)
    return model.config.eos_id if eos is None else eos


# --- GGUF model ---------------------------------------------------------------------------

def gguf_plan(cfg, weights, dtype="float32", adapter=None) -> list:
    """``[(gguf name, numpy shape, dtype, make)]`` in llama.cpp's layout: linears ``[out,
    in]`` (ggml ``[in, out]``), with q/k rows (and biases) permuted into the interleaved
    rope order for the llama architecture; 1-d norms and biases stay float32 (as
    llama.cpp's converter keeps them); llama3 rope factors as ``rope_freqs``.  ``make()``
    builds one tensor (see ``hf_plan``)."""
    dt = _np_dtype(dtype)
    arch = ARCHS[cfg.arch]
    theirs = {ours: g for g, ours in arch.gguf_block.items()}
    top = {"tok_embd": "token_embd", "norm": "output_norm", "lm_head": "output"}
    shapes = cfg.weight_shapes()

    def make(name, base, linear, tdt):
        w = merged_tensor(weights, adapter, name)
        if linear:
            w = w.T  # [out, in]
        if cfg.norm_plus_one and (base == "norm" or base.endswith("_norm")):
            w = np.asarray(w, np.float32) + np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if arch.permute_qk and base in ("q", "k"):
            n = cfg.n_heads if base == "q" else cfg.n_kv_heads
            w = permute_rope_rows(np.asarray(w).reshape(w.shape[0], -1), n).reshape(w.shape)
        return np.ascontiguousarray(w, dtype=tdt)

    out = []
    for name in weights:
        if name.startswith("layers."):
            _, i, ours = name.split(".", 2)
            base, kind = (ours[:-5], "bias") if ours.endswith("_bias") else (ours, "weight")
            gname = f"blk.{i}.{theirs[base]}.{kind}"
        else:
            base, kind, gname = name, "weight", top[name] + ".weight"
        linear = base in LINEARS and kind == "weight"
        shape = tuple(reversed(shapes[name])) if linear else tuple(shapes[name])
        tdt = dt if len(shape) == 2 else np.dtype(np.float32)
        out.append((gname, shape, tdt, functools.partial(make, name, base, linear, tdt)))
    if cfg.rope_factors and not cfg.rope_linear:  # (linear scaling is a metadata key)
        factors = np.asarray(cfg.rope_factors, dtype=np.float32)
        out.append(("rope_freqs.weight", factors.shape, factors.dtype, lambda: factors))
    return out


def _hparams(cfg) -> dict:
    """``{key: value}`` of the model's hyper-parameters under the family's GGUF keys
    (without the ``{arch}.`` prefix), as llama.cpp's converter writes them."""
    hp = {"context_length": cfg.max_seq_len, "embedding_length": cfg.dim,
          "block_count": cfg.n_layers, "feed_forward_length": cfg.ffn_dim,
          "attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads,
          "rope.dimension_count": cfg.head_dim, "rope.freq_base": float(cfg.rope_base),
          "attention.layer_norm_rms_epsilon": float(cfg.norm_eps), "vocab_size": cfg.vocab_size}
    if cfg.head_dim * cfg.n_heads != cfg.dim:  # llama.cpp assumes dim / n_heads otherwise
        hp.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim})
    if cfg.sliding_window:
        hp["attention.sliding_window"] = cfg.sliding_window
    if cfg.attn_softcap:
        hp["attn_logit_softcapping"] = float(cfg.attn_softcap)
    if cfg.final_softcap:
        hp["final_logit_softcapping"] = float(cfg.final_softcap)
    if cfg.rope_linear:
        hp.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(cfg.rope_linear)})
    if cfg.rope_local_base:
        hp["rope.freq_base_swa"] = float(cfg.rope_local_base)
    return hp


def _check_gguf_can_describe(cfg, hparams, names):
    """llama.cpp's GGUF leaves some settings implicit per family (Gemma's local/global
    pattern and attention scale, SmolLM3's NoPE layers: ``models.arch``); read the
    metadata back as a loader would and refuse a model it would misread rather than
    write a file that runs wrongly."""
    from .config import from_gguf_metadata

    a = ARCHS[cfg.arch].gguf
    meta = {"general.architecture": a, **{f"{a}.{k}": v for k, v in hparams.items()}}
    back = from_gguf_metadata(meta, "save_gguf", cfg.vocab_size, cfg.tie_embeddings,
                              names=names, rope_factors=() if cfg.rope_linear else cfg.rope_factors)
    # (the vocabulary's ids come from the tokenizer keys; llama3's scaling parameters
    # reach the file as their per-frequency factors, the rope_freqs tensor; Mistral is
    # llama.cpp's llama, the same graph)
    ours = dataclasses.replace(cfg, bos_id=None, eos_id=None, rope_scaling=(), arch=back.arch)
    for f in dataclasses.fields(cfg):
        if getattr(back, f.name) != getattr(ours, f.name):
            raise GradtapeError(f"save_gguf: llama.cpp's {a} GGUF cannot describe this "
                                f"model's {f.name} = {getattr(ours, f.name)!r} (it would be "
                                f"read as {getattr(back, f.name)!r})")


def _copied_tokenizer_fields(source):
    """``[(key, value, type, sub_type)]`` of every ``tokenizer.*`` key of a GGUF file.

    Read with our numpy-backed header parser (``gguf.GGUFReader`` takes ~10 s on a 49k
    vocabulary); value types follow llama.cpp's convention for each python kind (token
    ids UINT32, token types INT32, scores FLOAT32, flags BOOL)."""
    from gguf import GGUFValueType as T

    from ..formats.gguf_reader import GGUFFile

    def kind(v):
        if isinstance(v, bool):
            return T.BOOL
        if isinstance(v, int):
            return T.UINT32 if 0 <= v < 2**32 else T.INT64
        if isinstance(v, float):
            return T.FLOAT32
        return T.STRING

    out = []
    for key, value in GGUFFile(Path(source)).meta.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            if not value:
                continue
            sub = kind(value[0])
            if sub == T.UINT32:
                sub = T.INT32  # token_type and other int arrays: llama.cpp reads int32
            out.append((key, value, T.ARRAY, sub))
        else:
            out.append((key, value, kind(value), None))
    return out


def _derived_tokenizer_fields(tok):
    """``tokenizer.ggml.*`` fields rebuilt from a byte-level BPE ``tokenizer.json`` (what
    llama.cpp's converter writes for a "gpt2" tokenizer), or ``None`` when the tokenizer
    is of a kind we cannot describe in GGUF."""
    from gguf import GGUFValueType as T

    from .tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    backend = getattr(tok, "backend", None)
    if backend is None:
        return None
    j = json.loads(backend.to_str())
    model = j.get("model") or {}
    if model.get("type") != "BPE" or j.get("normalizer"):
        return None
    pre = j.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        pre_name = "gpt2"
    elif pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        regex = (((parts[0] if parts else {}).get("pattern") or {}).get("Regex"))
        byte_level = len(parts) == 2 and parts[1].get("type") == "ByteLevel" \
            and not parts[1].get("use_regex", True)
        names = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
        if not byte_level or regex not in names:
            return None
        pre_name = names[regex]
    else:
        return None
    vocab = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in j.get("added_tokens") or []}
    for tid, t in added.items():
        vocab.setdefault(t["content"], tid)
    n = max(vocab.values()) + 1 if vocab else 0
    tokens = [f"[PAD{i}]" for i in range(n)]  # ids with no token, as llama.cpp pads
    types = [5] * n  # UNUSED
    for text, tid in vocab.items():
        tokens[tid] = text
        types[tid] = 1  # NORMAL
    for tid, t in added.items():
        types[tid] = 3 if t.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    fields = [("tokenizer.ggml.model", "gpt2", T.STRING, None),
              ("tokenizer.ggml.pre", pre_name, T.STRING, None),
              ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
              ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
              ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING)]
    ids = {"bos": tok.bos_id, "eos": tok.eos_id}
    for name, key in (("unk_token", "unknown"), ("pad_token", "padding")):
        text = tok.special_tokens.get(name)
        ids[key] = backend.token_to_id(text) if text else None
    for key, tid in ids.items():
        if tid is not None:
            fields.append((f"tokenizer.ggml.{key}_token_id", int(tid), T.UINT32, None))
    post = j.get("post_processor") or {}
    fields.append(("tokenizer.ggml.add_bos_token", post.get("type") == "TemplateProcessing"
                   and tok.bos_id is not None, T.BOOL, None))
    if tok.chat_template:
        fields.append(("tokenizer.chat_template", tok.chat_template, T.STRING, None))
    return fields


def save_gguf(model, path, dtype="float32", adapter=None) -> Path:
    """Write ``model`` as a GGUF of its family (float32 or float16 matrices) that
    ``llama.load``, transformers' GGUF loader and llama.cpp read.  The tokenizer metadata
    is copied from the base GGUF when the model came from one, else rebuilt from a
    byte-level BPE ``tokenizer.json``; a tokenizer that fits neither is left out (with a
    warning on stderr: the file then runs on token ids only).  ``adapter``: folded in
    tensor by tensor while writing (``merged_tensor``); tensors are written one at a
    time."""
    import gguf

    path = Path(path)
    dt = _np_dtype(dtype)
    cfg = model.config
    source = Path(getattr(model, "source", "") or "")
    if source.suffix.lower() == ".gguf" and source.is_file():
        tok_fields = _copied_tokenizer_fields(source)
    else:
        tok = getattr(model, "tokenizer", None)
        tok_fields = _derived_tokenizer_fields(tok) if tok is not None else None
        if tok is not None and tok_fields is None:
            print("gradtape: warning: this tokenizer cannot be described in GGUF metadata; "
                  f"{path.name} is written without one", file=sys.stderr)
    if adapter is not None:
        from .lora import check_adapter_fits
        check_adapter_fits(adapter, cfg, "adapter")
    plan = gguf_plan(cfg, model.weights, dt, adapter)
    hparams = _hparams(cfg)
    _check_gguf_can_describe(cfg, hparams, [name for name, *_ in plan])
    arch = ARCHS[cfg.arch].gguf
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(getattr(model, "name", "") or "gradtape-merged")
        for key, value in hparams.items():
            vtype = (gguf.GGUFValueType.STRING if isinstance(value, str) else
                     gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else
                     gguf.GGUFValueType.UINT32)
            w.add_key_value(f"{arch}.{key}", value, vtype)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if dt == np.float32
                        else gguf.LlamaFileType.MOSTLY_F16)
        for key, value, vtype, sub in tok_fields or []:
            w.add_key_value(key, value, vtype, sub_type=sub)
        for name, shape, tdt, _ in plan:
            w.add_tensor_info(name, shape, tdt, int(np.prod(shape, dtype=np.int64)) * tdt.itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, tdt, make in plan:  # one tensor in memory at a time
            w.write_tensor_data(make())
        w.close()
    return path


# --- llama.cpp LoRA GGUF ------------------------------------------------------------------

def lora_gguf_tensors(adapter, cfg, dtype="float32") -> dict:
    """``{gguf name: numpy array}`` of a llama.cpp LoRA: ``blk.N.<name>.weight.lora_a``
    ``[r, in]`` (= our ``A.T``) and ``.lora_b`` ``[out, r]`` (= our ``B.T``), with lora_b's
    rows of q/k permuted like the base tensor's, since ``W = w0 + s * lora_b @ lora_a``
    must permute the same way as ``w0``."""
    dt = _np_dtype(dtype)
    theirs = {ours: g for g, ours in ARCHS[cfg.arch].gguf_block.items()}
    out = {}
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        la, lb = np.asarray(a).T, np.asarray(b).T  # [r, in], [out, r]
        if ARCHS[cfg.arch].permute_qk and target == "q":
            lb = permute_rope_rows(lb, cfg.n_heads)
        elif ARCHS[cfg.arch].permute_qk and target == "k":
            lb = permute_rope_rows(lb, cfg.n_kv_heads)
        stem = f"blk.{layer}.{theirs[target]}.weight"
        out[stem + ".lora_a"] = np.ascontiguousarray(la, dtype=dt)
        out[stem + ".lora_b"] = np.ascontiguousarray(lb, dtype=dt)
    return out


def refuse_dora(adapter, where):
    """llama.cpp's LoRA GGUF holds A and B only: a DoRA adapter's magnitudes have no place
    there (one line naming ``merge``, which folds them in)."""
    if adapter.dora:
        raise GradtapeError(f"{where}: a DoRA adapter cannot be a llama.cpp LoRA GGUF (it "
                            "has no magnitude vectors); fold it into the model with "
                            "'gradtape merge' instead")


def save_gguf_lora(adapter, cfg, path, dtype="float32", name="") -> Path:
    """Write ``adapter`` (made for a model with config ``cfg``) as a llama.cpp LoRA GGUF:
    ``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``.  llama.cpp
    scales by alpha / r, so an rsLoRA adapter (scale alpha / sqrt(r)) is written with
    alpha = scale * r, which gives the same scale."""
    import gguf

    from .lora import check_adapter_fits

    check_adapter_fits(adapter, cfg, "adapter")
    refuse_dora(adapter, "adapter")
    path = Path(path)
    tensors = lora_gguf_tensors(adapter, cfg, dtype)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, ARCHS[cfg.arch].gguf)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.scale) * adapter.rank)
        if name:
            w.add_name(name)
        for tname, arr in tensors.items():
            w.add_tensor(tname, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path

