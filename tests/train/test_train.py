"""The replayed LoRA training step, accumulation, masking, the finetune loop and resume."""

import json

import numpy as np
import pytest

from gradtape import nn
from gradtape.errors import GradtapeError
from gradtape.train import data as data_mod
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.models.lora import init_adapter, load_adapter
from gradtape.train.step import Schedule, TrainStep

from support.tinymodel import tiny_model
from support.interrupt import killed_at_step

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def _seqs(model, text=TEXT, seq_len=16):
    return data_mod._pack_text(model.tokenizer.encode(text), seq_len, 0)


def _nonzero_adapter(model, seed=1, rank=4, dtype=np.float64):
    ad = init_adapter(model.config, rank=rank, alpha=8.0, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    ad.weights = {k: (a, (0.05 * rng.standard_normal(b.shape)).astype(dtype))
                  for k, (a, b) in ad.weights.items()}
    return ad


def test_fresh_adapter_starts_at_the_base_model():
    m = tiny_model()
    ad = init_adapter(m.config, rank=4, alpha=8, seed=3)
    assert all(not b.any() for _, b in ad.weights.values())
    bound = 1 / np.sqrt(m.config.dim)
    a = ad.weights[(0, "q")][0]
    assert a.shape == (m.config.dim, 4) and np.abs(a).max() <= bound
    again = init_adapter(m.config, rank=4, alpha=8, seed=3)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(ad.weights.values(), again.weights.values()))


def test_schedule_warmup_then_cosine():
    s = Schedule(lr=1e-3, steps=110, warmup=10, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3)
    assert s(10) == pytest.approx(1e-3)
    assert s(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert s(110) == pytest.approx(1e-4)


@pytest.mark.parametrize("method, kind, lr", [("sft", "lora", 1e-3), ("dpo", "lora", 5e-5),
                                              ("orpo", "dora", 5e-5), ("sft", "full", 2e-5),
                                              ("simpo", "full", 1e-6)])
def test_the_default_lr_follows_the_method_and_what_is_trained(tmp_path, method, kind, lr):
    base = dict(data="d.txt", out=str(tmp_path / "o"), method=method, fine_tune_type=kind)
    assert FinetuneConfig(**base).lr is None and FinetuneConfig(**base).peak_lr() == lr
    assert FinetuneConfig(**base, lr=3e-4).peak_lr() == 3e-4


def test_a_run_without_lr_trains_and_says_at_the_default(tmp_path):
    said = []
    finetune(_cfg(tmp_path, "run", steps=2, lr=None, warmup=2, eval_every=0),
             model=tiny_model(), log=said.append)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in log] == pytest.approx([0.5e-3, 1e-3])
    assert any("at lr 0.001 (the default for sft of an adapter)" in x for x in said), said


def test_a_resume_without_lr_keeps_the_rate_the_run_had(tmp_path):
    m = tiny_model()
    finetune(_cfg(tmp_path, "run", steps=2, lr=2e-3, eval_every=0, save_every=1), model=m,
             log=lambda *a: None)
    with pytest.raises(GradtapeError, match=r"^--resume: the checkpoint's run trained at "
                       r"--lr 0.002; give --lr 0.002 to continue it so \(without --lr it "
                       r"would take the default, 0.001\)$"):
        finetune(_cfg(tmp_path, "run", steps=3, lr=None, eval_every=0, resume=True), model=m,
                 log=lambda *a: None)
    done = finetune(_cfg(tmp_path, "run", steps=3, lr=2e-3, eval_every=0, resume=True),
                    model=m, log=lambda *a: None)
    assert done["steps"] == 3


def test_only_adapter_params_get_gradients_and_step_changes_only_them():
    m = tiny_model()
    ad = _nonzero_adapter(m)
    st = TrainStep(m, ad, batch_size=2, seq_len=16, dtype=np.float64)
    params = st.state_leaves["param"]
    assert len(params) == 2 * 7 * m.config.n_layers
    assert all(v.op == "const" for v in st.tape.vars if v.is_leaf and v not in params)
    seqs = _seqs(m)
    before = [st.program.state(p) for p in params]
    loss, norm = st.step([(seqs.ids[:2], seqs.targets[:2])], 1, 1e-3)
    assert np.isfinite(loss) and norm > 0
    after = [st.program.state(p) for p in params]
    assert all(not np.array_equal(x, y) for x, y in zip(before, after))


