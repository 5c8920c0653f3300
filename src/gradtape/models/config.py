"""The model hyper-parameters, read from GGUF metadata or a Hugging Face config.json.

``LlamaConfig`` is a frozen dataclass: the numbers and switches the model graph needs
(sizes, rope, and the features the families of ``models.arch`` differ by) and nothing
else.  The readers here validate every value (positive sizes, heads that divide, rope
settings and options we implement) and raise ``FileFormatError`` naming the file and the
field or option; they do not read tensors (see ``load_gguf`` and ``load_hf``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import FileFormatError

# Sizes above these are not a real LLaMA; rejecting them early keeps a corrupt header
# from asking for terabytes.
_MAX_DIM = 1 << 17
_MAX_VOCAB = 1 << 22
_MAX_LAYERS = 1024


@dataclass(frozen=True)
class LlamaConfig:
    dim: int  # D: residual width
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    head_dim: int  # hd; q projects to n_heads*hd, k and v to n_kv_heads*hd
    ffn_dim: int  # F: SwiGLU hidden width
    vocab_size: int  # V
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # LM head = token embedding (no separate lm_head weight)
    max_seq_len: int = 2048
    bos_id: int | None = None
    eos_id: int | None = None
    # --- the features the families differ by (models.arch); defaults = SmolLM2's llama ---
    arch: str = "llama"  # the family's row in models.arch.ARCHS
    biases: tuple = ()  # linears with a bias (Qwen2: q, k, v), ours [out]
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3)
    fused: bool = False  # qkv and gate_up are single linears (Phi-3)
    rope_scaling: tuple = ()  # llama3: (factor, low_freq_factor, high_freq_factor, orig ctx)
    rope_factors: tuple = ()  # per-frequency divisors of the rope angles [hd/2] (llama3)
    sliding_window: int = 0  # > 0: windowed layers see only the last `sliding_window` keys
    sliding_layers: tuple = ()  # the windowed layers; () with a window = every layer
    act: str = "silu"  # gated MLP activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    embed_scale: bool = False  # token embeddings times sqrt(dim) (Gemma)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 2)
    attn_softcap: float = 0.0  # > 0: scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float = 0.0  # > 0: the same on the logits
    query_scale: float = 0.0  # > 0: scores scaled by query_scale**-0.5, not head_dim**-0.5

    def __post_init__(self):
        self.validate("config")

    def validate(self, where):
        for name, hi in (("dim", _MAX_DIM), ("n_layers", _MAX_LAYERS), ("n_heads", _MAX_DIM),
                         ("n_kv_heads", _MAX_DIM), ("head_dim", _MAX_DIM),
                         ("ffn_dim", 8 * _MAX_DIM), ("vocab_size", _MAX_VOCAB),
                         ("max_seq_len", 1 << 24)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= hi:
                raise FileFormatError(f"{where}: {name} = {v!r} is not an integer in [1, {hi}]")
        if self.n_heads % self.n_kv_heads:
            raise FileFormatError(f"{where}: n_heads = {self.n_heads} is not a multiple of "
                                  f"n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise FileFormatError(f"{where}: head_dim = {self.head_dim} must be even for rope")
        if not (self.rope_base > 1.0):
            raise FileFormatError(f"{where}: rope base {self.rope_base!r} must be > 1")
        if not (0.0 < self.norm_eps < 1.0):
            raise FileFormatError(f"{where}: rms norm eps {self.norm_eps!r} must be in (0, 1)")
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise FileFormatError(f"{where}: {name} = {v} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        from .arch import ARCHS, LINEARS
        if self.arch not in ARCHS:
            raise FileFormatError(f"{where}: unknown architecture {self.arch!r}")
        bad = [b for b in self.biases if b not in LINEARS]
        if bad:
            raise FileFormatError(f"{where}: bias on unknown linear {bad[0]!r}")
        if self.act not in ("silu", "gelu_tanh"):
            raise FileFormatError(f"{where}: activation {self.act!r} is not supported")
        if self.rope_factors and (len(self.rope_factors) != self.head_dim // 2 or not all(
                math.isfinite(f) and f > 0 for f in self.rope_factors)):
            raise FileFormatError(f"{where}: rope frequency factors must be {self.head_dim // 2}"
                                  " positive numbers")
        if not isinstance(self.sliding_window, int) or not 0 <= self.sliding_window <= 1 << 24:
            raise FileFormatError(f"{where}: sliding_window {self.sliding_window!r} invalid")
        if any(not 0 <= i < self.n_layers for i in self.sliding_layers):
            raise FileFormatError(f"{where}: sliding-window layers {list(self.sliding_layers)}"
                                  f" outside the {self.n_layers} layers")
        for name in ("attn_softcap", "final_softcap", "query_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise FileFormatError(f"{where}: {name} = {v!r} must be a number >= 0")

    def window(self, layer) -> int:
        """The sliding window of ``layer`` (0: full causal attention)."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if not self.sliding_layers or layer in self.sliding_layers \
            else 0

    @property
    def attn_iscale(self) -> float:
        """The factor on the attention scores: 1/sqrt(head_dim), or 1/sqrt(query_scale)."""
        return 1.0 / math.sqrt(self.query_scale or self.head_dim)

    # --- expected weight shapes, in OUR names and orientation ([in, out]) ---------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        D, F, V, hd = self.dim, self.ffn_dim, self.vocab_size, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        shapes = {"tok_embd": (V, D), "norm": (D,)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            lin = {"o": (q, D), "down": (F, D)}
            if self.fused:
                lin.update({"qkv": (D, q + 2 * kv), "gate_up": (D, 2 * F)})
            else:
                lin.update({"q": (D, q), "k": (D, kv), "v": (D, kv), "gate": (D, F),
                            "up": (D, F)})
            for name, shape in lin.items():
                shapes[p + name] = shape
            for name in self.biases:
                shapes[p + name + "_bias"] = (lin[name][1],)
            shapes.update({p + "attn_norm": (D,), p + "ffn_norm": (D,)})
            if self.qk_norm:
                shapes.update({p + "q_norm": (hd,), p + "k_norm": (hd,)})
            if self.post_norms:
                shapes.update({p + "post_attn_norm": (D,), p + "post_ffn_norm": (D,)})
        if not self.tie_embeddings:
            shapes["lm_head"] = (V, D)
        return shapes


