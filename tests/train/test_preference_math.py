"""``graph.sequence_logps`` on both head routes against NumPy, and the methods table's
one-line mistakes (fast; TRL parity is ``test_preference_trl.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape.errors import GradtapeError
from gradtape.models import graph
from gradtape.train import methods as M
from gradtape.train import preference as P
from support.compare import rel_err
from support.tinymodel import tiny_model


def _numpy_logps(model, ids, n_seq, targets, weights):
    tp = gt.Tape(np.float64)
    W = graph.weight_consts(tp, {k: w.astype(np.float64) for k, w in model.weights.items()})
    z = graph.record_forward(tp, model.config, W, tp.const(ids), n_seq).value  # [N, V]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    lp = z[np.arange(len(ids)), targets] - lse
    return weights.T @ lp


@pytest.mark.parametrize("fused", [False, True], ids=["composed", "fused-head"])
def test_sequence_logps_equal_numpy(fused, monkeypatch):
    if fused:
        monkeypatch.setattr(graph, "LOGPS_FUSE_MIN", 0)
    model = tiny_model()
    rng = np.random.default_rng(1)
    n_seq, t = 3, 6
    ids = rng.integers(0, model.config.vocab_size, n_seq * t)
    targets = rng.integers(0, model.config.vocab_size, n_seq * t)
    w = rng.random((n_seq * t, n_seq + 1)) * (rng.random((n_seq * t, 1)) < 0.7)
    tp = gt.Tape(np.float64)
    W = graph.weight_consts(tp, {k: x.astype(np.float64) for k, x in model.weights.items()})
    hidden = graph.record_forward(tp, model.config, W, tp.const(ids), n_seq, head=False)
    got = graph.sequence_logps(tp, model.config, W, hidden, tp.const(targets), tp.const(w))
    assert got.shape == (n_seq + 1, 1)
    assert rel_err(got.value[:, 0], _numpy_logps(model, ids, n_seq, targets, w)) < 1e-12


def test_pair_batch_layout():
    pairs = [([1, 2, 3, 4], [0, 0, 1, 1], [1, 2, 5], [0, 0, 1])]
    b = P.pair_batch(pairs, 5, average=True)
    w = b.weights.reshape(2, 5, 3)
    assert list(b.counts) == [2, 1]
    assert list(w[0, :, 0]) == [0, 0.5, 0.5, 0, 0] and list(w[1, :, 1]) == [0, 1, 0, 0, 0]
    assert list(w[0, :, 2]) == [1 / 3] * 3 + [0, 0] and not w[1, :, 2].any()
    assert list(b.targets[:5]) == [2, 3, 4, 0, 0]


def test_rows_no_read_sum_counts_are_fed_no_target():
    """With ``no_target`` -1 (a fused head that skips), a row gets -1 where no sum the
    program reads counts it: a prompt's rows and padding; the chosen prompt's rows stay
    where the loss reads their NLL (ORPO's ``nll``)."""
    pairs = [([1, 2, 3, 4], [0, 0, 1, 1], [1, 2, 5], [0, 0, 1])]
    b = P.pair_batch(pairs, 5, average=True)
    lv = {k: k for k in ("ids", "targets")}  # the leaves stand for themselves here
    assert list(P._feeds(lv, b, np.float64)["targets"]) == [2, 3, 4, 0, 0, 2, 5, 0, 0, 0]
    dpo = P._feeds(lv, b, np.float64, no_target=-1, nll=False)["targets"]
    assert list(dpo) == [-1, 3, 4, -1, -1, -1, 5, -1, -1, -1]
    orpo = P._feeds(lv, b, np.float64, no_target=-1, nll=True)["targets"]
    assert list(orpo) == [2, 3, 4, -1, -1, -1, 5, -1, -1, -1]


@pytest.mark.parametrize("pairs, t, match", [
    ([([1, 2], [0, 0], [1, 3], [0, 1])], 4, "pair 0's chosen: no completion token"),
    ([([1, 2, 3], [0, 1, 1], [1, 3], [0, 1])], 2, "pair 0's chosen: 3 tokens do not fit"),
    ([([1, 2], [0, 1], [1, 3], [0])], 4, "pair 0's rejected: 2 tokens but 1 mask"),
])
def test_pair_batch_mistakes_are_one_line(pairs, t, match):
    with pytest.raises(GradtapeError, match=match):
        P.pair_batch(pairs, t, average=False, where="data.jsonl")


@pytest.mark.parametrize("name, opt, match", [
    ("dpo", M.Options(beta=0.0), "--beta 0.0 is out of range"),
    ("dpo", M.Options(label_smoothing=0.5), r"--label-smoothing 0.5 is out of range"),
    ("ipo", M.Options(label_smoothing=0.1), "applies to dpo and simpo, not ipo"),
    ("orpo", M.Options(simpo_gamma=1.0), "--simpo-gamma applies to simpo, not orpo"),
    ("sft", M.Options(beta=0.1), "--beta applies to the preference methods, not sft"),
])
def test_method_option_mistakes_are_one_line(name, opt, match):
    with pytest.raises(GradtapeError, match=match):
        M.check_options(M.method(name), opt)
    with pytest.raises(GradtapeError, match="unknown method 'kto': the methods are sft, dpo"):
        M.method("kto")


def test_table_defaults_are_trls():
    assert {n: (m.reference, m.average, m.beta) for n, m in M.METHODS.items()} == {
        "sft": (False, False, None), "dpo": (True, False, 0.1), "ipo": (True, False, 0.1),
        "orpo": (False, True, 0.1), "simpo": (False, True, 0.1)}


def test_log_sigmoid_is_stable():
    tp = gt.Tape(np.float64)
    x = np.array([-800.0, -30.0, -1.0, 0.0, 2.0, 40.0])
    got = M.log_sigmoid(tp.const(x)).value
    ref = -np.logaddexp(0.0, -x)
    assert np.all(np.isfinite(got)) and np.max(np.abs(got - ref)) < 1e-15


def test_eval_logps_take_a_head_without_the_backwards_fold(monkeypatch):
    """Through the fused head, the held-out evaluation (and the reference pass, which runs
    it) reads a head recorded with training=False: the same log-probabilities, bit for
    bit, without the softmax-weighted table rows the training head folds up for its
    backward (``fwd_head_nll_e``)."""
    monkeypatch.setattr(graph, "LOGPS_FUSE_MIN", 0)
    model = tiny_model()
    pairs = [([1, 2, 3, 4], [0, 0, 1, 1], [1, 2, 5], [0, 0, 1]),
             ([3, 1, 4], [0, 1, 1], [3, 1, 5, 9], [0, 1, 1, 1])]
    tp = gt.Tape(np.float32)
    W = graph.weight_consts(tp, model.weights)
    g = P.record_preference(tp, model.config, W, None, 1.0, M.method("orpo"),
                            P.pair_batch(pairs, 5, average=True))
    assert g.eval_logps is not g.logps
    both = tp.compile([g.logps, g.eval_logps], backend="cpu").run()
    # bitwise on any CPU: both heads run the same walk (_head_walk: the same GEMMs over
    # the same vocabulary blocks), the training one only adding E; a reference pass then
    # gives the first step's rewards exactly 0
    assert np.array_equal(both[0], both[1])
    ev = tp.compile([g.eval_loss, g.eval_logps], backend="cpu")
    names = {getattr(getattr(s, "func", s), "__name__", "") for s in ev.executable._steps}
    assert "fwd_head_nll" in names and "fwd_head_nll_e" not in names
    # the composed head (below LOGPS_FUSE_MIN) folds nothing: one head for both
    monkeypatch.setattr(graph, "LOGPS_FUSE_MIN", 1 << 40)
    g2 = P.record_preference(tp, model.config, W, None, 1.0, M.method("orpo"),
                             P.pair_batch(pairs, 5, average=True))
    assert g2.eval_logps is g2.logps
