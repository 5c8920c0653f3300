"""Memory planning by liveness over the fixed op order.

Every intermediate lives in one of a few reusable buffers.  Walking the ops in order, an op's output takes the smallest free
buffer that fits (or grows the largest free one, or opens a new one); after the op, the
buffers of inputs whose last use it was go back to the free list.  The output is placed
before its inputs are released, so an op never writes over what it reads.  Outputs and
update sources keep buffers of their own (they are read after the run).  Buffers are
allocated once, by the backend, at their final sizes: a replay allocates nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    buffer_sizes: tuple  # (dtype, n_elements) per buffer
    slot: dict  # op Var -> buffer index; the Var's value is buffer[:size].reshape(shape)

    @property
    def n_buffers(self):
        return len(self.buffer_sizes)

    @property
    def nbytes(self):
        return sum(dt.itemsize * n for dt, n in self.buffer_sizes)


class _Pool:
    """Free buffers per dtype, kept sorted by size: best fit in O(log n)."""

    def __init__(self):
        self.sizes = []  # [dtype, n] per buffer, grown while planning
        self.free = {}  # dtype -> sorted list of (n, buffer index)

    def take(self, dtype, n):
        free = self.free.setdefault(dtype, [])
        i = bisect.bisect_left(free, (n, -1))
        if i < len(free):  # the smallest free buffer that fits
            _, b = free.pop(i)
        elif free:  # none fits: grow the largest free one
            _, b = free.pop()
            self.sizes[b][1] = n
        else:
            return self.new(dtype, n)
        return b

    def new(self, dtype, n):
        self.sizes.append([dtype, n])
        return len(self.sizes) - 1

    def give_back(self, b):
        dtype, n = self.sizes[b]
        bisect.insort(self.free.setdefault(dtype, []), (n, b))


def plan_liveness(steps, pinned) -> MemoryPlan:
    """Plan buffers for ``steps``, a list of ``(inputs, outputs)`` Var tuples in execution
    order; every output gets a buffer (``pinned`` ones a buffer of their own)."""
    last_use = {}
    for i, (inputs, _) in enumerate(steps):
        for x in inputs:
            last_use[x] = i
    pool, slot = _Pool(), {}
    for i, (inputs, outputs) in enumerate(steps):
        for v in outputs:
            n = max(v.size, 1)
            slot[v] = pool.new(v.dtype, n) if v in pinned else pool.take(v.dtype, n)
        for x in set(inputs):
            if x in slot and last_use[x] == i and x not in pinned:
                pool.give_back(slot[x])
        for v in outputs:  # an output nothing reads frees at once
            if v not in last_use and v not in pinned:
                pool.give_back(slot[v])
    return MemoryPlan(buffer_sizes=tuple((dt, n) for dt, n in pool.sizes), slot=slot)


def plan_memory(graph) -> MemoryPlan:
    """One step per op of the graph."""
    pinned = set(graph.outputs) | {src for _, src in graph.updates}
    return plan_liveness([(v.inputs, (v,)) for v in graph.ops], pinned)
