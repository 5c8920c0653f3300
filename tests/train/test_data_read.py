"""Reading a data file before any model is loaded (``train.data.read_data``): the byte
offset and line of the first byte that is not UTF-8 text, the line of a bad JSONL
record, and what is text after all (a byte-order mark, U+2028 inside a JSON string)."""

from __future__ import annotations

import pytest

from gradtape.errors import GradtapeError
from gradtape.train import data as data_mod


def test_data_reader_names_the_line_or_byte(tmp_path):
    p = tmp_path / "d.jsonl"
    good, bad = b'{"prompt": "a", "completion": "b"}\n' * 2, b'{"prompt": "'
    p.write_bytes(good + bad + b'\xc3(", ')
    with pytest.raises(GradtapeError, match=rf"not UTF-8 text \(byte 0xc3 at byte offset "
                                            rf"{len(good + bad)}, line 3\)"):
        data_mod.read_data(p)
    p.write_text('{"prompt": "a", "completion": "\\ud800"}\n')
    with pytest.raises(GradtapeError, match=r"d.jsonl:1: a string holds an unpaired surrogate"):
        data_mod.read_data(p)
    # U+2028 is valid inside a JSON string: it must not split the line (or renumber them)
    p.write_text('{"prompt": "a\u2028b", "completion": "c"}\n{"prompt": 1}\n')
    with pytest.raises(GradtapeError, match=r"d.jsonl:2: expected"):
        data_mod.read_data(p)
    p.write_text("[" * 100000 + "\n")
    p.rename(tmp_path / "deep.jsonl")
    with pytest.raises(GradtapeError, match=r"deep.jsonl:1: (JSON nested too deeply|malformed)"):
        data_mod.read_data(tmp_path / "deep.jsonl")


def test_a_byte_order_mark_is_not_text(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a", "completion": "b"}\n')
    d = data_mod.read_data(p)
    assert d.records == ((f"{p}:1", {"prompt": "a", "completion": "b"}),)
