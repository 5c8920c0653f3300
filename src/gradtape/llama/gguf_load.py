"""Loading a llama-architecture GGUF file: config, float32 weights, tokenizer.

Reads with llama.cpp's own ``gguf`` package (``GGUFReader``, ``gguf.quants.dequantize``:
every ggml type it implements).  Weights come out in OUR names and orientation (see
``model``): linears ``[in, out]``, the token embedding ``[V, D]``.  llama.cpp's converter
permuted the rows of ``attn_q``/``attn_k`` from Hugging Face's half-split rope layout into
its interleaved one; we undo that (DESIGN.md section 2) because our rope is NEOX
half-split.  Every tensor's shape is checked against the config before it is used.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ..errors import FileFormatError
from .config import LlamaConfig, from_gguf_metadata
from .tokenizer import Tokenizer

# GGUF tensor name (per block "blk.{i}.") -> our name ("layers.{i}.")
_BLOCK_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up",
    "ffn_down": "down",
}
_TOP_NAMES = {"token_embd": "tok_embd", "output_norm": "norm", "output": "lm_head"}
# Linear layers are stored [out, in] (numpy order of ggml's [in, out]); we keep [in, out].
_LINEARS = {"q", "k", "v", "o", "gate", "up", "down"}


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


# GGUF value types (gguf's GGUFValueType) -> struct format; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NP_SCALARS = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1",
               10: "<u8", 11: "<i8", 12: "<f8"}


class _Tensor:
    __slots__ = ("name", "shape", "tensor_type", "data")

    def __init__(self, name, shape, tensor_type, data):
        self.name, self.shape, self.tensor_type, self.data = name, shape, tensor_type, data


class GGUFFile:
    """A GGUF file's metadata (``meta``: key -> python value) and tensors (``tensors``:
    name -> raw bytes view, ggml-order ``shape``, ``tensor_type``), read from a memory map.

    A small direct parser: gguf's ``GGUFReader`` builds a numpy view per metadata item and
    takes seconds on a 49k-token vocabulary; this reads the same header in milliseconds.
    Every count and offset is checked against the file size before it is used."""

    def __init__(self, path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = buf
        mv = memoryview(buf)
        self._mv, self._pos = mv, 0
        if len(mv) < 24 or bytes(mv[:4]) != b"GGUF":
            raise FileFormatError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise FileFormatError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        # each item takes at least 8 bytes of header: a larger count is corruption
        if n_tensors > len(mv) // 8 or n_kv > len(mv) // 8:
            raise FileFormatError(f"{self.path}: header counts {n_tensors} tensors / "
                                  f"{n_kv} keys do not fit in {len(mv)} bytes")
        self.meta = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("I")
            if n_dims > 4:
                raise FileFormatError(f"{self.path}: tensor {name} has {n_dims} dims")
            dims = [self._scalar("Q") for _ in range(n_dims)]
            ttype, offset = self._scalar("I"), self._scalar("Q")
            infos.append((name, dims, ttype, offset))
        align = int(self.meta.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise FileFormatError(f"{self.path}: general.alignment {align} is not a power of 2")
        start = -(-self._pos // align) * align
        self.tensors = {}
        for name, dims, ttype, offset in infos:
            try:
                qtype = GGMLQuantizationType(ttype)
                block, tsize = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise FileFormatError(f"{self.path}: tensor {name} has unknown ggml type "
                                      f"{ttype}") from None
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if not dims or dims[0] % block:
                raise FileFormatError(f"{self.path}: tensor {name} dims {dims} do not fit "
                                      f"{qtype.name} blocks of {block}")
            nbytes = n // block * tsize
            lo = start + offset
            if lo + nbytes > len(mv):
                raise FileFormatError(f"{self.path}: tensor {name} ({nbytes} bytes at "
                                      f"{lo}) runs past the end of the file ({len(mv)} "
                                      "bytes): truncated?")
            # bytes shaped like gguf's reader: rows of ggml's fastest dim, in bytes
            rows = list(reversed(dims[1:])) + [dims[0] // block * tsize]
            data = np.asarray(buf[lo:lo + nbytes]).reshape(rows)
            self.tensors[name] = _Tensor(name, np.array(dims), qtype, data)

    def _need(self, n):
        if self._pos + n > len(self._mv):
            raise FileFormatError(f"{self.path}: header runs past the end of the file "
                                  "(truncated or not GGUF)")

    def _scalar(self, fmt):
        size = struct.calcsize("<" + fmt)
        self._need(size)
        (v,) = struct.unpack_from("<" + fmt, self._mv, self._pos)
        self._pos += size
        return v

    def _string(self):
        n = self._scalar("Q")
        self._need(n)
        s = bytes(self._mv[self._pos:self._pos + n])
        self._pos += n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            return s.decode("utf-8", errors="replace")

    def _value(self, vtype):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == 8:
            return self._string()
        if vtype == 9:
            itype, count = self._scalar("I"), self._scalar("Q")
            if count > len(self._mv):
                raise FileFormatError(f"{self.path}: array of {count} items is corrupt")
            if itype in _NP_SCALARS:  # one numpy view for numeric arrays
                dt = np.dtype(_NP_SCALARS[itype])
                self._need(count * dt.itemsize)
                arr = np.frombuffer(self._mv, dt, count, self._pos)
                self._pos += count * dt.itemsize
                return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
            return [self._value(itype) for _ in range(count)]
        raise FileFormatError(f"{self.path}: unknown GGUF value type {vtype}")


def load_gguf(path) -> tuple[LlamaConfig, dict, Tokenizer | None, str]:
    """``(config, weights, tokenizer, name)`` from a llama GGUF file."""
    from gguf import quants

    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: no such file")
    gf = GGUFFile(path)
    meta = gf.meta
    gtype = meta.get("general.type", "model")
    if gtype != "model":
        raise FileFormatError(f"{path}: general.type is {gtype!r} (an adapter?), not a model")
    tensors = gf.tensors
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise FileFormatError(f"{path}: no token_embd.weight tensor")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else 0
    cfg = from_gguf_metadata(meta, str(path), vocab, tied="output.weight" not in tensors)
    expected = cfg.weight_shapes()

    weights = {}
    for gname, t in tensors.items():
        ours = _our_name(gname)
        if ours is None:
            if gname == "rope_freqs.weight":
                raise FileFormatError(f"{path}: rope frequency factors (rope_freqs.weight, "
                                      "llama 3.1 rope scaling) are not supported")
            continue  # e.g. an unused rope cache; nothing we compute depends on it
        if ours not in expected:
            raise FileFormatError(f"{path}: tensor {gname} does not fit the config "
                                  f"({cfg.n_layers} layers)")
        want = expected[ours]
        # ggml lists dims fastest first; numpy (and dequantize) wants them reversed
        np_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        stored = tuple(reversed(want)) if _base(ours) in _LINEARS else want
        if np_shape != stored:
            raise FileFormatError(f"{path}: tensor {gname} has shape {list(np_shape)}, "
                                  f"expected {list(stored)} from the config")
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise FileFormatError(f"{path}: tensor {gname}: ggml type {t.tensor_type.name} "
                                  f"cannot be dequantized ({e})") from None
        except Exception as e:
            raise FileFormatError(f"{path}: tensor {gname} is truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None
        w = np.asarray(w, dtype=np.float32).reshape(np_shape)
        base = _base(ours)
        if base == "q":
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif base == "k":
            w = unpermute_rope_rows(w, cfg.n_kv_heads)
        if base in _LINEARS:
            w = w.T  # [out, in] -> [in, out]
        weights[ours] = np.ascontiguousarray(w, dtype=np.float32)
        if not np.isfinite(weights[ours]).all():
            raise FileFormatError(f"{path}: tensor {gname} holds non-finite values")
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise FileFormatError(f"{path}: missing tensors for {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    # a GGUF without a vocabulary still runs on token ids
    tok = Tokenizer.from_gguf(meta, str(path)) if "tokenizer.ggml.model" in meta else None
    name = meta.get("general.name") or path.stem
    return cfg, weights, tok, str(name)


def _base(ours):
    return ours.rsplit(".", 1)[-1] if ours.startswith("layers.") else ours


def _our_name(gname):
    if not gname.endswith(".weight"):
        return None
    stem = gname[: -len(".weight")]
    if stem in _TOP_NAMES:
        return _TOP_NAMES[stem]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}"
    return None
