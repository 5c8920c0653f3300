"""The tape's contract (the README's tape API): leaves, values, operator overloading, backward
as graph on the same tape, second order, eager and lazy recording."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops

DTYPES = [np.float64, np.float32]


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leaves_shape_dtype_value(dtype, rng):
    tp = gt.Tape(dtype=dtype)
    a = rng.standard_normal((3, 4))
    w = tp.param(a)
    c = tp.const(a)
    for v in (w, c):
        assert v.shape == (3, 4) and isinstance(v.shape, tuple)
        assert v.dtype == np.dtype(dtype)
        assert isinstance(v.value, np.ndarray) and v.value.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(v), a.astype(dtype))
    assert w.requires_grad and not c.requires_grad


def test_default_dtype_is_float64():
    assert gt.Tape().dtype == np.float64


def test_param_copies_and_integer_const_stays_integer():
    tp = gt.Tape()
    a = np.ones((2, 2))
    w = tp.param(a)
    a[0, 0] = 5.0
    assert w.value[0, 0] == 1.0  # a param owns its value
    ids = tp.const(np.array([1, 0, 2], dtype=np.int32))
    assert np.issubdtype(ids.dtype, np.integer)
    wi = tp.param(np.array([1, 2]))  # integer data becomes a float param
    assert wi.dtype == np.float64


def test_vars_hash_by_identity():
    tp = gt.Tape()
    a, b = tp.param(np.ones(2)), tp.param(np.ones(2))
    d = {a: 1, b: 2}
    assert d[a] == 1 and d[b] == 2
    assert (a == b) is False and (a == a) is True  # == is identity, not elementwise


@pytest.mark.parametrize("dtype", DTYPES)
def test_operator_overloading(dtype, rng):
    tp = gt.Tape(dtype=dtype)
    xa, ya = rng.uniform(0.5, 2, (3, 4)), rng.uniform(0.5, 2, (3, 4))
    wa = rng.standard_normal((4, 2))
    x, y, w = tp.param(xa), tp.param(ya), tp.const(wa)
    xa, ya, wa = xa.astype(dtype), ya.astype(dtype), wa.astype(dtype)
    tol = dict(rtol=1e-6 if dtype == np.float32 else 1e-15, atol=0)
    checks = [
        (x + y, xa + ya, "add"), (x - y, xa - ya, "sub"), (x * y, xa * ya, "mul"),
        (x / y, xa / ya, "div"), (-x, -xa, "neg"), (x @ w, xa @ wa, "matmul"),
        (x + 2.0, xa + 2, "addc"), (2.0 + x, 2 + xa, "addc"), (x - 1.5, xa - 1.5, "addc"),
        (x * 3, xa * 3, "scale"), (3 * x, 3 * xa, "scale"), (x / 4.0, xa / 4, "scale"),
        (1.0 - x, 1 - xa, "addc"), (2.0 / x, 2 / xa, "div"), (x ** 2, xa ** 2, "powc"),
        (x + ya, xa + ya, "add"), (ya + x, ya + xa, "add"), (ya - x, ya - xa, "sub"),
        (ya * x, ya * xa, "mul"), (xa @ w, xa @ wa, "matmul"), (x.T, xa.T, "transpose"),
        (x * np.float64(2.0), xa * 2, "scale"),
    ]
    for v, ref, op in checks:
        assert v.op == op, (v, op)
        assert v.tape is tp and v.dtype == np.dtype(dtype)
        np.testing.assert_allclose(v.value, ref, **tol)


def test_pow_needs_a_scalar_exponent():
    tp = gt.Tape()
    x = tp.param(np.ones(3))
    with pytest.raises(TypeError, match="pow: only a constant scalar exponent"):
        x ** x


def test_operator_with_unsupported_type():
    tp = gt.Tape()
    x = tp.param(np.ones(3))
    with pytest.raises(TypeError, match=r"add: cannot combine a Var with str"):
        x + "a"


def test_backward_returns_gradients_keyed_by_params():
    tp = gt.Tape()
    a = tp.param(np.array([1.0, 2.0, 3.0]))
    unused = tp.param(np.ones(3))
    b = tp.param(np.array([4.0, 5.0, 6.0]))
    c = tp.const(np.array([1.0, 1.0, 2.0]))
    loss = ops.reduce_sum(a * b * c)
    grads = tp.backward(loss)
    assert list(grads) == [a, b]  # recording order; only params the loss depends on
    assert unused not in grads
    for p, g in grads.items():
        assert isinstance(g, gt.Var) and g.tape is tp and g.shape == p.shape
    np.testing.assert_array_equal(grads[a].value, [4.0, 5.0, 12.0])
    np.testing.assert_array_equal(grads[b].value, [1.0, 2.0, 6.0])


def test_backward_extends_the_same_tape():
    tp = gt.Tape()
    x = tp.param(np.array([[1.0, 2.0]]))
    loss = ops.reduce_sum(ops.exp(x))
    n = len(tp.vars)
    g = tp.backward(loss)[x]
    assert len(tp.vars) > n and tp.vars[g.index] is g and g.index >= n
    np.testing.assert_allclose(g.value, np.exp([[1.0, 2.0]]), rtol=1e-15)


def test_param_used_twice_accumulates():
    tp = gt.Tape()
    x = tp.param(np.array([2.0, 3.0]))
    loss = ops.reduce_sum(x * x + x)
    np.testing.assert_array_equal(tp.backward(loss)[x].value, [5.0, 7.0])


def test_loss_shapes_with_one_element():
    tp = gt.Tape()
    x = tp.param(np.array([[3.0]]))
    np.testing.assert_array_equal(tp.backward(x * x)[x].value, [[6.0]])
    y = tp.param(np.array(2.0))
    np.testing.assert_array_equal(tp.backward(y * y * y)[y].value, 12.0)
    assert tp.backward(y)[y].value == 1.0  # the loss may be the param itself


def test_loss_without_params_gives_no_gradients():
    tp = gt.Tape()
    c = tp.const(np.ones(3))
    assert tp.backward(ops.reduce_sum(c)) == {}


def test_integer_ids_get_no_gradient():
    tp = gt.Tape()
    table = tp.param(np.arange(6.0).reshape(3, 2))
    ids = tp.const(np.array([2, 2, 0]))
    g = tp.backward(ops.reduce_sum(ops.take_rows(table, ids)))
    assert list(g) == [table]
    np.testing.assert_array_equal(g[table].value, [[1, 1], [0, 0], [2, 2]])


def test_second_order_is_graph():
    """d/dx of (d/dx sum(x^3)) . 1 = 6x: backward over a graph holding backward ops."""
    tp = gt.Tape()
    x = tp.param(np.array([1.0, -2.0, 0.5]))
    g = tp.backward(ops.reduce_sum(x * x * x))[x]  # 3x^2
    h = tp.backward(ops.reduce_sum(g))[x]  # 6x
    np.testing.assert_allclose(h.value, [6.0, -12.0, 3.0], rtol=1e-15)
    h3 = tp.backward(ops.reduce_sum(h))[x]  # third order: 6
    np.testing.assert_allclose(h3.value, [6.0, 6.0, 6.0], rtol=1e-15)


def test_lazy_tape_has_no_values_but_compiles():
    tp = gt.Tape(eager=False)
    x = tp.param(np.array([1.0, 2.0]))
    y = ops.exp(x)
    with pytest.raises(ValueError, match=r"exp var \[2\] has no eager value: the tape was "
                                         r"created with eager=False"):
        y.value
    loss = ops.reduce_sum(y)
    g = tp.backward(loss)[x]
    out = tp.compile([loss, g]).run()
    np.testing.assert_allclose(out[0], np.exp([1.0, 2.0]).sum(), rtol=1e-15)
    np.testing.assert_allclose(out[1], np.exp([1.0, 2.0]), rtol=1e-15)


def test_eager_and_lazy_tapes_agree_bitwise(rng):
    xa = rng.standard_normal((5, 3))
    res = []
    for eager in (True, False):
        tp = gt.Tape(eager=eager)
        x = tp.param(xa)
        loss = ops.reduce_sum(ops.softmax(x @ x.T, 1) * 2.0)
        res.append(tp.compile([loss, tp.backward(loss)[x]]).run())
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)


def test_repr_names_op_shape_dtype():
    tp = gt.Tape(dtype=np.float32)
    x = tp.param(np.ones((2, 3)))
    assert repr(x) == "Var#0<param [2, 3] float32>"
    assert x.ndim == 2 and x.size == 6 and x.is_leaf and not (x * 2).is_leaf
