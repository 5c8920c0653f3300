"""The next-token loss and its gradient, next to each other.

A training step records ``nll_ids(logits, ids)`` in forward and ``nll_ids_grad(g, logits,
ids)`` in backward; each reads the whole ``[T, V]`` logits (50 MB for SmolLM2 at T=256),
which no cache holds between the two.  Where ``g`` does not depend on the loss's value
(SFT: ``g`` is the loss weights times the seed; not DPO, whose ``g`` is a function of the
log-probabilities), ``pair_loss_grads`` places the gradient, with the ops ``g`` is made
of, right after the loss, so that a backend can compute both in one pass over each row
(the cpu backend: ``fuse.loss_pairs``, ``codegen.row_kernel_body``).  Only the order
changes: every op computes what it did, from the same values.
"""

from __future__ import annotations

import dataclasses


def pair_loss_grads(graph):
    """``graph`` with each ``nll_ids_grad`` that does not depend on its ``nll_ids`` (same
    logits and ids) placed right after it, preceded by the ops between them it needs."""
    ops = list(graph.ops)
    for d in [v for v in ops if v.op == "nll_ids_grad"]:
        pos = {v: i for i, v in enumerate(ops)}
        _, x, ids = d.inputs
        n = next((v for v in ops[:pos[d]] if v.op == "nll_ids" and v.inputs == (x, ids)),
                 None)
        if n is None or pos[d] == pos[n] + 1:
            continue
        lo = pos[n]
        need, stack = set(), [d]
        while stack:  # what d reads that is made between n and d (n itself: no pair)
            for u in stack.pop().inputs:
                if u in pos and pos[u] >= lo and u not in need:
                    need.add(u)
                    stack.append(u)
        if n in need:
            continue
        between = ops[lo + 1:pos[d]]
        ops = (ops[:lo] + [v for v in between if v in need] + [n, d]
               + [v for v in between if v not in need] + ops[pos[d] + 1:])
    if ops == list(graph.ops):
        return graph
    return dataclasses.replace(graph, ops=tuple(ops))
