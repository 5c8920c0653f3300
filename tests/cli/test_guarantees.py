"""The README's guarantees: user mistakes from the CLI are one clear line with a non-zero
exit code; no lost work (atomic checkpoints, Ctrl-C / SIGTERM save one, a non-finite loss
stops and keeps the last good checkpoint, ``--resume`` ends with the same adapter).

The SIGKILL-and-resume test (numpy and cpu backends) is in ``test_finetune_cli.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.train.finetune import CHECKPOINT, FinetuneConfig, finetune
from gradtape.models.lora import init_adapter, load_adapter
from gradtape.formats.safetensors_reader import read_safetensors
from gradtape.train.step import TrainStep

from support.filebuilders import write_tiny_gguf
from support.tinymodel import TINY_TEXT, tiny_model

QUIET = lambda *a: None  # noqa: E731


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "gradtape.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(res, *needles):
    assert res.returncode != 0, res.stdout
    err = res.stderr
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], err
    return lines[0]


# --- user mistakes from the CLI ---------------------------------------------------------
def test_generate_adapter_for_another_base_model(tiny_dir, tmp_path):
    other = tiny_model(dim=48, n_heads=4, n_kv_heads=2)
    init_adapter(other.config, rank=4, alpha=8, seed=1, targets="q,v").save(tmp_path / "ad")
    res = _cli("generate", "--model", tiny_dir / "model", "--adapter", tmp_path / "ad",
               "--prompt", "hello", "--max-new-tokens", "2")
    _one_line_error(res, "gradtape generate: error:", "tensor layers.0.self_attn.q_proj",
                    "lora_A [4, 48]", "lora_A [4, 32]", "another base model")


def test_generate_prompt_longer_than_the_context(tiny_dir):
    # the tiny model's context is 512 tokens; its tokenizer is one token per byte
    res = _cli("generate", "--model", tiny_dir / "model", "--prompt", "x" * 600)
    _one_line_error(res, "prompt (600 tokens)", "longer than the model's context (512",
                    "shorten the prompt")
    res = _cli("generate", "--model", tiny_dir / "model", "--prompt", "x" * 500,
               "--max-new-tokens", "64")
    _one_line_error(res, "prompt (500 tokens)", "--max-new-tokens 12 or less")


@pytest.mark.parametrize("command", ["generate", "finetune"])
def test_corrupted_model_file(tiny_dir, tmp_path, command):
    good = write_tiny_gguf(tiny_model(seed=1, vocab=258), tmp_path / "good.gguf").read_bytes()
    cases = {"truncated.gguf": (good[:len(good) // 2], "truncated"),
             "random.gguf": (os.urandom(5000), "not a GGUF file"),
             "random.bin": (os.urandom(5000), "not a model file"),
             "empty.gguf": (b"", "not a GGUF file")}
    for name, (data, needle) in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        args = (["--prompt", "hi"] if command == "generate" else
                ["--data", tiny_dir / "text.txt", "--out", tmp_path / f"o-{name}"])
        res = _cli(command, "--model", p, *args)
        _one_line_error(res, f"gradtape {command}: error:", str(p), needle)


def test_finetune_adapter_folder_given_as_model(tiny_dir, tmp_path):
    init_adapter(tiny_model().config, rank=2, seed=0).save(tmp_path / "ad")
    res = _cli("finetune", "--model", tmp_path / "ad", "--data", tiny_dir / "text.txt",
               "--out", tmp_path / "out")
    _one_line_error(res, "config.json")


# --- no lost work -----------------------------------------------------------------------
def _cfg(root, name, **kw):
    base = dict(data=str(root / "text.txt"), out=str(root / name), steps=8, seq_len=16,
                batch_size=2, rank=4, lr=1e-2, warmup=2, eval_every=0, save_every=2,
                dtype="float64", progress=False)
    return FinetuneConfig(**{**base, **kw})


def _ck_step(out):
    arrays, meta = read_safetensors(out / "checkpoint" / CHECKPOINT, float32=False,
                                    floats_only=False)
    assert all(np.isfinite(a).all() for a in arrays.values())
    return int(meta["step"])


def _same_adapter(a_dir, b_dir):
    a, b = load_adapter(a_dir), load_adapter(b_dir)
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:  # bitwise (float64 training)
        assert np.array_equal(a.weights[k][0], b.weights[k][0]), k
        assert np.array_equal(a.weights[k][1], b.weights[k][1]), k


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """An uninterrupted in-process run (8 steps) to compare resumed runs with."""
    root = tiny_dir
    finetune(_cfg(root, "reference"), model=tiny_model(seed=4), log=QUIET)
    return root / "reference"


def test_a_failed_checkpoint_write_keeps_the_previous_one(tiny_dir, tmp_path, monkeypatch,
                                                          reference):
    (tmp_path / "text.txt").write_text(TINY_TEXT)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        if str(dst).endswith(CHECKPOINT):
            calls.append(dst)
            if len(calls) == 2:  # the step-4 checkpoint: the disk "fills up" mid-write
                raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr("gradtape.io.os.replace", failing_replace)
    with pytest.raises(GradtapeError, match=r"checkpoint for step 4 .*No space left.*"
                                            r"previous checkpoint .* is kept"):
        finetune(_cfg(tmp_path, "run"), model=tiny_model(seed=4), log=QUIET)
    monkeypatch.setattr("gradtape.io.os.replace", real_replace)
    out = tmp_path / "run"
    assert _ck_step(out) == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [CHECKPOINT]  # no temps
    finetune(_cfg(tmp_path, "run", resume=True), model=tiny_model(seed=4), log=QUIET)
    _same_adapter(reference / "adapter", out / "adapter")


def test_a_torn_temporary_file_from_a_kill_is_ignored_and_cleaned(tiny_dir, tmp_path,
                                                                  reference):
    (tmp_path / "text.txt").write_text(TINY_TEXT)
    m = tiny_model(seed=4)
    calls = {"n": 0}
    real_step = TrainStep.step

    def dying(self, *a, **k):  # the process "dies" during step 4 ...
        calls["n"] += 1
        if calls["n"] == 4:
            raise SystemExit(9)
        return real_step(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainStep, "step", dying)
        with pytest.raises(SystemExit):
            finetune(_cfg(tmp_path, "run"), model=m, log=QUIET)
    out = tmp_path / "run"
    # ... and a kill during a checkpoint write leaves a torn temporary file behind
    torn = out / "checkpoint" / f".{CHECKPOINT}.x1y2z3.tmp"
    torn.write_bytes(b"\x10\0\0\0\0\0\0\0{\"a\": {\"dtyp")
    assert _ck_step(out) == 2
    finetune(_cfg(tmp_path, "run", resume=True), model=m, log=QUIET)
    assert not torn.exists()
    _same_adapter(reference / "adapter", out / "adapter")


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_checkpoint(tiny_dir, tmp_path,
                                                                         monkeypatch):
    (tmp_path / "text.txt").write_text(TINY_TEXT)
    calls = {"n": 0}
    real_step = TrainStep.step

    def nan_at_5(self, *a, **k):
        calls["n"] += 1
        loss, norm = real_step(self, *a, **k)
        return (math.nan, norm) if calls["n"] == 5 else (loss, norm)

    monkeypatch.setattr(TrainStep, "step", nan_at_5)
    with pytest.raises(GradtapeError, match=r"loss became nan at step 5; stopped, the last "
                                            r"good checkpoint .* is kept"):
        finetune(_cfg(tmp_path, "run"), model=tiny_model(seed=4), log=QUIET)
    out = tmp_path / "run"
    assert _ck_step(out) == 4
    assert not (out / "adapter").exists()


def test_a_diverged_state_never_replaces_a_good_checkpoint(tiny_dir, tmp_path, monkeypatch):
    (tmp_path / "text.txt").write_text(TINY_TEXT)
    real = TrainStep.state_arrays
    calls = {"n": 0}

    def poisoned(self):
        calls["n"] += 1
        arrays = real(self)
        if calls["n"] == 2:  # the parameters blew up before the step-4 checkpoint
            k = sorted(arrays)[0]
            arrays[k] = arrays[k].copy()
            arrays[k].flat[0] = np.inf
        return arrays

    monkeypatch.setattr(TrainStep, "state_arrays", poisoned)
    with pytest.raises(GradtapeError, match=r"non-finite at step 4 .*last good checkpoint"):
        finetune(_cfg(tmp_path, "run"), model=tiny_model(seed=4), log=QUIET)
    assert _ck_step(tmp_path / "run") == 2


def test_cli_huge_learning_rate_stops_cleanly(tiny_dir, tmp_path):
    out = tmp_path / "out"
    res = _cli("finetune", "--model", tiny_dir / "model", "--data", tiny_dir / "text.txt",
               "--out", out, "--steps", "30", "--seq-len", "16", "--batch-size", "2",
               "--rank", "4", "--lr", "1e30", "--warmup", "0", "--clip", "0",
               "--save-every", "1", "--dtype", "float32")
    line = _one_line_error(res, "at step")
    assert "non-finite" in line or "loss became" in line, line
    assert "is kept" in line
    if (out / "checkpoint" / CHECKPOINT).exists():
        _ck_step(out)  # whatever was kept is finite and readable


def _finetune_cmd(root, out, *extra):
    return [sys.executable, "-m", "gradtape.cli", "finetune", "--model", str(root / "model"),
            "--data", str(root / "text.txt"), "--out", str(out), "--steps", "14",
            "--seq-len", "24", "--batch-size", "2", "--rank", "4", "--lr", "5e-3",
            "--save-every", "5", "--eval-every", "5", "--dtype", "float64", *extra]


def _steps_logged(out):
    try:
        return len((out / "log.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_saves_a_checkpoint_and_resume_finishes_the_same(tiny_dir, tmp_path, sig):
    ref = subprocess.run(_finetune_cmd(tiny_dir, tmp_path / "ref"), capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "stopped"
    proc = subprocess.Popen(_finetune_cmd(tiny_dir, out), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while _steps_logged(out) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert "gradtape finetune: interrupted" in stderr
    step = _ck_step(out)
    # saved at a step boundary not in the --save-every 5 schedule, and said so
    assert 3 <= step < 14
    assert f"interrupted: checkpoint at step {step} saved" in stdout, stdout
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] \
        == list(range(1, step + 1))
    res = subprocess.run(_finetune_cmd(tiny_dir, out, "--resume"), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    _same_adapter(tmp_path / "ref" / "adapter", out / "adapter")
