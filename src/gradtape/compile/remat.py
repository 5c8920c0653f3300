"""Rematerialization: recompute cheap forward values in backward instead of keeping them.

A forward value that backward reads again (an activation) stays alive from its creation
until the end of backward: for a transformer that is most of peak memory.  When the value
is an elementwise op whose inputs are alive at that later point anyway (or are leaves),
recomputing it there costs one cheap pass (which the fusion pass then folds into the
backward kernels) and frees its memory between forward and backward.  Example: in SwiGLU
``silu(gate) * up`` only ``gate`` and ``up`` need to survive the forward pass.

"Late" uses are those by ops recorded after the value by a later ``Tape.backward`` call
(the tape remembers where each backward began).  The pass returns a new Graph whose op
list holds the clones; the tape is not modified.
"""

from __future__ import annotations

from ..ops import PRIMS
from ..var import Var
from .graph import Graph


def rematerialize(graph: Graph, marks) -> Graph:
    """Clone elementwise forward values at their first use after a backward mark."""
    ops = list(graph.ops)
    if not marks or not ops:
        return graph
    marks = sorted(marks)
    pos = {v: i for i, v in enumerate(ops)}
    users = {}
    for i, v in enumerate(ops):
        for x in v.inputs:
            users.setdefault(x, []).append(i)
    last_use = {x: u[-1] for x, u in users.items()}
    pinned = set(graph.outputs) | {src for _, src in graph.updates}

    def boundary(v):  # the first backward mark after v was recorded, if any
        return next((m for m in marks if m > v.index), None)

    # 1. choose values and the point (op position) where their clone goes
    at = {}  # value -> position of its first late use (the clone is placed before it)
    for v in ops:
        if v in pinned or not PRIMS[v.op].elementwise or v not in users:
            continue
        b = boundary(v)
        if b is None:
            continue
        late = [i for i in users[v] if ops[i].index >= b]
        if not late or len(late) == len(users[v]):
            continue  # no late use, or nothing early: keeping it costs nothing extra
        chain = _recomputable(v, late[0], at, last_use, pinned, depth=2)
        if chain is not None:
            for u in chain:  # v and the inputs it needs recomputed too
                at[u] = min(at.get(u, late[0]), late[0])
    if not at:
        return graph
    # 2. a clone's inputs that are clones themselves must be placed no later than it
    for v in sorted(at, key=lambda v: pos[v], reverse=True):
        for x in v.inputs:
            if x in at and at[x] > at[v]:
                at[x] = at[v]
    before = {}
    for v in sorted(at, key=lambda v: pos[v]):
        before.setdefault(at[v], []).append(v)
    # 3. rewrite: a clone (a new Var) is emitted at its position; ops from there on read
    #    it; every op whose inputs changed becomes a new Var, and so do its consumers
    new_of = {}  # original Var -> the Var that replaces it in the new graph
    active = {}  # value -> its clone, once the clone's position is reached

    def inputs_now(v):
        return tuple(active.get(x, new_of.get(x, x)) for x in v.inputs)

    new_ops = []
    for i, v in enumerate(ops):
        for orig in before.get(i, ()):
            active[orig] = _with_inputs(orig, inputs_now(orig))
            new_ops.append(active[orig])
        ins = inputs_now(v)
        if ins != v.inputs:
            new_of[v] = _with_inputs(v, ins)
        new_ops.append(new_of.get(v, v))
    outputs = tuple(new_of.get(v, v) for v in graph.outputs)
    updates = tuple((leaf, new_of.get(src, src)) for leaf, src in graph.updates)
    return Graph(leaves=graph.leaves, ops=tuple(new_ops), outputs=outputs, updates=updates)


def _with_inputs(v, inputs):
    """A new Var computing ``v``'s op on ``inputs`` (no eager value)."""
    return Var(v.tape, v.index, v.op, inputs, v.attrs, v.shape, v.dtype, None, v.requires_grad)


def _recomputable(v, p, at, last_use, pinned, depth):
    """The values to clone so that ``v`` can be recomputed at position ``p``: ``v``, then
    inputs that are not alive there but are recomputable themselves (up to ``depth``
    levels), or None."""
    chain = [v]
    for x in v.inputs:
        if x.is_leaf or x in at or last_use.get(x, -1) >= p:
            continue
        if depth == 0 or x in pinned or not PRIMS[x.op].elementwise:
            return None
        sub = _recomputable(x, p, at, last_use, pinned, depth - 1)
        if sub is None:
            return None
        chain += sub
    return chain
