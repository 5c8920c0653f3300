"""The tape: recording ops as Vars, and reverse-mode differentiation as more ops.

A ``Tape`` holds Vars in recording order (which is a topological order).  Leaves are
``param`` (trainable) or ``const``; every other Var is one application of a primitive
from ``ops.PRIMS``.  Shapes and dtypes are checked when an op is recorded, never at replay.
``backward`` walks the tape once in reverse, asks each primitive's VJP rule for its
inputs' gradients, reduces broadcast gradients, and sums contributions — all by recording
ops, so the gradients are graph that compiles and replays like any other op.

``Var`` itself lives in ``var.py``.  The tape is the core: it imports neither
``gradtape.compile`` nor any backend.  ``Tape.compile`` reaches them through one door,
``plan.compile_tape``, imported only when a tape compiles.
"""

from __future__ import annotations

import numpy as np

from . import ops
from .blocks import BlockMatrix
from .ops import PRIMS, ShapeError
from .var import FLOAT_DTYPES, Var, is_scalar, fmt_shape, is_blocks


class Tape:
    """Records ops; differentiates them; compiles them into replayable programs.

    ``dtype`` is the float dtype of every value on the tape (float64 or float32).  With
    ``eager=True`` (the default) every recorded op is also evaluated with NumPy at once.
    """

    def __init__(self, dtype=np.float64, eager=True):
        dtype = np.dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"Tape: dtype must be float32 or float64, got {dtype}")
        self.dtype = dtype
        self.eager = eager
        self.vars: list[Var] = []
        self.backward_marks: list[int] = []  # where each backward call began recording
        self.backward_ends: list[int] = []  # and where it ended (what follows: the update)
        self.checkpoints: list[Var] = []  # kept values a checkpointed compile recomputes from

    # --- leaves ---
    def param(self, value) -> Var:
        """A trainable leaf: ``backward`` derives its gradient."""
        arr = np.asarray(value)
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"param: needs a numeric array, got dtype {arr.dtype}")
        return self._leaf("param", np.array(arr, dtype=self.dtype), True)

    def const(self, value) -> Var:
        """A constant leaf.  Integer arrays stay integer (token ids, targets).

        An array already of the tape's dtype is shared, not copied (frozen model weights
        are large): do not modify it afterwards.
        """
        if isinstance(value, BlockMatrix):
            return self.const_blocks(value)
        arr = np.asarray(value)
        if np.issubdtype(arr.dtype, np.integer):
            return self._leaf("const", np.asarray(arr, dtype=np.int64), False)
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"const: needs a numeric array, got dtype {arr.dtype}")
        return self._leaf("const", np.asarray(arr, dtype=self.dtype), False)

    def const_blocks(self, bm: BlockMatrix) -> Var:
        """A frozen weight kept in its stored type: a const leaf of dtype uint8 holding
        the raw blocks ``[rows, row_bytes]`` (shared, never copied), with the ggml type
        and the logical ``[rows, k]`` shape in its attrs.  Only the block primitives
        (``ops.qmatmul``, ``qmatmul_t``, ``qtake_rows``) read it."""
        if not isinstance(bm, BlockMatrix):
            raise TypeError(f"const_blocks: needs a BlockMatrix, got {type(bm).__name__}")
        return self._leaf("const", bm.data, False, {"qtype": bm.qtype, "logical": bm.shape})

    def _leaf(self, op, arr, requires_grad, attrs=None):
        v = Var(self, len(self.vars), op, (), attrs or {}, tuple(arr.shape), arr.dtype, arr,
                requires_grad)
        self.vars.append(v)
        return v

    def _lift(self, o, opname):
        """An operand of an overloaded operator: a Var of this tape, or an array -> const."""
        if isinstance(o, Var):
            return o
        if isinstance(o, np.ndarray) or is_scalar(o):
            return self.const(np.asarray(o, dtype=self.dtype))
        raise TypeError(f"{opname}: cannot combine a Var with {type(o).__name__}")

    # --- recording ---
    def record(self, op, inputs, **attrs) -> Var:
        """Append one application of primitive ``op``; check shapes and dtypes now."""
        prim = PRIMS.get(op)
        if prim is None:
            raise ValueError(f"record: unknown primitive {op!r}; known: {sorted(PRIMS)}")
        shapes = [getattr(x, "shape", None) for x in inputs]

        def where():
            desc = ", ".join(fmt_shape(s) if s is not None else type(x).__name__
                             for x, s in zip(inputs, shapes))
            extra = "".join(f", {k}={v}" for k, v in attrs.items())
            return f"{op}({desc}{extra})"

        for i, x in enumerate(inputs):
            if not isinstance(x, Var):
                raise TypeError(f"{where()}: input {i} is a {type(x).__name__}, not a Var")
            if x.tape is not self:
                raise ValueError(f"{where()}: input {i} belongs to another tape "
                                 "(Vars of two tapes cannot be mixed)")
            if i in prim.maybe_block_inputs and is_blocks(x):
                continue
            if i in prim.block_inputs:
                if not is_blocks(x):
                    raise TypeError(f"{where()}: input {i} must be a block matrix const "
                                    f"(Tape.const_blocks), got a {x.op} of dtype {x.dtype}")
                continue
            if is_blocks(x):
                raise TypeError(f"{where()}: input {i} is a block matrix ({x.attrs['qtype']} "
                                f"{fmt_shape(x.attrs['logical'])}); only qmatmul, qmatmul_t, "
                                "qtake_rows and the fused head (head_nll) read one")
            want_int = i in prim.index_inputs
            if want_int != np.issubdtype(x.dtype, np.integer):
                kind = "integer ids" if want_int else f"{self.dtype} values"
                raise TypeError(f"{where()}: input {i} has dtype {x.dtype}, expected {kind}")
        try:
            shape = tuple(int(d) for d in prim.shape(shapes, **attrs))
        except ShapeError as e:
            raise ValueError(f"{where()}: {e}") from None
        value = None
        if self.eager:
            value = np.empty(shape, self.dtype)
            prim.forward(value, *(x.value for x in inputs), **attrs)
        requires_grad = not prim.stops_gradient and any(x.requires_grad for x in inputs)
        v = Var(self, len(self.vars), op, tuple(inputs), attrs, shape, self.dtype, value,
                requires_grad)
        self.vars.append(v)
        return v

    # --- differentiation ---
    def backward(self, loss: Var) -> dict:
        """Record the gradient of the one-element ``loss`` w.r.t. every param it depends on.

        Returns ``{param Var: gradient Var}``; the gradients are ops on this tape.
        """
        if not isinstance(loss, Var) or loss.tape is not self:
            raise ValueError("backward: loss must be a Var of this tape")
        if loss.size != 1:
            raise ValueError(f"backward: loss must have exactly one element, got shape "
                             f"{fmt_shape(loss.shape)}")
        grads = {loss: self.const(np.ones(loss.shape, self.dtype))}
        self.backward_marks.append(len(self.vars))
        out = {}
        for v in reversed(self.vars[:loss.index + 1]):
            g = grads.pop(v, None)
            if g is None or not v.requires_grad:
                continue
            if v.op == "param":
                out[v] = g
                continue
            rule = PRIMS[v.op].vjp
            if rule is None:
                raise ValueError(f"backward: primitive {v.op!r} has no gradient rule")
            thunks = rule(g, v, *v.inputs, **v.attrs)
            for i, (x, thunk) in enumerate(zip(v.inputs, thunks)):
                if not x.requires_grad:
                    continue
                if thunk is None:
                    raise ValueError(f"backward: {v.op} is not differentiable w.r.t. input {i}")
                gx = thunk()
                if gx.shape != x.shape:  # the input was broadcast: sum over those axes
                    gx = ops.sum_to(gx, x.shape)
                grads[x] = ops.add(grads[x], gx) if x in grads else gx
        self.backward_ends.append(len(self.vars))
        # keep the params' recording order, which callers find natural
        return dict(sorted(out.items(), key=lambda kv: kv[0].index))

    def checkpoint(self, v: Var) -> Var:
        """Mark ``v`` (a layer's input rows) as a checkpoint: compiled with
        ``checkpoint=True``, backward recomputes the forward values it needs from the
        checkpoints instead of keeping them (``compile.checkpoint``).  Returns ``v``."""
        if not isinstance(v, Var) or v.tape is not self:
            raise ValueError("checkpoint: needs a Var of this tape")
        self.checkpoints.append(v)
        return v

    # --- compilation ---
    def compile(self, outputs, backend="numpy", updates=None, compute="float32",
                checkpoint=False, plan=None, donate=(), arena=None):
        """Compile the ops ``outputs`` need into a replayable ``Program``.

        ``updates`` ({leaf: Var}) makes state: after each run the leaf takes the Var's
        new value (parameters and optimizer moments in a replayed training step).
        ``compute="bf16"``: the cpu backend runs GEMMs against frozen float32 weights
        with bf16 inputs and float32 accumulation (see ``backends.cpu.measure``).
        ``checkpoint=True``: recompute forward values in backward from the values marked
        with ``Tape.checkpoint`` (activation checkpointing; same values, less memory); a
        number n: only those of the first n marked layers, the others keep theirs.
        ``donate``: update targets whose recorded arrays a host backend keeps the state in
        instead of a copy (a full step's params: a copy of every weight less); those
        leaves' values on the tape then change with every run.
        ``arena``: a ``backends.base.SharedArena`` shared by programs that never run at
        the same time (a training step and its eval program): their intermediates take
        the largest one's memory instead of the sum (host backends; others ignore it).
        """
        from .plan import compile_tape  # the core's one door upward (see the module doc)
        return compile_tape(self, outputs, backend, updates, compute, checkpoint, plan,
                            donate, arena)
