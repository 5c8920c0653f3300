"""Fewer, larger GEMMs: two rewrites of a compiled Graph's matmuls (used by the cpu backend).

* **Shared left operand.**  LoRA records ``x @ A_q``, ``x @ A_k``, ``x @ A_v`` (and ``x @
  A_gate``, ``x @ A_up``) on the same ``x``, each ``[T, r]``; backward records ``xᵀ @ g_q``,
  ``xᵀ @ g_k``, ... the same way.  A BLAS call that narrow runs far below peak and costs a
  call each, so matmuls that share ``op(a)`` and produce at most ``max_n`` columns become
  one: ``op(a) @ concat(op(b_i))``, sliced back into the original outputs.  Each output
  column is the same dot product as before (over the same k terms), so the math is
  unchanged; only the BLAS blocking, hence the last bits, may differ.
* **Outer products.**  A matmul with inner dimension 1 (the norms' backward: ``g[T, 1] @
  onesᵀ``) is ``a * b`` broadcast: an elementwise ``mul`` that fuses with the ops around it
  instead of a BLAS call.  One product per element either way: bitwise equal.

Placement: the merged matmul goes right after the last of its inputs is computed; members
are merged only while that point comes before every member's first use (a greedy split
in recording order), so the graph stays in topological order.  The pass returns a new
Graph; the tape is not modified.  The NumPy reference backend does not use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import inner_dim  # (importing ops loads the primitive table)
from ..var import Var
from .graph import Graph


def _new(like, op, inputs, attrs, shape):
    return Var(like.tape, like.index, op, tuple(inputs), dict(attrs), tuple(shape), like.dtype,
               None, like.requires_grad)


@dataclass
class _Rewrites:
    """What the two rewrites decide, before the graph is rebuilt."""
    before: dict = field(default_factory=dict)  # position -> new ops to emit before the op there
    repl: dict = field(default_factory=dict)  # removed matmul -> the Var that replaces it
    removed: set = field(default_factory=set)


def merge_matmuls(graph: Graph, max_n=64, max_total=512) -> Graph:
    """The rewritten graph (``graph`` itself when nothing applies)."""
    ops = list(graph.ops)
    if not ops:
        return graph
    pos = {v: i for i, v in enumerate(ops)}
    rw = _Rewrites()
    _outer_products(ops, pos, rw)
    _merge_shared_left(graph, ops, pos, rw, max_n, max_total)
    if not rw.removed:
        return graph
    return _rebuild(graph, ops, rw)


def _outer_products(ops, pos, rw):
    """1. A 2-d matmul with inner dimension 1 becomes a broadcast ``mul`` (an operand
    given transposed is reshaped to a column / a row first)."""
    for v in ops:
        if v.op != "matmul" or v.ndim != 2 or inner_dim(v) != 1:
            continue
        a, b = v.inputs
        ta, tb = v.attrs.get("ta"), v.attrs.get("tb")
        new = []
        col = a
        if ta:  # a is [1, m]
            col = _new(v, "reshape", (a,), {"shape": (a.shape[1], 1)}, (a.shape[1], 1))
            new.append(col)
        row = b
        if tb:  # b is [n, 1]
            row = _new(v, "reshape", (b,), {"shape": (1, b.shape[0])}, (1, b.shape[0]))
            new.append(row)
        out = _new(v, "mul", (col, row), {}, v.shape)
        new.append(out)
        rw.before.setdefault(pos[v], []).extend(new)
        rw.repl[v] = out
        rw.removed.add(v)


def _merge_shared_left(graph, ops, pos, rw, max_n, max_total):
    """2. Narrow 2-d matmuls (at most ``max_n`` columns) on the same ``op(a)``, grouped,
    then split greedily in recording order into runs of at most ``max_total`` columns
    whose merged matmul can be placed before every member's first use."""
    end = len(ops)
    first_use = {}
    for i, v in enumerate(ops):
        for x in v.inputs:
            first_use.setdefault(x, i)
    for v in list(graph.outputs) + [src for _, src in graph.updates]:
        first_use.setdefault(v, end)
    groups = {}
    for v in ops:
        if v.op != "matmul" or v.ndim != 2 or v in rw.removed or v.shape[1] > max_n:
            continue
        groups.setdefault((v.inputs[0], bool(v.attrs.get("ta")), bool(v.attrs.get("tb"))),
                          []).append(v)
    for (a, ta, tb), members in groups.items():
        sub, width = [], 0
        for m in members:  # recording order
            cand = sub + [m]
            if (width + m.shape[1] <= max_total and
                    max(_in_pos(x, pos) for x in cand) < min(first_use.get(x, end) for x in cand)):
                sub, width = cand, width + m.shape[1]
            else:
                _emit_merged(sub, ta, tb, ops, pos, rw)
                sub, width = [m], m.shape[1]
        _emit_merged(sub, ta, tb, ops, pos, rw)


