"""The LLaMA model graph, recorded from ``gradtape.nn`` layers, and inference on it.

``record_forward`` records the whole forward pass (embedding, ``n_layers`` pre-norm
blocks of GQA attention and a gated MLP, final RMSNorm, LM head) for ``n_seq`` equal-
length sequences at once: the graph the trainer differentiates and replays.  One graph
serves every family of ``models.arch``; the config switches its features (biases, fused
projections, q/k norms, sliding windows, rope factors, Gemma 2's norms, GeGLU and
soft-capping).
``Llama.logits`` / ``Llama.generate`` run the same block (``_block``) with a KV cache:
each layer of each chunk of new rows is recorded on its own small eager tape, the keys
(already roped) and values of past rows are fed back as consts, so a decoded token costs
one row of work and memory stays bounded by one layer; a long prompt runs as one compiled
program (``PromptStep``, bf16 GEMMs where they are faster).  The math lives only in
``gradtape.nn``; this module wires layers, it computes nothing itself besides picking
the next token from the logits.

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
import warnings
from dataclasses import dataclass

import numpy as np

from .. import nn, ops, tiled
from ..blocks import is_block_matrix
from ..compile.memplan import fused_scratch_bytes
from ..errors import GradtapeError
from ..tape import Tape
from . import decode_engine
from .config import LlamaConfig
from .generate import Sampling, check_length, check_stop_strings, run_loop
from .lora import check_adapter_fits
from .memory import GiB, mem_available
from .rope import rope_tables

PREFILL_CHUNK = 256  # rows per tape when running a long prompt through the cached path
# generate's prompt as one compiled bf16 program (PromptStep): its rows are padded to a
# multiple of PROMPT_PAD (of 16 below it), so that prompts of similar length share a
# program (the last one is kept); under compute "auto" it runs from PROMPT_BF16_FLOPS of
# GEMM work on.  Building the program
# costs 0.2-0.5 s (a few seconds more the first time a size runs on a CPU: its GEMM
# layouts are measured).  Zen 5, an 8B Q4_K_M: 8 rows took 1.0 s (program built)
# against 1.3 s row by row, 16 rows 1.0 against 2.1, 48 rows 1.8 against 5.4, 256 rows
# 5.6 against 20-27.  SmolLM2 (Zen 5, a slow host, the first prompt of a fresh process,
# its program built): 256 rows 0.88 s against 0.70 s row by row, 512 rows (0.1 TFLOP)
# 1.29 against 1.44 s, then 0.36 against 1.2 s each later prompt of that size
PROMPT_PAD = 64
PROMPT_BF16_FLOPS = 1e11
# float32 prompts of this many rows on run as a float32 program too: the C prefill
# attends a row at a time.  SmolLM2 (Zen 5): 1024 rows 2.0 s either way, 3000 rows 6.2
# against 12.6 s, 8000 rows 20.8 against 68.0 s
PROMPT_F32_ROWS = 2048
# a prompt program runs only where what it holds (PromptStep.nbytes) is at most this
# share of the memory available when it is built; else the prompt is prefilled row by
# row, which needs the decoder's cache alone (an 8B's 8k-row program plans several GB)
PROMPT_MEM_SHARE = 0.8


def linear_weights(cfg) -> int:
    """The weights of the linears a token goes through (the layers' projections and MLP;
    not the embedding or the LM head): its GEMM work is twice this."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * (2 * cfg.dim * q + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim)


# --- the graph ----------------------------------------------------------------------------

def weight_consts(tp, model) -> dict:
    """``tp.const`` of every weight (a ``Llama`` or a weights dict); on a float32 tape the
    consts share the float32 arrays without copying."""
    weights = model.weights if hasattr(model, "weights") else model
    return {name: tp.const(w) for name, w in weights.items()}


def _linear_fn(tp, W, lora, lora_scale):
    """``lin(i, target, x)``: ``x @ W[layers.i.target]``, plus the LoRA update where
    ``lora`` has ``(i, target)``."""
    def lin(i, target, x):
        w0 = W[f"layers.{i}.{target}"]
        ab = lora.get((i, target)) if lora else None
        if ab is None:
            return nn.linear(tp, x, w0)
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


def _block(tp, cfg, W, i, x, ones, lin, attend):
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


def _embed(tp, cfg, W, ids):
    """Token embeddings ``[N, D]``, times sqrt(D) where the family scales them (Gemma)."""
    x = nn.embedding(tp, W["tok_embd"], ids)  # [N, D]
    return ops.scale(x, math.sqrt(cfg.dim)) if cfg.embed_scale else x


def _head_table(cfg, W):
    return W["tok_embd"] if cfg.tie_embeddings else W["lm_head"]  # [V, D]


def _head(tp, cfg, W, x, ones):
    """Final RMSNorm and the LM head: ``[N, D] -> [N, V]`` (soft-capped where the family
    caps its logits)."""
    h = _rmsnorm(tp, cfg, x, W["norm"], ones)
    logits = nn.linear_rows(tp, h, _head_table(cfg, W))  # [N, V]
    return nn.softcap(tp, logits, cfg.final_softcap) if cfg.final_softcap else logits


# logits elements from which the training loss fuses the head with it (128 MB float32):
# below, the [N, V] logits are small, and their GEMMs take bf16 where --compute bf16 runs
HEAD_FUSE_MIN = 1 << 25


