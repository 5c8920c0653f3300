"""``--fine-tune-type full`` end to end on the tiny model: every weight trained (a tied
head stays tied), the trained model written as a Hugging Face folder that gradtape and
transformers load with the same logits (and a GGUF on request), a resumed run ending with
the bitwise same weights and moments, and what cannot fit refused from the header before
anything is loaded, in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.train import data as data_mod
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.step import TrainStep
from support.compare import rel_err
from support.tinymodel import TINY_TEXT as TEXT, tiny_model
from support.interrupt import killed_at_step

quiet = lambda *a, **k: None  # noqa: E731


def _cfg(tmp_path, name, **kw):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    base = dict(data=str(data), out=str(tmp_path / name), steps=6, seq_len=16,
                batch_size=2, lr=1e-2, warmup=2, eval_every=3, save_every=3,
                dtype="float64", fine_tune_type="full", progress=False)
    return FinetuneConfig(**{**base, **kw})


def test_a_full_step_trains_every_weight_and_keeps_the_head_tied():
    m = tiny_model(tied=True)
    assert m.config.tie_embeddings and "lm_head" not in m.weights
    st = TrainStep(m, None, 2, 16, dtype=np.float64, fine_tune_type="full")
    assert set(st.trained) == set(m.weights)
    assert st.n_param == sum(w.size for w in m.weights.values())
    seqs = data_mod._pack_text(m.tokenizer.encode(TEXT), 16, 0)
    st.step([(seqs.ids[:2], seqs.targets[:2])], 1, 1e-2)
    after = st.model_weights()
    for name, w in m.weights.items():
        assert not np.array_equal(after[name], w), f"{name} did not change"


def test_full_run_writes_the_model_and_resumes_exactly(tiny_dir, tmp_path, monkeypatch):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from gradtape import llama

    m = llama.load(tiny_dir / "model")
    finetune(_cfg(tmp_path, "ref", save_gguf="float32"), model=m, log=quiet)
    out = tmp_path / "ref"
    for f in ("model/config.json", "model/model.safetensors", "model/tokenizer.json",
              "model.gguf", "checkpoint/state.safetensors", "loss.png"):
        assert (out / f).is_file(), f
    assert not (out / "adapter").exists()

    # gradtape and transformers read the trained folder with the same logits, and the GGUF
    ids = m.tokenizer.encode(TEXT)[:12]
    ours = llama.load(out / "model")
    assert not np.array_equal(ours.weights["layers.0.q"], m.weights["layers.0.q"])
    logits = ours.logits(ids)
    hf = AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(logits, theirs) <= 1e-5
    assert rel_err(llama.load(out / "model.gguf").logits(ids), logits) <= 1e-5

    # killed after step 4 (the checkpoint is at step 3), resumed: the same state, bit for bit
    with killed_at_step(monkeypatch, 5):
        finetune(_cfg(tmp_path, "split"), model=m, log=quiet)
    finetune(_cfg(tmp_path, "split", resume=True), model=m, log=quiet)
    a = load_file(str(out / "checkpoint/state.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoint/state.safetensors"))
    assert set(a) == set(b) and len([k for k in a if k.startswith("m.")]) == len(m.weights)
    for k in a:  # every weight and both its moments, float64
        assert np.array_equal(a[k], b[k]), k
    assert (out / "model/model.safetensors").read_bytes() == \
        (tmp_path / "split/model/model.safetensors").read_bytes()
    log = [json.loads(x) for x in (tmp_path / "split/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))


def test_a_model_that_cannot_fit_is_refused_from_its_header(tiny_dir, tmp_path, monkeypatch):
    from gradtape import models

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(models, "load", no_load)
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(200 << 20))
    with pytest.raises(GradtapeError, match=r"not enough memory: full fine-tuning of .* "
                                            r"needs about .* GiB before its activations"):
        finetune(_cfg(tmp_path, "big", model=str(tiny_dir / "model")), log=quiet)


@pytest.mark.parametrize("kw, message", [
    ({"rank": 4}, "--rank applies to --fine-tune-type lora or dora, not full"),
    ({"targets": "q,v"}, "--targets applies to --fine-tune-type lora"),
    ({"weights": "stored"}, "--weights applies to --fine-tune-type lora"),
    ({"fine_tune_type": "lora", "save_gguf": "float16"},
     "--save-gguf applies to --fine-tune-type full"),
    ({"save_gguf": "q4"}, "--save-gguf must be one of float32, float16"),
    ({"fine_tune_type": "qlora"}, "--fine-tune-type must be one of lora, dora, full"),
])
def test_options_that_do_not_apply_are_one_line(tmp_path, kw, message):
    with pytest.raises(GradtapeError, match=message):
        _cfg(tmp_path, "x", **kw)


def test_checkpointing_a_full_step_changes_no_value():
    """--grad-checkpoint on recomputes each layer's forward in backward: the same ops on
    the same inputs, so the weights after a step are bitwise those without it."""
    m = tiny_model(tied=True)
    seqs = data_mod._pack_text(m.tokenizer.encode(TEXT), 16, 0)
    after = []
    for mode in ("off", "on"):
        st = TrainStep(m, None, 2, 16, dtype=np.float64, fine_tune_type="full",
                       grad_checkpoint=mode)
        assert st.checkpointed == (m.config.n_layers if mode == "on" else 0)
        st.step([(seqs.ids[:2], seqs.targets[:2])], 1, 1e-2)
        after.append(st.model_weights())
    for name in m.weights:
        assert np.array_equal(after[0][name], after[1][name]), name


def test_full_dpo_starts_at_its_reference(tmp_path):
    """DPO with every weight trained: the reference pass is the starting model, so the
    first loss is log 2; the trained model is written to model/."""
    from support.tinymodel import tiny_model as tiny

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: sky?", "chosen": f" blue {i}",
                                        "rejected": f" red {i} no"}) + "\n"
                            for i in range(8)))
    cfg = _cfg(tmp_path, "dpo", data=str(data), method="dpo", seq_len=32, steps=2,
               backend="numpy")
    finetune(cfg, model=tiny(tied=True), log=quiet)
    log = [json.loads(x) for x in (tmp_path / "dpo/log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(np.log(2), rel=1e-12)
    assert (tmp_path / "dpo/model/model.safetensors").is_file()


def test_a_full_step_that_cannot_fit_is_refused_before_it_runs():
    """The step's own estimate (weights, their params and moments, activations) against
    the limit: one line naming what it needs, before anything is allocated."""
    m = tiny_model(tied=True)
    with pytest.raises(GradtapeError, match=r"not enough memory: this run needs about .* "
                                            r"params \+ optimizer .* or --fine-tune-type lora"):
        TrainStep(m, None, 2, 16, dtype=np.float64, fine_tune_type="full",
                  grad_checkpoint="auto", memory_limit=1 << 20,
                  memory_hint=": use a shorter --seq-len, or --fine-tune-type lora")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_eval_program_reads_the_params_where_the_step_keeps_them(backend):
    """No copy of every weight for the eval program (``Program.share_state``): after a
    step it sees the updated weights, the same loss as when they are fed to it."""
    m = tiny_model(tied=True)
    seqs = data_mod._pack_text(m.tokenizer.encode(TEXT), 16, 0)
    st = TrainStep(m, None, 2, 16, dtype=np.float64, fine_tune_type="full", backend=backend)
    assert st._eval_shares
    before = st.eval_loss(seqs)
    st.step([(seqs.ids[:2], seqs.targets[:2])], 1, 1e-2)
    shared = st.eval_loss(seqs)
    st._eval_shares = False  # feed them: the program takes its own copy
    assert st.eval_loss(seqs) == shared != before


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_fused_head_gives_a_full_step_the_composed_values(backend, monkeypatch):
    """From ``full.HEAD_FUSE_FROM`` logits a full step's head and loss are the fused
    primitive, its table's gradient made last (``compile.sink``): loss, norm and every
    weight after a step equal the composed head's (float64, 1e-10)."""
    from gradtape.train import full

    m = tiny_model(tied=True)
    seqs = data_mod._pack_text(m.tokenizer.encode(TEXT), 16, 0)
    runs = []
    for fuse_from in (1 << 40, 0):
        monkeypatch.setattr(full, "HEAD_FUSE_FROM", fuse_from)
        st = TrainStep(m, None, 2, 16, dtype=np.float64, fine_tune_type="full",
                       backend=backend)
        fused = any(v.op.startswith("head_nll") for v in st.program.graph.ops)
        assert fused == (fuse_from == 0)
        out = st.step([(seqs.ids[:2], seqs.targets[:2])], 1, 1e-2)
        runs.append((out, st.model_weights()))
    (a, wa), (b, wb) = runs
    assert rel_err(np.array(a), np.array(b)) < 1e-10
    for name in m.weights:
        assert rel_err(wa[name], wb[name]) < 1e-10, name
