"""Generation: sampling settings and their checks, picking the next token, stop strings,
and the prompt-then-decode loop behind ``Llama.generate``.

The loop is independent of how logits are computed: it is given a ``prefill(ids)``
function (logits of the prompt's last row, filling a cache) and a ``decode(token)``
function (logits of one more token).  ``model.py`` supplies them (the float32 graph
replay, or the block-weight decode step of ``decode_engine``).  This module computes no
model math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from a row of logits ``z``:

    1. ``repetition_penalty`` (CTRL / Hugging Face): for every token already seen (prompt
       and output), ``z > 0 -> z / penalty``, ``z <= 0 -> z * penalty``; 1 = off;
    2. ``temperature == 0``: the argmax (greedy; the steps below are skipped);
    3. ``p = softmax(z / temperature)``;
    4. ``top_k``: keep the k most likely tokens (0 = off);
    5. ``top_p``: keep the smallest set of the most likely tokens with mass >= top_p;
    6. ``min_p``: keep tokens with ``p >= min_p * max(p)`` (0 = off);
    7. renormalise and draw, from a generator seeded with ``seed``.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_sampling(self)


def _number(name, flag, v, integer=False):
    kind = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind + (np.integer, np.floating)):
        raise GradtapeError(f"{name} ({flag}) must be a{'n integer' if integer else ' number'}, "
                            f"got {v!r}")
    if integer and isinstance(v, (float, np.floating)):
        raise GradtapeError(f"{name} ({flag}) must be an integer, got {v!r}")
    if not integer and not math.isfinite(float(v)):
        raise GradtapeError(f"{name} ({flag}) must be finite, got {v!r}")
    return v


def check_sampling(s: Sampling):
    """One ``GradtapeError`` naming the first bad value (with its CLI option)."""
    t = _number("temperature", "--temperature", s.temperature)
    if t < 0:
        raise GradtapeError(f"temperature (--temperature) must be >= 0 (0 = greedy), got {t}")
    k = _number("top_k", "--top-k", s.top_k, integer=True)
    if k < 0:
        raise GradtapeError(f"top_k (--top-k) must be >= 0 (0 = off), got {k}")
    p = _number("top_p", "--top-p", s.top_p)
    if not 0.0 < p <= 1.0:
        raise GradtapeError(f"top_p (--top-p) must be in (0, 1] (1 = off), got {p}")
    m = _number("min_p", "--min-p", s.min_p)
    if not 0.0 <= m < 1.0:
        raise GradtapeError(f"min_p (--min-p) must be in [0, 1) (0 = off), got {m}")
    r = _number("repetition_penalty", "--repetition-penalty", s.repetition_penalty)
    if r <= 0:
        raise GradtapeError(f"repetition_penalty (--repetition-penalty) must be > 0 "
                            f"(1 = off), got {r}")
    seed = _number("seed", "--seed", s.seed, integer=True)
    if seed < 0:
        raise GradtapeError(f"seed (--seed) must be >= 0, got {seed}")


def penalize(z: np.ndarray, seen, penalty: float) -> np.ndarray:
    """The repetition penalty on a copy of ``z`` (float64) for the ids in ``seen``."""
    z = z.astype(np.float64)
    if penalty != 1.0 and len(seen):
        ids = np.unique(np.asarray(seen, dtype=np.int64))
        v = z[ids]
        z[ids] = np.where(v > 0, v / penalty, v * penalty)
    return z


def sample_next(logits_row, s: Sampling, rng, seen=()) -> int:
    """The next token id from one row of logits (see ``Sampling`` for the steps)."""
    z = penalize(logits_row, seen, s.repetition_penalty)
    if s.temperature == 0.0:
        return int(np.argmax(z))
    z = z / s.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")  # most likely first; ties by id
    keep = len(p)
    if s.top_k:
        keep = min(keep, s.top_k)
    if s.top_p < 1.0:
        cum = np.cumsum(p[order])
        keep = min(keep, int(np.searchsorted(cum, s.top_p)) + 1)  # mass >= top_p
    if s.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(p >= s.min_p * p[order[0]])))
    kept = order[:keep]
    q = p[kept] / p[kept].sum()
    return int(kept[rng.choice(len(q), p=q)])


# --- stop strings -------------------------------------------------------------------------

def check_stop_strings(stop):
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    for s in stop:
        if not isinstance(s, str) or not s:
            raise GradtapeError(f"stop strings (--stop) must be non-empty text, got {s!r}")
    return tuple(stop)


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """``(text before the first stop string, whether one was found)``."""
    cut = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cut)], True) if cut else (text, False)


def held_back(text: str, stop) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (and
    must not be shown yet)."""
    n = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


# --- the loop -----------------------------------------------------------------------------

def check_length(n_prompt, max_new_tokens, context):
    """The prompt plus ``max_new_tokens`` must fit the model's context."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise GradtapeError(f"max_new_tokens (--max-new-tokens) must be an integer, "
                            f"got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise GradtapeError(f"max_new_tokens (--max-new-tokens) must be >= 0, got "
                            f"{max_new_tokens}")
    if n_prompt + max_new_tokens > context:
        hint = ("shorten the prompt" if n_prompt >= context else
                f"allow at most {context - n_prompt} new tokens (--max-new-tokens "
                f"{context - n_prompt} or less)")
        raise GradtapeError(f"the prompt ({n_prompt} tokens) plus max_new_tokens "
                            f"{max_new_tokens} is longer than the model's context "
                            f"({context} tokens); {hint}")


def run_loop(prompt, max_new_tokens, s: Sampling, prefill, decode, stop_ids=(),
             stop=(), decode_text=None, stream=None) -> list[int]:
    """New token ids: ``prefill(prompt)`` gives the logits after the prompt, then each
    picked token is fed to ``decode(token)``.  Stops after a token in ``stop_ids``, after
    the token that completes one of the ``stop`` strings (``decode_text(ids) -> str``
    turns the new ids into text; both tokens are included in the result), or after
    ``max_new_tokens``.  ``stream(token)`` sees every new token as it is picked."""
    out = []
    if max_new_tokens == 0:
        return out
    rng = np.random.default_rng(s.seed)
    seen = list(prompt) if s.repetition_penalty != 1.0 else ()
    last = prefill(prompt)
    while True:
        tok = sample_next(last, s, rng, seen)
        out.append(tok)
        if seen != ():
            seen.append(tok)
        if stream is not None:
            stream(tok)
        if tok in stop_ids or len(out) >= max_new_tokens:
            return out
        if stop and cut_at_stop(decode_text(out), stop)[1]:
            return out
        last = decode(tok)
