"""Decomposition: a fused primitive becomes its composed primitives, for a backend with no
kernel for it.

A fused primitive (``ops.head_nll``, ``ops.attn`` and their gradients) declares
``decompose(tp, *inputs, **attrs)``: the same value recorded from ordinary primitives.
Layers record the fused op whatever the backend; a backend that cannot run it (its
``has_kernel(op)`` says no, or it has no ``has_kernel``) gets the composed ops instead,
with the memory they need (the ``[T, V]`` logits, the ``[T, T]`` scores).

The rule is recorded on a scratch tape over placeholder leaves (zero-stride views: no
memory) standing for the op's inputs, then its ops are copied into the graph in the
op's place.  They take fractional indices between the op's and the next (the passes
order and place ops by index), and the placeholders map back to the real inputs.  The
tape is not modified; the pass returns a new Graph.
"""

from __future__ import annotations

import numpy as np

from ..ops import PRIMS
from ..var import Var
from .graph import Graph


def _placeholder(tp, x):
    view = np.broadcast_to(np.zeros((), x.dtype), x.shape)
    float_input = np.issubdtype(x.dtype, np.floating)
    v = Var(tp, len(tp.vars), "param" if float_input else "const", (), dict(x.attrs),
            tuple(x.shape), x.dtype, view, float_input)
    tp.vars.append(v)
    return v


def _expand(v):
    """``(ops, result)``: the composed ops replacing ``v``, as Vars of ``v``'s tape whose
    inputs are ``v``'s inputs or each other, and the one standing for ``v``."""
    tp = type(v.tape)(v.dtype, eager=False)  # a scratch tape of the graph's own kind
    ph = [_placeholder(tp, x) for x in v.inputs]
    res = PRIMS[v.op].decompose(tp, *ph, **v.attrs)
    needed, stack = set(), [res]
    while stack:  # only what the result reads (a rule's backward records more)
        u = stack.pop()
        if u not in needed:
            needed.add(u)
            stack.extend(u.inputs)
    mapped = dict(zip(ph, v.inputs))
    body = [u for u in tp.vars if u in needed and u not in mapped]
    out = []
    for n, u in enumerate(body):
        index = v.index + (n + 1) / (len(body) + 1)
        if u.is_leaf:  # a const the rule made (a mask, a ones column)
            w = Var(v.tape, index, u.op, (), dict(u.attrs), u.shape, u.dtype, u._value, False)
        else:
            w = Var(v.tape, index, u.op, tuple(mapped[x] for x in u.inputs), dict(u.attrs),
                    u.shape, u.dtype, None, v.requires_grad)
            out.append(w)
        mapped[u] = w
    if res.shape != v.shape:
        raise AssertionError(f"decompose {v.op}: {res.shape} != {v.shape}")
    return out, [mapped[u] for u in body if u.is_leaf], mapped[res]


def decompose(graph: Graph, has_kernel=None) -> Graph:
    """The graph with every fused op ``has_kernel`` refuses replaced by composed ops."""
    todo = [v for v in graph.ops if PRIMS[v.op].decompose is not None
            and not (has_kernel and has_kernel(v.op))]
    if not todo:
        return graph
    repl, new_ops, leaves = {}, [], list(graph.leaves)
    for v in graph.ops:
        ins = tuple(repl.get(x, x) for x in v.inputs)
        if ins != v.inputs:
            v2 = Var(v.tape, v.index, v.op, ins, v.attrs, v.shape, v.dtype, None,
                     v.requires_grad)
        else:
            v2 = v
        if v in todo:
            ops, consts, res = _expand(v2)
            new_ops.extend(ops)
            leaves.extend(consts)
            repl[v] = res
        else:
            if v2 is not v:
                repl[v] = v2
            new_ops.append(v2)
    return Graph(leaves=tuple(sorted(leaves, key=lambda x: x.index)), ops=tuple(new_ops),
                 outputs=tuple(repl.get(v, v) for v in graph.outputs),
                 updates=tuple((leaf, repl.get(src, src)) for leaf, src in graph.updates))
