"""The primitive record and the table every primitive is declared in.

A ``Prim`` holds one primitive's shape rule (checked when the op is recorded), its NumPy
forward (writes into a preallocated ``out``; the same function runs eagerly and at
replay, so a replay is bitwise equal to the eager values) and its vector-Jacobian rule
written in tape ops.  ``_prim`` adds a row to ``PRIMS``; ``_rec`` records one application
through the tape that owns the first input.  The axis helpers below are shared by the
shape rules and forwards of several families.  This module declares no primitive itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class ShapeError(ValueError):
    """Raised by a shape rule; the recorder prefixes the op and every input shape."""


@dataclass(frozen=True)
class Prim:
    name: str
    shape: Callable  # (in_shapes, **attrs) -> out shape; raises ShapeError
    forward: Callable  # (out, *inputs, **attrs) -> None; writes into out
    vjp: Callable | None  # (g, out, *inputs, **attrs) -> tuple of thunks / None
    elementwise: bool = False  # out[i] depends only on inputs[i] (after broadcasting)
    index_inputs: tuple = field(default_factory=tuple)  # positions holding integer ids
    block_inputs: tuple = field(default_factory=tuple)  # positions holding a block matrix
    # positions that may hold a float matrix or a block matrix (the fused LM head's table)
    maybe_block_inputs: tuple = field(default_factory=tuple)
    # fused primitives: elements of scratch the forward allocates beyond its output, as a
    # function of the op's Var (the memory estimate adds the largest)
    scratch: Callable | None = None
    # fused primitives: ``(tp, *inputs, **attrs) -> Var``, the same value from composed
    # primitives, for a backend with no kernel of its own (``compile.decompose``)
    decompose: Callable | None = None
    # the output carries no gradient (``detach``): backward never walks into its inputs
    stops_gradient: bool = False


PRIMS: dict[str, Prim] = {}


def _prim(name, shape, forward, vjp, elementwise=False, index_inputs=(), block_inputs=(),
          maybe_block_inputs=(), scratch=None, decompose=None, stops_gradient=False):
    PRIMS[name] = Prim(name, shape, forward, vjp, elementwise, tuple(index_inputs),
                       tuple(block_inputs), tuple(maybe_block_inputs), scratch, decompose,
                       stops_gradient)


def _rec(op, *inputs, **attrs):
    return inputs[0].tape.record(op, inputs, **attrs)


# ---------------------------------------------------------------------------------------
# axis helpers shared by the shape rules and the forwards

def _norm_axis(axis, ndim):
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} out of range for {ndim}-d input")
    return axis % ndim


def _reduce_shape(shape, axis, keepdims):
    if axis is None:
        return tuple(1 for _ in shape) if keepdims else ()
    a = _norm_axis(axis, len(shape))
    if keepdims:
        return shape[:a] + (1,) + shape[a + 1:]
    return shape[:a] + shape[a + 1:]


def _index(ndim, axis, start, stop):
    """The index of ``[start:stop]`` along ``axis`` of an ``ndim``-d array."""
    idx = [slice(None)] * ndim
    idx[axis % ndim] = slice(start, stop)
    return tuple(idx)
