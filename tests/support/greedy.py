"""Greedy tokens compared across code paths that sum in different orders.

Two decoders (the C step and the graph, float32 and a quantized copy, ours and
transformers) round differently, so their logits differ by a little; where a step's top
two logits lie closer than that, either may pick either token and both are right.  So
tokens are compared only where the reference's top-2 margin is asserted larger than the
paths' rounding, and a test that compares tokens says how far apart its paths may round.

``rounding`` is relative to the step's largest |logit| (the suite's ``rel_err``
measure): each path's logits are within ``rounding * max|ref|`` of the reference's, so
where the reference's top two are more than twice that apart, both paths pick its top.
"""

from __future__ import annotations

import numpy as np


def top2_margins(logits):
    """Per row of ``logits`` ``[n, V]``: (largest - second largest) / max |row|."""
    z = np.asarray(logits, np.float64)
    z = z.reshape(-1, z.shape[-1])
    top2 = np.sort(z, axis=1)[:, -2:]
    scale = np.max(np.abs(z), axis=1)
    scale[scale == 0] = 1.0
    return (top2[:, 1] - top2[:, 0]) / scale


def decisive_steps(ref_logits, rounding):
    """How many leading rows of ``ref_logits`` have a top-2 margin over ``2 * rounding``:
    the steps whose greedy token no path within ``rounding`` of the reference can change."""
    m = top2_margins(ref_logits) > 2 * rounding
    return int(m.size if m.all() else np.argmin(m))


def assert_greedy_equal(ref_logits, tokens_a, tokens_b, rounding, min_steps=None):
    """Two greedy continuations of one prompt agree with the reference's argmax.

    ``ref_logits[i]``: the reference's logits for step ``i`` along ``tokens_a`` (teacher
    forcing: after the prompt and ``tokens_a[:i]``); ``rounding``: how far (relative to
    the step's largest |logit|) each path's logits may lie from the reference's.  The
    steps up to the first one whose top-2 margin is not over ``2 * rounding`` are
    compared (after a near tie the paths may part, both right); at least ``min_steps``
    of them (default: all) must be, so a test cannot silently compare nothing.  Returns
    the number of steps compared."""
    ref = np.asarray(ref_logits, np.float64)
    a, b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    n = min(len(a), len(b), len(ref))
    want = len(ref) if min_steps is None else min_steps
    k = min(decisive_steps(ref[:n], rounding), n)
    margins = top2_margins(ref[:n])
    assert k >= want, (f"only {k} of the {want} steps asked for have a top-2 margin over "
                       f"2 x {rounding:g} (margins {np.round(margins, 6).tolist()}): pick a "
                       "prompt without near ties")
    top = [int(i) for i in ref[:k].argmax(1)]
    assert a[:k] == top, f"path a {a[:k]} != the reference's argmax {top}"
    assert b[:k] == top, f"path b {b[:k]} != the reference's argmax {top}"
    return k


def assert_argmax_equal(ref_logits, got_logits, rounding):
    """Rows scored independently (teacher forcing, no chain): wherever the reference's
    top-2 margin is over ``2 * rounding``, ``got_logits`` picks the reference's token.
    Returns how many rows were decisive (at least one, or the check said nothing)."""
    ref, got = np.asarray(ref_logits), np.asarray(got_logits)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    decisive = top2_margins(ref) > 2 * rounding
    assert decisive.any(), "no row's top-2 margin is over the paths' rounding"
    np.testing.assert_array_equal(got.argmax(-1)[decisive], ref.argmax(-1)[decisive])
    return int(decisive.sum())
