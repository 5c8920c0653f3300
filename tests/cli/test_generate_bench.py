"""bench/generate_bench.py's pieces on the real model (the timed run itself is for a quiet
machine): a short timed generate, the first-difference report, the CPU description."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "generate_bench.py"


@pytest.fixture(scope="module")
def gb():
    return runpy.run_path(str(SCRIPT))


@pytest.mark.slow
def test_timed_generate_and_difference_report(gb, smollm2):
    ids = gb["prompt_ids"](smollm2.tokenizer)
    assert len(ids) == gb["PROMPT_TOKENS"]
    short = ids[:40]
    prefill, decode, out = gb["ours_once"](smollm2, short, n=5)
    assert prefill > 0 and decode > 0 and len(out) == 5
    assert gb["first_difference"](smollm2, short, out, out) == {"equal_tokens": 5}
    other = out[:2] + [(out[2] + 1) % 1000] + out[3:]
    d = gb["first_difference"](smollm2, short, other, out)
    assert d["equal_tokens"] == 2 and d["reference_token"] == out[2]
    # the report's margin is the reference's own at that step (the full forward's logits
    # after short + out[:2], up to float32 order), and our C step's logits there are the
    # reference's up to float32 summation order (logits of size 10-30; float32 sums in
    # another order differ by about 1e-5)
    z = smollm2.logits(short + out[:2])[-1]
    top = np.sort(z.astype(np.float64))[-2:]
    assert d["reference_top2_margin"] == pytest.approx(top[1] - top[0], abs=1e-3)
    assert d["max_logit_difference"] < 1e-3


def test_cpu_info(gb):
    info = gb["cpu_info"]()
    assert info["cpu"] and info["cores"] >= 1
    assert isinstance(gb["blas_info"](), list)
