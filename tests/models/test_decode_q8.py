"""The C decode step with 8-bit input rows and integer dots (``dots="q8"``, the default of
``$GRADTAPE_DECODE_DOTS``; the suite runs the float32-input step, ``tests/conftest.py``)
against the float32-input step on the real model: logits within a stated bound, greedy
text that still answers, and the setting's range check.  The kernels' exactness is
``tests/backends/test_q8_dots.py``.

The bound: quantizing each product's input to 8 bits per block of 32 (llama.cpp's Q8_0)
moves SmolLM2's logits by about 2% of the largest (median over steps) and at most about
4% (measured over 96 steps at 256 cached rows); the tests allow twice that.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradtape import settings
from gradtape.errors import GradtapeError
from gradtape.infer import block_decoder as E

Q8_MEDIAN = 0.04  # median over steps of max |q8 - float| / max |float|
Q8_MAX = 0.08  # the largest such step

TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting the steps "
        "as his father had taught him, and lit the lamp before the fishing boats came home.")


def _decoders(model, cap=128):
    blocks = E.block_weights(model)
    return {d: E.BlockDecoder(model, blocks, cap=cap, dots=d) for d in ("float", "q8")}


def test_q8_logits_lie_within_the_bound_of_float(smollm2):
    prompt = smollm2.tokenizer.encode(TEXT)
    decs = _decoders(smollm2)
    assert {name: d.m.q8 for name, d in decs.items()} == {"float": 0, "q8": 1}
    for d in decs.values():
        d.prefill(prompt[:-1])
    tok, errs = prompt[-1], []
    for _ in range(24):  # along the float step's greedy tokens (teacher forcing for q8)
        f = decs["float"].step(tok).copy()
        q = decs["q8"].step(tok)
        errs.append(np.abs(q - f).max() / np.abs(f).max())
        tok = int(f.argmax())
    assert np.median(errs) <= Q8_MEDIAN and max(errs) <= Q8_MAX, errs
    assert max(errs) > 0  # the q8 products ran (Q4_1 and Q8_0 weights both have them)


def test_q8_greedy_text_answers(smollm2, monkeypatch):
    monkeypatch.setenv("GRADTAPE_DECODE_DOTS", "q8")
    tok = smollm2.tokenizer
    prompt = tok.encode("The capital of France is")
    out = smollm2.generate(prompt, 6, decoder="blocks")
    assert tok.decode(out).startswith(" Paris"), tok.decode(out)


def test_decode_dots_setting_is_checked(monkeypatch):
    monkeypatch.setenv("GRADTAPE_DECODE_DOTS", "Q8")
    assert settings.decode_dots() == "q8"
    monkeypatch.setenv("GRADTAPE_DECODE_DOTS", "int8")
    with pytest.raises(GradtapeError, match=r"\$GRADTAPE_DECODE_DOTS must be one of q8 \| float"):
        settings.decode_dots()
