"""bench/dpo_bench.py, the DPO workloads against TRL's DPOTrainer: `gradtape bench` sends
its workloads there, the script runs end to end on the tiny model in a fresh interpreter
(both sides, every field of a row), and the 8B workload's two sides train on a shrunken
shape.  (The SmolLM2 and 8B timings belong to the benchmark, not to the test suite.)"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from gradtape.cli import bench as cli_bench

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "dpo_bench.py"
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def dpo(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return runpy.run_path(str(SCRIPT))


def test_the_cli_sends_the_dpo_workloads_to_the_script(dpo):
    mine = {w for w, s in cli_bench.SCRIPTS.items() if s == SCRIPT}
    assert mine == set(dpo["WORKLOADS"]) == {"smollm2-dpo", "llama8b-q4km-dpo", "tiny-dpo"}
    assert {"trl", "datasets"} <= set(cli_bench.NEEDS[SCRIPT])


def test_pairs_are_full_rows_the_same_on_both_sides(dpo):
    pairs = dpo["make_pairs"](3, 32, 256)
    assert pairs == dpo["make_pairs"](3, 32, 256)
    for prompt, chosen, rejected in pairs:
        assert len(prompt) == 8 and len(prompt + chosen) == len(prompt + rejected) == 32
        assert chosen != rejected and min(prompt + chosen + rejected) >= 3


def test_the_sides_train_with_finetunes_defaults(dpo):
    d = dpo["defaults"]()
    assert (d["rank"], d["alpha"], d["clip"], d["compute"], d["grad_checkpoint"]) == \
        (8, 16.0, 1.0, "auto", "auto")


@pytest.mark.slow
def test_tiny_workload_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "tiny-dpo", "--reps", "2",
                          "--warmup", "1", "--json"], capture_output=True, text=True,
                         timeout=900, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    peers = {r["peer"] for r in rows}
    assert "trl-eager-f32" in peers  # autocast only where the CPU has bf16 instructions
    for r in rows:
        assert "peer_error" not in r, r.get("peer_error")
        assert r["workload"] == "tiny-dpo" and r["default"] and r["seq_len"] == 32
        assert r["step_ratio"] == pytest.approx(r["gradtape_s"] / r["peer_s"])
        assert r["rss_ratio"] == pytest.approx(r["gradtape_peak_mb"] / r["peer_peak_mb"])
        assert r["ref_vs_epoch"] == pytest.approx(r["ref_pass_s"] / r["epoch_s"])
        assert r["peer_grad_checkpoint"] and r["cpu"] and r["split_s"]


@pytest.mark.model
@pytest.mark.slow
def test_8b_workload_sides_on_a_small_shape(dpo, smollm2_gguf, monkeypatch, tmp_path):
    qb = sys.modules["quant_bench"]  # the module dpo_bench imported
    monkeypatch.setenv("GRADTAPE_CACHE", str(tmp_path))
    monkeypatch.setattr(qb, "SHAPE", dict(qb.SHAPE, dim=256, n_heads=2, n_kv_heads=1,
                                          head_dim=128, ffn=512))
    ours = dpo["run_gradtape"]("llama8b-q4km-dpo", 0, 1, "cpu", layers=2)
    assert ours["weights"] == "stored" and len(ours["step_times"]) == 1
    assert ours["ref_s"] > 0 and ours["epoch_s"] > 0 and ours["compute_why"]
    peer = dpo["run_peer"]("llama8b-q4km-dpo", "trl-bf16", 0, 1, layers=2)
    assert len(peer["step_times"]) == 1 and peer["weights"] == "bfloat16"
