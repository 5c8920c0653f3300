"""Hostile and broken model and adapter files: each gives one ``FileFormatError`` naming
the file and the problem, after bounded work (counted in function calls, not timed) and
without large allocations; nothing unpickles.

The files are a tiny real llama GGUF (llama.cpp's ``GGUFWriter``), a tiny Hugging Face
folder and a PEFT adapter folder, each mutated in one precise way, plus raw headers no
writer would produce (2^40 tensors, a 2^60-element tensor, a 2^50-byte string, ...).
"""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from gradtape import llama
from gradtape.errors import FileFormatError, GradtapeError
from gradtape.models.lora import init_adapter, load_adapter

from support.filebuilders import (gguf_kv_str, gguf_kv_u32, gguf_string, gguf_tensor_info,
                                  raw_gguf, raw_safetensors, write_tiny_gguf)
from support.tinymodel import tiny_model, write_hf_folder
from support.work import calls_made

# function calls a rejected file may cost: a hundred times loading the whole tiny GGUF
# (about 10^4); a reader looping over a hostile count makes billions
MAX_CALLS = 1_000_000
MAX_ALLOC = 32 << 20  # bytes of Python/NumPy heap a rejected file may cost


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    m = tiny_model(seed=5, vocab=258)
    gguf = write_tiny_gguf(m, root / "tiny.gguf")
    hf = write_hf_folder(tiny_model(seed=5), root / "hf")
    ad = init_adapter(m.config, rank=4, alpha=8, seed=1)
    ad.save(root / "adapter")
    return {"root": root, "model": m, "gguf": gguf, "gguf_bytes": gguf.read_bytes(), "hf": hf,
            "st_bytes": (hf / "model.safetensors").read_bytes(),
            "ad_bytes": (root / "adapter" / "adapter_model.safetensors").read_bytes()}


def expect_format_error(fn, *where, match=None):
    """Run ``fn()``: it must raise FileFormatError (nothing else), after bounded work and
    small allocations, whose message names every item of ``where`` and matches
    ``match``."""
    tracemalloc.start()
    try:
        calls, err = calls_made(fn, MAX_CALLS)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if not isinstance(err, FileFormatError):
        raise AssertionError("no FileFormatError raised") from (
            err if isinstance(err, Exception) else None)
    msg = str(err)
    assert peak < MAX_ALLOC, f"allocated {peak >> 20} MiB after {calls} calls: {msg}"
    for w in where:
        assert str(w) in msg, msg
    if match:
        assert re.search(match, msg, re.I), msg
    assert "\n" not in msg
    return msg


# --- GGUF ------------------------------------------------------------------------------
def _write(tmp_path, data, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _tensor_info_at(data: bytes, name: str) -> int:
    """Byte position of tensor ``name``'s n_dims field in a GGUF header."""
    pos = data.find(gguf_string(name))
    assert pos > 0
    return pos + len(gguf_string(name))


def _patch_tensor(data: bytes, name: str, dims=None, ttype=None, offset=None) -> bytes:
    b = bytearray(data)
    p = _tensor_info_at(data, name)
    (n_dims,) = struct.unpack_from("<I", b, p)
    if dims is not None:
        assert len(dims) == n_dims
        struct.pack_into(f"<{n_dims}Q", b, p + 4, *dims)
    q = p + 4 + 8 * n_dims
    if ttype is not None:
        struct.pack_into("<I", b, q, ttype)
    if offset is not None:
        struct.pack_into("<Q", b, q + 4, offset)
    return bytes(b)


def _replace_str(data: bytes, old: str, new: str) -> bytes:
    """Swap a metadata string value for another of any length."""
    i = data.find(gguf_string(old))
    assert i > 0
    return data[:i] + gguf_string(new) + data[i + len(gguf_string(old)):]


def test_the_tiny_gguf_loads_exactly(files):
    m = llama.load(files["gguf"])
    for k, w in files["model"].weights.items():
        assert np.array_equal(m.weights[k], w), k
    assert m.tokenizer.decode(m.tokenizer.encode("héllo, tiny")) == "héllo, tiny"


@pytest.mark.parametrize("cut", [0, 3, 4, 10, 23, 24, 60, 200, 2000, 5000, 5408, 20000, -1])
def test_truncated_gguf(files, tmp_path, cut):
    data = files["gguf_bytes"]
    p = _write(tmp_path, data[:cut])
    expect_format_error(lambda: llama.load(p), p,
                        match="truncated|too short|bad magic|not a model|past the end")


def test_random_bytes(files, tmp_path):
    rng = np.random.default_rng(0)
    for i, head in enumerate([b"", b"GGUF", b"GGUF\x03\0\0\0"]):
        data = head + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        p = _write(tmp_path, data, f"rand{i}.gguf")
        expect_format_error(lambda: llama.load(p), p)
    # random bytes under another name are not taken for a model at all
    p = _write(tmp_path, rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "x.bin")
    expect_format_error(lambda: llama.load(p), p, match="not a model file")


@pytest.mark.parametrize("field, value, match", [
    ("tensors", 1 << 40, r"declares 1099511627776 tensors"),
    ("kv", 1 << 40, r"declares 1099511627776 metadata keys"),
    ("tensors", (1 << 64) - 1, r"tensors"),
    ("version", 1, r"unsupported GGUF version 1"),
    ("version", 3 << 24, r"big-endian"),
])
def test_gguf_header_counts(files, tmp_path, field, value, match):
    b = bytearray(files["gguf_bytes"])
    at, fmt = {"version": (4, "<I"), "tensors": (8, "<Q"), "kv": (16, "<Q")}[field]
    struct.pack_into(fmt, b, at, value)
    p = _write(tmp_path, bytes(b))
    expect_format_error(lambda: llama.load(p), p, match=match)


def test_gguf_string_of_2_pow_50_bytes(tmp_path):
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 50) + b"key"
    p = _write(tmp_path, data + b"\0" * 64)
    expect_format_error(lambda: llama.load(p), p, match="1125899906842624")
    # the same as a string value, and as a tensor name
    data = raw_gguf([gguf_string("general.name") + struct.pack("<IQ", 8, 1 << 50)])
    p = _write(tmp_path, data + b"\0" * 64, "v.gguf")
    expect_format_error(lambda: llama.load(p), p, match="past the end")
    data = raw_gguf(infos=[struct.pack("<Q", 1 << 50) + b"blk"])
    p = _write(tmp_path, data + b"\0" * 64, "t.gguf")
    expect_format_error(lambda: llama.load(p), p, match="name of tensor")


