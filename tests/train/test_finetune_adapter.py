"""``finetune --adapter DIR``: training starts from an existing PEFT LoRA folder, for sft
and the preference methods; its rank, alpha, targets and rsLoRA scale are the run's (a
contradicting --rank / --alpha / --targets is one line); for DPO the model with that
adapter is the reference; ``--adapter`` is part of the run's identity for ``--resume``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.models.lora import load_adapter
from gradtape.train import preference_run
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.methods import method as row
from gradtape.train.preference import reference_logps
from gradtape.train.records import read_data

from support.adapters import random_adapter
from support.tinymodel import TINY_TEXT, tiny_model

QUIET = lambda *a: None  # noqa: E731
WORDS = "sky blue green red sun moon two four three Paris Lyon cat dog tree rain snow".split()


def _pairs(path, n=10):
    rows = [{"prompt": f"Q{i}: {WORDS[i % 16]}?", "chosen": f" {WORDS[(i + 1) % 16]}",
             "rejected": f" {WORDS[(i + 7) % 16]} no"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, name, method="sft", **kw):
    if method == "sft":
        data = tmp_path / "text.txt"
        data.write_text(TINY_TEXT)
    else:
        data = tmp_path / "pairs.jsonl"
        if not data.exists():
            _pairs(data)
    base = dict(data=str(data), out=str(tmp_path / name), steps=2, seq_len=32, batch_size=2,
                lr=1e-2, warmup=1, eval_every=0, save_every=1, dtype="float64",
                method=method, backend="numpy", progress=False)
    return FinetuneConfig(**{**base, **kw})


def _log(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture
def start(tmp_path):
    """A rank-4 adapter on q, v and down with a non-zero B, saved as a PEFT folder."""
    m = tiny_model()
    ad = random_adapter(m.config, rank=4, alpha=8.0, targets="q,v,down", b_scale=0.3)
    ad.save(tmp_path / "start")
    return m, tmp_path / "start"


def test_sft_starts_from_the_adapter(tmp_path, start):
    m, folder = start
    lines = []
    finetune(_cfg(tmp_path, "from", adapter=str(folder)), model=m, log=lines.append)
    finetune(_cfg(tmp_path, "fresh", rank=4, alpha=8.0, targets="q,v,down"), model=m,
             log=QUIET)
    assert any(x.startswith(f"adapter: starting from {folder} (LoRA, r=4, alpha 8, scale 2,")
               for x in lines), lines
    # the same rows: only the starting adapter differs, and so does the first loss
    first, fresh = _log(tmp_path / "from")[0]["loss"], _log(tmp_path / "fresh")[0]["loss"]
    assert first != pytest.approx(fresh, rel=1e-6)
    # the first loss is that of the model with the adapter: one step at lr ~ 0 from it
    # equals it to rounding, and what is written keeps the adapter's layout
    finetune(_cfg(tmp_path, "still", adapter=str(folder), steps=1, lr=1e-300), model=m,
             log=QUIET)
    assert _log(tmp_path / "still")[0]["loss"] == pytest.approx(first, rel=1e-12)
    out, src = load_adapter(tmp_path / "from" / "adapter"), load_adapter(folder)
    assert (out.rank, out.alpha, out.targets) == (4, 8.0, ("q", "v", "down"))
    assert out.weights.keys() == src.weights.keys()
    kept = load_adapter(tmp_path / "still" / "adapter")
    for k, (a, b) in src.weights.items():
        np.testing.assert_array_equal(kept.weights[k][1], b)
    marker = json.loads((tmp_path / "from" / "gradtape-run.json").read_text())
    assert marker["config"]["adapter"] == str(folder)


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_the_reference_is_the_model_with_the_adapter(tmp_path, start, method):
    m, folder = start
    lines = []
    finetune(_cfg(tmp_path, "run", method, adapter=str(folder), steps=1), model=m,
             log=lines.append)
    cfg = _cfg(tmp_path, "run", method)
    train, held = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                      m.tokenizer, row(method).average, QUIET)
    from safetensors.numpy import load_file
    saved = load_file(tmp_path / "run" / preference_run.REFERENCE)
    ad = load_adapter(folder)
    ad.weights = {k: (a.astype(np.float64), b.astype(np.float64))
                  for k, (a, b) in ad.weights.items()}
    taken = {"train": train.used(1), "eval": np.arange(len(held))}  # one step's pairs
    for name, d in (("train", train), ("eval", held)):
        assert np.array_equal(np.flatnonzero(~np.isnan(saved[name][:, 0])), taken[name])
        for i in taken[name]:
            with_it = reference_logps(m, ad, row(method), d.batch([i]))
            base = reference_logps(m, None, row(method), d.batch([i]))
            np.testing.assert_allclose(saved[name][i], with_it, rtol=1e-10, atol=0)
            assert np.abs(with_it - base).max() > 1e-3
    # the policy at step 0 is the reference: DPO's first loss is log 2, its margin 0
    first = _log(tmp_path / "run")[0]
    if method == "dpo":
        assert first["loss"] == pytest.approx(np.log(2.0), rel=1e-12)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-12)


def test_rslora_scale_is_kept(tmp_path):
    m = tiny_model()
    ad = random_adapter(m.config, rank=4, alpha=8.0, targets="q,v")
    ad.scale_override = 8.0 / 2.0
    ad.save(tmp_path / "rs")
    lines = []
    finetune(_cfg(tmp_path, "run", adapter=str(tmp_path / "rs")), model=m, log=lines.append)
    assert any("scale 4 (rsLoRA)" in x for x in lines), lines
    out = load_adapter(tmp_path / "run" / "adapter")
    assert out.scale == 4.0 and out.peft_config()["use_rslora"] is True


@pytest.mark.parametrize("opts, message", [
    ({"rank": 2}, "--rank 2 contradicts --adapter"),
    ({"alpha": 4.0}, "--alpha 4.0 contradicts --adapter"),
    ({"targets": "q,k"}, "--targets q,k contradicts --adapter"),
])
def test_contradicting_options_are_one_line(tmp_path, start, opts, message):
    m, folder = start
    with pytest.raises(GradtapeError) as e:
        finetune(_cfg(tmp_path, "bad", adapter=str(folder), **opts), model=m, log=QUIET)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_repeating_the_adapters_options_is_fine(tmp_path, start):
    m, folder = start
    finetune(_cfg(tmp_path, "ok", adapter=str(folder), rank=4, alpha=8.0,
                  targets="v,q,down", steps=1), model=m, log=QUIET)


def test_bad_folders_are_one_line(tmp_path, start):
    m, folder = start
    with pytest.raises(GradtapeError, match="--adapter .*does not exist"):
        _cfg(tmp_path, "x", adapter=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GradtapeError, match="adapter_config.json is missing"):
        _cfg(tmp_path, "x", adapter=str(tmp_path / "empty"))
    other = tiny_model(dim=64, n_heads=4, n_kv_heads=2)  # another shape of model
    with pytest.raises(GradtapeError) as e:
        finetune(_cfg(tmp_path, "x", adapter=str(folder)), model=other, log=QUIET)
    assert "does not fit this model" in str(e.value) and "\n" not in str(e.value)


def test_resume_with_another_adapter_is_refused(tmp_path, start):
    m, folder = start
    finetune(_cfg(tmp_path, "run", adapter=str(folder)), model=m, log=QUIET)
    with pytest.raises(GradtapeError, match="--adapter .* -> "):
        finetune(_cfg(tmp_path, "run", steps=3, resume=True), model=m, log=QUIET)
    finetune(_cfg(tmp_path, "run", adapter=str(folder), steps=3, resume=True), model=m,
             log=QUIET)
    assert [r["step"] for r in _log(tmp_path / "run")] == [1, 2, 3]


def test_cli_finetune_adapter(tiny_dir, tmp_path, capsys):
    from gradtape.cli import main

    m = tiny_model(seed=4)  # tiny_dir's model
    random_adapter(m.config, rank=4, alpha=8.0, targets="q,v").save(tmp_path / "start")
    argv = ["finetune", "--model", str(tiny_dir / "model"), "--data",
            str(tiny_dir / "text.txt"), "--steps", "1", "--seq-len", "16", "--batch-size",
            "2", "--backend", "numpy"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--adapter",
                 str(tmp_path / "start")]) == 0
    assert f"adapter: starting from {tmp_path / 'start'} (LoRA, r=4" in capsys.readouterr().out
    code = main([*argv, "--out", str(tmp_path / "bad"), "--adapter", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [x for x in err.splitlines() if "error" in x] == [
        f"gradtape finetune: error: --adapter {tmp_path / 'none'}: does not exist"], err


@pytest.mark.slow
def test_a_peft_written_rslora_adapter_trains_and_loads_back_in_peft(tiny_dir, tmp_path):
    """PEFT writes an rsLoRA adapter on the tiny model's Hugging Face folder; DPO starts
    from it; what we write loads in PEFT with its options, and PEFT's logits are ours."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from gradtape import llama
    from support.compare import rel_err

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir / "model"))
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       lora_dropout=0.0, use_rslora=True,
                                       task_type="CAUSAL_LM"))
    with torch.no_grad():  # PEFT starts B at zero: make it matter
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    pm.save_pretrained(str(tmp_path / "theirs"))
    lines = []
    finetune(_cfg(tmp_path, "run", "dpo", model=str(tiny_dir / "model"), dtype="float32",
                  adapter=str(tmp_path / "theirs")), log=lines.append)
    assert any("scale 4 (rsLoRA), targets q,v" in x for x in lines), lines
    assert _log(tmp_path / "run")[0]["loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    back = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        str(tiny_dir / "model")), str(tmp_path / "run" / "adapter")).eval()
    assert back.peft_config["default"].use_rslora and back.peft_config["default"].r == 4
    model = llama.load(str(tiny_dir / "model"))
    ours = load_adapter(tmp_path / "run" / "adapter", model)
    ids = [5, 80, 3, 200, 17, 9, 33]
    with torch.no_grad():
        ref = back(torch.tensor([ids])).logits[0].double().numpy()
    assert rel_err(model.logits(ids, adapter=ours), ref) <= 1e-4
    assert rel_err(model.logits(ids, adapter=load_adapter(tmp_path / "theirs")), ref) > 1e-4
