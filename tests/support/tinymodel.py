"""A tiny random LLaMA with a byte-level tokenizer, for fast training tests.

It has the attributes the trainer uses (config, weights, tokenizer, name), built directly
from random arrays, so training tests need neither the real model nor transformers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gradtape.models.config import LlamaConfig
from gradtape.models.tokenizer import _bytes_to_unicode


class ByteTokenizer:
    """Bytes 0..255 are tokens; 256 is end-of-sequence.  A minimal chat template."""

    eos_id = 256

    def encode(self, text, add_special_tokens=True):  # (it has none to add)
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


# the text the CLI and MPI tests fine-tune the tiny model on (``tiny_dir`` in conftest.py)
TINY_TEXT = "pack my box with five dozen liquor jugs. " * 60


def tiny_model(seed=0, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab=257,
               tied=False, rope_base=10000.0, head_scale=1.0):
    """``head_scale`` multiplies the LM head: a random head's logits are too flat for any
    hidden state to reach a loss near 0 (with it at 16, a learnable answer does)."""
    cfg = LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=dim // n_heads, ffn_dim=ffn_dim, vocab_size=vocab,
                      rope_base=rope_base, norm_eps=1e-5, tie_embeddings=tied,
                      max_seq_len=512, eos_id=256)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in cfg.weight_shapes().items():
        if len(shape) == 1:
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    head = "tok_embd" if tied else "lm_head"
    weights[head] = (weights[head] * head_scale).astype(np.float32)
    return SimpleNamespace(config=cfg, weights=weights, tokenizer=ByteTokenizer(), name="tiny")


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def write_hf_folder(model, path):
    """Save ``model`` as a Hugging Face folder (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json) that ``llama.load`` reads, without transformers."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.ffn_dim, "vocab_size": c.vocab_size, "rope_theta": c.rope_base,
        "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_seq_len, "eos_token_id": c.eos_id,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    w = model.weights
    hf = {"model.embed_tokens.weight": w["tok_embd"], "model.norm.weight": w["norm"]}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = w[f"layers.{i}.attn_norm"]
        hf[p + "post_attention_layernorm.weight"] = w[f"layers.{i}.ffn_norm"]
        for ours, theirs in names.items():
            hf[p + theirs + ".weight"] = np.ascontiguousarray(w[f"layers.{i}.{ours}"].T)
    if not c.tie_embeddings:
        hf["lm_head.weight"] = w["lm_head"]
    save_file(hf, str(path / "model.safetensors"), metadata={"format": "pt"})

    # byte-level BPE with no merges: token i is byte i, plus an end-of-sequence token
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    table = _bytes_to_unicode()  # the tokenizer's own byte map
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<eos>"}))
    return path




def lora_loss_outputs(tp, config, weights, adapter, ids, targets=None, positions=None,
                      segments=None, head_loss=False):
    """Record on ``tp`` (in its dtype) the next-token loss of ``ids`` through ``config``'s
    graph, the frozen ``weights`` as consts and ``adapter``'s A and B (and DoRA's m) as
    params; ``(outputs, keys)``: ``[loss, dA, dB (, dm) for each adapted (layer, target)
    in keys]`` and
    those keys, in order.  ``ids``: one sequence ``[T]`` (every next token a target), or
    rows ``[n, T]`` with their ``targets`` (and, for packed rows, ``positions`` and
    ``segments``), all ``[n, T]``.  ``head_loss``: the training's own head and loss
    (``graph.head_loss``: fused from ``HEAD_FUSE_MIN`` logits on) instead of the
    composed ``[N, V]`` logits and ``nn.cross_entropy_ids``."""
    from gradtape import nn
    from gradtape.models import graph
    from gradtape.models.graph import record_forward, weight_consts

    dt = tp.dtype
    ids = np.asarray(ids)
    if targets is None:
        targets = np.r_[ids[1:], -100]
    from gradtape.blocks import BlockMatrix

    from gradtape.models.dora import adapter_leaves
    W = weight_consts(tp, {k: w if isinstance(w, BlockMatrix)  # kept in its ggml blocks
                           else np.asarray(w).astype(dt, copy=False)
                           for k, w in weights.items()})
    lora = adapter_leaves(tp, adapter, weights)  # DoRA: (A, B, m, w0_sq)
    layout = {} if positions is None else {
        "positions": tp.const(np.asarray(positions).reshape(-1)),
        "segments": tp.const(np.asarray(segments).reshape(-1))}
    last = record_forward(tp, config, W, tp.const(ids.reshape(-1)),
                          1 if ids.ndim == 1 else len(ids), lora, adapter.scale, **layout,
                          head=not head_loss)
    tid, w = (tp.const(a) for a in nn.ce_targets_fill(np.asarray(targets).reshape(-1)))
    loss = (graph.head_loss(tp, config, W, last, tid, w) if head_loss
            else nn.cross_entropy_ids(tp, last, tid, w))
    grads = tp.backward(loss)
    keys = list(lora)
    return [loss] + [grads[p] for k in keys for p in lora[k] if p.op == "param"], keys
