"""The one error measure of the suite: ``rel_err(got, ref) = max |got - ref| / max |ref|``
(the oracle's metric, as llm.c's tests use it), in float64."""

from __future__ import annotations

import numpy as np


def rel_err(got, ref):
    """max |got - ref| / max |ref|; the absolute difference where ``ref`` is all zero, 0
    for empty arrays.  The shapes must agree (no broadcasting hides a wrong shape)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    d = np.max(np.abs(got - ref)) if got.size else 0.0
    s = np.max(np.abs(ref)) if ref.size else 0.0
    if s == 0.0:
        return float(d)
    return float(d / s)
