"""The table of model families gradtape runs: one row per architecture.

A row says how a family is recognised (its Hugging Face ``model_type`` and GGUF
``general.architecture``), which features of the one model graph it switches on by
default (q/k/v biases, per-head q/k norm, fused projections, the Gemma 2 set), and how
its tensors are named in Hugging Face folders and in GGUF files.  ``config`` reads the
numbers; ``load_hf`` / ``load_gguf`` use the name maps; ``model`` runs the graph.  This
module holds data only.  Anything not in the table (another model type, a MoE block, a
vision tower) is refused by the readers with an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FileFormatError

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


@dataclass(frozen=True)
class Arch:
    family: str  # our name for the family
    hf_types: tuple  # config.json model_type values
    gguf: str  # GGUF general.architecture (its metadata keys start with it)
    permute_qk: bool  # llama.cpp's converter permuted q/k rows into interleaved rope order
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q / k head before rope (Qwen3)
    fused: bool = False  # one qkv_proj and one gate_up_proj linear (Phi-3)
    gemma: bool = False  # the Gemma 2 set: GeGLU, (1 + w) norms, sqrt(D) embedding scale,
    # norms after attention and MLP, soft-capping, query_pre_attn_scalar, local/global
    hf_extra: dict = field(default_factory=dict)
    gguf_extra: dict = field(default_factory=dict)

    @property
    def hf_block(self) -> dict:
        return {**_HF_LLAMA, **self.hf_extra}

    @property
    def gguf_block(self) -> dict:
        return {**_GGUF_LLAMA, **self.gguf_extra}


ARCHS = {a.family: a for a in (
    Arch("llama", ("llama",), "llama", permute_qk=True),
    # llama.cpp converts MistralForCausalLM as the llama architecture (q/k permuted)
    Arch("mistral", ("mistral",), "llama", permute_qk=True),
    Arch("qwen2", ("qwen2",), "qwen2", permute_qk=False, qkv_bias=True),
    Arch("qwen3", ("qwen3",), "qwen3", permute_qk=False, qk_norm=True),
    Arch("phi3", ("phi3",), "phi3", permute_qk=False, fused=True,
         hf_extra={"self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"},
         # llama.cpp keeps Phi-3's fused gate_up as ffn_up ([2F, D], gate rows first)
         gguf_extra={"attn_qkv": "qkv", "ffn_up": "gate_up"}),
    Arch("gemma2", ("gemma2",), "gemma2", permute_qk=False, gemma=True,
         hf_extra={"post_attention_layernorm.weight": "post_attn_norm",
                   "pre_feedforward_layernorm.weight": "ffn_norm",
                   "post_feedforward_layernorm.weight": "post_ffn_norm"},
         gguf_extra={"post_attention_norm": "post_attn_norm",
                     "post_ffw_norm": "post_ffn_norm"}),
)}

BY_HF_TYPE = {t: a for a in ARCHS.values() for t in a.hf_types}
# a GGUF architecture name -> its row (mistral's GGUF says "llama": the llama row)
BY_GGUF = {"llama": ARCHS["llama"], "qwen2": ARCHS["qwen2"], "qwen3": ARCHS["qwen3"],
           "phi3": ARCHS["phi3"], "gemma2": ARCHS["gemma2"]}

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
