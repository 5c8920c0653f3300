"""Runs people steer, on the tiny model: options from a YAML file (flags win, every value
checked as its flag's, one-line mistakes), early stopping (the best evaluation's adapter
kept, its step said, the state surviving a resume bit for bit, SFT and DPO), and samples
at each evaluation in log.jsonl."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.models.lora import load_adapter
from gradtape.train import config_file, samples
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.step import TrainStep

from support.tinymodel import tiny_model
from support.interrupt import killed_at_step

QUIET = lambda *a: None  # noqa: E731
WORDS = ("pack my box with five dozen liquor jugs. " * 60).split()


def _chats(path):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(WORDS[i:i + i % 5 + 1])},
        {"role": "assistant", "content": " ".join(WORDS[i + 2:i + 2 + i % 3 + 1])}]}) + "\n"
        for i in range(40)))
    return path


def _cfg(tmp_path, name, **kw):
    """A run whose held-out loss falls, then rises (a learning rate too high for it):
    with --early-stop 2 it stops at step 8, its best evaluation at step 4."""
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        _chats(data)
    base = dict(data=str(data), out=str(tmp_path / name), steps=30, seq_len=160,
                batch_size=2, rank=4, lr=5e-2, warmup=2, eval_every=2, save_every=3,
                dtype="float64", backend="numpy", progress=False, early_stop=2,
                samples=2, sample_tokens=6)
    return FinetuneConfig(**{**base, **kw})


def _log(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def _same(a, b):
    return a.keys() == b.keys() and all(
        np.array_equal(a[k][0], b[k][0]) and np.array_equal(a[k][1], b[k][1]) for k in a)


# --- the config file --------------------------------------------------------------------

def _yaml(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_config_file_sets_options_by_their_flag_names(tmp_path):
    p = _yaml(tmp_path, "data: d.txt\nout: o\nseq-len: 64\nbatch_size: 3\nlr: 1e-3\n"
                        "no-packing: true\ngrad-checkpoint: 'on'\nbeta: null\n")
    cfg = FinetuneConfig.from_yaml(p, batch_size=5)  # the override wins
    assert (cfg.seq_len, cfg.batch_size, cfg.lr, cfg.packing, cfg.grad_checkpoint) == \
        (64, 5, 1e-3, False, "on")
    assert isinstance(cfg.lr, float)  # YAML 1.1 reads 1e-3 as a string
    # the resolved file reads back as the same options
    config_file.write_resolved(tmp_path / "config.yaml", cfg)
    again = FinetuneConfig.from_yaml(tmp_path / "config.yaml", progress=cfg.progress)
    assert again == cfg


@pytest.mark.parametrize("text, message", [
    ("lr: -1\n", "run.yaml: lr must be > 0, got -1"),
    ("seq-len: 1.5\n", "run.yaml: seq-len must be an integer, got 1.5"),
    ("backend: gpu\n", "run.yaml: backend must be one of"),
    ("lora-rank: 8\n", "run.yaml: lora-rank: not a finetune option (did you mean rank?)"),
    ("progress: false\n", "run.yaml: progress: not a finetune option"),
    ("rank: 4\nrank: 8\n", None),  # PyYAML keeps the last (a duplicate mapping key)
    ("seq-len: 8\nseq_len: 9\n", "run.yaml: seq_len: seq-len is set twice (also as seq-len)"),
    ("grad-checkpoint: on\n", "run.yaml: grad-checkpoint must be a string, got True (YAML "
                              "reads on, off"),
    ("packing: maybe\n", "run.yaml: packing must be True or False, got 'maybe'"),
    ("a: &a [1, 1]\nb: &b [*a, *a]\nlr: [*b, *b]\n", "run.yaml: a: not a finetune option"),
    ("lr: &b [1, 1]\n", "run.yaml: lr must be one value, got a list"),
    ("lr: [1, 2\n", "run.yaml: is not YAML ("),
    ("- lr: 1\n", "run.yaml: is not a mapping of options (key: value lines), it holds a list"),
    ("just words\n", "run.yaml: is not a mapping of options"),
])
def test_config_file_mistakes_are_one_line_naming_file_and_key(tmp_path, text, message):
    p = _yaml(tmp_path, text)
    if message is None:
        assert config_file.read_config(p, FinetuneConfig) == {"rank": 8}
        return
    with pytest.raises(GradtapeError) as e:
        config_file.read_config(p, FinetuneConfig)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith(f"--config {p}: ")


def test_cli_config_with_flags_overriding_and_its_mistakes(tiny_dir, tmp_path, capsys):
    from gradtape.cli import main

    out = tmp_path / "out"
    p = _yaml(tmp_path, f"model: {tiny_dir / 'model'}\ndata: {tiny_dir / 'text.txt'}\n"
                        f"out: {out}\nsteps: 5\nseq_len: 24\nbatch-size: 2\nrank: 4\n"
                        "dtype: float64\nbackend: numpy\neval-every: 2\nsamples: 1\n"
                        "sample-tokens: 4\n")
    assert main(["finetune", "--config", str(p), "--steps", "3", "--no-packing"]) == 0
    resolved = config_file.read_config(out / "config.yaml", FinetuneConfig)
    assert (resolved["steps"], resolved["packing"], resolved["rank"]) == (3, False, 4)
    assert [r["step"] for r in _log(out)] == [1, 2, 3]
    assert [len(r["samples"]) for r in _log(out) if "eval_loss" in r] == [1, 1]
    capsys.readouterr()
    bad = _yaml(tmp_path, "rank: 0\n", "bad.yaml")
    assert main(["finetune", "--config", str(bad), "--data", "x", "--out", "y"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"gradtape finetune: error: --config {bad}: rank must be >= 1, got 0"
    for text, said in (("steps: [1\n", "is not YAML"), ("lora-rank: 8\n", "lora-rank: not a "
                       "finetune option (did you mean rank?)")):
        other = _yaml(tmp_path, text, "other.yaml")
        assert main(["finetune", "--config", str(other)]) == 1
        assert capsys.readouterr().err.startswith(f"gradtape finetune: error: --config "
                                                  f"{other}: {said}")
    assert main(["finetune", "--config", str(tmp_path / "none.yaml")]) == 1
    assert "none.yaml: does not exist" in capsys.readouterr().err
    # a file's mistake counts even where a flag overrides it
    assert main(["finetune", "--config", str(bad), "--rank", "2", "--data", "x", "--out",
                 "y"]) == 1
    assert "bad.yaml: rank must be >= 1" in capsys.readouterr().err
    # still required where neither the file nor the command line gives it
    good = _yaml(tmp_path, "rank: 2\n", "good.yaml")
    assert main(["finetune", "--config", str(good), "--out", "y"]) == 1
    assert capsys.readouterr().err.strip() == "gradtape finetune: error: --data is required"


# --- early stopping and samples ---------------------------------------------------------

def _snapshots(monkeypatch):
    """The adapter's weights (a full step's: the model's) after every optimizer step of
    the runs that follow."""
    seen, real = {}, TrainStep.step

    def step(self, micro, opt_step, *a, **k):
        out = real(self, micro, opt_step, *a, **k)
        seen[opt_step] = (dict(self.model_weights()) if self.full
                          else self.adapter_weights())
        return out
    monkeypatch.setattr(TrainStep, "step", step)
    return seen


def test_early_stop_keeps_the_best_steps_adapter_and_says_so(tmp_path, monkeypatch):
    snaps = _snapshots(monkeypatch)
    lines = []
    summary = finetune(_cfg(tmp_path, "run"), model=tiny_model(), log=lines.append)
    out = tmp_path / "run"
    log = _log(out)
    evals = [r for r in log if "eval_loss" in r]
    losses = [r["eval_loss"] for r in evals]
    best = evals[int(np.argmin(losses))]["step"]
    assert summary["stopped_early"] and summary["best_step"] == best
    assert summary["steps"] == log[-1]["step"] < 30 and log[-1].get("early_stop")
    # stopped after 2 evaluations without a lower loss than the best's
    assert [r["step"] for r in evals][-3] == best and log[-1]["evals_without_improvement"] == 2
    assert all(r["best_step"] == best for r in evals if r["step"] >= best)
    assert load_adapter(out / "adapter").weights.keys() == snaps[best].keys()
    assert _same(load_adapter(out / "adapter").weights, snaps[best])
    assert not _same(load_adapter(out / "adapter").weights, snaps[summary["steps"]])
    assert any(f"adapter/ holds step {best}'s weights" in x for x in lines), lines
    assert any(x.startswith(f"early stop at step {summary['steps']}") for x in lines), lines
    # the samples: greedy answers to two held-out prompts at every evaluation
    for r in evals:
        assert len(r["samples"]) == 2
        for s in r["samples"]:
            assert set(s) == {"prompt", "answer"} and s["prompt"].endswith("<assistant>")
            assert len(s["answer"].encode("utf-8", "replace")) <= 6 * 3
    assert any(x.startswith("  sample: ") for x in lines)


# a full run whose held-out loss falls, then rises: its best evaluation at step 10, its
# stop at step 14 (every weight trained, at the rank an adapter's options leave alone)
FULL = {"rank": 8, "lr": 0.1}


def test_full_early_stop_keeps_the_best_model_and_samples_its_weights(tmp_path, monkeypatch):
    """--fine-tune-type full: model/ holds the best evaluation's weights (the same bytes
    as that step's model written on its own), and each evaluation's samples are greedy
    answers from the weights of that step."""
    from gradtape.train import full

    snaps = _snapshots(monkeypatch)
    m = tiny_model()
    lines = []
    summary = finetune(_cfg(tmp_path, "run", fine_tune_type="full", **FULL), model=m,
                       log=lines.append)
    out = tmp_path / "run"
    evals = [r for r in _log(out) if "eval_loss" in r]
    best = evals[int(np.argmin([r["eval_loss"] for r in evals]))]["step"]
    assert summary["stopped_early"] and summary["best_step"] == best < summary["steps"]
    assert any(f"model/ holds step {best}'s weights" in x for x in lines), lines
    full.save_model(full.trained_model(m, snaps[best]), tmp_path / "ref")
    got = (out / "model/model.safetensors").read_bytes()
    assert got == (tmp_path / "ref/model/model.safetensors").read_bytes()
    # the samples at an evaluation are the answers of that step's weights
    prompts = [np.asarray(m.tokenizer.encode(s["prompt"])) for s in evals[0]["samples"]]
    sampler = samples.Sampler(m, prompts, 6)
    for r in evals:
        assert r["samples"] == sampler.answers(None, model=full.trained_model(
            m, snaps[r["step"]]))
    assert evals[0]["samples"] != evals[-1]["samples"]


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])  # the best's magnitudes, model
def test_early_stop_survives_a_resume_bit_for_bit(tmp_path, monkeypatch, kind):
    m = tiny_model()
    # at 5e-2 DoRA's held-out loss still falls at step 30; at 0.2 it rises again
    _cfg = functools.partial(globals()["_cfg"], fine_tune_type=kind,
                             **({"lr": 0.2} if kind == "dora" else FULL if kind == "full"
                                else {}))
    whole = finetune(_cfg(tmp_path, "whole"), model=m, log=QUIET)
    best, last = whole["best_step"], whole["steps"]
    assert best < last
    # killed after the best evaluation was written, before the stop; the checkpoint is at
    # step 6 (--save-every 3), the best evaluation at step 4
    with killed_at_step(monkeypatch, last):
        finetune(_cfg(tmp_path, "split"), model=m, log=QUIET)
    lines = []
    again = finetune(_cfg(tmp_path, "split", resume=True), model=m, log=lines.append)
    assert (again["best_step"], again["steps"], again["best_eval_loss"]) == \
        (best, last, whole["best_eval_loss"])
    assert any("so far step" in x for x in lines), lines
    for f in (("model/model.safetensors", "model/config.json") if kind == "full" else
              ("adapter/adapter_model.safetensors", "adapter/adapter_config.json")):
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "split" / f).read_bytes()
    strip = lambda log: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")}
                         for r in log]
    assert strip(_log(tmp_path / "split")) == strip(_log(tmp_path / "whole"))
    # a run its early stop ended trains no further when resumed
    done = finetune(_cfg(tmp_path, "whole", resume=True), model=m, log=QUIET)
    assert (done["steps"], done["best_step"], done["stopped_early"]) == (last, best, True)


def test_a_resume_puts_the_checkpoints_best_back(tmp_path, monkeypatch):
    """Killed after an evaluation better than the checkpoint knows (adapter/ written at
    step 4, the checkpoint at step 3 with its best at step 2): the resumed run starts
    from the checkpoint's best, whatever it then trains (here: nothing more)."""
    m = tiny_model()
    snaps = _snapshots(monkeypatch)
    with killed_at_step(monkeypatch, 5):
        finetune(_cfg(tmp_path, "run", lr=1e-2, early_stop=3), model=m, log=QUIET)
    log = _log(tmp_path / "run")
    assert [r.get("best_step") for r in log] == [None, 2, None, 4]
    assert _same(load_adapter(tmp_path / "run/adapter").weights, snaps[4])
    done = finetune(_cfg(tmp_path, "run", lr=1e-2, early_stop=3, steps=3, resume=True),
                    model=m, log=QUIET)
    assert done["best_step"] == 2
    assert _same(load_adapter(tmp_path / "run/adapter").weights, snaps[2])