@pytest.mark.parametrize("kv, match", [
    (gguf_string("a") + struct.pack("<I", 99) + b"\0" * 16, "unknown GGUF value type 99"),
    (gguf_string("a") + struct.pack("<IIQ", 9, 4, 1 << 40), "array of 1099511627776 items"),
    (gguf_string("a") + struct.pack("<IIQ", 9, 8, 1 << 40), "array of 1099511627776 items"),
    (gguf_string("a") + struct.pack("<IIQ", 9, 77, 1), "unknown GGUF value type 77"),
    (gguf_string("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 40, "nests arrays"),
    (gguf_kv_u32("general.alignment", 3), "alignment 3 is not a power of 2"),
    (gguf_kv_u32("general.alignment", 0), "alignment 0"),
    (gguf_kv_str("general.alignment", "32"), "alignment '32'"),
])
def test_gguf_bad_metadata(tmp_path, kv, match):
    p = _write(tmp_path, raw_gguf([kv]) + b"\0" * 256)
    expect_format_error(lambda: llama.load(p), p, match=match)


def test_gguf_duplicate_key_and_tensor(tmp_path):
    kv = gguf_kv_u32("x", 1)
    p = _write(tmp_path, raw_gguf([kv, kv]) + b"\0" * 64)
    expect_format_error(lambda: llama.load(p), p, match="'x' appears twice")
    info = gguf_tensor_info("t.weight", [8], 0, 0)
    p = _write(tmp_path, raw_gguf(infos=[info, info], data=b"\0" * 64), "t.gguf")
    expect_format_error(lambda: llama.load(p), p, match="'t.weight' appears twice")


@pytest.mark.parametrize("dims", [[], [1] * 5])
def test_gguf_bad_rank(tmp_path, dims):
    p = _write(tmp_path, raw_gguf(infos=[gguf_tensor_info("t", dims)], data=b"\0" * 64))
    expect_format_error(lambda: llama.load(p), p, match=f"has {len(dims)} dims")


@pytest.mark.parametrize("patch, match", [
    (dict(dims=[1 << 30, 1 << 30]), r"runs past the end"),                  # 2^60 elements
    (dict(dims=[1 << 62, 1 << 62]), r"runs past the end"),                  # wraps int64
    (dict(dims=[0, 32]), r"do not fit"),                                     # empty
    (dict(ttype=99), r"unknown ggml type 99"),
    (dict(offset=(1 << 64) - 32), r"runs past the end"),                    # "negative"
    (dict(offset=(1 << 63)), r"runs past the end"),
    (dict(offset=33), r"not a multiple of the alignment 32"),
    (dict(offset=0), r"overlap"),                                           # on token_embd
])
def test_gguf_bad_tensor_info(files, tmp_path, patch, match):
    data = _patch_tensor(files["gguf_bytes"], "blk.0.attn_q.weight", **patch)
    p = _write(tmp_path, data)
    expect_format_error(lambda: llama.load(p), p, match=match)


def test_gguf_quant_blocks_must_divide_the_rows(files, tmp_path):
    # ffn_down is [48, 32] in ggml order: 48 is not a whole number of Q4_0 blocks (32)
    data = _patch_tensor(files["gguf_bytes"], "blk.0.ffn_down.weight", ttype=2)
    p = _write(tmp_path, data)
    expect_format_error(lambda: llama.load(p), p, match="do not fit Q4_0 blocks of 32")


def test_gguf_wrong_shape_missing_tensor_and_wrong_kind(files, tmp_path):
    m = files["model"]
    # a tensor the config does not predict: up has the wrong width
    bad = tiny_model(seed=5, vocab=258)
    bad.weights["layers.1.up"] = np.zeros((32, 40), np.float32)
    p = write_tiny_gguf(bad, tmp_path / "shape.gguf")
    expect_format_error(lambda: llama.load(p), p, "blk.1.ffn_up.weight", "[40, 32]",
                        "[48, 32]")
    p = write_tiny_gguf(m, tmp_path / "missing.gguf", skip={"layers.1.v", "norm"})
    expect_format_error(lambda: llama.load(p), p, "layers.1.v", match="missing tensors")
    p = write_tiny_gguf(m, tmp_path / "noemb.gguf", skip={"tok_embd"})
    expect_format_error(lambda: llama.load(p), p, "token_embd")
    p = write_tiny_gguf(m, tmp_path / "falcon.gguf", arch="falcon")
    expect_format_error(lambda: llama.load(p), p, match="architecture 'falcon' is not supported")
    data = _replace_str(files["gguf_bytes"], "tiny", "tiny")  # sanity of the helper
    assert data == files["gguf_bytes"]
    data = _replace_str(files["gguf_bytes"], "gpt2", "bert")  # same length: offsets hold
    p = _write(tmp_path, data, "bert.gguf")
    expect_format_error(lambda: llama.load(p), p, match="tokenizer model 'bert'")


def test_gguf_non_finite_weights(files, tmp_path):
    m = tiny_model(seed=5, vocab=258)
    m.weights["layers.0.gate"][3, 4] = np.nan
    p = write_tiny_gguf(m, tmp_path / "nan.gguf")
    expect_format_error(lambda: llama.load(p), p, "blk.0.ffn_gate.weight", match="non-finite")


def test_gguf_adapter_is_not_a_model(tmp_path):
    p = _write(tmp_path, raw_gguf([gguf_kv_str("general.type", "adapter")]))
    expect_format_error(lambda: llama.load(p), p, match="'adapter'")


def test_gguf_tokenizer_metadata_of_the_wrong_type(files, tmp_path):
    # the merges' one string "Ġ t" becomes something tokenizers rejects
    data = _replace_str(files["gguf_bytes"], "Ġ t", "qq z")  # same byte length
    p = _write(tmp_path, data)
    expect_format_error(lambda: llama.load(p), p, match="tokenizer")
    # the token list's item type changed from string (8) to u32 (4)
    b = bytearray(files["gguf_bytes"])
    at = b.find(gguf_string("tokenizer.ggml.tokens")) + len(gguf_string("tokenizer.ggml.tokens"))
    assert struct.unpack_from("<II", b, at) == (9, 8)
    struct.pack_into("<I", b, at + 4, 4)
    p = _write(tmp_path, bytes(b), "types.gguf")
    expect_format_error(lambda: llama.load(p), p)


# --- safetensors (Hugging Face folder) --------------------------------------------------
def _hf_copy(files, tmp_path, st_bytes):
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in files["hf"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "model.safetensors").write_bytes(st_bytes)
    return folder


def _header(data: bytes):
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _edit_entry(data: bytes, name, **fields):
    h, body = _header(data)
    h[name].update(fields)
    return raw_safetensors(h, body)


E = "model.embed_tokens.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


def test_the_tiny_hf_folder_loads(files):
    m = llama.load(files["hf"])
    for k, w in tiny_model(seed=5).weights.items():
        assert np.array_equal(m.weights[k], w), k


@pytest.mark.parametrize("cut", [0, 5, 8, 100, -1, -4096])
def test_truncated_safetensors(files, tmp_path, cut):
    folder = _hf_copy(files, tmp_path, files["st_bytes"][:cut])
    expect_format_error(lambda: llama.load(folder), folder / "model.safetensors",
                        match="too short|larger than the file|past the end|not valid JSON")


def _mutations(data):
    h, body = _header(data)
    lo, hi = h[Q]["data_offsets"]
    e_lo, e_hi = h[E]["data_offsets"]
    return {
        "random": (np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes(),
                   "larger than the file|too short|not valid JSON"),
        "header longer than file": (struct.pack("<Q", len(data)) + data[8:],
                                    "larger than the file"),
        "header 2^63": (struct.pack("<Q", 1 << 63) + data[8:], "larger than the file"),
        "invalid json": (raw_safetensors(b"{not json" + b" " * 20, body), "not valid JSON"),
        "json list": (raw_safetensors([1, 2, 3], body), "not a JSON object"),
        "deep json": (raw_safetensors(b"[" * 100000 + b"]" * 100000, body), "not valid JSON"),
        "duplicate key": (raw_safetensors(
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', body),
            "duplicate key"),
        "unknown dtype": (_edit_entry(data, Q, dtype="F8_E4M3"), "dtype 'F8_E4M3'"),
        "int dtype": (_edit_entry(data, Q, dtype="I32"), "dtype I32"),
        "shape vs offsets": (_edit_entry(data, Q, shape=[32, 33]), "do not hold"),
        "2^60 elements": (_edit_entry(data, Q, shape=[1 << 30, 1 << 30],
                                      data_offsets=[0, 1 << 62]), "past the end"),
        "int64 wrap": (_edit_entry(data, Q, shape=[1 << 32, 1 << 32], data_offsets=[lo, lo]),
                       "do not hold"),
        "negative offset": (_edit_entry(data, Q, data_offsets=[-4096, hi - lo - 4096]),
                            "do not hold"),
        "offset past end": (_edit_entry(data, Q, data_offsets=[lo + (1 << 40),
                                                               hi + (1 << 40)]),
                            "past the end"),
        "huge int": (_edit_entry(data, Q, data_offsets=[10 ** 40, 10 ** 40 + hi - lo]),
                     "past the end"),
        "overlap": (_edit_entry(data, Q, data_offsets=[e_lo, e_lo + hi - lo]), "overlap"),
        "bool shape": (_edit_entry(data, Q, shape=[True, 32]), "bad shape"),
        "string shape": (_edit_entry(data, Q, shape="32"), "bad shape"),
        "bad offsets": (_edit_entry(data, Q, data_offsets={"a": 1}), "bad data_offsets"),
        "bad metadata": (raw_safetensors({**h, "__metadata__": {"x": 1}}, body),
                         "__metadata__"),
    }


@pytest.mark.parametrize("case", [
    "random", "header longer than file", "header 2^63", "invalid json", "json list",
    "deep json", "duplicate key", "unknown dtype", "int dtype", "shape vs offsets",
    "2^60 elements", "int64 wrap", "negative offset", "offset past end", "huge int",
    "overlap", "bool shape", "string shape", "bad offsets", "bad metadata"])
def test_hostile_safetensors(files, tmp_path, case):
    data, match = _mutations(files["st_bytes"])[case]
    folder = _hf_copy(files, tmp_path, data)
    expect_format_error(lambda: llama.load(folder), folder / "model.safetensors", match=match)


def test_hf_wrong_shape_and_missing_tensor(files, tmp_path):
    h, body = _header(files["st_bytes"])
    # drop a tensor: the folder names what is missing
    del h[Q]
    folder = _hf_copy(files, tmp_path, raw_safetensors(h, body))
    expect_format_error(lambda: llama.load(folder), folder, "layers.0.q", match="missing")
    # a config.json that disagrees with the tensors: the file, the tensor and both shapes
    cj = json.loads((folder / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(files["st_bytes"])
    (folder / "config.json").write_text(json.dumps({**cj, "intermediate_size": 40}))
    expect_format_error(lambda: llama.load(folder), folder / "model.safetensors",
                        "model.layers.0.mlp.", match=r"has shape \[(48, 32|32, 48)\], "
                        r"expected \[(40, 32|32, 40)\]")
    for bad, match in [("[1, 2]", "not a JSON object"), ("{", "not valid JSON"),
                       (json.dumps({**cj, "model_type": "gpt2"}), "model_type 'gpt2'")]:
        (folder / "config.json").write_text(bad)
        expect_format_error(lambda: llama.load(folder), folder / "config.json", match=match)


@pytest.mark.parametrize("layers", [0, 1 << 31])
def test_hf_layer_count_is_checked_before_anything_per_layer(files, tmp_path, layers):
    """A config.json saying 2^31 layers is one error at once (per-layer settings were
    built from it before the count was checked: 24 GB, found by the fuzzer)."""
    folder = _hf_copy(files, tmp_path, files["st_bytes"])
    cj = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cj, "num_hidden_layers": layers}))
    expect_format_error(lambda: llama.load(folder), folder, match="num_hidden_layers")


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pt"
    folder.mkdir()
    (folder / "config.json").write_text((json.dumps({"model_type": "llama"})))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(GradtapeError):
        llama.load(folder)
    write_hf_folder(tiny_model(), folder)
    (folder / "model.safetensors").unlink()
    expect_format_error(lambda: llama.load(folder), folder, match="never unpickles")


# --- adapters ---------------------------------------------------------------------------
def _adapter(files, tmp_path, st_bytes=None, config=None):
    folder = tmp_path / "ad"
    folder.mkdir(exist_ok=True)
    src = files["root"] / "adapter"
    (folder / "adapter_model.safetensors").write_bytes(
        files["ad_bytes"] if st_bytes is None else st_bytes)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        config if isinstance(config, str) else json.dumps({**cfg, **(config or {})}))
    return folder


@pytest.mark.parametrize("case", ["random", "header 2^63", "invalid json", "unknown dtype",
                                  "shape vs offsets", "2^60 elements", "overlap"])
def test_hostile_adapter_weights(files, tmp_path, case):
    h, body = _header(files["ad_bytes"])
    names = sorted(k for k in h if k != "__metadata__")
    data = files["ad_bytes"]
    a, b = names[0], names[1]
    lo, hi = h[a]["data_offsets"]
    muts = {
        "random": np.random.default_rng(2).integers(0, 256, 999, dtype=np.uint8).tobytes(),
        "header 2^63": struct.pack("<Q", 1 << 63) + data[8:],
        "invalid json": raw_safetensors(b"{]", body),
        "unknown dtype": _edit_entry(data, a, dtype="Q4"),
        "shape vs offsets": _edit_entry(data, a, shape=[5, 5]),
        "2^60 elements": _edit_entry(data, a, shape=[1 << 60], data_offsets=[0, 1 << 62]),
        "overlap": _edit_entry(data, a, data_offsets=[h[b]["data_offsets"][0],
                                                      h[b]["data_offsets"][0] + hi - lo]),
    }
    folder = _adapter(files, tmp_path, muts[case])
    expect_format_error(lambda: load_adapter(folder), folder / "adapter_model.safetensors")


@pytest.mark.parametrize("config, match", [
    ("{", "invalid JSON"), ("[]", "not a LoRA adapter config"),
    ({"r": 0}, "r = 0"), ({"r": -3}, "r = -3"), ({"r": "8"}, "r = '8'"),
    ({"r": 1e300}, "r = 1e\\+300"), ({"lora_alpha": "x"}, "lora_alpha"),
    ({"lora_alpha": float("inf")}, "lora_alpha"), ({"peft_type": "IA3"}, "not a LoRA"),
    ({"r": 8}, "do not match rank 8"), ({"use_dora": True}, "lacks lora_magnitude_vector"),
])
def test_hostile_adapter_config(files, tmp_path, config, match):
    folder = _adapter(files, tmp_path, config=config)
    expect_format_error(lambda: load_adapter(folder), folder, match=match)


def test_adapter_for_another_model_names_tensor_and_shapes(files, tmp_path):
    other = tiny_model(dim=48, n_heads=4, n_kv_heads=2, vocab=258)
    ad = init_adapter(other.config, rank=4, alpha=8, seed=1)
    ad.save(tmp_path / "other")
    model = llama.load(files["gguf"])
    with pytest.raises(GradtapeError) as e:
        load_adapter(tmp_path / "other", model)
    msg = str(e.value)
    assert "tensor layers.0.mlp.down_proj" in msg, msg
    assert "lora_B [48, 4]" in msg and "lora_B [32, 4]" in msg, msg


# --- nothing unpickles ------------------------------------------------------------------
_PICKLE = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|joblib|shelve|marshal)\b"
                     r"|\bpickle\.loads?\(|\btorch\.load\(|allow_pickle\s*=\s*True"
                     r"|\b(np|numpy)\.load\(|\bunpickler\b", re.M | re.I)


def test_nothing_in_src_unpickles():
    src = Path(__file__).resolve().parents[2] / "src"
    hits = []
    for f in sorted(src.rglob("*.py")):
        for m in _PICKLE.finditer(f.read_text(encoding="utf-8")):
            hits.append(f"{f.relative_to(src)}: {m.group(0).strip()}")
    assert not hits, hits
