"""``finetune --fine-tune-type dora`` (and ``--rslora``) end to end on a tiny model: the run
writes a PEFT DoRA adapter whose magnitudes moved, a run killed after a checkpoint and
resumed ends with the bitwise same A, B and magnitudes (they are state like A and B), and
the options are checked against the checkpoint's run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.models.dora import init_magnitudes
from gradtape.models.lora import load_adapter
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.step import TrainStep
from support.tinymodel import tiny_model
from support.interrupt import killed_at_step

TEXT = ("the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun "
        "and the birds sing songs of the morning to the trees that sway in the wind ") * 6


def _cfg(tmp_path, name, **kw):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    base = dict(data=str(data), out=str(tmp_path / name), steps=6, seq_len=16, batch_size=2,
                rank=4, lr=1e-2, warmup=2, eval_every=3, save_every=3, dtype="float64",
                fine_tune_type="dora", rslora=True, progress=False)
    return FinetuneConfig(**{**base, **kw})


def test_dora_finetune_trains_magnitudes_and_resumes_exactly(tmp_path, monkeypatch):
    m = tiny_model()
    quiet = lambda *a: None
    finetune(_cfg(tmp_path, "full"), model=m, log=quiet)
    conf = json.loads((tmp_path / "full/adapter/adapter_config.json").read_text())
    assert conf["use_dora"] is True and conf["use_rslora"] is True
    a = load_adapter(tmp_path / "full/adapter")
    start = init_magnitudes(m.weights, a.weights)
    assert a.dora and max(np.max(np.abs(a.magnitudes[k] - start[k])) for k in start) > 1e-4

    with killed_at_step(monkeypatch, 5):
        finetune(_cfg(tmp_path, "split"), model=m, log=quiet)
    with pytest.raises(GradtapeError, match="--fine-tune-type dora -> lora"):
        finetune(_cfg(tmp_path, "split", resume=True, fine_tune_type="lora"), model=m, log=quiet)
    finetune(_cfg(tmp_path, "split", resume=True), model=m, log=quiet)
    b = load_adapter(tmp_path / "split/adapter")
    for k in a.weights:
        assert np.array_equal(a.weights[k][0], b.weights[k][0])
        assert np.array_equal(a.weights[k][1], b.weights[k][1])
        assert np.array_equal(a.magnitudes[k], b.magnitudes[k])


@pytest.mark.parametrize("kw, match", [
    ({"fine_tune_type": "dorа"}, "--fine-tune-type"),  # a Cyrillic a
    ({"fine_tune_type": "qlora"}, "--fine-tune-type"),
])
def test_bad_fine_tune_type_is_one_clear_error(tmp_path, kw, match):
    with pytest.raises(GradtapeError, match=match):
        _cfg(tmp_path, "x", **kw)


def test_cli_help_teaches_the_flags(capsys):
    from gradtape.cli import main
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert "--fine-tune-type" in out and "--rslora" in out and "use_dora" in out


def test_a_fresh_dora_adapter_is_the_base_model_and_dpo_trains_it(tmp_path):
    """B = 0 and m = ||W0||: DoRA starts equal to the base model, so DPO's first loss is
    log 2 (the policy is its reference); the preference step trains the magnitudes too."""
    from gradtape.models.lora import init_adapter
    from gradtape.train import preference_run
    from gradtape.train.pairs import Pair

    m = tiny_model()
    ad = init_adapter(m.config, 4, 8.0, "all", 0, dtype=np.float64, fine_tune_type="dora",
                      weights=m.weights)
    st = TrainStep(m, ad, 2, 32, dtype=np.float64, method="dpo")
    pairs = [Pair(np.array([1, 2, 3]), np.array([4, 5]), np.array([6])),
             Pair(np.array([7, 8]), np.array([9]), np.array([10, 11, 12]))]
    data = preference_run.PairData(pairs, 32, False, 256, 2, 0)
    preference_run.reference_pass(st, {"train": data}, tmp_path, lambda *a: None)
    loss, _ = st.step(data.micro(0)[0], 1, 1e-2)
    assert loss == pytest.approx(np.log(2.0), rel=1e-12)
    mags = st.adapter_magnitudes()
    assert set(mags) == set(ad.magnitudes)
    assert max(np.max(np.abs(mags[k] - ad.magnitudes[k])) for k in mags) > 1e-4