def test_early_stop_with_dpo(tmp_path):
    rows = [{"prompt": f"Q{i}: {WORDS[i % 9]}?", "chosen": f" {WORDS[(i + 1) % 9]}",
             "rejected": f" {WORDS[(i + 4) % 9]} no"} for i in range(12)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = finetune(_cfg(tmp_path, "dpo", data=str(data), method="dpo", seq_len=32,
                            steps=6, lr=1e-2, early_stop=5), model=tiny_model(), log=QUIET)
    log = _log(tmp_path / "dpo")
    evals = [r for r in log if "eval_loss" in r]
    best = evals[int(np.argmin([r["eval_loss"] for r in evals]))]["step"]
    assert summary["best_step"] == best and not summary["stopped_early"]
    assert all(len(r["samples"]) == 1 and r["samples"][0]["prompt"].startswith("Q")
               for r in evals)  # one pair held out: its prompt


def test_sample_prompts_from_a_file(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"box with"\n\n{"prompt": "five dozen"}\n'
                       '{"messages": [{"role": "user", "content": "jugs"}]}\n')
    finetune(_cfg(tmp_path, "run", steps=2, early_stop=0, sample_prompts=str(prompts)),
             model=tiny_model(), log=QUIET)
    (rec,) = [r for r in _log(tmp_path / "run") if "samples" in r]
    # the tiny tokenizer has no chat template text: strings go as they are
    assert [s["prompt"] for s in rec["samples"]] == ["box with", "five dozen",
                                                     "<user>jugs</user>\n<assistant>"]


def test_a_messages_prompt_needs_a_chat_template():
    from types import SimpleNamespace
    tok = SimpleNamespace(chat_template=None, encode=lambda t: list(t.encode()))
    assert samples.encode_prompt(tok, "hi").tolist() == [104, 105]
    with pytest.raises(GradtapeError, match="a messages prompt needs a chat template"):
        samples.encode_prompt(tok, [{"role": "user", "content": "hi"}])


def test_example_prompts():
    ids, target = np.arange(10), np.array([0, 0, 0, 1, 1, 0, 1, 1, 1, 1], bool)
    assert samples.example_prompt(ids, target).tolist() == [0, 1, 2]
    assert samples.example_prompt(np.arange(200), np.ones(200, bool)).tolist() == \
        list(range(samples.TEXT_PROMPT_MAX))


@pytest.mark.parametrize("opts, message", [
    ({"eval_frac": 0.0}, "--early-stop needs held-out data: give --eval-data, or an "
                         "--eval-frac > 0"),
    ({"eval_every": 0}, "--early-stop counts evaluations: it needs --eval-every > 0"),
    ({"data": "{d}/one.txt"}, "--early-stop needs held-out data, and this run has none"),
    ({"early_stop": -1}, "--early-stop must be >= 0, got -1"),
    ({"samples": 65}, "--samples must be in [0, 64], got 65"),
    ({"sample_tokens": 0}, "--sample-tokens must be in [1, 4096], got 0"),
    ({"samples": 0, "sample_prompts": "p.txt"}, "--sample-prompts needs --samples > 0"),
    ({"sample_prompts": "{d}/none.txt"}, "none.txt: does not exist"),
    ({"sample_prompts": "{d}/empty.txt"}, "empty.txt: holds no prompt"),
    ({"sample_prompts": "{d}/bad.jsonl"}, "bad.jsonl:2: a prompt is a string"),
])
def test_steering_mistakes_are_one_line(tmp_path, opts, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "one.txt").write_text("a text of one example")
    (tmp_path / "bad.jsonl").write_text('"fine"\n{"text": "no"}\n')
    opts = {k: v.format(d=tmp_path) if isinstance(v, str) else v for k, v in opts.items()}
    with pytest.raises(GradtapeError) as e:
        finetune(_cfg(tmp_path, "run", **opts), model=tiny_model(), log=QUIET)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_every_option_is_a_config_key():
    """A new FinetuneConfig field is a config-file key with no code of its own."""
    keys = {f.name for f in dataclasses.fields(FinetuneConfig) if f.metadata.get("cli") is not False}
    assert set(config_file.options(FinetuneConfig)) == keys


@pytest.mark.slow
def test_early_stop_under_mpi_stops_every_rank_at_the_same_step(tiny_dir, tmp_path):
    """Rank 0 evaluates and decides; every rank stops after the same step, as one process
    with the same global batch does."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    mpiexec = shutil.which("mpiexec", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert mpiexec is not None, "mpiexec not installed (pip install '.[mpi]')"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def run(out, batch, *launcher):
        cmd = [*launcher, sys.executable, "-m", "gradtape.cli", "finetune", "--model",
               str(tiny_dir / "model"), "--data", str(tiny_dir / "text.txt"), "--out",
               str(out), "--steps", "12", "--seq-len", "32", "--batch-size", str(batch),
               "--grad-accum", "2", "--rank", "4", "--lr", "0.5", "--warmup", "2",
               "--eval-every", "1", "--early-stop", "1", "--samples", "1",
               "--sample-tokens", "3", "--dtype", "float64"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        return _log(out)

    one = run(tmp_path / "one", 4)
    two = run(tmp_path / "two", 2, mpiexec, "-n", "2")
    assert one[-1].get("early_stop") and len(one) < 12
    assert [r["step"] for r in two] == [r["step"] for r in one]
    assert two[-1]["best_step"] == one[-1]["best_step"] and two[-1].get("early_stop")
