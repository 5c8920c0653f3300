"""The preference methods under ``mpiexec -n 2``: two ranks of one pair each train as one
process with two pairs a micro-batch (float64): the same losses, TRL's metrics, held-out
metrics and reference pass (written once, by rank 0), and the same adapter."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from support.mpi import MPIEXEC, mpi_env

WORDS = "sky blue green red sun moon two four three Paris Lyon cat dog tree rain snow".split()


def _pairs(path, n=11):
    rows = [{"prompt": f"Q{i}: {WORDS[i % 16]}?", "chosen": f" {WORDS[(i + 1) % 16]}",
             "rejected": f" {WORDS[(i + 7) % 16]} no{'!' * (i % 3)}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _finetune(tiny_dir, data, out, method, batch, *extra, ranks=0):
    cmd = [sys.executable, "-m", "gradtape.cli", "finetune", "--model", str(tiny_dir / "model"),
           "--data", str(data), "--out", str(out), "--method", method, "--steps", "4", *extra,
           "--seq-len", "32", "--batch-size", str(batch), "--grad-accum", "2", "--rank", "4",
           "--lr", "1e-2", "--warmup", "1", "--save-every", "2", "--eval-every", "2",
           "--eval-frac", "0.3", "--dtype", "float64", "--backend", "numpy"]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_two_ranks_equal_one_process_with_twice_the_pairs(tiny_dir, tmp_path, method):
    assert MPIEXEC is not None, "mpiexec / mpi4py not installed (pip install '.[mpi]')"
    data = _pairs(tmp_path / "pairs.jsonl")
    one = _finetune(tiny_dir, data, tmp_path / "one", method, 2)
    assert one.returncode == 0, one.stdout + one.stderr
    two = _finetune(tiny_dir, data, tmp_path / "two", method, 1, ranks=2)
    assert two.returncode == 0, two.stdout + two.stderr
    assert two.stdout.count("final train loss") == 1
    logs = [[json.loads(x) for x in (tmp_path / run / "log.jsonl").read_text().splitlines()]
            for run in ("one", "two")]
    assert [r["step"] for r in logs[1]] == [1, 2, 3, 4]
    for q, r in zip(*logs):
        assert set(r) == set(q)
        for k, v in q.items():
            # samples: greedy text, and the adapters agree to rounding only
            if k not in ("tokens_per_s", "elapsed_s", "lr", "step", "samples"):
                if method == "dpo" and r["step"] == 1 and k == "rewards/accuracies":
                    # the policy is the reference, computed several pairs a call: every
                    # reward is 0 to rounding, and which side of 0 it falls is rounding
                    assert max(abs(x["rewards/chosen"]) for x in (q, r)) < 1e-12
                    continue
                assert r[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (r["step"], k)
    assert "eval_rewards/accuracies" in logs[1][1]
    if method == "dpo":  # the reference pass, shared out over the ranks, kept once
        a, b = (load_file(tmp_path / run / "reference.safetensors") for run in ("one", "two"))
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-12, atol=0)
    sa, sb = (load_file(tmp_path / run / "checkpoint" / "state.safetensors")
              for run in ("one", "two"))
    # AdamW divides each gradient by its own root mean square: where one is near zero a
    # rounding of the sums' order moves its update far more than the gradient's error
    for k in sa:
        if k.startswith("param."):
            np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-9, err_msg=k)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())
    if method == "dpo":  # each run resumes with the other's rank count, reference read back
        more = ("--steps", "6", "--resume")
        for res in (_finetune(tiny_dir, data, tmp_path / "two", method, 2, *more),
                    _finetune(tiny_dir, data, tmp_path / "one", method, 1, *more, ranks=2)):
            assert res.returncode == 0, res.stdout + res.stderr
            assert "reference pass: read from" in res.stdout
        sa, sb = (load_file(tmp_path / run / "checkpoint" / "state.safetensors")
                  for run in ("one", "two"))
        for k in sa:
            if k.startswith("param."):
                np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-9, err_msg=k)
