"""The LLaMA model graph, recorded from ``gradtape.nn`` layers: what training differentiates.

``record_forward`` records the whole forward pass (embedding, ``n_layers`` pre-norm
blocks of GQA attention and a gated MLP, final RMSNorm, LM head) for ``n_seq`` equal-
length sequences at once: the graph the trainer differentiates and replays.  One graph
serves every family of ``models.arch``; the config switches its features (biases, fused
projections, q/k norms, sliding windows, rope factors, Gemma 2's norms, GeGLU and
soft-capping).  ``head_loss`` is the training loss over the last hidden rows, ``sequence_logps``
the per-sequence log-probabilities a preference loss is built from.  The
pieces (``embed``, ``block``, ``lm_head``, ``linear_fn``) are public because inference
(``gradtape.infer``) records the same block with a KV cache.  The math lives only in
``gradtape.nn``; this module wires layers and computes nothing itself.  It decides no
route either: which attention a training step takes is ``attention_choice``'s.

Weights are a dict of float32 arrays in OUR names and ``[in, out]`` orientation:
``tok_embd [V, D]``, ``layers.{i}.attn_norm [D]``, ``layers.{i}.{q,k,v,o,gate,up,down}``,
``layers.{i}.ffn_norm [D]``, ``norm [D]`` and, for untied embeddings only, ``lm_head [V, D]``;
by family also ``layers.{i}.{q,k,v,o}_bias [out]``, ``layers.{i}.{q,k}_norm [hd]``,
``layers.{i}.qkv [D, (nh+2nkv)*hd]`` / ``layers.{i}.gate_up [D, 2F]`` in place of the
separate projections, ``layers.{i}.post_attn_norm`` / ``post_ffn_norm [D]``
(``LlamaConfig.weight_shapes`` lists them).
A matrix may instead be a ``blocks.BlockMatrix`` (a frozen weight in its stored type,
``[out, in]`` as stored: ``load(..., keep_quantized=True)``); the ``nn`` layers dispatch
on it (``linear``, ``embedding``, ``linear_rows``), so the graph code is the same.
"""

from __future__ import annotations

import math

from .. import nn, ops, plan, tiled
from .config import LlamaConfig
from .rope import rope_tables


def weight_consts(tp, model) -> dict:
    """``tp.const`` of every weight (a loaded model or a weights dict); on a float32 tape
    the consts share the float32 arrays without copying."""
    weights = model.weights if hasattr(model, "weights") else model
    return {name: tp.const(w) for name, w in weights.items()}


def linear_fn(tp, W, lora, lora_scale):
    """``lin(i, target, x)``: ``x @ W[layers.i.target]``, plus the LoRA update where
    ``lora`` has ``(i, target)``: ``(A, B)``, or ``(A, B, m, w0_sq)`` for DoRA
    (``models.dora.adapter_leaves``), or ``(A, B, c)`` for DoRA with its column factor
    fixed (generation: ``models.dora.column_factors``)."""
    def lin(i, target, x):
        w0 = W[f"layers.{i}.{target}"]
        ab = lora.get((i, target)) if lora else None
        if ab is None:
            return nn.linear(tp, x, w0)
        if len(ab) == 4:
            return nn.dora_linear(tp, x, w0, *ab, lora_scale)
        if len(ab) == 3:
            return nn.scaled_lora_linear(tp, x, w0, ab[0], ab[1], lora_scale, ab[2])
        return nn.lora_linear(tp, x, w0, ab[0], ab[1], lora_scale)
    return lin


def _rmsnorm(tp, cfg, x, w, ones, h=None):
    """RMSNorm of the rows of ``x``, scaled by ``w``, or by ``1 + w`` where the family
    stores its norms that way (Gemma)."""
    if cfg.norm_plus_one:
        w = ops.addc(w, 1.0)
    return nn.rmsnorm(tp, x, w, ones, h or cfg.dim, cfg.norm_eps)