def head_loss(tp, cfg, W, x, targets, weights, ones=None, training=True):
    """``nn.cross_entropy_ids`` of ``_head``'s logits from the last hidden rows ``x [N,
    D]`` (``record_forward(..., head=False)``).  From ``HEAD_FUSE_MIN`` logits on, the
    head and the loss are one tiled primitive (``nn.cross_entropy_head``): no ``[N, V]``
    logits in memory; ``training``: a loss to differentiate, whose fused head folds up
    the gradient w.r.t. ``x`` in its forward (one GEMM over the vocabulary instead of
    two in backward; an evaluation loss would pay it for nothing)."""
    ones = ones if ones is not None else nn.ones(tp, cfg.dim)
    if x.shape[0] * cfg.vocab_size < HEAD_FUSE_MIN:
        return nn.cross_entropy_ids(tp, _head(tp, cfg, W, x, ones), targets, weights)
    h = _rmsnorm(tp, cfg, x, W["norm"], ones)
    return nn.cross_entropy_head(tp, h, _head_table(cfg, W), targets, weights,
                                 cfg.final_softcap or 0.0, grad_in_forward=training)


# rows per sequence from which attention is the tiled primitive (``nn.tiled_attention``);
# shorter sequences take the composed attention (``nn.gqa_attention_seqs``, small [t, t]
# scores): with at most two query tiles the tiled walk skips at most a quarter of the
# scores, and its per-tile work costs more than that (SmolLM2's step, Zen 3: 1.61 s
# composed vs 1.92 s tiled at T=256, even at T=512; packed rows of 352: tiled 10% faster)
ATTN_TILED_MIN = 2 * tiled.ATTN_TILE + 1


def attention_from(cfg, n_seq, t, backend, compute):
    """``(rows, why)``: the rows per sequence from which a training step's attention is
    the fused primitive, and a sentence saying why where it was decided here ("" where
    not): ``ATTN_TILED_MIN``, or ``t`` where ``t`` spans two query tiles (129-256
    rows) and the fused attention, its products kept float32, measured faster than the
    composed one on this CPU: a few layers' attention forward and backward at the step's
    shape (``_time_attention``), both timed in turn, once per CPU (cached with the
    compute decisions).  At 256 rows SmolLM2's step took 0.322 s fused against 0.371 s
    composed on Zen 5; the fused one (with bf16 products) was the slower on Zen 4 and
    the AMX Xeon (docs/benchmarks.md).  Other backends, and a machine without oneDNN to
    key the cache by: ``ATTN_TILED_MIN``.  ``$GRADTAPE_ATTENTION`` = fused | composed
    decides instead of the timing."""
    import os

    if backend != "cpu" or not tiled.ATTN_TILE < t <= 2 * tiled.ATTN_TILE or \
            t >= ATTN_TILED_MIN:
        return ATTN_TILED_MIN, ""
    forced = os.environ.get("GRADTAPE_ATTENTION")
    if forced in ("fused", "composed"):
        return (t if forced == "fused" else ATTN_TILED_MIN), f"{forced} ($GRADTAPE_ATTENTION)"
    if forced:
        warnings.warn(f"gradtape: $GRADTAPE_ATTENTION={forced} is neither fused nor composed: "
                      "timing both", RuntimeWarning, stacklevel=2)
    from ..backends.cpu import measure as _compute
    from ..backends.cpu.onednn import DnnlError

    shape = (n_seq, t, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim)
    try:
        (composed, fused), cached = _compute.rates(
            f"attention {compute}", shape, lambda *_: _time_attention(cfg, n_seq, t, compute),
            kernels=True)
    except DnnlError:
        return ATTN_TILED_MIN, ""
    why = (f"fused {1e3 * fused:.1f} vs composed {1e3 * composed:.1f} ms at {t} rows, "
           f"timed {'before ' if cached else ''}on this CPU")
    return (t if fused < composed else ATTN_TILED_MIN), ("fused" if fused < composed
                                                        else "composed") + f" ({why})"


# layers of the attention probe: one layer's attention stays in cache and ran both ways
# at about one speed (3.2 against 3.4 ms, SmolLM2's, Zen 5); from four on, its activations
# go through memory as a step's do, and the probe's ratio is the step's (30 layers: 168
# against 107 ms composed / fused; whole steps 0.371 against 0.322 s)
ATTN_PROBE_LAYERS = 4


