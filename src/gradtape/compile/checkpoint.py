"""Activation checkpointing: recompute the forward of each layer in backward instead of
keeping its activations.

Without it, every forward value that backward reads again stays alive from its creation
to its use in backward: for a transformer at long context that is most of the memory.
With it, only the values the tape marks as checkpoints (``Tape.checkpoint``: each layer's
input rows) survive the forward pass; every other forward value backward reads is cloned
just before its first use after the first backward mark, together with the forward ops it
needs, back to checkpoints, leaves and the program's outputs.  Backward then walks the
layers in reverse, so one layer's recomputed activations are alive at a time; the price
is about one more forward pass.  The clones are the same ops on the same inputs: the
values, hence every gradient, are bitwise those of the graph without checkpointing.

Unlike ``remat`` (cheap elementwise values, a few levels deep), any op is recomputed here,
GEMMs and the tiled attention included.

Checkpointing can stop part way: with ``layers`` = n, only the first n checkpointed layers
are recomputed, and every forward value from the n-th checkpoint on (the last layers, the
head) stays as without checkpointing.  Backward reaches the last layers first, so their
kept activations are freed before the recomputed layers need room: memory falls by
about a layer's activations for each layer recomputed, and time rises by about a
layer's forward (``TrainStep``'s ``auto`` recomputes the fewest layers that fit).

The pass returns a new Graph; the tape is not modified.
"""

from __future__ import annotations

from .graph import Graph
from .remat import _with_inputs


def checkpoint(graph: Graph, marks, keep, layers=None) -> Graph:
    """Recompute every forward value read after the first backward mark from ``keep``
    (checkpoint Vars, one per layer in forward order), leaves and pinned values; with
    ``layers`` (0 to ``len(keep)``; None: all), only those computed before the
    ``layers``-th checkpoint."""
    ops = list(graph.ops)
    if layers is None:
        layers = len(keep)
    if not marks or not ops or not keep or layers <= 0:
        return graph
    first = min(marks)
    start = next((i for i, v in enumerate(ops) if v.index >= first), None)
    if start is None:
        return graph
    pos = {v: i for i, v in enumerate(ops)}
    # the forward values recomputed: those before the first layer kept whole (counting
    # the checkpoints of this graph only: a tape can hold another program's too)
    end = min((pos[v] for v in [v for v in keep if v in pos][layers:]), default=start)
    forward = set(ops[:min(start, end)])
    stays = set(keep) | set(graph.outputs) | {src for _, src in graph.updates}

    def cloned(x):
        return x in forward and x not in stays

    # 1. the position of each clone: its value's first use in backward, or earlier where
    #    a later clone reads it
    at = {}
    for i in range(start, len(ops)):
        for x in ops[i].inputs:
            if cloned(x) and x not in at:
                at[x] = i
    for v in reversed(ops[:start]):  # consumers before producers
        if v in at:
            for x in v.inputs:
                if cloned(x) and at.get(x, len(ops)) > at[v]:
                    at[x] = at[v]
    if not at:
        return graph
    before = {}
    for v in sorted(at, key=lambda v: pos[v]):  # producers first at each position
        before.setdefault(at[v], []).append(v)
    # 2. rewrite: from each clone's position on, backward reads the clone
    clone, new_of, new_ops = {}, {}, []

    def now(x):
        return clone.get(x, new_of.get(x, x))

    for i, v in enumerate(ops):
        for orig in before.get(i, ()):
            clone[orig] = _with_inputs(orig, tuple(now(x) for x in orig.inputs))
            new_ops.append(clone[orig])
        if i >= start:
            ins = tuple(now(x) for x in v.inputs)
            if ins != v.inputs:
                new_of[v] = _with_inputs(v, ins)
        new_ops.append(new_of.get(v, v))
    return Graph(leaves=graph.leaves, ops=tuple(new_ops),
                 outputs=tuple(new_of.get(v, v) for v in graph.outputs),
                 updates=tuple((leaf, new_of.get(src, src)) for leaf, src in graph.updates))
