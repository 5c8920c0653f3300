"""Small real model files for the hostile-file and fuzz tests: a tiny llama GGUF written by
llama.cpp's own ``GGUFWriter``, and raw safetensors / GGUF byte builders for headers that
no honest writer would produce."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from gradtape.models.load_gguf import permute_rope_rows
from gradtape.models.tokenizer import _bytes_to_unicode

_GGUF_BLOCK = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
               "o": "attn_output", "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up",
               "down": "ffn_down"}
_LINEARS = {"q", "k", "v", "o", "gate", "up", "down"}


def write_tiny_gguf(model, path, arch="llama", with_tokenizer=True, skip=(), f16=False,
                    qtype=None, rng=None):
    """``model`` (tinymodel's) as a llama GGUF: F32 (or F16) tensors in llama.cpp's layout
    (linears ``[out, in]``, q/k rows permuted to the interleaved rope), llama metadata and
    a byte-level BPE vocabulary (bytes 0..255, ``<eos>``, ``Ġt`` when the vocabulary
    has room).  ``skip``: our tensor
    names to leave out.  ``qtype`` (a ggml type name gguf can quantize, e.g. "Q8_0"):
    the matrices are stored in that type instead (llama.cpp's own quantizer); with
    ``rng``, random valid blocks of it (``blocks.random_blocks``, any type we run: gguf
    cannot quantize the K and IQ types) in place of the model's values."""
    from gguf import GGUFWriter

    path = Path(path)
    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    if with_tokenizer:
        table = _bytes_to_unicode()
        w.add_tokenizer_model("gpt2")
        # the vocabulary needs one merge (an empty merge list is not written), so a
        # model with vocab 258 gets token 257 = "Ġt"; with 257 the merge is left out
        extra = ["Ġt"] if c.vocab_size > 257 else []
        w.add_token_list([table[b] for b in range(256)] + ["<eos>"] + extra)
        w.add_token_types([1] * 256 + [3] + [1] * len(extra))
        w.add_token_merges(["Ġ t"] if extra else [])
        w.add_eos_token_id(256)
    dt = np.float16 if f16 else np.float32
    for ours, arr in model.weights.items():
        if ours in skip:
            continue
        if ours.startswith("layers."):
            _, i, base = ours.split(".")
            name = f"blk.{i}.{_GGUF_BLOCK[base]}.weight"
        else:
            base = ours
            name = {"tok_embd": "token_embd", "norm": "output_norm",
                    "lm_head": "output"}[ours] + ".weight"
        a = arr
        if base in _LINEARS:
            a = a.T  # ours [in, out] -> [out, in]
            if base == "q":
                a = permute_rope_rows(a, c.n_heads)
            elif base == "k":
                a = permute_rope_rows(a, c.n_kv_heads)
        if qtype is not None and a.ndim == 2:
            from gguf import GGMLQuantizationType, quants
            q = GGMLQuantizationType[qtype]
            if rng is not None:
                from gradtape.blocks import random_blocks
                data = random_blocks(qtype, *a.shape, rng, std=float(a.std())).data
            else:
                data = quants.quantize(np.ascontiguousarray(a, np.float32), q)
            w.add_tensor(name, data, raw_dtype=q)
            continue
        w.add_tensor(name, np.ascontiguousarray(a, dtype=dt if a.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- raw GGUF pieces, for headers no writer produces ----------------------------------
def gguf_string(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_kv_u32(key, v) -> bytes:
    return gguf_string(key) + struct.pack("<II", 4, v)


def gguf_kv_str(key, v) -> bytes:
    return gguf_string(key) + struct.pack("<I", 8) + gguf_string(v)


def gguf_tensor_info(name, dims, ttype=0, offset=0) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset))


def raw_gguf(kvs=(), infos=(), n_tensors=None, n_kv=None, version=3, data=b"",
             align=32) -> bytes:
    """A GGUF byte string from raw pieces; counts default to the pieces given."""
    head = b"GGUF" + struct.pack("<IQQ", version,
                                 len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % align)
    return body + data


# --- raw safetensors ------------------------------------------------------------------
def raw_safetensors(header, data=b"", header_len=None) -> bytes:
    """A safetensors byte string: ``header`` (a dict, or raw bytes) and data bytes."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + data


def write_records(path, rows):
    """``rows`` as the file ``path``'s suffix says: JSON Lines, a JSON array or Parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