def _time_attention(cfg, n_seq, t, compute):
    """The seconds (``compute.seconds_in_turn``) of a few layers' attention, forward and
    backward, composed and fused (``attention_from``), as a training step records them:
    the residual rows ``x [n_seq*t, D]`` projected to q, k, v and back by frozen weights
    (so that a bf16 step's program is one here too), packed rows' rope tables and
    segments."""
    from ..backends.cpu.measure import seconds_in_turn

    rng = np.random.default_rng(0)
    n, hd, window = n_seq * t, cfg.head_dim, cfg.window(0)
    cos, sin = (np.tile(c, (n_seq, 1)) for c in rope_tables(cfg, t, layer=0))
    scale = np.float32(1 / math.sqrt(cfg.dim))  # scores of a trained model's size

    weights = {}  # one random matrix per shape, each layer's const a copy of it

    def frozen(tp, rows, cols):
        if (rows, cols) not in weights:
            weights[rows, cols] = scale * rng.standard_normal((rows, cols), dtype=np.float32)
        return tp.const(weights[rows, cols])
    runs = []
    for fused in (False, True):
        tp = Tape(np.float32, eager=False)
        x0 = x = tp.param(rng.standard_normal((n, cfg.dim), dtype=np.float32))
        cosc, sinc, segments = tp.const(cos), tp.const(sin), tp.const(np.zeros(n, np.int64))
        mask = nn.segment_mask(tp, segments, tp.const(nn.causal_mask_fill(t, window=window)),
                               n_seq, t)
        for _ in range(min(cfg.n_layers, ATTN_PROBE_LAYERS)):
            q, k, v = (ops.matmul(x, frozen(tp, cfg.dim, h * hd))
                       for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads))
            if fused:
                o = nn.tiled_attention(tp, q, k, v, cosc, sinc, n_seq, t, cfg.n_heads,
                                       cfg.n_kv_heads, hd, cfg.attn_iscale,
                                       cfg.attn_softcap, window, segments, f32=True)
            else:
                o = nn.gqa_attention_seqs(tp, q, k, v, cosc, sinc, mask, n_seq, t,
                                          cfg.n_heads, cfg.n_kv_heads, hd, cfg.attn_iscale,
                                          cfg.attn_softcap)
            x = ops.add(x, ops.matmul(o, frozen(tp, cfg.n_heads * hd, cfg.dim)))
        loss = ops.reduce_sum(ops.mul(x, tp.const(rng.standard_normal(x.shape,
                                                                      dtype=np.float32))))
        runs.append(tp.compile([tp.backward(loss)[x0]], backend="cpu", compute=compute).run)
    return seconds_in_turn(runs)


def _rope_keys(cfg):
    """``{layer: its rope setting}``; layers with equal settings share one table."""
    return {i: cfg.rope_for(i) for i in range(cfg.n_layers)}


