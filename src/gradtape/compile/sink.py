"""Computing a large value late: just before the ops that read it.

Recording order computes a value where the tape recorded it, which can be long before its
first use: a tied LM head's weight gradient ``dlogits^T h`` (``[V, D]``, a copy of the
embedding) is recorded at the start of backward but read only at its end, where the
embedding's own gradient is added to it, so it stays alive through the whole backward.
``sink_large`` moves such an op to just before its first reader (before the reader's other
inputs made since, so that a producer and its one reader stay adjacent) where that
shortens the lives of more bytes than it lengthens: the op's output lives shorter, the
inputs it was the last to read live longer.  Only the order changes: every op computes
what it did, from the same values.  Not moved: an op reading a state leaf whose new value
is not computed from it (that update may be written in place before the reader), one
nothing reads in the graph (an output), one read within ``SINK_SPAN`` ops, or one whose
move would gain nothing.
"""

from __future__ import annotations

import dataclasses


# only values at least this big move: a small one frees little, and moving it away from
# the elementwise chain it was recorded in could split a fused kernel
SINK_MIN = 1 << 22  # bytes
# ... and only past at least this many ops: a value read a few ops later lives briefly
# anyway, and a short move only changes which neighbours run together (products sharing
# an input, which round it to bf16 once)
SINK_SPAN = 64


def _nbytes(v):
    return v.size * v.dtype.itemsize


def _feeds(v, out) -> bool:
    """Whether ``out`` is computed from ``v``: a state leaf that ``v`` reads and whose new
    value ``out`` is then takes that value after ``v`` wherever ``v`` runs."""
    seen, stack = set(), [out]
    while stack:
        x = stack.pop()
        if x is v:
            return True
        if x not in seen and not x.is_leaf:
            seen.add(x)
            stack.extend(x.inputs)
    return False


def sink_large(graph):
    """``graph`` with each large op placed just before its first reader where that frees
    more bytes than it holds (see the module docstring); the candidates are chosen on
    the recorded order, in one pass."""
    ops = list(graph.ops)
    targets = {leaf for leaf, _ in graph.updates}
    keep = set(graph.outputs) | {src for _, src in graph.updates}
    pos = {v: i for i, v in enumerate(ops)}
    first, last = {}, {}
    for i, v in enumerate(ops):
        for x in v.inputs:
            first.setdefault(x, i)
            last[x] = i
    source = dict(graph.updates)
    moves = {}  # op -> the position of the op it goes right before
    for i, v in enumerate(ops):
        c = first.get(v)
        if (c is None or c <= i + 1 or _nbytes(v) < SINK_MIN or v in keep
                or any(x in targets and not _feeds(v, source[x]) for x in v.inputs)):
            continue
        # the reader's other inputs made after v come first: v goes right before them
        at = min([c] + [pos[x] for x in ops[c].inputs if x in pos and i < pos[x] < c])
        longer = sum(_nbytes(x) for x in dict.fromkeys(v.inputs)
                     if not x.is_leaf and last.get(x) == i)
        if at - i > SINK_SPAN and _nbytes(v) > longer:
            moves[v] = at
    if not moves:
        return graph
    before = {}
    for v, at in moves.items():
        before.setdefault(at, []).append(v)
    order = []
    for i, v in enumerate(ops):
        order.extend(before.get(i, ()))
        if v not in moves:
            order.append(v)
    return dataclasses.replace(graph, ops=tuple(order))
