"""Fuzzing the file readers (hypothesis): real GGUF, safetensors and adapter files, mutated
(bit flips, byte overwrites, inflated counts and sizes, truncations, edited JSON), must
either load or raise gradtape's own error -- never another exception, a crash or a hang.

The budget is bounded for CI: ``EXAMPLES`` examples per test (150; set
GRADTAPE_FUZZ_EXAMPLES for a deeper run), each load within ``MAX_CALLS`` function calls
(counted, the same on every CPU: ``support.work``); a timer stops a load that hangs
outside Python (``HANG_SECONDS``, far above any load's time: a guard, not a measure).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from gradtape import llama
from gradtape.errors import GradtapeError
from gradtape.models.lora import init_adapter, load_adapter

from support.filebuilders import write_tiny_gguf
from support.tinymodel import tiny_model, write_hf_folder
from support.work import calls_made

pytestmark = pytest.mark.slow  # hypothesis: hundreds of loads per test
EXAMPLES = int(os.environ.get("GRADTAPE_FUZZ_EXAMPLES", "150"))  # raise it for a deep run
# function calls a load may make: a hundred times loading the whole tiny GGUF (about
# 10^4); a reader looping over an inflated count makes billions
MAX_CALLS = 1_000_000
HANG_SECONDS = 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# values that break naive readers: zero, one, powers of two near the limits, all-ones
INTERESTING = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31,
               (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 50, 1 << 60, (1 << 63) - 1, 1 << 63,
               (1 << 64) - 1]


class Hang(BaseException):  # not an Exception: no reader catches it
    pass


def _alarm(*_):
    raise Hang


def load_outcome(fn):
    """Run ``fn``: return "ok" or "error" (a GradtapeError); anything else fails the test.
    A run over ``MAX_CALLS`` function calls fails too (and a timer stops one that would
    hang in C)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    try:
        _, got = calls_made(fn, MAX_CALLS)
    except Hang:
        pytest.fail(f"hung for over {HANG_SECONDS} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if isinstance(got, GradtapeError):
        assert str(got), "an empty error message"
        outcome = "error"
    elif isinstance(got, Exception):
        raise got
    else:
        outcome = "ok"
    try:
        event(outcome)  # --hypothesis-show-statistics: how often a mutant still loads
    except InvalidArgument:
        pass  # called outside a hypothesis test
    return outcome


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    m = tiny_model(seed=9, vocab=258)
    gguf = write_tiny_gguf(m, root / "tiny.gguf").read_bytes()
    hf = write_hf_folder(tiny_model(seed=9), root / "hf")
    ad = init_adapter(m.config, rank=2, alpha=4, seed=1, targets="q,v")
    ad.save(root / "adapter")
    base = llama.load(root / "hf")
    return Seeds({"root": root, "gguf": gguf, "gguf_fields": gguf_fields(gguf), "hf": hf,
            "st": (hf / "model.safetensors").read_bytes(), "base": base,
            "ad_st": (root / "adapter" / "adapter_model.safetensors").read_bytes(),
            "ad_cfg": json.loads((root / "adapter" / "adapter_config.json").read_text())})


class Seeds(dict):
    """The unmutated files; a short repr keeps hypothesis' failure reports readable."""

    def __repr__(self):
        return "<fuzz seed files>"


def gguf_fields(data: bytes):
    """(position, width) of every count, length, type, dim, offset and scalar value field
    of a valid GGUF header: the places where an inflated number does the most damage."""
    fields = [(4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string():
        nonlocal pos
        fields.append((pos, 8))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    def value(t):
        nonlocal pos
        if t == 8:
            string()
        elif t == 9:
            fields.extend([(pos, 4), (pos + 4, 8)])
            it, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(min(count, 3)):  # the first few items' fields
                value(it)
            if count > 3:
                if it == 8:
                    for _ in range(count - 3):
                        (n,) = struct.unpack_from("<Q", data, pos)
                        pos += 8 + n
                else:
                    pos += (count - 3) * struct.calcsize(
                        "<" + "BbHhIif?  Qqd"[it].strip())
        else:  # a scalar value (a config number, a token id, ...)
            size = struct.calcsize("<" + "BbHhIif?  Qqd"[t])
            fields.append((pos, size))
            pos += size

    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        value(t)
    for _ in range(n_tensors):
        string()
        (nd,) = struct.unpack_from("<I", data, pos)
        fields.extend([(pos, 4)] + [(pos + 4 + 8 * i, 8) for i in range(nd)])
        pos += 4 + 8 * nd
        fields.extend([(pos, 4), (pos + 4, 8)])
        pos += 12
    return fields


# --- mutations, as hypothesis strategies over a byte string ----------------------------
def _flip(data, pos, bit):
    b = bytearray(data)
    b[pos % len(b)] ^= 1 << bit
    return bytes(b)


def _overwrite(data, pos, chunk):
    pos %= len(data)
    return data[:pos] + chunk + data[pos + len(chunk):]


@st.composite
def mutated_gguf(draw, data, fields, header_end):
    kind = draw(st.sampled_from(["field", "field", "flip", "flip", "bytes", "truncate",
                                 "insert", "data"]))
    if kind == "field":  # an inflated (or zeroed, or wrapped) count / length / offset
        pos, width = draw(st.sampled_from(fields))
        v = draw(st.sampled_from(INTERESTING) | st.integers(0, (1 << 64) - 1))
        delta = draw(st.sampled_from([None, -1, 1]))
        old = int.from_bytes(data[pos:pos + width], "little")
        v = (old + delta if delta is not None else v) % (1 << (8 * width))
        return _overwrite(data, pos, v.to_bytes(width, "little"))
    if kind == "flip":
        n = draw(st.integers(1, 4))
        for _ in range(n):
            data = _flip(data, draw(st.integers(0, header_end)), draw(st.integers(0, 7)))
        return data
    if kind == "bytes":
        return _overwrite(data, draw(st.integers(0, header_end)),
                          draw(st.binary(min_size=1, max_size=16)))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "insert":
        pos = draw(st.integers(0, header_end))
        return data[:pos] + draw(st.binary(min_size=1, max_size=9)) + data[pos:]
    # the tensor data: flips there must not crash anything either
    return _flip(data, draw(st.integers(header_end, len(data) - 1)), draw(st.integers(0, 7)))


@FUZZ
@given(st.data())
def test_fuzz_gguf(real, data):
    header_end = real["gguf_fields"][-1][0] + 8
    blob = data.draw(mutated_gguf(real["gguf"], real["gguf_fields"], header_end))
    path = real["root"] / "mut.gguf"
    path.write_bytes(blob)
    load_outcome(lambda: llama.load(path))


_NUMBER = re.compile(rb"-?\d+")


@st.composite
def mutated_safetensors(draw, data):
    (n,) = struct.unpack_from("<Q", data)
    header = data[8:8 + n]
    kind = draw(st.sampled_from(["number", "number", "number", "length", "flip", "bytes",
                                 "truncate", "json", "data"]))
    if kind == "number":  # a shape dim or data offset in the JSON header, inflated
        nums = list(_NUMBER.finditer(header))
        m = draw(st.sampled_from(nums))
        v = draw(st.sampled_from(INTERESTING + [-1, -(1 << 63), 10 ** 30]) |
                 st.integers(-(1 << 70), 1 << 70))
        if draw(st.booleans()):
            v = int(m.group()) + draw(st.sampled_from([-4, -1, 1, 4]))
        header = header[:m.start()] + str(v).encode() + header[m.end():]
        return struct.pack("<Q", len(header)) + header + data[8 + n:]
    if kind == "length":
        v = draw(st.sampled_from(INTERESTING) | st.integers(0, n + 64))
        return struct.pack("<Q", v % (1 << 64)) + data[8:]
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            data = _flip(data, draw(st.integers(0, 8 + n - 1)), draw(st.integers(0, 7)))
        return data
    if kind == "bytes":
        return _overwrite(data, draw(st.integers(0, 8 + n - 1)),
                          draw(st.binary(min_size=1, max_size=12)))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "json":  # a structurally edited header: one entry's field replaced
        h = json.loads(header)
        name = draw(st.sampled_from(sorted(h)))
        if name == "__metadata__" or not isinstance(h[name], dict):
            h[name] = draw(_JSON)
        else:
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
            h[name][key] = draw(_JSON)
        header = json.dumps(h).encode()
        return struct.pack("<Q", len(header)) + header + data[8 + n:]
    return _flip(data, draw(st.integers(8 + n, len(data) - 1)), draw(st.integers(0, 7)))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 65), 1 << 65) |
    st.floats(allow_nan=False) | st.sampled_from(["F32", "BF16", "I64", "F8_E5M2", "", "x"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=3),
    max_leaves=6)


@FUZZ
@given(st.data())
def test_fuzz_safetensors_model(real, data):
    blob = data.draw(mutated_safetensors(real["st"]))
    folder = real["root"] / "hfmut"
    if not folder.exists():
        folder.mkdir()
        for f in real["hf"].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "model.safetensors").write_bytes(blob)
    load_outcome(lambda: llama.load(folder))


