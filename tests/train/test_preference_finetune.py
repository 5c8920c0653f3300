"""``finetune --method dpo|ipo|orpo|simpo`` end to end on the tiny model: each method
trains a few steps with TRL's metrics in log.jsonl, a DPO run stopped and resumed ends
bit for bit equal to one never stopped (the reference pass read back, not recomputed),
every mistake one line, and the CLI through ``main()``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.formats.safetensors_reader import read_safetensors
from gradtape.models.lora import load_adapter
from gradtape.train import data as data_mod, preference_run
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.pairs import Pair
from gradtape.train.step import TrainStep

from support.tinymodel import tiny_model
from support.interrupt import killed_at_step

QUIET = lambda *a: None  # noqa: E731
METRICS = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected"}
WORDS = ("sky blue green red sun moon two four three Paris Lyon cat dog tree rain snow "
         "hot cold up down").split()


def _pairs(path, n=12):
    rows = [{"prompt": f"Q{i}: {WORDS[i % len(WORDS)]}?", "chosen": f" {WORDS[(i + 1) % 20]}",
             "rejected": f" {WORDS[(i + 7) % 20]} no"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, name, method="dpo", **kw):
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        _pairs(data)
    base = dict(data=str(data), out=str(tmp_path / name), steps=3, seq_len=32,
                batch_size=2, rank=4, lr=1e-2, warmup=1, eval_every=2, save_every=2,
                dtype="float64", method=method, backend="numpy", progress=False)
    return FinetuneConfig(**{**base, **kw})


def _log(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method, opts", [
    ("dpo", {}), ("dpo", {"label_smoothing": 0.1}), ("ipo", {"beta": 0.5}), ("orpo", {}),
    ("simpo", {"simpo_gamma": 0.3}),
    ("dpo", {"grad_accum": 2, "batch_size": 1})])
def test_each_method_trains_with_trl_metrics(tmp_path, method, opts):
    lines = []
    summary = finetune(_cfg(tmp_path, "run", method, **opts), model=tiny_model(),
                       log=lines.append)
    out = tmp_path / "run"
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    for r in log:
        assert METRICS <= set(r) and all(np.isfinite(r[k]) for k in METRICS), r
    assert {f"eval_{k[len('eval_'):]}" for k in log[1] if k.startswith("eval_")} >= \
        {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"}
    assert np.isfinite(summary["final_loss"])
    assert any(x.startswith(f"method {method}: beta") for x in lines), lines
    assert (out / preference_run.REFERENCE).is_file() == (method in ("dpo", "ipo"))
    # 3 steps of 2 pairs take 6 of the 11 training pairs: only theirs are computed
    assert any(x.startswith("reference pass: 7 pairs (train: 6 of 11; eval: 1), those the steps "
                            "take in ") for x in lines) == (method in ("dpo", "ipo"))
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_first_dpo_step_starts_at_the_reference(tmp_path):
    """With B = 0 the policy is the reference: DPO's first loss is log 2, its rewards 0."""
    m = tiny_model()
    from gradtape.models.lora import init_adapter, parse_targets
    ad = init_adapter(m.config, 4, 8.0, parse_targets("all", m.config), 0, dtype=np.float64)
    st = TrainStep(m, ad, 2, 32, dtype=np.float64, method="dpo")
    pairs = [Pair(np.array([1, 2, 3]), np.array([4, 5]), np.array([6])),
             Pair(np.array([7, 8]), np.array([9]), np.array([10, 11, 12]))]
    data = preference_run.PairData(pairs, 32, False, 256, 2, 0)
    preference_run.reference_pass(st, {"train": data}, tmp_path, QUIET)
    loss, _ = st.step(data.micro(0)[0], 1, 0.0)
    assert loss == pytest.approx(np.log(2.0), rel=1e-12)
    assert st.metrics["rewards/chosen"] == 0.0 and st.metrics["rewards/margins"] == 0.0