def _head_norm(tp, cfg, x, w, n):
    """RMSNorm over each of the ``n`` heads of ``x [N, n*hd]`` with one ``w [hd]`` (Qwen3's
    q/k norm): the heads become rows ``[N*n, hd]`` and back."""
    rows, hd = x.shape[0], cfg.head_dim
    h = ops.reshape(x, (rows * n, hd))  # [N*n, hd]
    h = _rmsnorm(tp, cfg, h, w, nn.ones(tp, hd), hd)
    return ops.reshape(h, (rows, n * hd))  # [N, n*hd]


def block(tp, cfg, W, i, x, ones, lin, attend):
    """One pre-norm decoder layer on rows ``x [N, D]``; ``attend(q, k, v)`` is the
    attention over the projected rows (full-sequence or KV-cached).  The family's
    features (``cfg``): biases, fused qkv / gate_up (split by columns: q | k | v and
    gate | up), per-head q/k norm, norms after attention and MLP, GeGLU."""
    p = f"layers.{i}."
    hd, F = cfg.head_dim, cfg.ffn_dim

    def proj(target, h):
        y = lin(i, target, h)
        return ops.add(y, W[p + target + "_bias"]) if target in cfg.biases else y

    def norm(name, h):
        return _rmsnorm(tp, cfg, h, W[p + name], ones)

    h = norm("attn_norm", x)  # [N, D]
    if cfg.fused:
        nq, nk = cfg.n_heads * hd, cfg.n_kv_heads * hd
        qkv = proj("qkv", h)  # [N, nq + 2*nk]
        q, k, v = (ops.slice_(qkv, 1, 0, nq), ops.slice_(qkv, 1, nq, nq + nk),
                   ops.slice_(qkv, 1, nq + nk, nq + 2 * nk))
    else:
        q, k, v = proj("q", h), proj("k", h), proj("v", h)  # [N, nh*hd], [N, nkv*hd] x2
    if cfg.qk_norm:
        q = _head_norm(tp, cfg, q, W[p + "q_norm"], cfg.n_heads)
        k = _head_norm(tp, cfg, k, W[p + "k_norm"], cfg.n_kv_heads)
    a = proj("o", attend(q, k, v))  # [N, D]
    if cfg.post_norms:
        a = norm("post_attn_norm", a)
    x = ops.add(x, a)
    h = norm("ffn_norm", x)
    if cfg.fused:
        gu = proj("gate_up", h)  # [N, 2F]
        gate, up = ops.slice_(gu, 1, 0, F), ops.slice_(gu, 1, F, 2 * F)
    else:
        gate, up = proj("gate", h), proj("up", h)
    act = nn.geglu if cfg.act == "gelu_tanh" else nn.swiglu
    m = proj("down", act(tp, gate, up))  # [N, F] -> [N, D]
    if cfg.post_norms:
        m = norm("post_ffn_norm", m)
    return ops.add(x, m)  # [N, D]


def embed(tp, cfg, W, ids):
    """Token embeddings ``[N, D]``, times sqrt(D) where the family scales them (Gemma)."""
    x = nn.embedding(tp, W["tok_embd"], ids)  # [N, D]
    return ops.scale(x, math.sqrt(cfg.dim)) if cfg.embed_scale else x


def _head_table(cfg, W):
    return W["tok_embd"] if cfg.tie_embeddings else W["lm_head"]  # [V, D]


def lm_head(tp, cfg, W, x, ones):
    """Final RMSNorm and the LM head: ``[N, D] -> [N, V]`` (soft-capped where the family
    caps its logits)."""
    h = _rmsnorm(tp, cfg, x, W["norm"], ones)
    logits = nn.linear_rows(tp, h, _head_table(cfg, W))  # [N, V]
    return nn.softcap(tp, logits, cfg.final_softcap) if cfg.final_softcap else logits


