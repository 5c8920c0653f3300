"""Sampling: the settings that pick the next token from a row of logits, their checks,
and the pick itself (repetition penalty, greedy, temperature, top-k, top-p, min-p).

Nothing here knows the model or the loop that calls it (``loop``).
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