@FUZZ
@given(st.data())
def test_fuzz_adapter_folder(real, data):
    folder = real["root"] / "admut"
    folder.mkdir(exist_ok=True)
    cfg = dict(real["ad_cfg"])
    st_bytes = real["ad_st"]
    if data.draw(st.booleans()):
        st_bytes = data.draw(mutated_safetensors(st_bytes))
    else:
        key = data.draw(st.sampled_from(["r", "lora_alpha", "peft_type", "use_rslora",
                                         "use_dora", "rank_pattern", "target_modules",
                                         "base_model_name_or_path"]))
        cfg[key] = data.draw(_JSON)
    (folder / "adapter_model.safetensors").write_bytes(st_bytes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    load_outcome(lambda: load_adapter(folder))
    # checked against a model (the tiny HF model has another vocab but the same shapes)
    outcome = load_outcome(lambda: load_adapter(folder, real["base"]))
    if outcome == "ok":  # a loaded adapter must also run
        ad = load_adapter(folder, real["base"])
        out = load_outcome(lambda: real["base"].logits([1, 2, 3], adapter=ad))
        assert out in ("ok", "error")


def test_the_fuzz_inputs_load_when_unmutated(real):
    """The seeds are valid files: the fuzzers start from things that load."""
    path = real["root"] / "seed.gguf"
    path.write_bytes(real["gguf"])
    assert load_outcome(lambda: llama.load(path)) == "ok"
    assert load_outcome(lambda: llama.load(real["hf"])) == "ok"
    assert load_outcome(lambda: load_adapter(real["root"] / "adapter", real["base"])) == "ok"
    assert len(real["gguf_fields"]) > 100
    # every recorded field lies inside the header
    assert max(p for p, _ in real["gguf_fields"]) < len(real["gguf"])
    assert np.all(np.diff([p for p, _ in real["gguf_fields"]]) > 0)


@FUZZ
@given(st.data())
def test_fuzz_hf_folder_json(real, data):
    """config.json and tokenizer_config.json with one field replaced by any JSON value."""
    folder = real["root"] / "hfjson"
    if not folder.exists():
        folder.mkdir()
        for f in real["hf"].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    name = data.draw(st.sampled_from(["config.json", "tokenizer_config.json"]))
    for n in ("config.json", "tokenizer_config.json"):
        (folder / n).write_bytes((real["hf"] / n).read_bytes())
    obj = json.loads((real["hf"] / name).read_text())
    key = data.draw(st.sampled_from(sorted(obj) + ["rope_parameters", "rope_scaling",
                                                   "head_dim", "bos_token_id"]))
    obj[key] = data.draw(_JSON | st.sampled_from(INTERESTING))
    (folder / name).write_text(json.dumps(obj))
    load_outcome(lambda: llama.load(folder))
