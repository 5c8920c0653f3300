"""The LLaMA hyper-parameters, read from GGUF metadata or a Hugging Face config.json.

``LlamaConfig`` is a frozen dataclass: the numbers the model graph needs and nothing
else.  The readers here validate every value (positive sizes, heads that divide, rope
settings we implement) and raise ``FileFormatError`` naming the file and the field; they
do not read tensors (see ``load_gguf`` and ``load_hf``).
"""

from __future__ import annotations

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

    # --- expected weight shapes, in OUR names and orientation ([in, out]) ---------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        D, F, V = self.dim, self.ffn_dim, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"tok_embd": (V, D), "norm": (D,)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes.update({p + "attn_norm": (D,), p + "q": (D, q), p + "k": (D, kv),
                           p + "v": (D, kv), p + "o": (q, D), p + "ffn_norm": (D,),
                           p + "gate": (D, F), p + "up": (D, F), p + "down": (F, D)})
        if not self.tie_embeddings:
            shapes["lm_head"] = (V, D)
        return shapes


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


def from_gguf_metadata(meta: dict, where: str, vocab_size: int, tied: bool) -> LlamaConfig:
    """``meta``: GGUF key -> python value.  ``vocab_size`` from the token list or the
    embedding tensor; ``tied``: whether the file lacks an ``output.weight`` tensor."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise FileFormatError(f"{where}: architecture {arch!r} is not supported "
                              "(only 'llama' GGUF models)")

    def need(key):
        if key not in meta:
            raise FileFormatError(f"{where}: missing GGUF metadata key {key!r}")
        return meta[key]

    dim = _int(need("llama.embedding_length"), where, "llama.embedding_length")
    n_heads = _int(need("llama.attention.head_count"), where, "llama.attention.head_count")
    n_kv = meta.get("llama.attention.head_count_kv", n_heads)
    n_kv = _int(n_kv, where, "llama.attention.head_count_kv")
    if n_heads <= 0 or dim <= 0:
        raise FileFormatError(f"{where}: embedding_length {dim} / head_count {n_heads} invalid")
    head_dim = _int(meta.get("llama.attention.key_length", dim // n_heads), where,
                    "llama.attention.key_length")
    v_len = _int(meta.get("llama.attention.value_length", head_dim), where,
                 "llama.attention.value_length")
    if v_len != head_dim:
        raise FileFormatError(f"{where}: value_length {v_len} != key_length {head_dim} "
                              "is not supported")
    rope_dims = _int(meta.get("llama.rope.dimension_count", head_dim), where,
                     "llama.rope.dimension_count")
    if rope_dims != head_dim:
        raise FileFormatError(f"{where}: partial rope (rope.dimension_count {rope_dims} != "
                              f"head_dim {head_dim}) is not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None, ""):
        raise FileFormatError(f"{where}: rope scaling {scaling!r} is not supported")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return _checked(LlamaConfig, where,
                    dim=dim,
                    n_layers=_int(need("llama.block_count"), where, "llama.block_count"),
                    n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                    ffn_dim=_int(need("llama.feed_forward_length"), where,
                                 "llama.feed_forward_length"),
                    vocab_size=vocab_size,
                    rope_base=_float(meta.get("llama.rope.freq_base", 10000.0), where,
                                     "llama.rope.freq_base"),
                    norm_eps=_float(need("llama.attention.layer_norm_rms_epsilon"), where,
                                    "llama.attention.layer_norm_rms_epsilon"),
                    tie_embeddings=tied,
                    max_seq_len=_int(meta.get("llama.context_length", 2048), where,
                                     "llama.context_length"),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"))


def from_hf_config(cj: dict, where: str) -> LlamaConfig:
    """A Hugging Face ``config.json`` (transformers 4.x or 5.x spelling) of a LLaMA model."""
    mt = cj.get("model_type")
    archs = cj.get("architectures") or []
    if mt != "llama":
        raise FileFormatError(f"{where}: model_type {mt!r} (architectures {archs}) is not "
                              "supported (only 'llama')")

    def need(key):
        if key not in cj:
            raise FileFormatError(f"{where}: missing key {key!r}")
        return cj[key]

    for key in ("attention_bias", "mlp_bias"):
        if cj.get(key):
            raise FileFormatError(f"{where}: {key} = true is not supported")
    act = cj.get("hidden_act", "silu")
    if act != "silu":
        raise FileFormatError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta/rope_scaling
    rp = cj.get("rope_parameters") or {}
    rope_type = rp.get("rope_type") or (cj.get("rope_scaling") or {}).get("rope_type") or \
        (cj.get("rope_scaling") or {}).get("type") or "default"
    if rope_type != "default":
        raise FileFormatError(f"{where}: rope scaling {rope_type!r} is not supported")
    theta = rp.get("rope_theta", cj.get("rope_theta", 10000.0))
    dim = _int(need("hidden_size"), where, "hidden_size")
    n_heads = _int(need("num_attention_heads"), where, "num_attention_heads")
    if n_heads <= 0:
        raise FileFormatError(f"{where}: num_attention_heads {n_heads} invalid")
    head_dim = cj.get("head_dim") or dim // n_heads
    bos, eos = cj.get("bos_token_id"), cj.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return _checked(LlamaConfig, where,
                    dim=dim,
                    n_layers=_int(need("num_hidden_layers"), where, "num_hidden_layers"),
                    n_heads=n_heads,
                    n_kv_heads=_int(cj.get("num_key_value_heads") or n_heads, where,
                                    "num_key_value_heads"),
                    head_dim=_int(head_dim, where, "head_dim"),
                    ffn_dim=_int(need("intermediate_size"), where, "intermediate_size"),
                    vocab_size=_int(need("vocab_size"), where, "vocab_size"),
                    rope_base=_float(theta, where, "rope_theta"),
                    norm_eps=_float(cj.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
                    tie_embeddings=bool(cj.get("tie_word_embeddings", False)),
                    max_seq_len=_int(cj.get("max_position_embeddings", 2048), where,
                                     "max_position_embeddings"),
                    bos_id=None if bos is None else _int(bos, where, "bos_token_id"),
                    eos_id=None if eos is None else _int(eos, where, "eos_token_id"))


def _checked(cls, where, **kw):
    try:
        return cls(**kw)
    except FileFormatError as e:
        raise FileFormatError(str(e).replace("config:", f"{where}:", 1)) from None
