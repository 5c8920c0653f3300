"""bench/generate_isa.py's pieces (the timed run itself is for a quiet machine): the
fresh prompt windows, the rows it prints, and our side's worker at the AVX2 class over its
line protocol on the real model, without a llama.cpp build (the row then says so)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from gradtape.backends.cpu import toolchain

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gi():
    sys.path.insert(0, str(BENCH))
    try:
        yield runpy.run_path(str(BENCH / "generate_isa.py"))
    finally:
        sys.path.remove(str(BENCH))


def test_prompts_are_fresh_windows(gi, smollm2):
    ids = gi["prompts"](smollm2.tokenizer, 3, 256)
    assert len(ids) == 4 and all(len(p) == 256 for p in ids)
    assert len({tuple(p) for p in ids}) == 4


def test_peer_folder_and_rows(gi, tmp_path):
    assert gi["peer_dir"]("avx2", None) == Path(sys.prefix) / "llama-cpp-avx2"
    assert gi["peer_dir"]("avx2", str(tmp_path)) == tmp_path
    skipped = {"workload": "smollm2-generate-avx2", "quant": "Q4_K_M", "skipped": "no build"}
    assert "skipped (no build)" in gi["show"](skipped)
    row = {"workload": "smollm2-generate-avx2", "quant": "Q4_1", "cpu": "X", "isa": "avx2",
           "gradtape_prefill_tok_s": 300.0, "gradtape_decode_tok_s": 100.0,
           "peer_note": "no llama.cpp build"}
    assert "[X; ISA avx2]" in gi["show"](row) and "no llama.cpp build" in gi["show"](row)


@pytest.mark.slow
def test_our_worker_at_avx2_without_a_peer(gi, smollm2, smollm2_gguf, tmp_path):
    if "avx2" not in toolchain.isa_classes():
        pytest.skip("this CPU lacks AVX2, FMA or F16C: it cannot run the avx2 class")
    row = gi["row_for"]("avx2", Path(smollm2_gguf), "Q4_1", tmp_path, 1, 16, 3,
                        smollm2.tokenizer, lambda *a: None)
    assert row["gradtape_isa"] == "avx2" and row["isa"] == "avx2"
    assert row["gradtape_prefill_tok_s"] > 0 and row["gradtape_decode_tok_s"] > 0
    assert "make llama-cpp-avx2" in row["peer_note"] and "prefill_ratio" not in row