# logits elements from which the training loss fuses the head with it (128 MB float32):
# below, the [N, V] logits are small, and their GEMMs take bf16 where --compute bf16 runs
HEAD_FUSE_MIN = 1 << 25


def head_loss(tp, cfg, W, x, targets, weights, ones=None, training=True,
              fuse_from=None, budget=None):
    """``nn.cross_entropy_ids`` of ``lm_head``'s logits from the last hidden rows ``x [N,
    D]`` (``record_forward(..., head=False)``).  From ``fuse_from`` (default
    ``HEAD_FUSE_MIN``) logits on, the head and the loss are one tiled primitive
    (``nn.cross_entropy_head``, logits blocks of ``budget`` elements): no ``[N, V]``
    logits in memory; ``training``: a loss to differentiate, whose fused head folds up
    the gradient w.r.t. ``x`` in its forward (one GEMM over the vocabulary instead of
    two in backward; an evaluation loss would pay it for nothing)."""
    ones = ones if ones is not None else nn.ones(tp, cfg.dim)
    if x.shape[0] * cfg.vocab_size < (HEAD_FUSE_MIN if fuse_from is None else fuse_from):
        return nn.cross_entropy_ids(tp, lm_head(tp, cfg, W, x, ones), targets, weights)
    h = _rmsnorm(tp, cfg, x, W["norm"], ones)
    return nn.cross_entropy_head(tp, h, _head_table(cfg, W), targets, weights,
                                 cfg.final_softcap or 0.0, grad_in_forward=training,
                                 budget=budget)



# logits elements from which the per-sequence log-probabilities fuse the head (16 MB
# float32): a preference batch holds 2N sequences, and the composed route would keep
# their [2NT, V] logits and, in the step, their gradient as well (most of a small
# model's eval program and reference pass)
LOGPS_FUSE_MIN = 1 << 22


def logps_fused(cfg, rows) -> bool:
    """Whether ``sequence_logps`` over ``rows`` rows takes the fused head."""
    return rows * cfg.vocab_size >= LOGPS_FUSE_MIN


def sequence_logps(tp, cfg, W, x, targets, weights, ones=None, training=True):
    """``[k, 1]``: ``-(weights^T @ nll)``, weighted sums of the target tokens'
    log-probabilities from the last hidden rows ``x [N, D]`` (composed logits below
    ``LOGPS_FUSE_MIN``, else the fused head, as ``head_loss``'s).
    ``targets``: integer const ``[N]``; ``weights``: const ``[N, k]``, column ``s`` the
    rows counted in sum ``s`` (1 on sequence ``s``'s completion tokens for a summed log-
    probability, ``1/n_s`` for an average; any other weighting, such as a pooled NLL, is
    one more column).  What a preference method's loss is built from."""
    ones = ones if ones is not None else nn.ones(tp, cfg.dim)
    if not logps_fused(cfg, x.shape[0]):
        nll = ops.nll_ids(lm_head(tp, cfg, W, x, ones), targets)  # [N, 1]
    else:
        h = _rmsnorm(tp, cfg, x, W["norm"], ones)
        nll = ops.slice_(ops.head_nll(h, _head_table(cfg, W), targets, cfg.final_softcap or 0.0,
                                      grad_in_forward=training), 1, 0, 1)  # [N, 1]
    return ops.neg(ops.matmul(weights, nll, ta=True))  # [k, 1]

# rows per sequence from which attention is the tiled primitive (``nn.tiled_attention``);
# shorter sequences take the composed attention (small [t, t] scores), from two query
# tiles on the plan may take the fused one where it measured faster (``plan.ATTN_TILED_MIN``)
ATTN_TILED_MIN = plan.ATTN_TILED_MIN


def attention_spec(cfg, layer, n_seq=1):
    """Layer ``layer``'s attention over ``n_seq`` stacked sequences: the heads, scale,
    soft-cap and sliding window of ``cfg`` (``tiled.AttentionSpec``)."""
    return tiled.AttentionSpec(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attn_iscale,
                               cfg.attn_softcap, cfg.window(layer), n_seq)


