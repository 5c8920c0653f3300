"""Rotary position embedding (NEOX half-split) as one primitive: ``rope``.

``rope(x, c, s)`` rotates each row of ``x [R, hd]`` by its angles: with ``x1, x2`` the two
column halves, ``[x1*c - x2*s, x2*c + x1*s]`` (``c, s [R, hd/2]``: cos and sin per row).
Composed, it is a pass per slice, per half and for the concat in forward, and pads and
adds in backward; as one op a backend runs it in one pass each way.  Its gradient is the
inverse rotation (``inverse=True``: ``[x1*c + x2*s, x2*c - x1*s]``), the same products
summed in the same pairs as the composed form's, so both give the same bits.  A backend
without a kernel runs the composed form (``decompose``).
"""

from __future__ import annotations

import numpy as np

from .elementwise import add, mul, sub
from .movement import concat, slice_
from .table import ShapeError, _prim, _rec


def _rope_shape(shapes, inverse=False):
    x, c, s = shapes
    if len(x) != 2 or x[1] % 2 or tuple(c) != (x[0], x[1] // 2) or tuple(s) != tuple(c):
        raise ShapeError("expects x [R, hd] (hd even) and cos, sin [R, hd/2]")
    return tuple(x)


def _fwd_rope(out, x, c, s, inverse=False):
    h = x.shape[1] // 2
    x1, x2 = x[:, :h], x[:, h:]
    if inverse:
        np.add(x1 * c, x2 * s, out=out[:, :h])
        np.subtract(x2 * c, x1 * s, out=out[:, h:])
    else:
        np.subtract(x1 * c, x2 * s, out=out[:, :h])
        np.add(x2 * c, x1 * s, out=out[:, h:])


def _halves(x):
    h = x.shape[1] // 2
    return slice_(x, 1, 0, h), slice_(x, 1, h, 2 * h)


def _composed(tp, x, c, s, inverse=False):
    x1, x2 = _halves(x)
    first, second = (add, sub) if inverse else (sub, add)
    return concat([first(mul(x1, c), mul(x2, s)), second(mul(x2, c), mul(x1, s))], 1)


def _rope_vjp(g, out, x, c, s, inverse=False):
    def dc():  # d/dc of x1*c and x2*c
        (g1, g2), (x1, x2) = _halves(g), _halves(x)
        return add(mul(g1, x1), mul(g2, x2))

    def ds():  # d/ds of -x2*s and x1*s (signs swapped when inverse)
        (g1, g2), (x1, x2) = _halves(g), _halves(x)
        return sub(mul(g1, x2), mul(g2, x1)) if inverse else sub(mul(g2, x1), mul(g1, x2))
    return (lambda: rope(g, c, s, inverse=not inverse), dc, ds)


_prim("rope", _rope_shape, _fwd_rope, _rope_vjp, decompose=_composed)


def rope(x, c, s, inverse=False):
    """``[x1*c - x2*s, x2*c + x1*s]`` for ``x [R, hd]`` with column halves ``x1, x2`` and
    ``c, s [R, hd/2]``; ``inverse``: the rotation back, ``[x1*c + x2*s, x2*c - x1*s]``."""
    return _rec("rope", x, c, s, inverse=bool(inverse))
