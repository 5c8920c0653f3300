"""Memory planning by liveness over the fixed op order.

Every intermediate lives in one of a few reusable buffers.  Walking the ops in order, an op's output takes the smallest free
buffer that fits (or grows the largest free one, or opens a new one); after the op, the
buffers of inputs whose last use it was go back to the free list.  The output is placed
before its inputs are released, so an op never writes over what it reads.  Outputs and
update sources keep buffers of their own (they are read after the run).  Buffers are
allocated once, by the backend, at their final sizes: a replay allocates nothing.
"""

from __future__ import annotations

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


def plan_memory(graph) -> MemoryPlan:
    last_use = {}
    for i, v in enumerate(graph.ops):
        for x in v.inputs:
            last_use[x] = i
    pinned = set(graph.outputs) | {src for _, src in graph.updates}
    sizes = []  # [dtype, n] per buffer, grown while planning
    free = []  # buffer indices not holding a live value
    slot = {}
    for i, v in enumerate(graph.ops):
        n = max(v.size, 1)
        fits = [b for b in free if sizes[b][0] == v.dtype and sizes[b][1] >= n]
        same_dtype = [b for b in free if sizes[b][0] == v.dtype]
        if v in pinned:
            b = None
        elif fits:
            b = min(fits, key=lambda b: sizes[b][1])
        elif same_dtype:
            b = max(same_dtype, key=lambda b: sizes[b][1])
            sizes[b][1] = n
        else:
            b = None
        if b is None:
            sizes.append([v.dtype, n])
            b = len(sizes) - 1
        else:
            free.remove(b)
        slot[v] = b
        for x in set(v.inputs):
            if x in slot and last_use[x] == i and x not in pinned:
                free.append(slot[x])
    return MemoryPlan(buffer_sizes=tuple((dt, n) for dt, n in sizes), slot=slot)
