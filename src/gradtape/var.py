"""``Var``: one value on a tape, a leaf or the output of one recorded op.

A Var is what layers pass around and what the compiler's passes and the backends read:
its op, inputs, attrs, shape and dtype (and its eager value where the tape has one).
Operator overloading records ops through ``ops`` on the tape that owns the operand.
This module records nothing itself and knows nothing of compilation; ``tape.py`` owns
recording and differentiation.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import ops

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
LEAF_OPS = ("param", "const")


def fmt_shape(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


class Var:
    """One value on a tape: a leaf or the output of one recorded op.

    Hashable by identity; ``==`` is not overloaded.
    """

    __slots__ = ("tape", "index", "op", "inputs", "attrs", "shape", "dtype", "_value",
                 "requires_grad", "__weakref__")
    # numpy defers to our reflected operators (np_array + var -> Var.__radd__)
    __array_ufunc__ = None

    def __init__(self, tape, index, op, inputs, attrs, shape, dtype, value, requires_grad):
        self.tape = tape
        self.index = index
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.shape = shape
        self.dtype = dtype
        self._value = value
        self.requires_grad = requires_grad

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def is_leaf(self):
        return self.op in LEAF_OPS

    @property
    def value(self) -> np.ndarray:
        if self._value is None:
            raise ValueError(f"{self.op} var {fmt_shape(self.shape)} has no eager value: the "
                             "tape was created with eager=False; compile and run it instead")
        return self._value

    def __array__(self, dtype=None, copy=None):
        v = self.value
        return v.astype(dtype) if dtype is not None else v

    def __repr__(self):
        return f"Var#{self.index}<{self.op} {fmt_shape(self.shape)} {self.dtype}>"

    # --- operator overloading: each records ops on the tape that owns the operand ---
    def __add__(self, o):
        return ops.addc(self, o) if is_scalar(o) else ops.add(self, self.tape._lift(o, "add"))

    def __radd__(self, o):
        return ops.addc(self, o) if is_scalar(o) else ops.add(self.tape._lift(o, "add"), self)

    def __sub__(self, o):
        return ops.addc(self, -o) if is_scalar(o) else ops.sub(self, self.tape._lift(o, "sub"))

    def __rsub__(self, o):
        if is_scalar(o):
            return ops.addc(ops.neg(self), o)
        return ops.sub(self.tape._lift(o, "sub"), self)

    def __mul__(self, o):
        return ops.scale(self, o) if is_scalar(o) else ops.mul(self, self.tape._lift(o, "mul"))

    def __rmul__(self, o):
        return ops.scale(self, o) if is_scalar(o) else ops.mul(self.tape._lift(o, "mul"), self)

    def __truediv__(self, o):
        if is_scalar(o):
            return ops.scale(self, 1.0 / o)
        return ops.div(self, self.tape._lift(o, "div"))

    def __rtruediv__(self, o):
        return ops.div(self.tape._lift(o, "div"), self)

    def __pow__(self, p):
        if not is_scalar(p):
            raise TypeError("pow: only a constant scalar exponent is supported")
        return ops.powc(self, p)

    def __neg__(self):
        return ops.neg(self)

    def __matmul__(self, o):
        return ops.matmul(self, self.tape._lift(o, "matmul"))

    def __rmatmul__(self, o):
        return ops.matmul(self.tape._lift(o, "matmul"), self)

    @property
    def T(self):
        return ops.transpose(self)


def is_blocks(v) -> bool:
    """Whether ``v`` is a block-matrix const (``Tape.const_blocks``)."""
    return isinstance(v, Var) and v.dtype == np.uint8 and "qtype" in v.attrs


def is_scalar(o):
    return isinstance(o, numbers.Real) and not isinstance(o, bool) or (
        isinstance(o, np.generic) and np.issubdtype(type(o), np.floating))