def llama3_rope_factors(head_dim, base, factor, low, high, orig) -> tuple:
    """Llama 3.1's rope scaling as per-frequency divisors of the angle ``p * base**(-2j/hd)``:
    wavelengths ``2 pi / f`` shorter than ``orig / high`` keep their frequency, longer than
    ``orig / low`` are divided by ``factor``, and those between are interpolated with
    ``s = (orig / wavelength - low) / (high - low)``: ``f' = (1 - s) f / factor + s f``,
    i.e. a divisor ``1 / ((1 - s) / factor + s)`` (transformers' ``_compute_llama3_parameters``,
    llama.cpp's ``rope_freqs``).  In float64."""
    out = []
    for j in range(head_dim // 2):
        freq = float(base) ** (-2.0 * j / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(float(factor))
        else:
            s = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - s) / factor + s))
    return tuple(out)


def _int(v, where, key):
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numpy as np
            if isinstance(v, np.integer):
                return int(v)
        except ImportError:  # pragma: no cover
            pass
        raise FileFormatError(f"{where}: {key} = {v!r} is not an integer")
    return v


def _float(v, where, key):
    try:
        return float(v)
    except (TypeError, ValueError):
        raise FileFormatError(f"{where}: {key} = {v!r} is not a number") from None


def from_gguf_metadata(meta: dict, where: str, vocab_size: int, tied: bool,
                       names=(), rope_factors=()) -> LlamaConfig:
    """``meta``: GGUF key -> python value.  ``vocab_size`` from the token list or the
    embedding tensor; ``tied``: whether the file lacks an ``output.weight`` tensor;
    ``names``: the file's tensor names (biases and q/k norms are known by their tensors);
    ``rope_factors``: the values of a ``rope_freqs`` tensor (llama3 rope scaling)."""
    from .arch import gguf_arch

    arch = gguf_arch(meta.get("general.architecture"), where)
    a = arch.gguf

    def need_raw(key):
        if f"{a}.{key}" not in meta:
            raise FileFormatError(f"{where}: missing GGUF metadata key '{a}.{key}'")
        return meta[f"{a}.{key}"]

    def need(key):
        return _int(need_raw(key), where, f"{a}.{key}")

    def opt(key, default, conv=_int):
        return conv(meta.get(f"{a}.{key}", default), where, f"{a}.{key}")

    for key in ("expert_count", "vision.block_count"):
        if meta.get(f"{a}.{key}"):
            raise FileFormatError(f"{where}: {a}.{key} = {meta[f'{a}.{key}']}: mixture-of-"
                                  "experts and vision models are not supported")
    dim = need("embedding_length")
    n_heads = need("attention.head_count")
    n_kv = opt("attention.head_count_kv", n_heads)
    if n_heads <= 0 or dim <= 0:
        raise FileFormatError(f"{where}: embedding_length {dim} / head_count {n_heads} invalid")
    head_dim = opt("attention.key_length", dim // n_heads)
    v_len = opt("attention.value_length", head_dim)
    if v_len != head_dim:
        raise FileFormatError(f"{where}: value_length {v_len} != key_length {head_dim} "
                              "is not supported")
    rope_dims = opt("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise FileFormatError(f"{where}: partial rope (rope.dimension_count {rope_dims} != "
                              f"head_dim {head_dim}) is not supported")
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", None, ""):
        raise FileFormatError(f"{where}: rope scaling {scaling!r} is not supported")
    layer_names = {n.split(".", 2)[2] for n in names if n.startswith("blk.0.")}
    biases = tuple(ours for g, ours in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"),
                                        ("attn_output", "o"), ("attn_qkv", "qkv"))
                   if g + ".bias" in layer_names)
    extra = {}
    window = opt("attention.sliding_window", 0)
    if arch.gemma:
        # Gemma 2 alternates local (sliding) and global layers, local first (llama.cpp's
        # and transformers' pattern); soft-capping and the query scale from the metadata
        extra = dict(act="gelu_tanh", norm_plus_one=True, embed_scale=True, post_norms=True,
                     attn_softcap=opt("attn_logit_softcapping", 0.0, _float),
                     final_softcap=opt("final_logit_softcapping", 0.0, _float),
                     query_scale=float(head_dim))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    n_layers = need("block_count")
    return _checked(LlamaConfig, where,
                    dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=head_dim, ffn_dim=need("feed_forward_length"),
                    vocab_size=vocab_size,
                    rope_base=opt("rope.freq_base", 10000.0, _float),
                    norm_eps=_float(need_raw("attention.layer_norm_rms_epsilon"), where,
                                    f"{a}.attention.layer_norm_rms_epsilon"),
                    tie_embeddings=tied,
                    max_seq_len=opt("context_length", 2048),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"),
                    arch=arch.family, biases=biases,
                    qk_norm="attn_q_norm.weight" in layer_names, fused=arch.fused,
                    rope_factors=tuple(float(f) for f in rope_factors),
                    sliding_window=window,
                    sliding_layers=tuple(range(0, n_layers, 2)) if arch.gemma and window else (),
                    **extra)


def _rope_settings(cj, where, head_dim):
    """``(theta, rope_scaling, rope_factors)`` from transformers 5's ``rope_parameters``
    or 4.x's ``rope_theta`` / ``rope_scaling``; anything but default and llama3 refused."""
    rp = cj.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise FileFormatError(f"{where}: rope_parameters is not an object")
    if "full_attention" in rp:  # per-layer-type rope settings (Gemma 3 style)
        raise FileFormatError(f"{where}: per-layer-type rope parameters are not supported")
    rs = cj.get("rope_scaling") or {}
    if not isinstance(rs, dict):
        raise FileFormatError(f"{where}: rope_scaling is not an object")
    merged = {**rs, **rp}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    theta = _float(merged.get("rope_theta", cj.get("rope_theta", 10000.0)), where, "rope_theta")
    partial = merged.get("partial_rotary_factor", cj.get("partial_rotary_factor", 1.0))
    if _float(partial, where, "partial_rotary_factor") != 1.0:
        raise FileFormatError(f"{where}: partial_rotary_factor {partial} (partial rope) is "
                              "not supported")
    if rope_type == "default":
        return theta, (), ()
    if rope_type != "llama3":
        raise FileFormatError(f"{where}: rope scaling {rope_type!r} is not supported (only "
                              "the default and 'llama3')")
    try:
        sc = (float(merged["factor"]), float(merged["low_freq_factor"]),
              float(merged["high_freq_factor"]), float(merged["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise FileFormatError(f"{where}: llama3 rope scaling needs factor, low_freq_factor, "
                              f"high_freq_factor and original_max_position_embeddings ({e})") \
            from None
    if not (all(math.isfinite(v) and v > 0 for v in sc) and sc[2] > sc[1]):
        raise FileFormatError(f"{where}: llama3 rope scaling {sc} invalid")
    return theta, sc, llama3_rope_factors(head_dim, theta, *sc)


def from_hf_config(cj: dict, where: str) -> LlamaConfig:
    """A Hugging Face ``config.json`` (transformers 4.x or 5.x spelling) of a family in
    ``models.arch.ARCHS``; options we do not implement are refused by name."""
    from .arch import BY_HF_TYPE, supported

    mt = cj.get("model_type")
    archs = cj.get("architectures") or []
    arch = BY_HF_TYPE.get(mt) if isinstance(mt, str) else None
    if arch is None:
        raise FileFormatError(f"{where}: model_type {mt!r} (architectures {archs}) is not "
                              f"supported (supported: {supported()})")

    def need(key):
        if key not in cj:
            raise FileFormatError(f"{where}: missing key {key!r}")
        return cj[key]

    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cj.get(key):
            raise FileFormatError(f"{where}: {key} = {cj[key]}: mixture-of-experts blocks "
                                  "are not supported")
    for key in ("vision_config", "audio_config", "text_config"):
        if cj.get(key):
            raise FileFormatError(f"{where}: {key}: multimodal models (a vision or audio "
                                  "tower) are not supported")
    act = cj.get("hidden_activation") if arch.gemma else cj.get("hidden_act", "silu")
    want_act = "gelu_pytorch_tanh" if arch.gemma else "silu"
    if act is None and arch.gemma:
        act = cj.get("hidden_act")
    if act != want_act:
        raise FileFormatError(f"{where}: hidden activation {act!r} is not supported for "
                              f"{mt} (only {want_act!r})")
    biases = ("q", "k", "v") if arch.qkv_bias else ()
    if cj.get("attention_bias"):
        if arch.family in ("mistral", "phi3", "qwen2"):
            raise FileFormatError(f"{where}: attention_bias = true is not supported for {mt}")
        biases = ("q", "k", "v", "o")
    if cj.get("mlp_bias"):
        if arch.family != "llama":
            raise FileFormatError(f"{where}: mlp_bias = true is not supported for {mt}")
        biases += ("gate", "up", "down")
    dim = _int(need("hidden_size"), where, "hidden_size")
    n_heads = _int(need("num_attention_heads"), where, "num_attention_heads")
    if n_heads <= 0:
        raise FileFormatError(f"{where}: num_attention_heads {n_heads} invalid")
    head_dim = _int(cj.get("head_dim") or dim // n_heads, where, "head_dim")
    theta, scaling, factors = _rope_settings(cj, where, head_dim)
    n_layers = _int(need("num_hidden_layers"), where, "num_hidden_layers")
    window = cj.get("sliding_window")
    window = 0 if window is None else _int(window, where, "sliding_window")
    types = cj.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise FileFormatError(f"{where}: layer_types must list {n_layers} layer kinds")
        odd = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if odd:
            raise FileFormatError(f"{where}: layer type {odd[0]!r} is not supported")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if sliding and not window:
            raise FileFormatError(f"{where}: layer_types has sliding layers but no "
                                  "sliding_window")
        if not sliding:
            window = 0
    elif arch.family in ("qwen2", "qwen3"):
        # transformers 4.x: a window only with use_sliding_window, from max_window_layers up
        start = _int(cj.get("max_window_layers", n_layers), where, "max_window_layers")
        sliding = tuple(range(start, n_layers)) if cj.get("use_sliding_window") else ()
        if not sliding:
            window = 0
    elif arch.gemma:
        sliding = tuple(range(0, n_layers, 2))  # local layers first, then alternating
    else:
        sliding = ()  # mistral, phi3: the window (if any) on every layer
    if window and sliding == tuple(range(n_layers)):
        sliding = ()
    extra = {}
    if arch.gemma:
        extra = dict(act="gelu_tanh", norm_plus_one=True, embed_scale=True, post_norms=True,
                     attn_softcap=_float(cj.get("attn_logit_softcapping") or 0.0, where,
                                         "attn_logit_softcapping"),
                     final_softcap=_float(cj.get("final_logit_softcapping") or 0.0, where,
                                          "final_logit_softcapping"),
                     query_scale=_float(cj.get("query_pre_attn_scalar", head_dim), where,
                                        "query_pre_attn_scalar"))
    bos, eos = cj.get("bos_token_id"), cj.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    tie_default = arch.gemma  # Gemma ties unless told otherwise; the others untie
    return _checked(LlamaConfig, where,
                    dim=dim, n_layers=n_layers, n_heads=n_heads,
                    n_kv_heads=_int(cj.get("num_key_value_heads") or n_heads, where,
                                    "num_key_value_heads"),
                    head_dim=head_dim,
                    ffn_dim=_int(need("intermediate_size"), where, "intermediate_size"),
                    vocab_size=_int(need("vocab_size"), where, "vocab_size"),
                    rope_base=theta,
                    norm_eps=_float(cj.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
                    tie_embeddings=bool(cj.get("tie_word_embeddings", tie_default)),
                    max_seq_len=_int(cj.get("max_position_embeddings", 2048), where,
                                     "max_position_embeddings"),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"),
                    arch=arch.family, biases=biases, qk_norm=arch.qk_norm, fused=arch.fused,
                    rope_scaling=scaling, rope_factors=factors, sliding_window=window,
                    sliding_layers=sliding, **extra)


def _checked(cls, where, **kw):
    try:
        return cls(**kw)
    except FileFormatError as e:
        raise FileFormatError(str(e).replace("config:", f"{where}:", 1)) from None
