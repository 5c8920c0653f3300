"""Generation: sampling steps (temperature, top-k, top-p, min-p, repetition penalty,
seed), stop strings, the context-length check and one clear error per bad value."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.models.generate import (Sampling, cut_at_stop, held_back, penalize,
                                      sample_next)
from gradtape.models.model import Llama
from support.tinymodel import tiny_model


@pytest.fixture(scope="module")
def tiny():
    m = tiny_model(seed=3)
    return Llama(m.config, m.weights, None, name="tiny")


def _draws(z, s, n=4000, seen=()):
    rng = np.random.default_rng(s.seed)
    return np.bincount([sample_next(z, s, rng, seen) for _ in range(n)], minlength=len(z))


Z = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))  # probabilities at T = 1


def test_greedy_is_argmax_and_penalty_applies():
    z = np.array([1.0, 3.0, -2.0, 2.9])
    assert sample_next(z, Sampling(), None) == 1
    # token 1 seen: 3.0 / 1.5 = 2.0 < 2.9; a negative logit is multiplied
    assert sample_next(z, Sampling(repetition_penalty=1.5), None, seen=[1, 1]) == 3
    np.testing.assert_array_equal(penalize(z, [1, 2], 2.0), [1.0, 1.5, -4.0, 2.9])
    np.testing.assert_array_equal(penalize(z, [1, 2], 1.0), z)


@pytest.mark.parametrize("kw, kept", [
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.6), {0, 1}),           # 0.40 < 0.6 <= 0.65
    (dict(top_p=0.4), {0}),              # the mass reaches 0.4 with the first token
    (dict(min_p=0.3), {0, 1, 2}),        # p >= 0.12
    (dict(top_k=3, top_p=0.9, min_p=0.2), {0, 1, 2}),
    (dict(), {0, 1, 2, 3, 4, 5}),
])
def test_filters_keep_the_right_tokens_in_proportion(kw, kept):
    s = Sampling(temperature=1.0, seed=1, **kw)
    counts = _draws(Z, s)
    assert set(np.nonzero(counts)[0]) == kept
    p = np.exp(Z)[sorted(kept)]
    p /= p.sum()
    freq = counts[sorted(kept)] / counts.sum()
    # 4000 draws: the standard error of a frequency is at most 0.008; 5 sigma
    assert np.abs(freq - p).max() < 0.04


def test_temperature_sharpens_and_seed_reproduces():
    hot, cold = _draws(Z, Sampling(temperature=2.0)), _draws(Z, Sampling(temperature=0.25))
    assert cold[0] > hot[0] and cold[5] < hot[5]
    a = _draws(Z, Sampling(temperature=1.0, seed=9), n=50)
    assert np.array_equal(a, _draws(Z, Sampling(temperature=1.0, seed=9), n=50))


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-0.1), "temperature (--temperature) must be >= 0"),
    (dict(temperature=float("nan")), "temperature (--temperature) must be finite"),
    (dict(top_p=0.0), "top_p (--top-p) must be in (0, 1]"),
    (dict(top_p=1.5), "top_p (--top-p) must be in (0, 1]"),
    (dict(top_k=-1), "top_k (--top-k) must be >= 0"),
    (dict(top_k=2.5), "top_k (--top-k) must be an integer"),
    (dict(min_p=1.0), "min_p (--min-p) must be in [0, 1)"),
    (dict(min_p=-0.5), "min_p (--min-p) must be in [0, 1)"),
    (dict(repetition_penalty=0.0), "repetition_penalty (--repetition-penalty) must be > 0"),
    (dict(seed=-1), "seed (--seed) must be >= 0"),
    (dict(temperature="hot"), "temperature (--temperature) must be a number"),
])
def test_bad_sampling_values_are_one_error(tiny, kw, msg):
    with pytest.raises(GradtapeError) as e:
        Sampling(**kw)
    assert msg in str(e.value)
    with pytest.raises(GradtapeError) as e:  # the model API checks with the same words
        tiny.generate([1, 2, 3], 4, stop_ids=(), **kw)
    assert msg in str(e.value)


def test_generate_checks_the_context(tiny):
    ctx = tiny.config.max_seq_len
    assert len(tiny.generate([5] * (ctx - 3), 3, stop_ids=())) == 3  # exactly fits
    with pytest.raises(GradtapeError, match=r"the prompt \(509 tokens\) plus max_new_tokens 4 "
                                            r"is longer than the model's context \(512 tokens\); "
                                            r"allow at most 3 new tokens "
                                            r"\(--max-new-tokens 3 or less\)"):
        tiny.generate([5] * (ctx - 3), 4, stop_ids=())
    with pytest.raises(GradtapeError, match="shorten the prompt"):
        tiny.generate([5] * ctx, 1, stop_ids=())
    with pytest.raises(GradtapeError, match="max_new_tokens .* must be >= 0"):
        tiny.generate([5], -1, stop_ids=())


def test_sampled_generation_is_seeded_and_filters_apply(tiny):
    kw = dict(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    a = tiny.generate([1, 2, 3], 12, seed=4, stop_ids=(), **kw)
    assert a == tiny.generate([1, 2, 3], 12, seed=4, stop_ids=(), **kw)
    assert a != tiny.generate([1, 2, 3], 12, seed=5, stop_ids=(), **kw)
    # top_k = 1 is greedy, whatever the temperature
    assert (tiny.generate([1, 2, 3], 8, temperature=5.0, top_k=1, seed=1, stop_ids=())
            == tiny.generate([1, 2, 3], 8, stop_ids=()))


def test_repetition_penalty_changes_greedy_output(tiny):
    plain = tiny.generate([7, 7, 7], 10, stop_ids=())
    pen = tiny.generate([7, 7, 7], 10, stop_ids=(), repetition_penalty=5.0)
    assert plain != pen
    assert len(set(pen)) >= len(set(plain))  # repeats are discouraged


def test_stop_strings(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("The capital of France is")
    full = smollm2.generate(prompt, 12)
    text = tok.decode(full)
    word = text.split()[1]  # a word that appears after the first few tokens
    out = smollm2.generate(prompt, 12, stop=[word])
    assert word in tok.decode(out) and word not in tok.decode(out[:-1])
    assert out == full[:len(out)]
    with pytest.raises(GradtapeError, match="stop strings"):
        smollm2.generate(prompt, 3, stop=[""])


def test_cut_and_hold_back():
    assert cut_at_stop("abc\n\nde", ["\n\n", "d"]) == ("abc", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world", "lo!"]) == 2
    assert held_back("hello", []) == 0
