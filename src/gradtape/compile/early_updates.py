"""Running what follows backward as soon as its inputs are ready.

The ops recorded after the last ``backward`` (clipping's and the norm's sums, AdamW) read
each gradient once; in recording order they all run at the end, so every gradient stays
alive until then (a full step: a copy of every weight).  ``early_updates`` moves each such
op to just after the last op it waits for: the producers of its inputs, and the last op
before it that reads the old value of a state leaf it reads (AdamW's new param is written
into the param's own storage, ``memplan.in_place_updates``).  An op that reads only leaves
(``m * beta1``) runs just before its first consumer, so nothing is computed long before it
is needed.  Only the order changes: every op computes what it did, in the same
arithmetic.  With clipping, each update waits for the global norm, hence for every
gradient: the reorder then saves nothing, and costs nothing.
"""

from __future__ import annotations

import dataclasses


def early_updates(graph):
    """``graph`` with its post-backward ops placed as early as their inputs allow."""
    ends = graph.ops[0].tape.backward_ends if graph.ops else []
    if not ends:
        return graph
    ops = list(graph.ops)
    tail = [v for v in ops if v.index >= ends[-1]]
    if not tail:
        return graph
    tail_set = set(tail)
    if any(x in tail_set for v in ops if v not in tail_set for x in v.inputs):
        return graph  # a pass placed an op that reads the tail before it: keep the order
    pos = {v: i for i, v in enumerate(ops)}
    targets = {leaf for leaf, _ in graph.updates}
    last_reader = {}  # state leaf -> position of the last op before the tail reading it
    for v in ops:
        if v not in tail_set:
            for x in v.inputs:
                if x in targets:
                    last_reader[x] = pos[v]
    # anchor: the position of the op after which a tail op runs (-1: before all)
    anchor, free = {}, set()
    for v in tail:
        a, waits = -1, False
        for x in v.inputs:
            if x in tail_set:
                if x not in free:
                    waits = True
                a = max(a, anchor[x])
            elif x.is_leaf:
                a = max(a, last_reader.get(x, -1))
            else:
                a, waits = max(a, pos[x]), True
        anchor[v] = a
        if not waits:
            free.add(v)
    consumers = {}
    for v in tail:
        for x in v.inputs:
            if x in tail_set:
                consumers.setdefault(x, []).append(v)
    for v in reversed(tail):  # an op of leaves only: just before its first consumer
        if v in free and consumers.get(v):
            anchor[v] = max(anchor[v], min(anchor[c] for c in consumers[v]))
    for v in tail:  # never before what it reads
        for x in v.inputs:
            if x in tail_set:
                anchor[v] = max(anchor[v], anchor[x])
    after = {}
    for v in tail:
        after.setdefault(anchor[v], []).append(v)
    order = list(after.get(-1, ()))
    for i, v in enumerate(ops):
        if v not in tail_set:
            order.append(v)
            order.extend(after.get(i, ()))
    return dataclasses.replace(graph, ops=tuple(order))