def record_forward(tp, cfg: LlamaConfig, W, ids, n_seq, lora=None, lora_scale=1.0,
                   ones=None, positions=None, segments=None, head=True, fused_from=None):
    """Record the logits ``[n_seq*T, V]`` of ``n_seq`` sequences of length ``T`` (with
    ``head=False`` the last layer's rows ``[n_seq*T, D]``, for ``head_loss``).

    ``ids``: integer const ``[n_seq*T]`` (the sequences concatenated); ``W``: from
    ``weight_consts``; ``lora``: ``None`` or ``{(layer, target): (A [in, r], B [r, out])}``
    of Vars.  Linears, norms and the MLP run on all rows at once; attention per sequence.

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
    hd = cfg.head_dim
    if ones is None:
        ones = nn.ones(tp, cfg.dim)  # [D, 1]
    keys = _rope_keys(cfg)
    tables = {}  # rope setting -> (cos, sin) consts [T, hd/2]
    for i, key in keys.items():
        if key not in tables:
            tables[key] = tuple(tp.const(a) for a in rope_tables(cfg, t, layer=i))
    if positions is not None:  # packed: rope rows per token; attention sees segments
        tables = {key: tuple(ops.take_rows(c, positions) for c in cs)  # [N, hd/2] each
                  for key, cs in tables.items()}
    iscale = cfg.attn_iscale
    lin = _linear_fn(tp, W, lora, lora_scale)

    masks = {}  # composed attention: window -> the additive mask (with the segments')

    def mask_of(window):
        if window not in masks:
            causal = tp.const(nn.causal_mask_fill(t, window=window))
            masks[window] = causal if segments is None else nn.segment_mask(
                tp, segments, causal, n_seq, t)
        return masks[window]

    x = _embed(tp, cfg, W, ids)  # [N, D]
    for i in range(cfg.n_layers):
        def attend(q, k, v, window=cfg.window(i), rope=tables[keys[i]]):
            # all sequences and heads at once; from fused_from rows tiled: no [T, T]
            # scores, the causal mask (and window, segments) applied by position
            cosc, sinc = rope
            if t < fused_from:
                return nn.gqa_attention_seqs(tp, q, k, v, cosc, sinc, mask_of(window), n_seq,
                                             t, cfg.n_heads, cfg.n_kv_heads, hd, iscale,
                                             cfg.attn_softcap)
            return nn.tiled_attention(tp, q, k, v, cosc, sinc, n_seq, t, cfg.n_heads,
                                      cfg.n_kv_heads, hd, iscale, cfg.attn_softcap, window,
                                      segments, f32=t < ATTN_TILED_MIN)

        # each layer's input rows: what a checkpointed step keeps (Tape.checkpoint)
        x = _block(tp, cfg, W, i, tp.checkpoint(x), ones, lin, attend)
    return _head(tp, cfg, W, x, ones) if head else x


# --- KV-cached inference ------------------------------------------------------------------

@dataclass
class KVCache:
    """Per layer, the roped keys and the values of every row seen so far ``[P, nkv*hd]``."""
    k: list
    v: list
    length: int = 0

    @classmethod
    def empty(cls, cfg):
        return cls([None] * cfg.n_layers, [None] * cfg.n_layers, 0)


class _Consts(dict):
    """Weights as consts of one tape, made on first use (a layer's tape needs only its
    own weights)."""

    def __init__(self, tp, arrays):
        super().__init__()
        self.tp, self.arrays = tp, arrays

    def __missing__(self, name):
        v = self[name] = self.tp.const(self.arrays[name])
        return v


def _rope_tables(tp, cos, sin, n):
    """The ``[t, hd/2]`` rope tables repeated per head (``[t*n, hd/2]``) as consts, for
    ``_rope_all`` on ``n`` heads."""
    return tp.const(np.repeat(cos, n, axis=0)), tp.const(np.repeat(sin, n, axis=0))


def _rope_all(tp, x, cos_rep, sin_rep, n, hd):
    """``nn.rope`` on every head of ``x [t, n*hd]`` in one call: the heads are stacked as
    rows (``[t*n, hd]``, row ``p*n + h``) with the tables repeated per head (from
    ``_rope_tables``).  Equal to ``nn.rope_heads`` element for element, with n times
    fewer recorded ops (a decode step is dominated by per-op overhead)."""
    t = x.shape[0]
    rows = ops.reshape(x, (t * n, hd))  # [t*n, hd]
    return ops.reshape(nn.rope(tp, rows, cos_rep, sin_rep, t * n, hd), (t, n * hd))


def _grouped_attention(tp, q, k, v, mask_tiled, nh, nkv, hd, iscale, softcap=0.0):
    """``nn.attention`` with the ``g = nh/nkv`` query heads that share a kv head stacked
    as extra query rows: ``q [tq, nh*hd]`` is regrouped to ``[g*tq, nkv*hd]`` (row
    ``r*tq + p``, column block ``j`` = query head ``j*g + r`` at position ``p``), attended
    with ``nkv`` heads and the ``[tq, tk]`` mask tiled ``g`` times (``mask_tiled [g*tq,
    tk]``), and regrouped back.  Each output row is the same softmax(q k^T * iscale +
    mask) v that ``nn.attention`` computes; GQA costs nkv instead of nh head loops."""
    tq, g = q.shape[0], nh // nkv
    if g == 1:
        return nn.attention(tp, q, k, v, mask_tiled, nh, nkv, hd, iscale, softcap)
    qg = ops.transpose(ops.reshape(q, (tq, nkv, g, hd)), (2, 0, 1, 3))  # [g, tq, nkv, hd]
    qg = ops.reshape(qg, (g * tq, nkv * hd))
    out = nn.attention(tp, qg, k, v, mask_tiled, nkv, nkv, hd, iscale, softcap)  # [g*tq, nkv*hd]
    out = ops.transpose(ops.reshape(out, (g, tq, nkv, hd)), (1, 2, 0, 3))  # [tq, nkv, g, hd]
    return ops.reshape(out, (tq, nh * hd))


def _attend_cached(tp, cfg, i, q, k, v, ropes, past=None):
    """Layer ``i``'s attention of new rows ``q [t, nh*hd]``, ``k, v [t, nkv*hd]`` after the
    cached rows ``past`` (their roped keys and values, consts; None: none): ``(out [t,
    nh*hd], the roped keys and the values of every row)``.  ``ropes``: ``_rope_tables``
    of the new rows' positions for the query heads and for the kv heads.  Tiled over the
    keys (``ops.attn``): no ``[t, past + t]`` scores per head."""
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (cq, sq), (ck, sk) = ropes
    kr = _rope_all(tp, k, ck, sk, nkv, hd)  # [t, nkv*hd]
    if past is not None:
        kr, v = ops.concat([past[0], kr], 0), ops.concat([past[1], v], 0)
    qr = _rope_all(tp, q, cq, sq, nh, hd)  # [t, nh*hd]
    out = ops.attn(qr, kr, v, nh=nh, nkv=nkv, hd=hd, iscale=cfg.attn_iscale,
                   cap=cfg.attn_softcap, window=cfg.window(i))
    return ops.slice_(out, 1, 0, nh * hd), kr, v


def forward_cached(cfg, weights, ids, cache: KVCache, lora=None, lora_scale=1.0,
                   dtype=np.float32, last_only=False) -> np.ndarray:
    """Logits ``[t, V]`` of ``t`` new rows after the ``cache.length`` rows in ``cache``
    (which is extended); ``[1, V]`` of the last row only with ``last_only``.  ``weights``:
    arrays of ``dtype``; ``lora``: ``{(layer, target): (A, B)}`` arrays.  Each layer is
    recorded on its own eager tape from ``_block``."""
    ids = np.asarray(ids, dtype=np.int64)
    t, start = len(ids), cache.length

    tp = Tape(dtype)
    x = _embed(tp, cfg, _Consts(tp, weights), tp.const(ids)).value  # [t, D]
    for i in range(cfg.n_layers):
        tp = Tape(dtype)
        W = _Consts(tp, weights)
        lw = {key: (tp.const(a), tp.const(b)) for key, (a, b) in (lora or {}).items()
              if key[0] == i}
        kv = {}
        cos, sin = rope_tables(cfg, t, start, layer=i)  # [t, hd/2], positions start..

        def attend(q, k, v, i=i):
            ropes = (_rope_tables(tp, cos, sin, cfg.n_heads),
                     _rope_tables(tp, cos, sin, cfg.n_kv_heads))
            past = (tp.const(cache.k[i]), tp.const(cache.v[i])) if start else None
            out, kv["k"], kv["v"] = _attend_cached(tp, cfg, i, q, k, v, ropes, past)
            return out

        out = _block(tp, cfg, W, i, tp.const(x), nn.ones(tp, cfg.dim),
                     _linear_fn(tp, W, lw, lora_scale), attend)
        x = out.value
        cache.k[i], cache.v[i] = kv["k"].value, kv["v"].value
    cache.length = start + t
    if last_only:
        x = x[-1:]  # [1, D]
    tp = Tape(dtype)
    return _head(tp, cfg, _Consts(tp, weights), tp.const(x), nn.ones(tp, cfg.dim)).value


class DecodeStep:
    """One decode step (a single new token) recorded once and replayed per token.

    The graph is ``_block`` x n_layers + the head for one row, attending over a cache of
    fixed capacity ``cap``: per layer the cached roped keys / values ``[cap, nkv*hd]``
    are leaves fed each step, the new row's key / value are appended in-graph
    (``[cap+1, nkv*hd]``), and cache rows not yet written are masked out (-1e9, so their
    softmax weight is exactly 0).  A step feeds the token id, its rope row, the mask and
    the caches, and gets the logits and the new key / value rows back.  Replay skips the
    per-op recording cost that dominates a one-row step on an eager tape.
    """

    def __init__(self, cfg, weights, lora, lora_scale, dtype, cap, backend="numpy"):
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.cfg, self.cap, self.g = cfg, cap, nh // nkv
        tp = Tape(dtype, eager=False)
        W = _Consts(tp, weights)
        lw = {key: (tp.const(a), tp.const(b)) for key, (a, b) in (lora or {}).items()}
        lin = _linear_fn(tp, W, lw, lora_scale)
        zeros = np.zeros
        self.tok = tp.const(zeros(1, np.int64))
        # per rope setting: the position's (cos, sin) rows repeated per q head and per kv
        # head, and a layer that uses it
        self.keys = _rope_keys(cfg)
        self.ropes = {key: (i, tuple(tp.const(zeros((n, hd // 2))) for n in (nh, nh, nkv, nkv)))
                      for i, key in reversed(self.keys.items())}
        # one mask per distinct sliding window (0: full), [g*1, cap+1]
        self.masks = {w: tp.const(zeros((self.g, cap + 1)))
                      for w in sorted({cfg.window(i) for i in range(cfg.n_layers)})}
        self.kc = [tp.const(zeros((cap, nkv * hd))) for _ in range(cfg.n_layers)]
        self.vc = [tp.const(zeros((cap, nkv * hd))) for _ in range(cfg.n_layers)]
        ones = nn.ones(tp, cfg.dim)
        iscale = cfg.attn_iscale
        new_k, new_v = [], []
        x = _embed(tp, cfg, W, self.tok)  # [1, D]
        for i in range(cfg.n_layers):
            def attend(q, k, v, i=i, mask=self.masks[cfg.window(i)],
                       rope=self.ropes[self.keys[i]][1]):
                cq, sq, ck, sk = rope
                kr = _rope_all(tp, k, ck, sk, nkv, hd)  # [1, nkv*hd]
                new_k.append(kr)
                new_v.append(v)
                keys = ops.concat([self.kc[i], kr], 0)  # [cap+1, nkv*hd]
                vals = ops.concat([self.vc[i], v], 0)
                qr = _rope_all(tp, q, cq, sq, nh, hd)  # [1, nh*hd]
                return _grouped_attention(tp, qr, keys, vals, mask, nh, nkv, hd, iscale,
                                          cfg.attn_softcap)
            x = _block(tp, cfg, W, i, x, ones, lin, attend)
        logits = _head(tp, cfg, W, x, ones)  # [1, V]
        self.prog = tp.compile([logits, *new_k, *new_v], backend=backend)
        self.kbuf = [zeros((cap, nkv * hd), dtype) for _ in range(cfg.n_layers)]
        self.vbuf = [zeros((cap, nkv * hd), dtype) for _ in range(cfg.n_layers)]
        self.length = 0

    def load(self, cache: KVCache):
        """Take over the rows of an eager ``KVCache`` (e.g. after the prompt)."""
        n = cache.length
        if n >= self.cap:
            raise ValueError(f"DecodeStep: {n} cached rows do not fit capacity {self.cap}")
        for i in range(self.cfg.n_layers):
            self.kbuf[i][:n], self.vbuf[i][:n] = cache.k[i], cache.v[i]
        self.length = n

    def take(self, other: "DecodeStep"):
        """Take over the cache of a smaller step (growing the capacity)."""
        n = other.length
        for i in range(self.cfg.n_layers):
            self.kbuf[i][:n], self.vbuf[i][:n] = other.kbuf[i][:n], other.vbuf[i][:n]
        self.length = n

    def __call__(self, token) -> np.ndarray:
        """Logits ``[V]`` of ``token`` at position ``self.length``; the cache grows by one."""
        cfg, p = self.cfg, self.length
        if p >= self.cap:
            raise ValueError(f"DecodeStep: the cache is full ({self.cap} rows)")
        feeds = {self.tok: np.array([token])}
        for layer, (cq, sq, ck, sk) in self.ropes.values():
            cos, sin = rope_tables(cfg, 1, p, layer=layer)  # [1, hd/2]
            feeds.update({cq: np.repeat(cos, cfg.n_heads, 0), sq: np.repeat(sin, cfg.n_heads, 0),
                          ck: np.repeat(cos, cfg.n_kv_heads, 0),
                          sk: np.repeat(sin, cfg.n_kv_heads, 0)})
        for w, var in self.masks.items():
            mask = np.zeros((self.g, self.cap + 1))
            mask[:, p:self.cap] = nn.MASK_VALUE  # rows not yet written; the new row is last
            if w:
                mask[:, :max(0, p - w + 1)] = nn.MASK_VALUE  # key j is seen iff j > p - w
            feeds[var] = mask
        feeds.update(zip(self.kc, self.kbuf))
        feeds.update(zip(self.vc, self.vbuf))
        outs = self.prog.run(feeds)
        n = cfg.n_layers
        for i in range(n):
            self.kbuf[i][p], self.vbuf[i][p] = outs[1 + i][0], outs[1 + n + i][0]
        self.length = p + 1
        return outs[0][0]


def _adapter_key(adapter, lora, scale):
    """What the rows a decoder cached with an adapter depend on: the adapter object, its
    scale and its values (a float64 sum of each matrix, so that an adapter trained in
    place between two calls does not decode from rows of its old values); None without."""
    if lora is None:
        return None
    sums = tuple(float(np.sum(m, dtype=np.float64)) for ab in lora.values() for m in ab)
    return id(adapter), scale, sums


class PromptStep:
    """A prompt of up to ``rows`` rows through the whole model as one compiled program
    on the cpu backend, whose frozen-weight GEMMs run in ``compute`` (bf16: the block
    GEMMs of a training step, about 5x the float32 prefill on an 8B Q4_K_M): the logits
    after the prompt's last row and each layer's roped keys and values, which a decoder
    takes over (``load``).  Shorter prompts are padded with id 0 up to ``rows``: causal
    attention keeps the padding out of the real rows, whose keys and values alone are
    kept.  The graph is ``forward_cached``'s at start 0, recorded once and compiled."""

    def __init__(self, cfg, weights, lora, lora_scale, rows, compute):
        self.cfg, self.rows = cfg, rows
        tp = Tape(np.float32, eager=False)
        W = _Consts(tp, weights)
        lw = {key: (tp.const(a), tp.const(b)) for key, (a, b) in (lora or {}).items()}
        lin = _linear_fn(tp, W, lw, lora_scale)
        self.ids = tp.const(np.zeros(rows, np.int64))
        self.last = tp.const(np.zeros(1, np.int64))  # the prompt's last row
        ones = nn.ones(tp, cfg.dim)
        tables = {}  # rope setting -> the (cos, sin) consts repeated per q and kv head
        keys, values = [], []
        x = _embed(tp, cfg, W, self.ids)  # [rows, D]
        for i in range(cfg.n_layers):
            setting = cfg.rope_for(i)
            if setting not in tables:
                cos, sin = rope_tables(cfg, rows, 0, layer=i)  # [rows, hd/2]
                tables[setting] = (_rope_tables(tp, cos, sin, cfg.n_heads),
                                   _rope_tables(tp, cos, sin, cfg.n_kv_heads))

            def attend(q, k, v, i=i, ropes=tables[setting]):
                out, kr, vv = _attend_cached(tp, cfg, i, q, k, v, ropes)
                keys.append(kr)
                values.append(vv)
                return out

            x = _block(tp, cfg, W, i, x, ones, lin, attend)
        logits = _head(tp, cfg, W, ops.take_rows(x, self.last), ones)  # [1, V]
        self.prog = tp.compile([logits, *keys, *values], backend="cpu", compute=compute)

    @property
    def nbytes(self) -> int:
        """Bytes the program holds once it runs: its memory plan (allocated when it is
        compiled, its pages touched on the first run), the block GEMMs' scratch, the bf16
        copies of dense weights and the largest scratch of a fused primitive."""
        ex = self.prog.executable
        return int(self.prog.memory.nbytes + ex.scratch_bytes()
                   + sum(a.nbytes for a in ex.bf16_weights())
                   + fused_scratch_bytes(self.prog.graph))

    def __call__(self, ids, cache: KVCache) -> np.ndarray:
        """Logits ``[V]`` after ``ids`` (at most ``rows``); ``cache`` (empty) gets their
        keys and values: views of the program's outputs, valid until its next call (a
        decoder's ``load`` copies them; an 8B's at 8k rows are 2 GiB)."""
        n, L = len(ids), self.cfg.n_layers
        padded = np.zeros(self.rows, np.int64)
        padded[:n] = ids
        outs = self.prog.run({self.ids: padded, self.last: np.array([n - 1])})
        cache.k = [o[:n] for o in outs[1:1 + L]]
        cache.v = [o[:n] for o in outs[1 + L:]]
        cache.length = n
        return outs[0][0]


