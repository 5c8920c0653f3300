"""Every error path raises ValueError or TypeError at record (or feed) time, with a
message that names the op and every shape involved.  Each test checks the message."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops


def M(s):
    """An exact (escaped) substring pattern for pytest.raises(match=...)."""
    return re.escape(s)


@pytest.fixture
def tp():
    return gt.Tape()


def test_matmul_inner_dims(tp):
    x, w = tp.param(np.ones((7, 24))), tp.param(np.ones((32, 8)))
    with pytest.raises(ValueError, match=M("matmul([7, 24], [32, 8], ta=False, tb=False): "
                                           "inner dims 24 != 32")):
        x @ w
    with pytest.raises(ValueError, match=M("matmul([7, 24], [32, 8], ta=False, tb=True): "
                                           "inner dims 24 != 8")):
        ops.matmul(x, w, tb=True)


def test_matmul_needs_2d(tp):
    x = tp.param(np.ones((7, 24)))
    with pytest.raises(ValueError, match=M("matmul([7, 24], [24], ta=False, tb=False): "
                                           "operands must both be 2-d, or both 3-d")):
        ops.matmul(x, tp.param(np.ones(24)))


def test_batched_matmul_needs_equal_batches(tp):
    a, b = tp.param(np.ones((3, 4, 5))), tp.param(np.ones((2, 5, 6)))
    with pytest.raises(ValueError, match=M("matmul([3, 4, 5], [2, 5, 6], ta=False, tb=False): "
                                           "batch sizes 3 != 2")):
        ops.matmul(a, b)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("other", [(7, 5), (5,), (5, 1), (2, 7, 3)])
def test_broadcast_failure(tp, op, other):
    x = tp.param(np.ones((7, 24)))
    y = tp.param(np.ones(other))
    want = f"{op}([7, 24], [{', '.join(map(str, other))}]): shapes do not broadcast"
    with pytest.raises(ValueError, match=M(want)):
        getattr(ops, op)(x, y)


def test_broadcast_failure_through_operator(tp):
    x = tp.param(np.ones((3, 4)))
    with pytest.raises(ValueError, match=M("mul([3, 4], [3]): shapes do not broadcast")):
        x * np.ones(3)


def test_mixed_tapes(tp):
    other = gt.Tape()
    x, y = tp.param(np.ones((2, 3))), other.param(np.ones((2, 3)))
    with pytest.raises(ValueError, match=M("add([2, 3], [2, 3]): input 1 belongs to another "
                                           "tape")):
        x + y
    with pytest.raises(ValueError, match=M("matmul([2, 3], [3, 2], ta=False, tb=False): "
                                           "input 1 belongs to another tape")):
        x @ other.const(np.ones((3, 2)))
    with pytest.raises(ValueError, match=M("sub([2, 3], [2, 3]): input 0 belongs to another "
                                           "tape")):
        tp.record("sub", (y, x))


def test_float_var_where_ids_expected(tp):
    table = tp.param(np.ones((5, 3)))
    with pytest.raises(TypeError, match=M("take_rows([5, 3], [4]): input 1 has dtype "
                                          "float64, expected integer ids")):
        ops.take_rows(table, tp.const(np.zeros(4)))
    with pytest.raises(TypeError, match=M("pick([5, 3], [5]): input 1 has dtype float64, "
                                          "expected integer ids")):
        ops.pick(table, tp.const(np.zeros(5)))


def test_integer_var_where_floats_expected(tp):
    x = tp.param(np.ones(3))
    ids = tp.const(np.array([0, 1, 2]))
    with pytest.raises(TypeError, match=M("add([3], [3]): input 1 has dtype int64, expected "
                                          "float64 values")):
        x + ids
    with pytest.raises(TypeError, match=M("exp([3]): input 0 has dtype int64, expected "
                                          "float64 values")):
        ops.exp(ids)
    with pytest.raises(TypeError, match=M("take_rows([3], [3]): input 0 has dtype int64, "
                                          "expected float64 values")):
        ops.take_rows(ids, ids)
    tp32 = gt.Tape(np.float32)
    with pytest.raises(TypeError, match=M("mul([2], [2]): input 1 has dtype int64, expected "
                                          "float32 values")):
        tp32.param(np.ones(2)) * tp32.const(np.array([1, 2]))


def test_non_var_input(tp):
    x = tp.param(np.ones(3))
    with pytest.raises(TypeError, match=M("add([3], [3]): input 1 is a ndarray, not a Var")):
        tp.record("add", (x, np.ones(3)))


def test_backward_of_non_scalar(tp):
    x = tp.param(np.ones((7, 24)))
    with pytest.raises(ValueError, match=M("backward: loss must have exactly one element, "
                                           "got shape [7, 24]")):
        tp.backward(ops.exp(x))


def test_backward_of_another_tapes_var(tp):
    other = gt.Tape()
    with pytest.raises(ValueError, match=M("backward: loss must be a Var of this tape")):
        tp.backward(other.param(np.ones(1)))


def test_backward_through_a_non_differentiable_input(tp):
    m = tp.param(np.ones(3))
    a = tp.const(np.ones(3))
    with pytest.raises(ValueError, match=M("backward: select is not differentiable w.r.t. "
                                           "input 0")):
        tp.backward(ops.reduce_sum(ops.select(m, a, a)))


def test_feed_wrong_shape_at_replay(tp):
    x = tp.param(np.ones((7, 24)))
    prog = tp.compile([ops.exp(x)])
    with pytest.raises(ValueError, match=M("run: feed for param leaf #0 [7, 24] got an array "
                                           "of shape [7, 23]")):
        prog.run({x: np.ones((7, 23))})
    with pytest.raises(ValueError, match=M("got an array of shape [168]")):
        prog.run({x: np.ones(168)})


def test_feed_wrong_dtype_at_replay(tp):
    table = tp.param(np.ones((5, 3)))
    ids = tp.const(np.array([0, 1, 2]))
    prog = tp.compile([ops.take_rows(table, ids)])
    with pytest.raises(TypeError, match=M("run: feed for integer leaf #1 [3] got dtype "
                                          "float64")):
        prog.run({ids: np.zeros(3)})
    with pytest.raises(TypeError, match=M("run: feed for leaf #0 got non-numeric dtype <U1")):
        prog.run({table: np.full((5, 3), "a")})


def test_feed_key_not_a_leaf(tp):
    x = tp.param(np.ones(2))
    y = ops.exp(x)
    prog = tp.compile([y])
    with pytest.raises(ValueError, match=M(f"run: feed key {y!r} is not a leaf (param or "
                                           "const) of this program's tape")):
        prog.run({y: np.ones(2)})
    foreign = gt.Tape().param(np.ones(2))
    with pytest.raises(ValueError, match=M(f"run: feed key {foreign!r} is not a leaf")):
        prog.run({foreign: np.ones(2)})


def test_unknown_primitive(tp):
    x = tp.param(np.ones(2))
    with pytest.raises(ValueError, match=r"record: unknown primitive 'gelu'; known: \[.*'add'"):
        tp.record("gelu", (x,))


@pytest.mark.parametrize("axis,start,stop,msg", [
    (1, 3, 30, "slice([7, 24], axis=1, start=3, stop=30): slice [3:30] out of range for dim "
               "1 of size 24"),
    (1, 5, 3, "slice([7, 24], axis=1, start=5, stop=3): slice [5:3] out of range"),
    (0, -1, 3, "slice([7, 24], axis=0, start=-1, stop=3): slice [-1:3] out of range for dim "
               "0 of size 7"),
    (2, 0, 1, "slice([7, 24], axis=2, start=0, stop=1): axis 2 out of range for 2-d input"),
])
def test_bad_slice(tp, axis, start, stop, msg):
    x = tp.param(np.ones((7, 24)))
    with pytest.raises(ValueError, match=M(msg)):
        ops.slice_(x, axis, start, stop)


def test_bad_reshape(tp):
    x = tp.param(np.ones((7, 24)))
    with pytest.raises(ValueError, match=M("reshape([7, 24], shape=(5, 5)): cannot reshape "
                                           "168 elements to [5, 5]")):
        ops.reshape(x, (5, 5))
    with pytest.raises(ValueError, match=M("reshape([7, 24], shape=(-1, 24)): cannot reshape")):
        ops.reshape(x, (-1, 24))


def test_other_shape_rules(tp):
    x = tp.param(np.ones((7, 24)))
    cases = [
        (lambda: ops.sum_to(x, (5,)), "sum_to([7, 24], shape=(5,)): cannot sum [7, 24] down "
                                      "to [5]"),
        (lambda: ops.sum_to(x, (3, 7, 24)), "sum_to([7, 24], shape=(3, 7, 24)): cannot sum"),
        (lambda: ops.broadcast_to(x, (5,)), "broadcast_to([7, 24], shape=(5,)): cannot "
                                            "broadcast [7, 24] to [5]"),
        (lambda: ops.concat([x, tp.param(np.ones((3, 8)))], 1),
         "concat([7, 24], [3, 8], axis=1): all inputs must match except on axis 1"),
        (lambda: ops.transpose(x, (0, 0)), "transpose([7, 24], perm=(0, 0)): perm (0, 0) is "
                                           "not a permutation of 2 axes"),
        (lambda: ops.softmax(x, 2), "softmax([7, 24], axis=2): axis 2 out of range"),
        (lambda: ops.logsumexp(x, -3), "logsumexp([7, 24], axis=-3): axis -3 out of range"),
        (lambda: ops.reduce_sum(x, 2), "sum([7, 24], axis=2, keepdims=False): axis 2 out of "
                                       "range"),
        (lambda: ops.pad(x, 1, -1, 0), "pad([7, 24], axis=1, before=-1, after=0): pad widths "
                                       "must be >= 0"),
        (lambda: ops.concat([], 1), "concat: needs at least one input"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=M(msg)):
            fn()


def test_index_op_shapes(tp):
    x = tp.param(np.ones((7, 24)))
    i3 = tp.const(np.zeros(3, dtype=np.int64))
    i7 = tp.const(np.zeros(7, dtype=np.int64))
    cases = [
        (lambda: ops.pick(x, i3), "pick([7, 24], [3]): expects x [T, V] and idx [T]"),
        (lambda: ops.put(x, i7, 3), "put([7, 24], [7], ncols=3): expects src [T, 1] and idx "
                                    "[T]"),
        (lambda: ops.scatter_rows(x, i3, 3), "scatter_rows([7, 24], [3], nrows=3): expects "
                                             "src [n, d] and ids [n]"),
        (lambda: ops.take_rows(x, tp.const(np.zeros((3, 2), dtype=np.int64))),
         "take_rows([7, 24], [3, 2]): expects a 2-d table and 1-d ids"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=M(msg)):
            fn()


@pytest.mark.parametrize("dtype", [int, np.int32, np.float16, bool])
def test_tape_dtype(dtype):
    want = f"Tape: dtype must be float32 or float64, got {np.dtype(dtype)}"
    with pytest.raises(TypeError, match=M(want)):
        gt.Tape(dtype=dtype)


def test_non_numeric_leaves(tp):
    with pytest.raises(TypeError, match=M("param: needs a numeric array, got dtype <U1")):
        tp.param(np.array(["a"]))
    with pytest.raises(TypeError, match=M("const: needs a numeric array, got dtype <U1")):
        tp.const(np.array(["a"]))


def test_pow_and_operand_types(tp):
    x = tp.param(np.ones(3))
    with pytest.raises(TypeError, match=M("pow: only a constant scalar exponent")):
        x ** x
    with pytest.raises(TypeError, match=M("matmul: cannot combine a Var with list")):
        x @ [1.0, 2.0, 3.0]


def test_compile_errors(tp):
    x = tp.param(np.ones(3))
    w = tp.param(np.ones(2))
    other = gt.Tape().param(np.ones(3))
    with pytest.raises(ValueError, match=M("compile: unknown backend 'tpu'; known backends: ")):
        tp.compile([x], backend="tpu")
    with pytest.raises(ValueError, match=M("compile: output 0 is not a Var of this tape")):
        tp.compile([other])
    with pytest.raises(ValueError, match=M("compile: update targets must be leaves of this "
                                           "tape")):
        tp.compile([x], updates={ops.exp(x): x})
    with pytest.raises(ValueError, match=M(f"compile: update of {x!r} from {w!r}: shape or "
                                           "dtype differs")):
        tp.compile([x], updates={x: w})
    with pytest.raises(ValueError, match=M("compile: update sources must be Vars of this "
                                           "tape")):
        tp.compile([x], updates={x: other})


def test_nn_errors(tp):
    q = tp.param(np.ones((4, 24)))
    with pytest.raises(ValueError, match=M("attention: nh=3 is not a multiple of nkv=2")):
        nn.gqa_attention(tp, q, q, q, None, None, None, 4, 3, 2, 8, 1.0)
    with pytest.raises(ValueError, match=M("nn: 5 values do not fill shape [2, 3]")):
        nn.const(tp, np.ones(5), 2, 3)
    with pytest.raises(ValueError, match=M("nn: 4 values do not fill shape [3]")):
        nn.param(tp, np.ones(4), 0, 3)


def test_missing_gradient_rule_names_the_op(tp, monkeypatch):
    from gradtape.ops import PRIMS, Prim
    monkeypatch.setitem(PRIMS, "floor", Prim("floor", lambda s: s[0],
                                             lambda out, x: np.floor(x, out=out), None))
    x = tp.param(np.array([1.5, 2.5]))
    y = tp.record("floor", (x,))
    np.testing.assert_array_equal(y.value, [1.0, 2.0])
    with pytest.raises(ValueError, match=M("backward: primitive 'floor' has no gradient rule")):
        tp.backward(ops.reduce_sum(y))