def test_dpo_stopped_and_resumed_is_bit_for_bit_without_a_second_reference_pass(
        tmp_path, monkeypatch):
    m = tiny_model()
    finetune(_cfg(tmp_path, "full", steps=4), model=m, log=QUIET)
    with killed_at_step(monkeypatch, 3):  # the checkpoint is at step 2
        finetune(_cfg(tmp_path, "split", steps=4), model=m, log=QUIET)

    def no_second_pass(*a, **k):
        raise AssertionError("the reference pass ran again")

    monkeypatch.setattr(preference_run, "reference_pass", no_second_pass)
    lines = []
    finetune(_cfg(tmp_path, "split", steps=4, resume=True), model=m, log=lines.append)
    assert any(x.startswith("reference pass: read from") for x in lines)
    a, b = load_adapter(tmp_path / "full" / "adapter"), load_adapter(tmp_path / "split" / "adapter")
    for k in a.weights:
        assert np.array_equal(a.weights[k][0], b.weights[k][0])
        assert np.array_equal(a.weights[k][1], b.weights[k][1])
    full, split = _log(tmp_path / "full"), _log(tmp_path / "split")
    drop = lambda r: {k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")}
    assert [drop(r) for r in full] == [drop(r) for r in split]


def test_a_short_run_computes_the_reference_of_the_pairs_it_takes(tmp_path):
    """A run shorter than an epoch computes the reference of the pairs its steps take
    (NaN for the others), as a pass over every pair computes them (other batch-mates:
    float64 rounding); its steps read only those."""
    m = tiny_model()
    lines = []
    finetune(_cfg(tmp_path, "short", steps=2), model=m, log=lines.append)
    finetune(_cfg(tmp_path, "epoch", steps=6), model=m, log=QUIET)
    assert any(x.startswith("reference pass: 5 pairs (train: 4 of 11; eval: 1), those the steps "
                            "take in ") for x in lines), lines
    short, whole = (read_safetensors(tmp_path / r / preference_run.REFERENCE, float32=False,
                                     floats_only=False)[0]["train"] for r in ("short", "epoch"))
    done = ~np.isnan(short[:, 0])
    assert done.sum() == 4 and not np.isnan(whole).any()
    assert np.isnan(short[~done]).all()
    assert np.abs(short[done] - whole[done]).max() <= 1e-12 * np.abs(whole).max()
    data = preference_run.PairData(list(range(11)), 32, False, 256, 2, 0)
    taken = np.concatenate([data_mod.batch_indices(11, 2, s, 0)
                            for s in range(2)])
    assert np.array_equal(np.flatnonzero(done), np.unique(taken))
    assert np.array_equal(data.used(2), np.unique(taken))
    assert np.array_equal(data.used(6), np.arange(11))  # an epoch or more: every pair


def test_a_resume_for_more_steps_computes_the_new_pairs_reference(tmp_path, monkeypatch):
    """Resumed with more steps than it started with, a run computes the reference of the
    pairs the new steps take, before the checkpoint loads (the model as the run started),
    and keeps the file's: the same reference as a run of that many steps from the start
    (float64 rounding: other batch-mates)."""
    m = tiny_model()
    with killed_at_step(monkeypatch, 3):  # the checkpoint is at step 2
        finetune(_cfg(tmp_path, "run", steps=3), model=m, log=QUIET)
    before = read_safetensors(tmp_path / "run" / preference_run.REFERENCE, float32=False,
                              floats_only=False)[0]["train"]
    lines = []
    finetune(_cfg(tmp_path, "run", steps=5, resume=True), model=m, log=lines.append)
    assert any(x.endswith("; these steps take pairs it does not hold") for x in lines)
    assert any(x.startswith("reference pass: 4 more pairs (train: 4 of 11; eval: 0 of 1), "
                            "the new ones the steps take in ") for x in lines), lines
    finetune(_cfg(tmp_path, "long", steps=5), model=m, log=QUIET)
    after, long = (read_safetensors(tmp_path / r / preference_run.REFERENCE, float32=False,
                                    floats_only=False)[0]["train"] for r in ("run", "long"))
    kept = ~np.isnan(before[:, 0])
    assert kept.sum() == 6 and np.array_equal(after[kept], before[kept])
    assert np.array_equal(np.isnan(after), np.isnan(long)) and (~np.isnan(after[:, 0])).sum() == 10
    done = ~np.isnan(long)
    assert np.abs(after[done] - long[done]).max() <= 1e-12 * np.abs(long[done]).max()


@pytest.mark.parametrize("opts, message", [
    ({"beta": 0.0}, "--beta must be > 0"),
    ({"beta": -1.0}, "--beta must be > 0"),
    ({"label_smoothing": 0.7}, "--label-smoothing must be in [0, 0.5)"),
    ({"method": "ipo", "label_smoothing": 0.1}, "--label-smoothing applies to dpo and simpo"),
    ({"method": "sft", "beta": 0.2}, "--beta applies to the preference methods"),
    ({"method": "sft", "label_smoothing": 0.1},
     "--label-smoothing applies to the preference methods, not sft"),
    ({"method": "orpo", "simpo_gamma": 1.0}, "--simpo-gamma applies to simpo, not orpo"),
    ({"method": "kto"}, "--method must be one of sft, dpo, ipo, orpo, simpo"),
])
def test_bad_options_are_one_line(tmp_path, opts, message):
    with pytest.raises(GradtapeError) as e:
        finetune(_cfg(tmp_path, "bad", **opts), model=tiny_model(), log=QUIET)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sft_data_with_a_preference_method_names_the_pair_schemas(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(GradtapeError) as e:
        finetune(_cfg(tmp_path, "bad", data=str(sft)), model=tiny_model(), log=QUIET)
    msg = str(e.value)
    assert "sft.jsonl" in msg and "prompt+chosen+rejected" in msg and "\n" not in msg, msg


def test_cli_finetune_method_dpo(tiny_dir, tmp_path, capsys):
    from gradtape.cli import main

    data = _pairs(tmp_path / "pairs.jsonl")
    code = main(["finetune", "--model", str(tiny_dir / "model"), "--data", str(data),
                 "--out", str(tmp_path / "out"), "--method", "dpo", "--beta", "0.2",
                 "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--rank", "4",
                 "--dtype", "float64", "--backend", "numpy"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "method dpo: beta 0.2" in printed and "reference pass" in printed, printed
    log = _log(tmp_path / "out")
    assert METRICS <= set(log[-1]) and "eval_rewards/accuracies" in log[-1]


@pytest.mark.parametrize("method", ["dpo", "simpo"])
def test_the_reference_pass_equals_reference_logps(tmp_path, method):
    """The step's eval program, batched and wrapped around, gives every pair's
    log-probabilities as ``train.preference.reference_logps`` does pair by pair."""
    from gradtape.models.lora import init_adapter, parse_targets
    from gradtape.train.methods import method as row
    from gradtape.train.preference import reference_logps
    from gradtape.train.records import read_data

    m = tiny_model()
    ad = init_adapter(m.config, 4, 8.0, parse_targets("all", m.config), 0, dtype=np.float64)
    cfg = _cfg(tmp_path, "ref", method)
    train, _ = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                   m.tokenizer, row(method).average, QUIET)
    st = TrainStep(m, ad, 3, 32, dtype=np.float64, method=method)  # 11 pairs: wraps around
    train.batch_size = 3
    preference_run.reference_pass(st, {"train": train}, tmp_path, QUIET)
    for i in range(len(train)):
        want = reference_logps(m, ad, row(method), train.batch([i]))
        np.testing.assert_allclose(train.ref[i], want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("backend, dtype, rtol", [("numpy", np.float64, 1e-13),
                                                    ("cpu", np.float32, 1e-5)])
def test_a_fresh_adapters_reference_is_the_base_models_forward(tmp_path, backend, dtype, rtol):
    """A fresh LoRA (B = 0) adds exactly zero: the reference pass runs the base model's
    forward alone and gives the eval program's values; once B is not zero (an adapter
    trained before, ``--adapter``) the reference is the model with it, and differs."""
    from gradtape.train.methods import method as row
    from gradtape.train.preference import reference_logps
    from gradtape.train.records import read_data

    m = tiny_model()
    ad = _adapter(m)
    cfg = _cfg(tmp_path, "base", "dpo")
    train, _ = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                   m.tokenizer, row("dpo").average, QUIET)
    st = TrainStep(m, ad, 2, 32, dtype=dtype, backend=backend, method="dpo")

    def per_pair(logps, b):  # [n, 2]: each batch is b chosen, then b rejected
        lp = np.stack([x.reshape(2, b).T for x in logps]).reshape(-1, 2)
        return lp[:len(train)]
    batches = list(train.batches())
    _, _, policy = st.eval_preference(batches)
    assert st.reference_pairs(len(train)) == len(train)  # 12 pairs of 64 rows: one call
    for b in (5, 12):  # 5: the last call wraps around
        base = st.reference_logps(list(train.batches(size=b)))
        np.testing.assert_allclose(per_pair(base, b), per_pair(policy, 2), rtol=rtol, atol=0)
    assert sorted(st._base) == [5, 12]  # the base model's programs ran
    st.release_reference()

    rng = np.random.default_rng(1)
    for a, b in ad.weights.values():
        b[...] = rng.normal(0, 0.5, b.shape)
    st = TrainStep(m, ad, 2, 32, dtype=np.float64, method="dpo")
    assert st.reference_pairs(len(train)) == 2
    trained = st.reference_logps(batches[:1])[0]
    assert not st._base  # the eval program, adapter on
    want = reference_logps(m, ad, row("dpo"), batches[0][0])
    np.testing.assert_allclose(trained, want, rtol=1e-10, atol=0)
    assert np.abs(trained - policy[0]).max() > 1e-3


@pytest.mark.parametrize("backend, dtype, rtol", [("numpy", np.float64, 1e-13),
                                                    ("cpu", np.float32, 1e-5)])
def test_full_fine_tunings_reference_is_the_models_forward(tmp_path, backend, dtype, rtol):
    """With every weight trained, the policy is the model's own forward: the reference
    pass runs it several pairs a call, reading the step's params, and gives the eval
    program's values; after a step it follows the trained weights."""
    from gradtape.train.methods import method as row
    from gradtape.train.records import read_data

    m = tiny_model()
    cfg = _cfg(tmp_path, "full", "dpo")
    train, _ = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                   m.tokenizer, row("dpo").average, QUIET)
    st = TrainStep(m, None, 2, 32, dtype=dtype, backend=backend, method="dpo",
                   fine_tune_type="full")

    def per_pair(logps, b):  # [n, 2]: each batch is b chosen, then b rejected
        lp = np.stack([x.reshape(2, b).T for x in logps]).reshape(-1, 2)
        return lp[:len(train)]
    batches = list(train.batches())
    _, _, policy = st.eval_preference(batches)
    assert st.reference_pairs(len(train)) == len(train)
    for b in (5, 12):
        base = st.reference_logps(list(train.batches(size=b)))
        np.testing.assert_allclose(per_pair(base, b), per_pair(policy, 2), rtol=rtol, atol=0)
    assert sorted(st._base) == [5, 12]
    st.step([(batches[0][0], policy[0])], 1, 1e-2)
    _, _, moved = st.eval_preference(batches)
    after = st.reference_logps(list(train.batches(size=12)))
    np.testing.assert_allclose(per_pair(after, 12), per_pair(moved, 2), rtol=rtol, atol=0)
    assert np.abs(per_pair(after, 12) - per_pair(base, 12)).max() > 1e-4


def _adapter(m):
    from gradtape.models.lora import init_adapter, parse_targets
    return init_adapter(m.config, 4, 8.0, parse_targets("all", m.config), 0, dtype=np.float64)


class _Mirror:
    """Two ranks in one process, the other rank holding the same pairs: its 'sum' over
    ranks doubles the vector, so the split step over N pairs is the step over them."""
    size, rank, is_root = 2, 0, True

    def allreduce_sum(self, buf):
        buf *= 2.0
        return buf


@pytest.mark.parametrize("method", ["dpo", "orpo"])
@pytest.mark.parametrize("accum", [1, 2])
def test_the_split_step_equals_the_fused_step(tmp_path, method, accum):
    """A preference step through MPI's split programs (gradients, loss and metrics in one
    vector, summed over ranks) equals the one-process step, float64, to rounding."""
    from gradtape.train.methods import method as row
    from gradtape.train.records import read_data

    m = tiny_model()
    cfg = _cfg(tmp_path, "split", method)
    train, _ = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                   m.tokenizer, row(method).average, QUIET)
    train.grad_accum = accum
    steps = [TrainStep(m, _adapter(m), 2, 32, dtype=np.float64, method=method,
                       grad_accum=accum, world=w) for w in (None, _Mirror())]
    if row(method).reference:
        preference_run.reference_pass(steps[0], {"train": train}, tmp_path, QUIET)
    for k in range(3):
        micro = train.micro(k)[0]
        (lf, nf), (ls, ns) = (st.step(micro, k + 1, 1e-2) for st in steps)
        assert ls == pytest.approx(lf, rel=1e-12) and ns == pytest.approx(nf, rel=1e-12)
        assert steps[1].metrics.keys() == steps[0].metrics.keys()
        for name, v in steps[0].metrics.items():
            assert steps[1].metrics[name] == pytest.approx(v, rel=1e-12, abs=1e-14), name
    for key, (a, b) in steps[0].adapter_weights().items():
        np.testing.assert_allclose(steps[1].adapter_weights()[key][1], b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("method", ["dpo", "simpo"])
def test_accumulation_is_the_step_over_all_the_pairs(tmp_path, method):
    """2 micro-batches of 1 pair each: the loss, gradient norm, metrics and the trained
    adapter of 1 micro-batch of 2 pairs (float64, to rounding)."""
    from gradtape.train.methods import method as row
    from gradtape.train.records import read_data

    m = tiny_model()
    cfg = _cfg(tmp_path, "acc", method)
    runs = []
    for b, accum in ((2, 1), (1, 2)):
        train, _ = preference_run.load(cfg, read_data(cfg.data, task="preference"), None,
                                       m.tokenizer, row(method).average, QUIET)
        train.batch_size, train.grad_accum = b, accum
        st = TrainStep(m, _adapter(m), b, 32, dtype=np.float64, method=method,
                       grad_accum=accum)
        if row(method).reference:
            preference_run.reference_pass(st, {"train": train}, tmp_path, QUIET)
        out = [(st.step(train.micro(k)[0], k + 1, 1e-2), dict(st.metrics)) for k in range(3)]
        runs.append((out, st.adapter_weights()))
    (a, wa), (b, wb) = runs
    for step, (((la, na), ma), ((lb, nb), mb)) in enumerate(zip(a, b)):
        assert lb == pytest.approx(la, rel=1e-10) and nb == pytest.approx(na, rel=1e-10)
        for k in ma:
            if row(method).reference and step == 0 and k == "rewards/accuracies":
                # the policy is the reference, over other row counts than the reference
                # pass's: every reward is 0 to rounding, and which side of 0 it falls
                # on is rounding (NumPy's BLAS blocks by rows)
                assert max(abs(x["rewards/chosen"]) for x in (ma, mb)) < 1e-12
                continue
            assert mb[k] == pytest.approx(ma[k], rel=1e-9, abs=1e-12), k
    # AdamW divides each gradient by its own root mean square: where a gradient is near
    # zero (A's at the first step, B starting at zero) a rounding of the sums' order
    # moves the update far more than 1e-10 of it
    for k in wa:
        np.testing.assert_allclose(wb[k][1], wa[k][1], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("n, seq_len, pairs", [
    (3, 256, 3), (5, 256, 3), (8, 256, 4), (9, 256, 3), (1, 256, 1), (0, 256, 1),
    (40, 32, 20), (7, 2048, 1), (7, 4096, 1)])
def test_the_reference_pass_takes_even_calls_of_at_most_its_rows(n, seq_len, pairs):
    from gradtape.plan import REFERENCE_ROWS, reference_pairs

    got = reference_pairs(n, seq_len)
    assert got == pairs
    assert got == 1 or 2 * seq_len * got <= REFERENCE_ROWS
    calls = -(-max(n, 1) // got)
    assert calls * got - max(n, 1) < calls  # the padding is less than a pair a call