def _manual_loss(model, adapter, ids, targets):
    """Mean next-token loss over counted targets, by a fresh eager tape."""
    from gradtape.models.graph import record_forward, weight_consts
    import gradtape as gt

    tp = gt.Tape(np.float64)
    W = weight_consts(tp, model)
    lora = {k: (tp.const(a), tp.const(b)) for k, (a, b) in adapter.weights.items()}
    logits = record_forward(tp, model.config, W, tp.const(ids.reshape(-1)), ids.shape[0],
                            lora, adapter.scale).value
    t = targets.reshape(-1)
    keep = t != data_mod.IGNORE
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return float(np.mean(lse[keep] - logits[np.arange(len(t)), np.where(keep, t, 0)][keep]))


def test_prompt_tokens_contribute_nothing(tmp_path):
    m = tiny_model()
    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": "question number %d? " % i, "completion": "answer %d" % (i * 7)}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs = data_mod.load_sequences(path, m.tokenizer, 48, pad_id=256)
    prompt_len = len(m.tokenizer.encode(rows[0]["prompt"]))
    # position t predicts token t+1: the first target is the completion's first token
    assert (seqs.targets[0, :prompt_len - 1] == data_mod.IGNORE).all()
    assert seqs.targets[0, prompt_len - 1] == m.tokenizer.encode(rows[0]["completion"])[0]
    n_completion = len(m.tokenizer.encode(rows[0]["completion"])) + 1  # + eos
    assert (seqs.targets[0] != data_mod.IGNORE).sum() == n_completion

    ad = _nonzero_adapter(m)
    st = TrainStep(m, ad, batch_size=2, seq_len=48, dtype=np.float64)
    ids, targets = seqs.ids[:2], seqs.targets[:2]
    loss, _ = st.step([(ids, targets)], 1, 0.0)
    assert loss == pytest.approx(_manual_loss(m, ad, ids, targets), rel=1e-12)


def test_chat_messages_mask_all_but_assistant(tmp_path):
    m = tiny_model()
    path = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    seqs = data_mod.load_sequences(path, m.tokenizer, 128, pad_id=256)
    counted = seqs.targets[0][seqs.targets[0] != data_mod.IGNORE]
    expect = m.tokenizer.encode("hello!</assistant>\n") + m.tokenizer.encode("bye</assistant>\n")
    assert counted.tolist() == expect


def test_accumulation_weights_by_tokens_not_micro_batches():
    """k micro-batches of b sequences == one batch of k*b, even with unequal counts."""
    m = tiny_model()
    seqs = _seqs(m, seq_len=16)
    ids, targets = seqs.ids[:4].copy(), seqs.targets[:4].copy()
    targets[0, 3:] = data_mod.IGNORE  # micro-batch 1 has far fewer target tokens
    targets[1, 8:] = data_mod.IGNORE
    one = TrainStep(m, _nonzero_adapter(m), batch_size=4, seq_len=16, dtype=np.float64)
    acc = TrainStep(m, _nonzero_adapter(m), batch_size=2, seq_len=16, grad_accum=2,
                    dtype=np.float64)
    for step in (1, 2, 3):
        l1, n1 = one.step([(ids, targets)], step, 1e-2)
        l2, n2 = acc.step([(ids[:2], targets[:2]), (ids[2:], targets[2:])], step, 1e-2)
        assert l2 == pytest.approx(l1, rel=1e-12) and n2 == pytest.approx(n1, rel=1e-12)
    for (a1, b1), (a2, b2) in zip(one.adapter_weights().values(), acc.adapter_weights().values()):
        scale = np.abs(b1).max()
        assert np.abs(b1 - b2).max() <= 1e-12 * scale
        assert np.abs(a1 - a2).max() <= 1e-12 * np.abs(a1).max()


def test_training_lowers_the_loss():
    m = tiny_model()
    seqs = _seqs(m, seq_len=32)
    st = TrainStep(m, init_adapter(m.config, rank=8, alpha=16, seed=0), batch_size=4,
                   seq_len=32, dtype=np.float32)
    first = st.eval_loss(seqs)
    for step in range(1, 31):
        idx = data_mod.batch_indices(len(seqs), 4, step, 0)
        st.step([(seqs.ids[idx], seqs.targets[idx])], step, 1e-2)
    assert st.eval_loss(seqs) < first - 0.5


