"""The C decode engine's wrapper: one token through the whole model in one C call, reading
the weights as stored in the GGUF file (``backends/cpu/csrc/llama_decode.c``).

``block_weights(model)`` gives every linear as ggml blocks ``(qtype, data [out,
row_bytes])``: the loader's block matrices, or the mapped GGUF tensors themselves (only
attn_q / attn_k rows are reordered, into our half-split rope layout, which copies those
two), or, for weights that are not the file's, float32 rows ``[out, in]`` (``F32``).  A
fused linear (Phi-3's ``qkv``, rows q | k | v, and ``gate_up``, rows gate | up) comes as
the separate linears the C step runs: ggml quantizes each row on its own, so the parts
are row slices of the stored blocks, not copies.

``BlockDecoder`` holds the preallocated KV cache ``[layers, nkv, cap, hd]``, the rope
tables (one per distinct layer setting, ``LlamaConfig.rope_for``), the family's biases,
q/k norms and windows, and the C struct that points at all of it; a step is one ctypes
call.  An adapter is applied unmerged (its A and B stay float32 and add ``scale * (h A)
B`` to each adapted row; DoRA then scales each output row by its fixed factor ``m /
||w0 + s A B||``); a fused linear's adapter adapts its parts with one A and B
split by columns, ``h A B = [h A B_q | h A B_k | h A B_v]``.  The arithmetic is
``models.graph.block`` in float32 with the same dequantized weights; only the order of
float32 sums differs from the graph replay, unless the step's products read their input
row quantized to 8 bits (``dots="q8"``, the default of ``$GRADTAPE_DECODE_DOTS``: llama.cpp's
scheme, ``csrc/q8_dots.c``) for the weight types that have integer dots, and the cache
holds halves (``kv="f16"``, which ``"q8"`` keeps where no ``kv`` is asked for: llama.cpp's
default cache, half the bytes a step streams at long context); then the logits differ
from the float32 graph's as llama.cpp's do.  ``prefill`` runs a prompt through the same
layers many rows per call (GEMMs from panels of dequantized weight rows; with ``"q8"``
where AMX-INT8 runs, the products with 32-element block weights read their rows
quantized as the steps do, integer GEMMs on AMX tiles: ``csrc/q8_amx.c``); ``load``
takes over a cache filled by the graph instead.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from ..backends.cpu import ggml_vec
from ..models.arch import ARCHS, LINEARS
from ..models.load_gguf import unpermute_rope_rows
from ..models.rope import rope_tables
from ..settings import DECODE_DOTS, decode_dots

_LINS = ("q", "k", "v", "o", "gate", "up", "down")  # the C enum's order
MAX_RANK = 64  # the C step's LoRA scratch holds r <= 64 per target
PREFILL_ROWS = 64  # prompt rows per C prefill call (their activations stay in L2)
# ... where its products run as integer GEMMs on AMX tiles (q8 dots, ggml_vec.amx_int8)
# or the float32 ones on AVX2's packed kernel (ggml_vec.packed_gemm): each panel of
# weight rows is unpacked or packed once per call, so more rows a call pay for it
PREFILL_ROWS_WIDE = 256
KV_TYPES = {"f32": np.float32, "f16": np.float16}  # the cache's element types
# ... the one each way of multiplying keeps where none is asked for
KV_OF_DOTS = {"q8": "f16", "float": "f32"}


class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("k", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("at", ctypes.c_void_p), ("b", ctypes.c_void_p), ("r", ctypes.c_int64),
                ("scale", ctypes.c_float), ("bias", ctypes.c_void_p), ("col", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("dim", "n_layers", "nh", "nkv", "hd", "ffn",
                                              "vocab", "cap", "nthreads")] + [
        ("eps", ctypes.c_float), ("lin", ctypes.c_void_p), ("embd", _Lin), ("head", _Lin),
        ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
        ("norm", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("rope_of", ctypes.c_void_p),
        ("window", ctypes.c_void_p), ("iscale", ctypes.c_float),
        ("post_attn_norm", ctypes.c_void_p), ("post_ffn_norm", ctypes.c_void_p),
        ("embed_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float), ("geglu", ctypes.c_int64), ("q8", ctypes.c_int64),
        ("kv16", ctypes.c_int64)]


def _fused_parts(cfg) -> dict:
    """``{fused linear: ((part, lo, hi), ...)}``: the separate linears a fused one holds,
    each its output range (``graph.block`` slices the same columns); {} when unfused."""
    if not cfg.fused:
        return {}
    nq, nk, F = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return {"qkv": (("q", 0, nq), ("k", nq, nq + nk), ("v", nq + nk, nq + 2 * nk)),
            "gate_up": (("gate", 0, F), ("up", F, 2 * F))}


def _split_fused(cfg, d, key, cut) -> dict:
    """``d`` with each fused linear's entry ``d[key(layer, fused)]`` replaced by its parts'
    ``d[key(layer, part)] = cut(value, lo, hi)`` (``_fused_parts``' output ranges)."""
    out = dict(d)
    for i in range(cfg.n_layers):
        for fused, parts in _fused_parts(cfg).items():
            v = out.pop(key(i, fused), None)
            if v is not None:
                out.update({key(i, t): cut(v, lo, hi) for t, lo, hi in parts})
    return out


def _lin_names(cfg) -> list:
    """Our names of the model's linears (fused or separate, as its weights hold them)."""
    shapes = cfg.weight_shapes()
    return [n for i in range(cfg.n_layers) for t in LINEARS
            for n in [f"layers.{i}.{t}"] if n in shapes]


def _gguf_blocks(model):
    """``{our name: (qtype, data)}`` of the linears and tables in the model's GGUF file,
    or None when the model has no GGUF file or a type the kernels lack."""
    src = Path(getattr(model, "source", "") or "")
    if src.suffix.lower() != ".gguf" or not src.is_file():
        return None
    from ..formats.gguf_reader import GGUFFile
    gf = GGUFFile(src)
    cfg, out = model.config, {}
    arch = ARCHS[cfg.arch]
    gguf_of = {ours: g for g, ours in arch.gguf_block.items()}
    names = {"tok_embd": "token_embd.weight", "lm_head": "output.weight"}
    for name in _lin_names(cfg):
        i, t = name.split(".")[1:]
        names[name] = f"blk.{i}.{gguf_of[t]}.weight"
    for ours, gname in names.items():
        t = gf.tensors.get(gname)
        if t is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in ggml_vec.QTYPES:
            return None
        data = t.data
        if data.ndim == 1:
            data = data.reshape(1, -1)
        if qtype == "F32" and data.dtype != np.uint8:
            data = np.ascontiguousarray(data).view(np.uint8)
        if not arch.permute_qk:  # q / k rows already in our half-split order (Qwen)
            pass
        elif ours.endswith(".q"):
            data = np.ascontiguousarray(unpermute_rope_rows(data, cfg.n_heads))
        elif ours.endswith(".k"):
            data = np.ascontiguousarray(unpermute_rope_rows(data, cfg.n_kv_heads))
        out[ours] = (qtype, data)
    return out


def _same_rows(qtype, data, w, linear) -> bool:
    """Whether float weights ``w`` (ours: ``[in, out]`` for a linear, ``[V, D]`` for a
    table) are the blocks' dequantized values, checked bitwise on three rows.  A model
    built from changed weights (``export.merged_model`` keeps the base file as its
    source) then does not decode from the file's unchanged blocks."""
    rows = data.shape[0]
    pick = sorted({0, rows // 2, rows - 1})
    got = ggml_vec.take_rows(qtype, data, pick)
    want = np.asarray(w[:, pick].T if linear else w[pick], np.float32)
    return got.shape == want.shape and np.array_equal(got.view(np.uint32),
                                                      want.view(np.uint32))


def block_weights(model) -> dict:
    """``{name: (qtype, data [out, row_bytes])}`` for every linear, the token table and
    (untied models) the LM head: block matrices kept by the loader as they are
    (``blocks.BlockMatrix``), else the GGUF file's blocks where they hold the
    model's float weights, else float32 rows ``[out, in]`` copied from the weights.
    Fused linears come as their parts (``_fused_parts``), row slices of the fused
    matrix."""
    cfg = model.config
    W = model.weights
    need = _lin_names(cfg) + ["tok_embd"]
    if not cfg.tie_embeddings:
        need.append("lm_head")
    stored = None
    got = {}
    for name in need:
        w = W[name]
        if hasattr(w, "qtype") and hasattr(w, "data"):  # a BlockMatrix: [out, in] as stored
            got[name] = (w.qtype, w.data)
            continue
        linear = name.startswith("layers.")
        if stored is None:
            stored = _gguf_blocks(model) or {}
        blk = stored.get(name)
        if blk is not None and _same_rows(*blk, w, linear):
            got[name] = blk
            continue
        w = np.asarray(w, np.float32)
        got[name] = ("F32", np.ascontiguousarray(w.T if linear else w).view(np.uint8))
    # whole rows: each row's blocks (and scales) are its own
    return _split_fused(cfg, got, lambda i, t: f"layers.{i}.{t}",
                        lambda blk, lo, hi: (blk[0], blk[1][lo:hi]))


# The C step computes every family feature of ``LlamaConfig``: biases on any linear,
# fused projections (split by rows, ``_fused_parts``), per-head q/k RMSNorm, sliding
# windows, every rope setting ``rope_for`` gives (llama3 / linear factors, a local base,
# no rope) as per-layer tables, and Gemma's block: (1 + w) norms, embeddings times
# sqrt(dim), norms after attention and MLP, GeGLU, attention and final soft-caps, the
# query scale.  What it lacks is row lengths its kernels do not take (``supported``).
_ACTS = {"silu": 0, "gelu_tanh": 1}  # the C step's gated activations (its geglu flag)


def supported(model) -> bool:
    """Whether the C step can run this model: a compiler, row lengths the kernels take
    (multiples of 16), a gated activation it has, and the weights its config names."""
    cfg = model.config
    if not ggml_vec.available() or cfg.head_dim % 16 or cfg.n_heads % cfg.n_kv_heads:
        return False
    if cfg.act not in _ACTS:
        return False
    if set(model.weights) != set(cfg.weight_shapes()):
        return False
    return cfg.dim % 16 == 0 and cfg.ffn_dim % 16 == 0 and cfg.n_heads * cfg.head_dim % 16 == 0


class BlockDecoder:
    """One decode step from block weights, with a preallocated KV cache of ``cap`` rows
    (``kv``: ``"f32"`` or ``"f16"``, rounded to nearest even as NumPy casts; None: the
    one its ``dots`` keep, ``KV_OF_DOTS``).

    ``load(cache)`` takes over an eager ``KVCache`` (the prefilled prompt);
    ``step(token)`` returns the logits ``[V]`` (a buffer reused by the next step) and
    appends the token's key and value rows."""

    def __init__(self, model, blocks, lora=None, lora_scale=1.0, cap=256, nthreads=None,
                 dots=None, kv=None):
        cfg = model.config
        if kv is not None and kv not in KV_TYPES:
            raise ValueError(f"BlockDecoder: kv={kv!r}, not one of {', '.join(KV_TYPES)}")
        self.cfg, self.cap = cfg, int(cap)
        self.keep = []  # every array the C struct points at
        lins = (_Lin * (cfg.n_layers * len(_LINS)))()
        for i in range(cfg.n_layers):
            for j, t in enumerate(_LINS):
                lins[i * len(_LINS) + j] = self._lin(blocks[f"layers.{i}.{t}"])
        self.lins = lins
        self.set_lora(lora, lora_scale)
        W = model.weights
        def norm_w(w):  # the factor of a norm: w, or 1 + w (Gemma), in float32 as the graph
            w = np.ascontiguousarray(w, np.float32)
            return w + np.float32(1.0) if cfg.norm_plus_one else w

        def stacked(name):  # [n_layers, ...]
            return norm_w(np.stack([W[f"layers.{i}.{name}"] for i in range(cfg.n_layers)]))

        norms = [stacked("attn_norm"), stacked("ffn_norm"), norm_w(W["norm"])]
        self.keep += norms
        # biases: added by the C linear to its output rows (a fused one's split as its rows)
        def bias_of(i, t):
            return f"layers.{i}.{t}_bias"

        biases = _split_fused(cfg, {bias_of(i, t): W[bias_of(i, t)] for i in range(cfg.n_layers)
                                    for t in cfg.biases}, bias_of, lambda b, lo, hi: b[lo:hi])
        for i in range(cfg.n_layers):
            for j, t in enumerate(_LINS):
                if bias_of(i, t) in biases:
                    b = np.ascontiguousarray(biases[bias_of(i, t)], np.float32)
                    self.keep.append(b)
                    lins[i * len(_LINS) + j].bias = b.ctypes.data
        qk = [stacked("q_norm"), stacked("k_norm")] if cfg.qk_norm else None
        post = [stacked("post_attn_norm"), stacked("post_ffn_norm")] if cfg.post_norms else None
        self.keep += (qk or []) + (post or [])
        # each key / value head's rows together: a step's attention streams them (made
        # by set_dots, in the type the dots keep or kv)
        self.kv_asked, self.kc, self.vc = kv, None, None
        # one rope table [cap, hd/2] per distinct layer setting (the graph's rope_tables:
        # base and factors, or cos 1 / sin 0 for a layer without rope)
        settings = {}
        for i in range(cfg.n_layers):
            settings.setdefault(cfg.rope_for(i), i)
        tabs = [rope_tables(cfg, self.cap, layer=i) for i in settings.values()]
        self.cos = np.ascontiguousarray(np.stack([c for c, _ in tabs]), np.float32)
        self.sin = np.ascontiguousarray(np.stack([s for _, s in tabs]), np.float32)
        order = list(settings)
        self.rope_of = np.array([order.index(cfg.rope_for(i)) for i in range(cfg.n_layers)],
                                np.int64)
        self.window = np.array([cfg.window(i) for i in range(cfg.n_layers)], np.int64)
        m = _Model(dim=cfg.dim, n_layers=cfg.n_layers, nh=cfg.n_heads, nkv=cfg.n_kv_heads,
                   hd=cfg.head_dim, ffn=cfg.ffn_dim, vocab=cfg.vocab_size, cap=self.cap,
                   nthreads=nthreads or ggml_vec.threads(), eps=cfg.norm_eps,
                   iscale=cfg.attn_iscale, attn_softcap=cfg.attn_softcap,
                   final_softcap=cfg.final_softcap, geglu=_ACTS[cfg.act],
                   embed_scale=math.sqrt(cfg.dim) if cfg.embed_scale else 0.0)
        if post:
            m.post_attn_norm, m.post_ffn_norm = post[0].ctypes.data, post[1].ctypes.data
        if qk:
            m.q_norm, m.k_norm = qk[0].ctypes.data, qk[1].ctypes.data
        m.rope_of, m.window = self.rope_of.ctypes.data, self.window.ctypes.data
        m.lin = ctypes.addressof(lins)
        m.embd = self._lin(blocks["tok_embd"])
        m.head = self._lin(blocks["tok_embd" if cfg.tie_embeddings else "lm_head"])
        m.attn_norm, m.ffn_norm, m.norm = (a.ctypes.data for a in norms)
        m.cos, m.sin = self.cos.ctypes.data, self.sin.ctypes.data
        lib = ggml_vec.lib()
        self.scratch = np.zeros(lib.gd_scratch_floats(ctypes.byref(m)), np.float32)
        m.scratch = self.scratch.ctypes.data
        self.m = m
        self.set_dots(dots)
        self.logits = np.zeros(cfg.vocab_size, np.float32)
        self._call = lib.gd_step
        self._args = (ctypes.addressof(m), self.logits.ctypes.data)
        self._pbuf, self._pbuf_rows = None, 0
        self.length = 0
        self.ids = []  # the tokens of the cached rows, where known (see kept)
        self.exact = True  # whether the cached rows were computed in float32 (generate)

    def set_dots(self, dots=None):
        """How the steps multiply: ``"q8"`` (8-bit input rows, integer dots where the
        weight type has them) or ``"float"``; None: ``$GRADTAPE_DECODE_DOTS``; and the
        cache's type that goes with it where the decoder was given no ``kv``.  A change
        forgets which tokens the cached rows hold (their values came from the other way),
        so the next prompt is run again."""
        dots = dots or decode_dots()
        if dots not in DECODE_DOTS:
            raise ValueError(f"BlockDecoder: dots={dots!r}, not one of {', '.join(DECODE_DOTS)}")
        if getattr(self, "dots", dots) != dots:
            self.ids = []
        self.dots = dots
        self.m.q8 = int(dots == "q8")
        kind = self.kv_asked or KV_OF_DOTS[dots]
        dtype = KV_TYPES[kind]
        if self.kc is None:
            shape = (self.cfg.n_layers, self.cfg.n_kv_heads, self.cap, self.cfg.head_dim)
            self.kc, self.vc = np.zeros(shape, dtype), np.zeros(shape, dtype)
        elif self.kc.dtype != dtype:
            self.kc, self.vc = self.kc.astype(dtype), self.vc.astype(dtype)
        self.kv = kind
        self.m.kc, self.m.vc = self.kc.ctypes.data, self.vc.ctypes.data
        self.m.kv16 = int(kind == "f16")

    def _lin(self, block):
        qtype, data = block
        k = ggml_vec.row_elems(qtype, data)
        self.keep.append(data)
        return _Lin(w=data.ctypes.data, type=ggml_vec.QTYPES[qtype][0], rows=data.shape[0],
                    k=k, row_bytes=data.shape[1])

    def set_lora(self, lora, scale=1.0):
        """Point the linears at an adapter's ``{(layer, target): (A [in, r], B [r, out])}``
        (DoRA: ``(A, B, c [out])``, each output row then scaled by ``c``; None: no adapter).  The C step reads A transposed, ``[r, in]`` (a float32
        copy, small beside the weights: each rank row is then one contiguous dot
        product); B is used where it is when it is float32 and C-contiguous.  A fused
        linear's ``(A, B)`` adapts its parts: ``(A, B[:, lo:hi])`` each, at the same
        scale (``_fused_parts``; the parts share one A transposed)."""
        self.lora_keep = []
        lora = _split_fused(self.cfg, lora or {}, lambda i, t: (i, t),
                            lambda ab, lo, hi: (ab[0], ab[1][:, lo:hi])
                            + tuple(c[lo:hi] for c in ab[2:]))
        ats = {}  # id(A) -> A transposed: one copy for the parts of a fused linear
        for i in range(self.cfg.n_layers):
            for j, t in enumerate(_LINS):
                lin = self.lins[i * len(_LINS) + j]
                ab = lora.get((i, t))
                if ab is None:
                    lin.at = lin.b = lin.col = None
                    lin.r, lin.scale = 0, 0.0
                    continue
                a = np.asarray(ab[0])  # [in, r]
                b = np.ascontiguousarray(ab[1], np.float32)  # [r, out]
                if a.shape != (lin.k, a.shape[1]) or b.shape != (a.shape[1], lin.rows):
                    raise ValueError(f"BlockDecoder: LoRA ({i}, {t}) A{list(a.shape)} "
                                     f"B{list(b.shape)} do not fit [{lin.rows}, {lin.k}]")
                if a.shape[1] > MAX_RANK:
                    raise ValueError(f"BlockDecoder: LoRA rank {a.shape[1]} > {MAX_RANK}")
                at = ats.get(id(ab[0]))  # (the split dict keeps each A alive)
                if at is None:
                    at = ats[id(ab[0])] = np.ascontiguousarray(a.T, np.float32)
                self.lora_keep += [at, b]
                lin.at, lin.b, lin.r, lin.scale = at.ctypes.data, b.ctypes.data, a.shape[1], scale
                lin.col = None
                if len(ab) == 3:  # DoRA: its fixed column factor (``infer.inputs.lora_arrays``)
                    col = np.ascontiguousarray(ab[2], np.float32)
                    if col.shape != (lin.rows,):
                        raise ValueError(f"BlockDecoder: DoRA ({i}, {t}) factor "
                                         f"{list(col.shape)} does not fit {lin.rows} rows")
                    self.lora_keep.append(col)
                    lin.col = col.ctypes.data

    def load(self, cache, ids=()):
        """Take over the rows of ``cache`` (a KVCache), the keys and values of the tokens
        ``ids`` (where known), in the cache's type."""
        n = cache.length
        if n >= self.cap:
            raise ValueError(f"BlockDecoder: {n} cached rows do not fit capacity {self.cap}")
        nkv, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        for i in range(self.cfg.n_layers):
            self.kc[i, :, :n] = np.asarray(cache.k[i]).reshape(n, nkv, hd).transpose(1, 0, 2)
            self.vc[i, :, :n] = np.asarray(cache.v[i]).reshape(n, nkv, hd).transpose(1, 0, 2)
        self.length = n
        self.ids = [int(t) for t in ids]

    def take(self, other: "BlockDecoder"):
        """Take over the cached rows (and their tokens) of a smaller decoder, in this
        one's cache type."""
        n = other.length
        self.kc[:, :, :n], self.vc[:, :, :n] = other.kc[:, :, :n], other.vc[:, :, :n]
        self.length, self.ids, self.exact = n, list(other.ids[:n]), other.exact

    def rows(self, i, n=None):
        """Layer ``i``'s first ``n`` (default: all) cached keys and values as float32 rows
        ``[n, nkv * hd]`` (copies; the cache holds each head's rows together)."""
        n = self.length if n is None else n
        return tuple(np.asarray(c[i, :, :n].transpose(1, 0, 2).reshape(n, -1), np.float32)
                     for c in (self.kc, self.vc))

    def kept(self, prompt) -> int:
        """How many of the cached rows ``prompt`` starts with: those need no prefill (at
        most ``len(prompt) - 1``: its last row is run again, for the logits)."""
        n = min(self.length, len(self.ids), len(prompt) - 1)
        if n <= 0:
            return 0
        differ = np.flatnonzero(np.asarray(self.ids[:n]) != np.asarray(prompt[:n]))
        return int(differ[0]) if differ.size else n

    def prefill(self, ids) -> np.ndarray:
        """Logits ``[V]`` after the rows ``ids`` (appended to the cache), computed
        ``PREFILL_ROWS`` rows per C call with GEMMs from the blocks (``PREFILL_ROWS_WIDE``
        where the q8 products run on AMX tiles or the float32 ones packed)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.length + len(ids) > self.cap:
            raise ValueError(f"BlockDecoder: {self.length} + {len(ids)} rows do not fit "
                             f"capacity {self.cap}")
        lib = ggml_vec.lib()
        self.ids[self.length:] = ids.tolist()
        wide = (self.dots == "q8" and ggml_vec.amx_int8()) or ggml_vec.packed_gemm()
        rows = PREFILL_ROWS_WIDE if wide else PREFILL_ROWS
        if self._pbuf is None or self._pbuf_rows < rows:
            n = lib.gd_prefill_floats(ctypes.addressof(self.m), rows)
            self._pbuf, self._pbuf_rows = np.zeros(n, np.float32), rows
        for a in range(0, len(ids), rows):
            chunk = ids[a:a + rows]
            last = a + rows >= len(ids)  # only the last chunk computes logits
            lib.gd_prefill(self._args[0], chunk.ctypes.data, len(chunk), self.length,
                           self._args[1] if last else None, self._pbuf.ctypes.data)
            self.length += len(chunk)
        return self.logits

    def step(self, token) -> np.ndarray:
        p = self.length
        if p >= self.cap:
            raise ValueError(f"BlockDecoder: the cache is full ({self.cap} rows)")
        self._call(self._args[0], int(token), p, self._args[1])
        self.ids[p:] = [int(token)]
        self.length = p + 1
        return self.logits
