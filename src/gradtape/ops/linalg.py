"""The matrix product primitive: ``matmul``, 2-d or a batch of 3-d matrices, with either
operand optionally transposed (a strided view, never a copy).

Its VJP is two more matmuls, each case written with the transposes as flags so backward
materialises no transposed copy.  Products against frozen weights kept in ggml blocks
are ``block_weights``' (``qmatmul``).
"""

from __future__ import annotations

import numpy as np

from .table import ShapeError, _prim, _rec


def _matmul_shape(shapes, ta=False, tb=False):
    a, b = shapes
    if len(a) not in (2, 3) or len(b) != len(a):
        raise ShapeError("operands must both be 2-d, or both 3-d (a batch of matrices)")
    if len(a) == 3 and a[0] != b[0]:
        raise ShapeError(f"batch sizes {a[0]} != {b[0]}")
    m, k = (a[-1], a[-2]) if ta else a[-2:]
    k2, n = (b[-1], b[-2]) if tb else b[-2:]
    if k != k2:
        raise ShapeError(f"inner dims {k} != {k2}")
    return a[:-2] + (m, n)


def _mT(x, t):
    """x, or x with its last two axes swapped (a view): a matrix or a batch of them."""
    return np.swapaxes(x, -1, -2) if t else x


def _fwd_matmul(out, a, b, ta=False, tb=False):
    np.matmul(_mT(a, ta), _mT(b, tb), out=out)


_prim("matmul", _matmul_shape, _fwd_matmul, lambda g, out, a, b, ta=False, tb=False: {
    # C = op(A) op(B); each case is dA, dB written without materialised transposes.
    (False, False): (lambda: matmul(g, b, tb=True), lambda: matmul(a, g, ta=True)),
    (False, True): (lambda: matmul(g, b), lambda: matmul(g, a, ta=True)),
    (True, False): (lambda: matmul(b, g, tb=True), lambda: matmul(a, g)),
    (True, True): (lambda: matmul(b, g, ta=True, tb=True),
                   lambda: matmul(g, a, ta=True, tb=True)),
}[(ta, tb)])


def matmul(a, b, ta=False, tb=False):
    """op(a) @ op(b), where op transposes when ta / tb is set (no copy is made).  Both
    2-d, or both 3-d ``[batch, m, k] @ [batch, k, n]`` (op swapping the last two axes)."""
    return _rec("matmul", a, b, ta=bool(ta), tb=bool(tb))


def inner_dim(v):
    """The number of terms each element of a recorded ``matmul`` ``v`` sums (its ``k``)."""
    a = v.inputs[0]
    return a.shape[-2] if v.attrs.get("ta") else a.shape[-1]

