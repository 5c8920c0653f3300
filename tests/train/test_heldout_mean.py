"""The held-out evaluation counts every held-out example once: a preference run's eval
loss and metrics are the mean of each pair's own values (the last, partial batch's
wrapped-around padding pairs weigh 0), and SFT's eval loss is the mean over every
held-out target token, whatever the batch size (float64)."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape.train import preference_run
from gradtape.train.data import IGNORE, empty_rows
from gradtape.train.pairs import Pair
from gradtape.train.methods import method as row
from gradtape.train.step import TrainStep

from support.adapters import random_adapter
from support.tinymodel import tiny_model


def _pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    tok = lambda k: rng.integers(0, 256, k)  # noqa: E731
    return [Pair(tok(int(rng.integers(1, 6))), tok(int(rng.integers(1, 8))),
                 tok(int(rng.integers(1, 8)))) for _ in range(n)]


def _adapter(m):
    ad = random_adapter(m.config, rank=4, alpha=8.0, b_scale=0.2)
    ad.weights = {k: (a.astype(np.float64), b.astype(np.float64))
                  for k, (a, b) in ad.weights.items()}
    return ad


@pytest.mark.parametrize("method", ["dpo", "ipo", "orpo", "simpo"])
@pytest.mark.parametrize("batch", [2, 3])
def test_preference_eval_is_the_mean_over_pairs(method, batch):
    m, n = tiny_model(), 5  # 5 pairs: the last batch is partial, filled by wrapping around
    pairs = _pairs(n)
    average = row(method).average
    ref = np.random.default_rng(1).normal(-20.0, 3.0, (n, 2)) if row(method).reference else None
    alone = preference_run.PairData(pairs, 32, average, 256, 1, 0)
    alone.ref = ref
    one = TrainStep(m, _adapter(m), 1, 32, dtype=np.float64, method=method)
    per_pair = []
    for i in range(n):  # each pair on its own
        loss, metrics, _ = one.eval_preference([(alone.batch([i]), alone._ref([i]), 1.0)])
        per_pair.append({"loss": loss, **metrics})
    want = {k: np.mean([p[k] for p in per_pair]) for k in per_pair[0]}
    data = preference_run.PairData(pairs, 32, average, 256, batch, 0)
    data.ref = ref
    st = TrainStep(m, _adapter(m), batch, 32, dtype=np.float64, method=method)
    got = data.evaluate(st)
    assert set(got) == {f"eval_{k}" for k in want}
    for k, v in want.items():
        assert got[f"eval_{k}"] == pytest.approx(v, rel=1e-12, abs=1e-13), k
    if method == "orpo":  # the NLL too: each pair's own token mean, then their mean
        assert got["eval_nll_loss"] == pytest.approx(want["nll_loss"], rel=1e-12)


@pytest.mark.parametrize("batch", [2, 4])
def test_sft_eval_is_the_mean_over_held_out_tokens(batch):
    m, T, n = tiny_model(), 16, 5
    rng = np.random.default_rng(2)
    seqs = empty_rows(n, T)
    seqs.ids[:] = rng.integers(0, 256, (n, T))
    seqs.targets[:] = np.where(rng.random((n, T)) < 0.6, rng.integers(0, 256, (n, T)), IGNORE)
    one = TrainStep(m, _adapter(m), 1, T, dtype=np.float64)
    # each row alone: its mean loss times its target tokens, summed, over all tokens
    counts = [int((seqs.targets[i] != IGNORE).sum()) for i in range(n)]
    want = sum(one.eval_loss(seqs.take([i])) * c for i, c in enumerate(counts)) / sum(counts)
    st = TrainStep(m, _adapter(m), batch, T, dtype=np.float64)
    assert st.eval_loss(seqs) == pytest.approx(want, rel=1e-12)