def _cfg(tmp_path, name, data="text.txt", **kw):
    """A short run's config on ``data``: plain text, or ``chat.jsonl`` (chats of unequal
    lengths, packed several to a row)."""
    data = tmp_path / data
    if not data.exists() and data.suffix == ".jsonl":
        words = TEXT.split()
        data.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": " ".join(words[i:i + i % 5 + 1])},
            {"role": "assistant", "content": " ".join(words[i + 2:i + 2 + i % 3 + 1])}]}) + "\n"
            for i in range(40)))
    elif not data.exists():
        data.write_text(TEXT)
    base = dict(data=str(data), out=str(tmp_path / name), steps=6,
                seq_len=160 if data.suffix == ".jsonl" else 16, batch_size=2,
                rank=4, lr=1e-2, warmup=2, eval_every=3, save_every=3, dtype="float64",
                progress=False)
    return FinetuneConfig(**{**base, **kw})


@pytest.mark.parametrize("data, opts", [
    ("text.txt", {}), ("chat.jsonl", {}),
    # float32 rows past model.ATTN_TILED_MIN: the fused C attention, threads and all
    ("text.txt", {"seq_len": 300, "dtype": "float32"})])
def test_finetune_writes_adapter_log_curve_and_resumes_exactly(tmp_path, monkeypatch, data,
                                                               opts):
    m = tiny_model()
    quiet = lambda *a: None
    full = finetune(_cfg(tmp_path, "full", data, **opts), model=m, log=quiet)
    out = tmp_path / "full"
    for f in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors",
              "checkpoint/state.safetensors", "log.jsonl", "loss.png"):
        assert (out / f).is_file(), f
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(log[0])
    assert "eval_loss" in log[2] and "eval_loss" in log[5]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert full["steps"] == 6

    # interrupt a second run after step 4 (the checkpoint is at step 3), then resume
    with killed_at_step(monkeypatch, 5):
        finetune(_cfg(tmp_path, "split", data, **opts), model=m, log=quiet)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "split/checkpoint/state.safetensors"), "np") as f:
        assert f.metadata()["step"] == "3"
    finetune(_cfg(tmp_path, "split", data, resume=True, **opts), model=m, log=quiet)
    a = load_adapter(out / "adapter")
    b = load_adapter(tmp_path / "split" / "adapter")
    for k in a.weights:
        assert np.array_equal(a.weights[k][0], b.weights[k][0])
        assert np.array_equal(a.weights[k][1], b.weights[k][1])
    relog = [json.loads(x) for x in (tmp_path / "split/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in relog] == list(range(1, 7))


def test_finetune_refuses_foreign_folder_and_bad_resume(tmp_path):
    m = tiny_model()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(GradtapeError, match="not a gradtape run folder"):
        finetune(_cfg(tmp_path, "foreign"), model=m, log=lambda *a: None)
    with pytest.raises(GradtapeError, match="no checkpoint"):
        finetune(_cfg(tmp_path, "nothing", resume=True), model=m, log=lambda *a: None)


def test_a_run_from_before_packing_resumes_padded(tmp_path):
    """A checkpoint whose config has no ``packing`` was trained on padded rows: resuming it
    packed would change the data, so it needs --no-packing."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    m, quiet = tiny_model(), (lambda *a: None)
    finetune(_cfg(tmp_path, "old", "chat.jsonl", steps=3, packing=False), model=m, log=quiet)
    path = tmp_path / "old" / "checkpoint" / "state.safetensors"
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    config = json.loads(meta["config"])
    del config["packing"]
    save_file(load_file(str(path)), str(path), metadata={**meta, "config": json.dumps(config)})
    with pytest.raises(GradtapeError, match=r"options differ .*--packing False -> True"):
        finetune(_cfg(tmp_path, "old", "chat.jsonl", steps=4, resume=True), model=m, log=quiet)
    done = finetune(_cfg(tmp_path, "old", "chat.jsonl", steps=4, resume=True, packing=False),
                    model=m, log=quiet)
    assert done["steps"] == 4


def test_cross_entropy_ids_matches_composed_with_token_weights():
    import gradtape as gt

    rng = np.random.default_rng(0)
    T, V = 7, 11
    logits = rng.standard_normal((T, V))
    tgt = rng.integers(0, V, T)
    tgt[[1, 4]] = -100
    tp = gt.Tape(np.float64)
    x = tp.param(logits)
    ids, w = nn.ce_targets_fill(tgt)
    loss = nn.cross_entropy_ids(tp, x, tp.const(ids), tp.const(w))
    keep = tgt >= 0
    lse = np.log(np.exp(logits).sum(1))
    assert loss.value == pytest.approx(np.mean(lse[keep] - logits[np.arange(T), ids][keep]),
                                       rel=1e-13)
