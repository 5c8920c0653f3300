"""Loading a GGUF file of a family in ``models.arch``: config, float32 weights, tokenizer.

The header is read by ``formats.gguf_reader.GGUFFile``, which validates every count,
offset and size against the file before use; tensors are dequantized by llama.cpp's own
``gguf`` package (``gguf.quants.dequantize``: every ggml type it implements).  Weights
come out in OUR names and orientation (see
``model``): linears ``[in, out]``, the token embedding ``[V, D]``.  llama.cpp's converter
permuted the rows of ``attn_q``/``attn_k`` from Hugging Face's half-split rope layout into
its interleaved one for the llama architecture only (not for qwen2, qwen3, phi3, gemma2,
whose llama.cpp rope is NEOX already); we undo that because our
rope is NEOX half-split.  Every tensor's name and shape is checked against the config
before it is used; a tensor the family does not have is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..blocks import BLOCK_TYPES, BlockMatrix
from ..errors import FileFormatError
from ..formats.gguf_reader import GGUFFile, check_tokenizer_meta
from .arch import LINEARS, gguf_arch
from .config import LlamaConfig, from_gguf_metadata
from .tokenizer import Tokenizer

_TOP_NAMES = {"token_embd": "tok_embd", "output_norm": "norm", "output": "lm_head"}
# Linear layers are stored [out, in] (numpy order of ggml's [in, out]); we keep [in, out].
_LINEARS = set(LINEARS)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: interleaved rope pairs -> half-split halves.

    ``w [out, in]`` with ``out = n_head * hd``; within each head, llama.cpp stored row
    ``2j + c`` for HF row ``c * hd/2 + j``; this returns HF's row order."""
    out, inp = w.shape
    if out % (2 * n_head):
        raise ValueError(f"unpermute: {out} rows do not split into {n_head} heads of pairs")
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of ``unpermute_rope_rows`` (HF half-split -> llama.cpp interleaved)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path, tokenizer=True, keep_quantized=False) -> tuple[LlamaConfig, dict,
                                                                  Tokenizer | None, str]:
    """``(config, weights, tokenizer, name)`` from a GGUF model file; ``tokenizer=False``
    skips the vocabulary (``None``): the model then runs on token ids, e.g. with a
    tokenizer from elsewhere when the file's kind is one we do not read (sentencepiece).

    ``keep_quantized``: the matrices (linears, embedding, LM head) stay in their stored
    ggml type as ``BlockMatrix`` views of the memory-mapped file (``[out, in]``, as
    stored; llama q/k rows un-permuted into a copy), never expanded; F32 matrices and the
    norms load as float32.  A matrix of a ggml type we cannot run is an error naming it.
    """

    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: no such file")
    gf = GGUFFile(path)
    meta = gf.meta
    gtype = meta.get("general.type", "model")
    if gtype != "model":
        raise FileFormatError(f"{path}: general.type is {gtype!r} (an adapter?), not a model")
    arch = gguf_arch(meta.get("general.architecture"), path)
    tensors = gf.tensors
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise FileFormatError(f"{path}: no token_embd.weight tensor")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else 0
    factors = ()
    rf = tensors.get("rope_freqs.weight")
    if rf is not None:  # llama3 rope scaling: one divisor per frequency
        factors = _dequantized(path, "rope_freqs.weight", rf).reshape(-1)
    cfg = from_gguf_metadata(meta, str(path), vocab, tied="output.weight" not in tensors,
                             names=tuple(tensors), rope_factors=factors)
    expected = cfg.weight_shapes()
    block = arch.gguf_block

    # names and shapes first, so a wrong or incomplete file fails before any dequantizing
    chosen = {}
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":
            continue  # read into the config above
        ours = _our_name(gname, block)
        if ours is None:
            # a tensor we would not use changes the model's function: refuse it by name
            raise FileFormatError(f"{path}: tensor {gname} is not part of a {cfg.arch} model "
                                  "as gradtape implements it")
        if ours not in expected:
            raise FileFormatError(f"{path}: tensor {gname} does not fit the config "
                                  f"({cfg.n_layers} layers)")
        if ours in chosen:
            raise FileFormatError(f"{path}: tensors {chosen[ours][0]} and {gname} both "
                                  f"hold {ours}")
        want = expected[ours]
        # ggml lists dims fastest first; numpy (and dequantize) wants them reversed
        np_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        stored = tuple(reversed(want)) if _base(ours) in _LINEARS else want
        if np_shape != stored:
            raise FileFormatError(f"{path}: tensor {gname} has shape {list(np_shape)}, "
                                  f"expected {list(stored)} from the config")
        chosen[ours] = (gname, t, np_shape)
    missing = sorted(set(expected) - set(chosen))
    if missing:
        raise FileFormatError(f"{path}: missing tensors for {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    weights = {}
    for ours, (gname, t, np_shape) in chosen.items():
        if keep_quantized and len(np_shape) == 2 and t.tensor_type.name not in ("F32", "F64"):
            weights[ours] = _blocks(path, cfg, arch, ours, gname, t, np_shape)
            if not np.may_share_memory(weights[ours].data, t.data):  # a permuted copy:
                gf.release(t)  # the mapped pages it was made from are not read again
            continue
        w = _dequantized(path, gname, t).reshape(np_shape)
        base = _base(ours)
        # only llama.cpp's llama architecture permutes q/k rows (and their biases)
        if arch.permute_qk and base in ("q", "q_bias"):
            w = unpermute_rope_rows(w.reshape(np_shape[0], -1), cfg.n_heads).reshape(np_shape)
        elif arch.permute_qk and base in ("k", "k_bias"):
            w = unpermute_rope_rows(w.reshape(np_shape[0], -1), cfg.n_kv_heads).reshape(np_shape)
        if base in _LINEARS:
            w = w.T  # [out, in] -> [in, out]
        if cfg.norm_plus_one and (base == "norm" or base.endswith("_norm")):
            # llama.cpp's converter stored Gemma's norm scale 1 + w; we keep w (HF's), and
            # s - 1 is exact in float32 for s in [0.5, 2]
            w = w - np.float32(1.0)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if np.may_share_memory(w, t.data):  # an F32 tensor is a view of the mapped file:
            w = w.copy()  # copy it, so the mapping is released once loading is done
        weights[ours] = w
        if not np.isfinite(weights[ours]).all():
            raise FileFormatError(f"{path}: tensor {gname} holds non-finite values")
    # a GGUF without a vocabulary still runs on token ids
    tok = _tokenizer(meta, path) if tokenizer and "tokenizer.ggml.model" in meta else None
    name = meta.get("general.name") or path.stem
    return cfg, weights, tok, str(name)


def _dequantized(path, gname, t):
    """A tensor of the file as float32 (any ggml type ``gguf`` implements)."""
    from gguf import quants

    try:
        with np.errstate(all="ignore"):  # non-finite results are refused by the caller
            w = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise FileFormatError(f"{path}: tensor {gname}: ggml type {t.tensor_type.name} "
                              f"cannot be dequantized ({e})") from None
    except (ValueError, TypeError, IndexError, ArithmeticError) as e:
        raise FileFormatError(f"{path}: tensor {gname} is truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None
    return np.asarray(w, dtype=np.float32)


def _blocks(path, cfg, arch, ours, gname, t, np_shape):
    """The stored blocks of one matrix as a ``BlockMatrix [rows, k]`` (the file's ``[out,
    in]``): a view of the mapped file (the reader checked its byte range), or for the
    llama architecture's q/k a copy of the blocks with rows in Hugging Face's half-split
    rope order (a row is whole blocks, so permuting rows is exact)."""
    qtype = t.tensor_type.name
    if qtype not in BLOCK_TYPES:
        raise FileFormatError(f"{path}: tensor {gname} has ggml type {qtype}, which gradtape "
                              "cannot keep quantized (it runs "
                              f"{', '.join(sorted(BLOCK_TYPES))}); load it dequantized to "
                              "float32 instead (keep_quantized=False, --weights float32)")
    data = t.data
    base = _base(ours)
    if arch.permute_qk and base in ("q", "k"):
        data = np.ascontiguousarray(
            unpermute_rope_rows(data, cfg.n_heads if base == "q" else cfg.n_kv_heads))
    return BlockMatrix(qtype, np_shape, data)


def _tokenizer(meta, path):
    check_tokenizer_meta(meta, str(path))
    try:
        return Tokenizer.from_gguf(meta, str(path))
    except FileFormatError:
        raise
    except (MemoryError, RecursionError):
        raise
    except Exception as e:  # the tokenizers library raises plain Exceptions on bad vocabularies
        raise FileFormatError(f"{path}: the tokenizer metadata is malformed "
                              f"({type(e).__name__}: {e})") from None


def _base(ours):
    return ours.rsplit(".", 1)[-1] if ours.startswith("layers.") else ours


def _our_name(gname, block):
    """Our name of GGUF tensor ``gname``; ``block``: the family's per-layer map."""
    stem, _, kind = gname.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES and kind == "weight":
        return _TOP_NAMES[stem]
    parts = stem.split(".")
    if (len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit()
            and parts[2] in block):
        ours = block[parts[2]]
        if kind == "bias":
            if ours not in _LINEARS:
                return None
            ours += "_bias"
        return f"layers.{int(parts[1])}.{ours}"
    return None