# --- the model object ---------------------------------------------------------------------

class Llama:
    """A loaded LLaMA-family model: ``config``, ``tokenizer``, float32 ``weights``, ``name``."""

    def __init__(self, config: LlamaConfig, weights: dict, tokenizer=None, name="",
                 source=""):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self._decode_steps = {}  # (dtype, capacity) -> (adapter, DecodeStep): reused
        self._prompt = None  # (adapter, rows, compute, PromptStep): the last one, reused

    def __repr__(self):
        c = self.config
        return (f"Llama({self.name!r}: {c.n_layers} layers, dim {c.dim}, {c.n_heads}/"
                f"{c.n_kv_heads} heads, vocab {c.vocab_size})")

    @property
    def eos_id(self):
        if self.tokenizer is not None and self.tokenizer.eos_id is not None:
            return self.tokenizer.eos_id
        return self.config.eos_id

    @property
    def stop_ids(self) -> frozenset:
        if self.tokenizer is not None:
            return self.tokenizer.stop_ids
        return frozenset() if self.config.eos_id is None else frozenset({self.config.eos_id})

    # --- helpers ---
    def _weights_as(self, dtype):
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise GradtapeError(f"dtype must be float32 or float64, got {dtype}")
        if all(is_block_matrix(w) or w.dtype == dtype for w in self.weights.values()):
            return self.weights
        # block matrices stay as they are: the block primitives compute in the tape's dtype
        return {k: w if is_block_matrix(w) else w.astype(dtype)
                for k, w in self.weights.items()}

    def _lora(self, adapter, dtype):
        """``(lora arrays {(layer, target): (A, B)}, scale)`` from an adapter object."""
        if adapter is None:
            return None, 1.0
        check_adapter_fits(adapter, self.config)
        out = {key: (np.asarray(a, dtype), np.asarray(b, dtype))
               for key, (a, b) in adapter.weights.items()}
        return out, float(adapter.scale)

    def _check_ids(self, ids):
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) and ids.size:
            raise GradtapeError(f"ids must be a flat list of integers, got shape "
                                f"{list(ids.shape)} dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise GradtapeError(f"token id out of range [0, {self.config.vocab_size}): "
                                f"{int(ids.min())}..{int(ids.max())}")
        return ids

    # --- inference ---
    def logits(self, ids, adapter=None, dtype=np.float32) -> np.ndarray:
        """Next-token logits ``[len(ids), vocab_size]`` (row ``t`` predicts token ``t+1``),
        in ``dtype`` (float32 default, float64 on request)."""
        ids = self._check_ids(ids)
        if ids.size == 0:
            raise GradtapeError("logits: needs at least one token")
        W = self._weights_as(dtype)
        lora, scale = self._lora(adapter, dtype)
        cache = KVCache.empty(self.config)
        rows = [forward_cached(self.config, W, ids[a:a + PREFILL_CHUNK], cache, lora, scale,
                               dtype) for a in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(rows, 0) if len(rows) > 1 else rows[0]

    def _decode_step(self, adapter, W, lora, scale, dtype, cap):
        """A DecodeStep of at least ``cap`` rows, reused across calls with the same adapter
        (compiling one costs far more than a short answer); capacities are rounded up to
        a multiple of 64 so that prompts of similar length share one."""
        cap = -(-cap // 64) * 64
        key = (np.dtype(dtype).str, cap)
        hit = self._decode_steps.get(key)
        if hit is None or hit[0] is not adapter:
            if hit is not None and hit[0] is not adapter:
                self._decode_steps.clear()  # another adapter: drop the old programs
            hit = self._decode_steps[key] = (adapter, DecodeStep(self.config, W, lora, scale,
                                                                 dtype, cap))
        return hit[1]

    def _prompt_compute(self, compute, rows, dtype):
        """The precision ``generate`` runs a prompt of ``rows`` rows in as one compiled
        ``PromptStep``, or None: row by row in the decoder's own prefill.  "bf16" (or
        "int8") under ``auto`` where this CPU's bf16 GEMMs are faster and the prompt's
        work pays for compiling the program (``PROMPT_BF16_FLOPS``), under ``bf16``
        wherever the prompt has more rows than the matrix-vector kernels take and this
        CPU's bf16 GEMMs are fast at the model's width (at 256 rows); else "float32"
        from ``PROMPT_F32_ROWS`` rows on (the program's tiled attention)."""
        from ..backends.cpu import ggml_vec
        from ..backends.cpu.measure import COMPUTE_CHOICES, DEFAULT_SHAPE, decide

        if compute not in COMPUTE_CHOICES:
            raise GradtapeError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, "
                                f"got {compute!r}")
        cfg, precision = self.config, "float32"
        small = compute == "auto" and 2 * rows * linear_weights(cfg) < PROMPT_BF16_FLOPS
        if compute != "float32" and rows > ggml_vec.MAX_ROWS and not small:
            applies = np.dtype(dtype) == np.float32 or "generation in float64 runs float64"
            # asked for by name: wherever this CPU's bf16 GEMMs are fast at the model's
            # width, whatever the prompt's length
            m = rows if compute == "auto" else DEFAULT_SHAPE[0]
            precision, _ = decide(compute, applies, shape=(m, cfg.dim, cfg.ffn_dim))
        if precision != "float32":
            return precision
        return "float32" if np.dtype(dtype) == np.float32 and rows >= PROMPT_F32_ROWS else None

    def _prompt_step(self, adapter, lora, scale, rows, compute):
        """A PromptStep of ``rows`` rounded up to a multiple of ``PROMPT_PAD`` (of 16
        below it); the last one is kept and reused by the next prompt of its size,
        adapter and precision (a chat's prompts only grow: older sizes are not).  None,
        with a warning, where the program would hold more than ``PROMPT_MEM_SHARE`` of
        the memory available: the caller prefills row by row."""
        pad = PROMPT_PAD if rows > PROMPT_PAD else 16
        key = (adapter, -(-rows // pad) * pad, compute)
        hit = self._prompt
        if hit is None or hit[0] is not key[0] or hit[1:3] != key[1:]:
            self._prompt = None  # its buffers go before the next program's are made
            available = mem_available()
            try:  # its arena is allocated here, its pages touched on the first run
                step = PromptStep(self.config, self.weights, lora, scale, key[1], compute)
            except MemoryError:  # more than the kernel lets one allocation have
                step = None
            if step is None or (available is not None
                                and step.nbytes > PROMPT_MEM_SHARE * available):
                held = f"{step.nbytes / GiB:.2f} GiB" if step else "more than it can have"
                free = "" if available is None else f", {available / GiB:.2f} GiB available"
                warnings.warn(f"gradtape: a prompt of {rows} rows as one program would "
                              f"hold {held}{free}: prefilling it row by row",
                              RuntimeWarning, stacklevel=3)
                return None
            hit = self._prompt = (*key, step)
        return hit[3]

    def _use_blocks(self, decoder, dtype, lora):
        if decoder not in ("auto", "blocks", "graph"):
            raise GradtapeError(f"decoder must be 'auto', 'blocks' or 'graph', got {decoder!r}")
        if decoder == "graph":
            return False
        ok = (np.dtype(dtype) == np.float32 and decode_engine.supported(self)
              and all(a.shape[1] <= decode_engine.MAX_RANK for a, _ in (lora or {}).values()))
        if decoder == "blocks" and not ok:
            raise GradtapeError("decoder 'blocks' needs float32, a C compiler, row lengths "
                                "that are multiples of 16 and a LoRA rank <= "
                                f"{decode_engine.MAX_RANK}")
        return ok

    def _block_decoder(self, adapter, lora, scale, need):
        """A ``decode_engine.BlockDecoder`` with room for ``need`` rows (capacity rounded
        up to a multiple of 256), reused across calls (its KV cache and the block views
        of the weights, taken once per model); the adapter is set afresh every call, and
        the cached rows are forgotten where they were computed with another adapter, or
        with this one before its values changed (``_adapter_key``)."""
        if getattr(self, "_blocks", None) is None:
            self._blocks = decode_engine.block_weights(self)
        hit = getattr(self, "_block_dec", None)
        if hit is None or hit[1].cap < need:  # (a larger one takes over the cached rows)
            cap = min(-(-need // 256) * 256, max(need, self.config.max_seq_len))
            grown = decode_engine.BlockDecoder(self, self._blocks, cap=cap)
            if hit is not None:
                grown.take(hit[1])
            hit = (hit and hit[0], grown)
        key, dec = _adapter_key(adapter, lora, scale), hit[1]
        if key != hit[0]:
            dec.ids = []
        dec.set_lora(lora, scale)
        self._block_dec = (key, dec)
        return dec

    def generate(self, ids, max_new_tokens, temperature=0.0, adapter=None, seed=0, *,
                 top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, stop=None,
                 stream=None, dtype=np.float32, stop_ids=None, decoder="auto",
                 compute="auto") -> list[int]:
        """New token ids after the prompt ``ids``: greedy at ``temperature == 0``, else
        sampled (``generate.Sampling`` gives the steps: repetition penalty, temperature,
        top-k, top-p, min-p) from a generator seeded by ``seed``.  Stops after an
        end-of-sequence token (``stop_ids``, default the tokenizer's), after the token that
        completes one of the ``stop`` strings (both included), or after
        ``max_new_tokens``; the prompt plus ``max_new_tokens`` must fit the context.
        ``stream(token_id)`` is called for each new token as it is produced.

        ``decoder``: ``"blocks"`` decodes with the one-call C step over the weights as
        stored (``decode_engine``; float32 only), ``"graph"`` replays the recorded graph
        (``DecodeStep``), ``"auto"`` (default) takes ``"blocks"`` where it can run.
        ``compute`` (float32, bf16, int8, auto): the precision of the prompt's GEMMs
        (``_prompt_compute``); the new tokens are always decoded in float32 (``dtype``)."""
        s = Sampling(temperature, top_k, top_p, min_p, repetition_penalty, seed)
        stop = check_stop_strings(stop)
        if stop and self.tokenizer is None:
            raise GradtapeError("stop strings need a tokenizer, and this model has none")
        ids = self._check_ids(ids)
        if ids.size == 0:
            raise GradtapeError("generate: needs a prompt of at least one token")
        check_length(len(ids), max_new_tokens, self.config.max_seq_len)
        stops = self.stop_ids if stop_ids is None else frozenset(stop_ids)
        W = self._weights_as(dtype)
        lora, scale = self._lora(adapter, dtype)
        cache = KVCache.empty(self.config)
        state = {}
        fast = self._use_blocks(decoder, dtype, lora)
        compiled = self._prompt_compute(compute, len(ids), dtype)

        def prefill(prompt):
            if fast:
                dec = state["fast"] = self._block_decoder(adapter, lora, scale,
                                                          len(prompt) + max_new_tokens)
                # a chat's history: the rest only (float32 asked for keeps float32 rows)
                kept = dec.kept(prompt) if compute != "float32" or dec.exact else 0
                if kept and kept >= len(prompt) - kept:
                    dec.length = kept
                    return dec.prefill(prompt[kept:])
            # one compiled program, where it fits; the decoder takes over its cache
            program = compiled and self._prompt_step(adapter, lora, scale, len(prompt),
                                                     compiled)
            if program:
                logits = program(prompt, cache)
                if fast:
                    dec.load(cache, prompt)
                    dec.exact = compiled == "float32"
                return logits
            if fast:  # many rows per C call, GEMMs from the stored blocks
                dec.length, dec.exact = 0, True
                return dec.prefill(prompt)
            for a in range(0, len(prompt), PREFILL_CHUNK):  # the batched graph, in chunks
                last = forward_cached(self.config, W, prompt[a:a + PREFILL_CHUNK], cache,
                                      lora, scale, dtype, last_only=True)[-1]
            return last

        def decode(tok):
            if fast:
                return state["fast"].step(tok)
            step = state.get("step")
            if step is None or step.length >= step.cap:  # (re)build with room to grow
                need = len(ids) + max_new_tokens - 1
                cap = min(need, max(2 * (step.cap if step else 0), len(ids) + 256))
                grown = self._decode_step(adapter, W, lora, scale, dtype, cap)
                if step is None:
                    grown.load(cache)
                else:
                    grown.take(step)
                step = state["step"] = grown
            return step(tok)

        return run_loop(ids, max_new_tokens, s, prefill, decode, stops, stop,
                        self.tokenizer.decode if stop else None, stream)