def _in_pos(v, pos):
    """The position of ``v``'s last computed input (-1: only leaves)."""
    return max((pos.get(x, -1) for x in v.inputs), default=-1)


def _emit_merged(members, ta, tb, ops, pos, rw):
    """``op(a) @ concat(op(b_i))`` sliced back into the members' outputs, placed right
    after the last of their inputs (nothing for fewer than two members)."""
    if len(members) < 2:
        return
    p = max(_in_pos(m, pos) for m in members) + 1
    a = members[0].inputs[0]
    bs = [m.inputs[1] for m in members]
    axis = 0 if tb else 1  # op(b) columns: b's columns, or b's rows when transposed
    n = sum(m.shape[1] for m in members)
    bshape = (n, bs[0].shape[1]) if tb else (bs[0].shape[0], n)
    like = ops[p - 1] if p > 0 else members[0]
    cat = _new(like, "concat", bs, {"axis": axis}, bshape)
    mm = _new(like, "matmul", (a, cat), {"ta": ta, "tb": tb}, (members[0].shape[0], n))
    new = [cat, mm]
    off = 0
    for m in members:
        s = _new(like, "slice", (mm,), {"axis": 1, "start": off, "stop": off + m.shape[1]},
                 m.shape)
        off += m.shape[1]
        new.append(s)
        rw.repl[m] = s
        rw.removed.add(m)
    rw.before.setdefault(p, []).extend(new)


def _rebuild(graph, ops, rw):
    """3. The graph in order: new ops before their position, consumers reading the
    replacements; ``graph`` unchanged where a merge would read a value before it is
    computed."""
    new_of = {}

    def now(x):
        return new_of.get(x, rw.repl.get(x, x))

    out_ops = []

    def take(v):
        ins = tuple(now(x) for x in v.inputs)
        if ins != v.inputs:
            w = _new(v, v.op, ins, v.attrs, v.shape)
            new_of[v] = w
            v = w
        out_ops.append(v)
        return v

    stands_for = {}  # new op -> the removed matmuls it replaces
    for m, r in rw.repl.items():
        stands_for.setdefault(r, []).append(m)
    for i, v in enumerate(ops + [None]):
        for w in rw.before.get(i, ()):
            got = take(w)
            for m in stands_for.get(w, ()):
                rw.repl[m] = got
        if v is not None and v not in rw.removed:
            take(v)
    # every input must be computed before it is read; a merge that chained two groups
    # the wrong way round is dropped as a whole (never a wrong program)
    seen = set(graph.leaves)
    for v in out_ops:
        if any(x not in seen for x in v.inputs):
            return graph
        seen.add(v)
    outputs = tuple(now(v) for v in graph.outputs)
    updates = tuple((leaf, now(src)) for leaf, src in graph.updates)
    return Graph(leaves=graph.leaves, ops=tuple(out_ops), outputs=outputs, updates=updates)
