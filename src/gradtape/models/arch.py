"""The table of model families gradtape runs: one row per architecture.

A row says how a family is recognised (its Hugging Face ``model_type`` and GGUF
``general.architecture``), which features of the one model graph it switches on
(``features``: ``LlamaConfig`` fields), which options of its config files it honours
(biases, windows, per-layer rope), the linears LoRA adapts, how its tensors are named in Hugging Face folders and
in GGUF files, and what llama.cpp's GGUF leaves implicit for it (a fixed local/global
pattern, a fixed NoPE step, the attention scale).  ``config`` reads the numbers with it,
``load_hf`` / ``load_gguf`` use the name maps, ``export`` writes the same names and keys
back, ``infer.block_decoder`` asks which block it is; nothing else branches on the
family, so adding a family is a row here plus its tests.  This module holds data only.  Anything
not in the table (another model type, a MoE block, a vision tower used as input) is
refused by the readers with an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FileFormatError

# LoRA targets, our names (PEFT's module names in ``models.lora.PEFT_MODULES``)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# families with fused projections (Phi-3) adapt the fused modules, as PEFT does
FUSED_TARGETS = ("qkv", "o", "gate_up", "down")

# Hugging Face module path inside ``model.layers.{i}.`` -> our name inside ``layers.{i}.``,
# shared by the llama-like families; a row's ``hf_extra`` adds to / overrides it.
_HF_LLAMA = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.o_proj.bias": "o_bias",
    "mlp.gate_proj.bias": "gate_bias", "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}
# GGUF tensor name inside ``blk.{i}.`` (without ``.weight`` / ``.bias``) -> our name
_GGUF_LLAMA = {
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "q", "attn_k": "k",
    "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
    "ffn_down": "down", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}
# Gemma's four norms per layer (around attention and around the MLP)
_HF_GEMMA = {"post_attention_layernorm.weight": "post_attn_norm",
             "pre_feedforward_layernorm.weight": "ffn_norm",
             "post_feedforward_layernorm.weight": "post_ffn_norm"}
_GGUF_GEMMA = {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm"}
# the graph switches of the Gemma families: GeGLU, (1 + w) norms, sqrt(D) embedding
# scale, norms after attention and MLP
_GEMMA = dict(act="gelu_tanh", norm_plus_one=True, embed_scale=True, post_norms=True)
# config.json spelling of our activation names
HF_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class Arch:
    family: str  # our name for the family
    hf_types: tuple  # config.json model_type values
    hf_class: str  # the transformers class a written config.json names
    gguf: str  # GGUF general.architecture (its metadata keys start with it)
    permute_qk: bool  # llama.cpp's converter permuted q/k rows into interleaved rope order
    features: dict = field(default_factory=dict)  # LlamaConfig fields the family sets
    act_key: str = "hidden_act"  # the config.json key of the MLP activation
    qkv_bias: bool = False  # biases on q, k, v always (Qwen2)
    attention_bias: bool = False  # config.json attention_bias: biases on q, k, v, o
    mlp_bias: bool = False  # config.json mlp_bias: biases on gate, up, down
    tie_default: bool = False  # tie_word_embeddings when config.json does not say
    # how config.json spells windows: "plain" (sliding_window on every layer), "qwen"
    # (only with use_sliding_window; layer_types or from max_window_layers up),
    # "pattern" (layer_types, or every swa_pattern-th layer global)
    hf_window: str = "plain"
    swa_pattern: int = 0  # > 0: layer i is local iff (i + 1) % swa_pattern (Gemma 2: 2, 3: 6)
    rope_local_base: float = 0.0  # > 0: the local layers' rope base unless the file says
    nope_step: int = 0  # > 0: layer i has no rope iff (i + 1) % nope_step == 0 (SmolLM3)
    query_scale: bool = False  # scores scaled by query_pre_attn_scalar**-0.5 (Gemma); in
    # GGUF, llama.cpp uses head_dim, or dim / n_heads at these layer counts:
    gguf_dim_scale_layers: tuple = ()  # (Gemma 3 27B: 62 layers)
    softcaps: bool = False  # attention / final-logit soft-capping keys (Gemma 2)
    text_prefixes: tuple = ()  # weight prefixes of a multimodal checkpoint's text tower
    hf_ctx_keys: tuple = ()  # config.json keys written as the context length (Phi-3)
    lora_targets: tuple = TARGETS  # the linears LoRA adapts (``--targets all``)
    hf_extra: dict = field(default_factory=dict)
    gguf_extra: dict = field(default_factory=dict)

    @property
    def hf_block(self) -> dict:
        return {**_HF_LLAMA, **self.hf_extra}

    @property
    def gguf_block(self) -> dict:
        return {**_GGUF_LLAMA, **self.gguf_extra}


ARCHS = {a.family: a for a in (
    Arch("llama", ("llama",), "LlamaForCausalLM", "llama", permute_qk=True,
         attention_bias=True, mlp_bias=True),
    # llama.cpp converts MistralForCausalLM as the llama architecture (q/k permuted)
    Arch("mistral", ("mistral",), "MistralForCausalLM", "llama", permute_qk=True),
    Arch("qwen2", ("qwen2",), "Qwen2ForCausalLM", "qwen2", permute_qk=False, qkv_bias=True,
         hf_window="qwen"),
    Arch("qwen3", ("qwen3",), "Qwen3ForCausalLM", "qwen3", permute_qk=False,
         features=dict(qk_norm=True), attention_bias=True, hf_window="qwen"),
    Arch("phi3", ("phi3",), "Phi3ForCausalLM", "phi3", permute_qk=False,
         features=dict(fused=True), hf_ctx_keys=("original_max_position_embeddings",),
         lora_targets=FUSED_TARGETS,
         hf_extra={"self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"},
         # llama.cpp keeps Phi-3's fused gate_up as ffn_up ([2F, D], gate rows first)
         gguf_extra={"attn_qkv": "qkv", "ffn_up": "gate_up"}),
    Arch("gemma2", ("gemma2",), "Gemma2ForCausalLM", "gemma2", permute_qk=False,
         features=_GEMMA, act_key="hidden_activation", attention_bias=True, tie_default=True,
         hf_window="pattern", swa_pattern=2, query_scale=True, softcaps=True,
         hf_extra=_HF_GEMMA, gguf_extra=_GGUF_GEMMA),
    # Gemma 3 text: Gemma 2's block with q/k norms, 5 local layers to 1 global, local
    # rope base 10k; the text tower of Gemma3ForConditionalGeneration checkpoints too
    Arch("gemma3", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM", "gemma3", permute_qk=False,
         features=dict(_GEMMA, qk_norm=True), act_key="hidden_activation",
         attention_bias=True, tie_default=True, hf_window="pattern", swa_pattern=6,
         rope_local_base=10000.0, query_scale=True, gguf_dim_scale_layers=(62,),
         softcaps=True, text_prefixes=("model.language_model.", "language_model.model."),
         hf_extra=_HF_GEMMA, gguf_extra=_GGUF_GEMMA),
    # SmolLM3: llama with no rope on every 4th layer (llama.cpp's converter permutes q/k
    # as for llama)
    Arch("smollm3", ("smollm3",), "SmolLM3ForCausalLM", "smollm3", permute_qk=True,
         attention_bias=True, mlp_bias=True, hf_window="qwen", nope_step=4),
)}

BY_HF_TYPE = {t: a for a in ARCHS.values() for t in a.hf_types}
# a GGUF architecture name -> its row (mistral's GGUF says "llama": the first row with it)
BY_GGUF = {}
for _a in ARCHS.values():
    BY_GGUF.setdefault(_a.gguf, _a)

# The projections of a block, by whether the family fuses them; LoRA targets follow.
LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")


def gguf_arch(name, where: str) -> "Arch":
    """The row of GGUF architecture ``name`` (``general.architecture``); a clear error
    naming ``where`` (the file) when we do not run it."""
    arch = BY_GGUF.get(name) if isinstance(name, str) else None
    if arch is None:
        raise FileFormatError(f"{where}: architecture {name!r} is not supported "
                              f"(supported GGUF architectures: {', '.join(sorted(BY_GGUF))})")
    return arch


def supported() -> str:
    return ", ".join(sorted(BY_HF_TYPE))


def layers_where(n_layers, step) -> tuple:
    """The layers ``i`` with ``(i + 1) % step == 0`` (every ``step``-th, counting from 1):
    Gemma's global layers, SmolLM3's NoPE layers."""
    return tuple(i for i in range(n_layers) if step and (i + 1) % step == 0)