def rope_keys(cfg):
    """``{layer: its rope setting}``; layers with equal settings share one table."""
    return {i: cfg.rope_for(i) for i in range(cfg.n_layers)}


def record_forward(tp, cfg: LlamaConfig, W, ids, n_seq, lora=None, lora_scale=1.0,
                   ones=None, positions=None, segments=None, head=True, fused_from=None):
    """Record the logits ``[n_seq*T, V]`` of ``n_seq`` sequences of length ``T`` (with
    ``head=False`` the last layer's rows ``[n_seq*T, D]``, for ``head_loss``).

    ``ids``: integer const ``[n_seq*T]`` (the sequences concatenated); ``W``: from
    ``weight_consts``; ``lora``: ``None`` or ``{(layer, target): (A [in, r], B [r, out])}``
    of Vars (DoRA: ``(A, B, m [out], w0_sq [out])``, ``linear_fn``).  Linears, norms and the MLP run on all rows at once; attention per sequence.

    Packed sequences (several examples in one, ``train.data.pack_rows``): ``positions``
    and ``segments``, integer consts ``[n_seq*T]``, give each token its rope position and
    the example it belongs to; a token attends only to the earlier tokens of its example,
    so each example computes what it would alone.  Without them every sequence is one
    example at positions ``0..T-1``.

    ``fused_from``: the rows per sequence from which attention is the fused primitive
    (default ``ATTN_TILED_MIN``; a training step's ``attention_from``); below
    ``ATTN_TILED_MIN`` its products stay float32, as the composed attention's.
    """
    fused_from = ATTN_TILED_MIN if fused_from is None else fused_from
    n = ids.shape[0]
    if n_seq < 1 or n % n_seq:
        raise ValueError(f"record_forward: {n} ids do not split into {n_seq} equal sequences")
    t = n // n_seq
    if ones is None:
        ones = nn.ones(tp, cfg.dim)  # [D, 1]
    keys = rope_keys(cfg)
    tables = {}  # rope setting -> (cos, sin) consts [T, hd/2]
    for i, key in keys.items():
        if key not in tables:
            tables[key] = tuple(tp.const(a) for a in rope_tables(cfg, t, layer=i))
    if positions is not None:  # packed: rope rows per token; attention sees segments
        tables = {key: tuple(ops.take_rows(c, positions) for c in cs)  # [N, hd/2] each
                  for key, cs in tables.items()}
    lin = linear_fn(tp, W, lora, lora_scale)

    masks = {}  # composed attention: window -> the additive mask (with the segments')

    def mask_of(window):
        if window not in masks:
            causal = tp.const(nn.causal_mask_fill(t, window=window))
            masks[window] = causal if segments is None else nn.segment_mask(
                tp, segments, causal, n_seq, t)
        return masks[window]

    x = embed(tp, cfg, W, ids)  # [N, D]
    for i in range(cfg.n_layers):
        def attend(q, k, v, spec=attention_spec(cfg, i, n_seq), rope=tables[keys[i]]):
            # all sequences and heads at once; from fused_from rows tiled: no [T, T]
            # scores, the causal mask (and window, segments) applied by position
            cosc, sinc = rope
            if t < fused_from:
                return nn.gqa_attention_seqs(tp, q, k, v, cosc, sinc, mask_of(spec.window),
                                             spec)
            return nn.tiled_attention(tp, q, k, v, cosc, sinc, spec, segments,
                                      f32=t < ATTN_TILED_MIN)

        # each layer's input rows: what a checkpointed step keeps (Tape.checkpoint)
        x = block(tp, cfg, W, i, tp.checkpoint(x), ones, lin, attend)
    return lm_head(tp, cfg, W, x, ones) if head else x

