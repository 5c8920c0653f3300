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
from .arch import ARCHS, BY_HF_TYPE, HF_ACT, LINEARS, gguf_arch, layers_where, supported

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
    rope_factors: tuple = ()  # per-frequency divisors of the rope angles [hd/2] (llama3, linear)
    rope_linear: float = 0.0  # > 0: linear rope scaling, every angle divided by it
    rope_local_base: float = 0.0  # > 0: the windowed layers' rope base, unscaled (Gemma 3)
    nope_layers: tuple = ()  # layers without rope (SmolLM3)
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
        if self.rope_local_base and not (self.rope_local_base > 1.0):
            raise FileFormatError(f"{where}: local rope base {self.rope_local_base!r} must be > 1")
        if any(not 0 <= i < self.n_layers for i in self.nope_layers):
            raise FileFormatError(f"{where}: no-rope layers {list(self.nope_layers)} outside "
                                  f"the {self.n_layers} layers")
        if not (0.0 < self.norm_eps < 1.0):
            raise FileFormatError(f"{where}: rms norm eps {self.norm_eps!r} must be in (0, 1)")
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise FileFormatError(f"{where}: {name} = {v} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
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
        for name in ("attn_softcap", "final_softcap", "query_scale", "rope_linear"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise FileFormatError(f"{where}: {name} = {v!r} must be a number >= 0")

    def window(self, layer) -> int:
        """The sliding window of ``layer`` (0: full causal attention)."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if not self.sliding_layers or layer in self.sliding_layers \
            else 0

    def rope_for(self, layer):
        """``(base, factors)`` of ``layer``'s rope (``factors``: per-frequency divisors or
        ``None``), or ``None`` for a layer without rope."""
        if layer in self.nope_layers:
            return None
        if self.rope_local_base and self.window(layer):
            return self.rope_local_base, None
        return self.rope_base, self.rope_factors or None

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


def _layer_count(v, where, key):
    """A layer count checked before anything is built per layer (a file may say 2^31)."""
    n = _int(v, where, key)
    if not 0 < n <= _MAX_LAYERS:
        raise FileFormatError(f"{where}: {key} = {n} is not an integer in [1, {_MAX_LAYERS}]")
    return n


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


def _layer_features(n_layers, window, sliding, local_base, rope_base, scaled, nope_layers):
    """The per-layer settings both readers end with, in one canonical form (so a model
    read from its folder and from its GGUF compare equal): a window on every layer is
    ``sliding_layers = ()``, a window on no layer is no window, and a local rope base
    only where there are windowed layers and it differs from the global rope (its base,
    or the global layers' scaling)."""
    if not window or not sliding:
        window, sliding = 0, ()
    if sliding == tuple(range(n_layers)):
        sliding = ()
    keep = window and local_base and (local_base != rope_base or scaled)
    return dict(sliding_window=window, sliding_layers=sliding,
                rope_local_base=float(local_base) if keep else 0.0, nope_layers=tuple(nope_layers))


def _pattern_layers(n_layers, pattern):
    """The local layers of a local/global pattern: every layer but every
    ``pattern``-th (``(i + 1) % pattern == 0`` are global); ``pattern`` 0: all local."""
    glob = set(layers_where(n_layers, pattern))
    return tuple(i for i in range(n_layers) if i not in glob)


def from_gguf_metadata(meta: dict, where: str, vocab_size: int, tied: bool,
                       names=(), rope_factors=()) -> LlamaConfig:
    """``meta``: GGUF key -> python value.  ``vocab_size`` from the token list or the
    embedding tensor; ``tied``: whether the file lacks an ``output.weight`` tensor;
    ``names``: the file's tensor names (biases and q/k norms are known by their tensors);
    ``rope_factors``: the values of a ``rope_freqs`` tensor (llama3 rope scaling).  What
    llama.cpp leaves implicit for a family (Gemma's local/global pattern and attention
    scale, SmolLM3's NoPE step) comes from its row of ``models.arch``."""
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
    n_layers = _layer_count(need("block_count"), where, "block_count")
    rope = {}
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = opt("rope.scaling.factor", 1.0, _float)
        if factor != 1.0:
            rope = _linear_rope(factor, head_dim, where)
    elif scaling not in ("none", None, ""):
        raise FileFormatError(f"{where}: rope scaling {scaling!r} is not supported")
    if len(rope_factors):
        rope = dict(rope_factors=tuple(float(f) for f in rope_factors))
    layer_names = {n.split(".", 2)[2] for n in names if n.startswith("blk.0.")}
    biases = tuple(ours for g, ours in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"),
                                        ("attn_output", "o"), ("attn_qkv", "qkv"))
                   if g + ".bias" in layer_names)
    window = opt("attention.sliding_window", 0)
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", arch.swa_pattern)
    if isinstance(pattern, list):  # one flag per layer: true = windowed
        if len(pattern) != n_layers:
            raise FileFormatError(f"{where}: {a}.attention.sliding_window_pattern lists "
                                  f"{len(pattern)} layers, not {n_layers}")
        sliding = tuple(i for i, f in enumerate(pattern) if f)
    else:
        sliding = _pattern_layers(n_layers, _int(pattern, where, "sliding_window_pattern"))
    local = opt("rope.freq_base_swa", arch.rope_local_base or 0.0, _float)
    rope_base = opt("rope.freq_base", 10000.0, _float)
    extra = dict(arch.features)
    if arch.query_scale:  # llama.cpp's rule: head_dim, or D / n_heads (Gemma 3 27B)
        extra["query_scale"] = float(dim / n_heads if n_layers in arch.gguf_dim_scale_layers
                                     else head_dim)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    extra.update(qk_norm="attn_q_norm.weight" in layer_names)
    return _checked(LlamaConfig, where,
                    dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=head_dim, ffn_dim=need("feed_forward_length"),
                    vocab_size=vocab_size,
                    rope_base=rope_base,
                    norm_eps=_float(need_raw("attention.layer_norm_rms_epsilon"), where,
                                    f"{a}.attention.layer_norm_rms_epsilon"),
                    tie_embeddings=tied,
                    max_seq_len=opt("context_length", 2048),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"),
                    arch=arch.family, biases=biases,
                    attn_softcap=opt("attn_logit_softcapping", 0.0, _float),
                    final_softcap=opt("final_logit_softcapping", 0.0, _float),
                    **rope, **extra,
                    **_layer_features(n_layers, window, sliding, local, rope_base, bool(rope),
                                      layers_where(n_layers, arch.nope_step)))


def _linear_rope(factor, head_dim, where):
    if not (math.isfinite(factor) and factor > 0):
        raise FileFormatError(f"{where}: linear rope scaling factor {factor!r} invalid")
    return dict(rope_linear=float(factor), rope_factors=(float(factor),) * (head_dim // 2))


def _rope_type(params, where):
    """``(theta or None, {rope fields})`` of one set of rope parameters (transformers'
    ``rope_parameters`` / ``rope_scaling`` spelling): the default, llama3 or linear."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta")
    theta = None if theta is None else _float(theta, where, "rope_theta")
    if rope_type == "default":
        return theta, {}
    if rope_type == "linear":
        factor = _float(params.get("factor"), where, "factor")
        return theta, ({"rope_linear": factor} if factor != 1.0 else {})
    if rope_type != "llama3":
        raise FileFormatError(f"{where}: rope scaling {rope_type!r} is not supported (only "
                              "the default, 'linear' and 'llama3')")
    try:
        sc = (float(params["factor"]), float(params["low_freq_factor"]),
              float(params["high_freq_factor"]), float(params["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise FileFormatError(f"{where}: llama3 rope scaling needs factor, low_freq_factor, "
                              f"high_freq_factor and original_max_position_embeddings ({e})") \
            from None
    if not (all(math.isfinite(v) and v > 0 for v in sc) and sc[2] > sc[1]):
        raise FileFormatError(f"{where}: llama3 rope scaling {sc} invalid")
    return theta, dict(rope_scaling=sc)


def _rope_settings(cj, where, head_dim, arch):
    """The rope fields of ``LlamaConfig`` from transformers 5's ``rope_parameters`` (one
    set, or one per layer type) or 4.x's ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq``; anything but default, linear and llama3 refused, and
    local layers only with default rope."""
    rp = cj.get("rope_parameters") or {}
    rs = cj.get("rope_scaling") or {}
    if not isinstance(rp, dict) or not isinstance(rs, dict):
        raise FileFormatError(f"{where}: rope_parameters / rope_scaling is not an object")
    partial = rp.get("partial_rotary_factor", cj.get("partial_rotary_factor", 1.0))
    if _float(partial, where, "partial_rotary_factor") != 1.0:
        raise FileFormatError(f"{where}: partial_rotary_factor {partial} (partial rope) is "
                              "not supported")
    local_theta = cj.get("rope_local_base_freq")
    if "full_attention" in rp or "sliding_attention" in rp:  # per layer type
        glob, loc = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        if not isinstance(glob, dict) or not isinstance(loc, dict):
            raise FileFormatError(f"{where}: rope_parameters per layer type are not objects")
        theta, fields = _rope_type({**rs, **glob}, where)
        ltheta, lfields = _rope_type(loc, where)
        if lfields:
            raise FileFormatError(f"{where}: rope scaling on the sliding-window layers is "
                                  "not supported")
        local_theta = ltheta if ltheta is not None else local_theta
    else:
        theta, fields = _rope_type({**rs, **rp}, where)
    if theta is None:
        theta = _float(cj.get("rope_theta", 10000.0), where, "rope_theta")
    if local_theta is None:
        local_theta = arch.rope_local_base or theta
    local_theta = _float(local_theta, where, "rope_local_base_freq")
    if "rope_scaling" in fields:
        fields["rope_factors"] = llama3_rope_factors(head_dim, theta, *fields["rope_scaling"])
    elif "rope_linear" in fields:
        fields = _linear_rope(fields["rope_linear"], head_dim, where)
    return dict(rope_base=theta, **fields), local_theta


def _windows(cj, where, arch, n_layers):
    """``(sliding_window, sliding_layers)`` from config.json, spelled as the family does
    (``arch.hf_window``)."""
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
    elif arch.hf_window == "qwen":  # transformers 4.x: from max_window_layers up
        start = _int(cj.get("max_window_layers", n_layers), where, "max_window_layers")
        sliding = tuple(range(start, n_layers))
    elif arch.hf_window == "pattern":
        pattern = _int(cj.get("sliding_window_pattern", arch.swa_pattern), where,
                       "sliding_window_pattern")
        sliding = _pattern_layers(n_layers, pattern)
    else:
        sliding = tuple(range(n_layers))  # mistral, phi3: the window on every layer
    if arch.hf_window == "qwen" and not cj.get("use_sliding_window"):
        return 0, ()  # (transformers drops the window then, whatever layer_types say)
    return (window, sliding) if sliding else (0, ())


def from_hf_config(cj: dict, where: str) -> LlamaConfig:
    """A Hugging Face ``config.json`` (transformers 4.x or 5.x spelling) of a family in
    ``models.arch.ARCHS`` (of a multimodal checkpoint, its text tower where the family
    has one); options we do not implement are refused by name."""
    mt = cj.get("model_type")
    archs = cj.get("architectures") or []
    arch = BY_HF_TYPE.get(mt) if isinstance(mt, str) else None
    if arch is None:
        raise FileFormatError(f"{where}: model_type {mt!r} (architectures {archs}) is not "
                              f"supported (supported: {supported()})")
    text = cj.get("text_config")
    if arch.text_prefixes and isinstance(text, dict):
        # the language model of a checkpoint with a vision tower: its text_config (the
        # token ids and the tying may be kept at the top level)
        cj = {**{k: cj[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
                 if k in cj}, **text}
        if cj.get("final_logit_softcapping"):
            raise FileFormatError(f"{where}: final_logit_softcapping in the text_config of a "
                                  "multimodal checkpoint is not supported (transformers' "
                                  "multimodal model does not apply it; its text model does)")

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
    if cj.get("use_bidirectional_attention"):
        raise FileFormatError(f"{where}: use_bidirectional_attention (an embedding model) is "
                              "not supported")
    features = dict(arch.features)
    want_act = HF_ACT[features.get("act", "silu")]
    act = cj.get(arch.act_key, cj.get("hidden_act", "silu"))
    if act != want_act:
        raise FileFormatError(f"{where}: hidden activation {act!r} is not supported for "
                              f"{mt} (only {want_act!r})")
    biases = ("q", "k", "v") if arch.qkv_bias else ()
    for key, allowed, names in (("attention_bias", arch.attention_bias, ("q", "k", "v", "o")),
                                ("mlp_bias", arch.mlp_bias, ("gate", "up", "down"))):
        if cj.get(key):
            if not allowed:
                raise FileFormatError(f"{where}: {key} = true is not supported for {mt}")
            biases += names
    dim = _int(need("hidden_size"), where, "hidden_size")
    n_heads = _int(need("num_attention_heads"), where, "num_attention_heads")
    if n_heads <= 0:
        raise FileFormatError(f"{where}: num_attention_heads {n_heads} invalid")
    head_dim = _int(cj.get("head_dim") or dim // n_heads, where, "head_dim")
    rope, local = _rope_settings(cj, where, head_dim, arch)
    n_layers = _layer_count(need("num_hidden_layers"), where, "num_hidden_layers")
    window, sliding = _windows(cj, where, arch, n_layers)
    nope = ()
    if arch.nope_step:  # SmolLM3: no_rope_layers[i] == 0 means layer i has no rope
        flags = cj.get("no_rope_layers")
        if flags is None:
            step = _int(cj.get("no_rope_layer_interval", arch.nope_step), where,
                        "no_rope_layer_interval")
            nope = layers_where(n_layers, step)
        elif not isinstance(flags, list) or len(flags) != n_layers:
            raise FileFormatError(f"{where}: no_rope_layers must list {n_layers} flags")
        else:
            nope = tuple(i for i, f in enumerate(flags) if not f)
    if arch.query_scale:
        features["query_scale"] = _float(cj.get("query_pre_attn_scalar", head_dim), where,
                                         "query_pre_attn_scalar")
    bos, eos = cj.get("bos_token_id"), cj.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return _checked(LlamaConfig, where,
                    dim=dim, n_layers=n_layers, n_heads=n_heads,
                    n_kv_heads=_int(cj.get("num_key_value_heads") or n_heads, where,
                                    "num_key_value_heads"),
                    head_dim=head_dim,
                    ffn_dim=_int(need("intermediate_size"), where, "intermediate_size"),
                    vocab_size=_int(need("vocab_size"), where, "vocab_size"),
                    norm_eps=_float(cj.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
                    tie_embeddings=bool(cj.get("tie_word_embeddings", arch.tie_default)),
                    max_seq_len=_int(cj.get("max_position_embeddings", 2048), where,
                                     "max_position_embeddings"),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"),
                    arch=arch.family, biases=biases,
                    attn_softcap=_float(cj.get("attn_logit_softcapping") or 0.0, where,
                                        "attn_logit_softcapping"),
                    final_softcap=_float(cj.get("final_logit_softcapping") or 0.0, where,
                                         "final_logit_softcapping"),
                    **rope, **features,
                    **_layer_features(n_layers, window, sliding, local, rope["rope_base"],
                                      len(rope) > 1, nope))


def _checked(cls, where, **kw):
    try:
        return cls(**kw)
    except FileFormatError as e:
        raise FileFormatError(str(e).replace("config:", f"{where}:", 1)) from None
