"""Memory planning by liveness over the fixed op order.

Every value a program computes gets a region of one arena per dtype, allocated once by
the backend at its final size: a replay allocates nothing.  A value is live from the step
that writes it to the last step that reads it (outputs and update sources to the end:
they are read after the run).  Regions of values whose lives overlap never overlap; a
step's outputs are live while it reads its inputs, so no step writes over what it reads.

Placement is greedy by size (as in TFLite's planner): largest values first, each at the
lowest offset that does not collide with an already placed value it is live with.  On a
transformer step this comes close to the peak of simultaneously live bytes, which simple
buffer reuse (best fit among freed buffers) misses by a wide margin through
fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ops import PRIMS

ALIGN = 16  # elements: 64-byte aligned regions for float32 SIMD (in a page-aligned arena)
# Regions are padded by 0..STAGGER-1 more ALIGN units (by rank in the placement order), so
# that values live together do not all start at the same offset within a 4 KiB page: a
# kernel storing one while loading another at the same page offset stalls on every
# vector (4K aliasing): a SwiGLU kernel over [256, 1536] ran 1.3-1.8x slower with its
# five arrays page-aligned than 1 KiB apart (AMX Xeon, measured).
STAGGER = 61


@dataclass(frozen=True)
class MemoryPlan:
    buffer_sizes: tuple  # (dtype, n_elements) per buffer (one arena per dtype)
    slot: dict  # Var -> buffer index
    offset: dict = field(default_factory=dict)  # Var -> element offset in its buffer

    @property
    def n_buffers(self):
        return len(self.buffer_sizes)

    @property
    def nbytes(self):
        return sum(dt.itemsize * n for dt, n in self.buffer_sizes)

    def view(self, buffers, v):
        """The array of ``v`` inside ``buffers`` (allocated from ``buffer_sizes``)."""
        off = self.offset.get(v, 0)
        return buffers[self.slot[v]][off:off + v.size].reshape(v.shape)


def fused_scratch_bytes(graph) -> int:
    """The largest scratch a fused primitive of ``graph`` allocates while it runs (the
    tiled head's logits block, attention's score tiles), in bytes: outside the plan."""
    return max((PRIMS[v.op].scratch(v) * v.dtype.itemsize for v in graph.ops
                if PRIMS[v.op].scratch is not None), default=0)


def plan_liveness(steps, pinned) -> MemoryPlan:
    """Plan regions for ``steps``, a list of ``(inputs, outputs)`` Var tuples in execution
    order; every output gets a region, ``pinned`` ones live to the end."""
    born, dies = {}, {}
    for i, (inputs, outputs) in enumerate(steps):
        for v in outputs:
            born[v] = dies[v] = i
        for x in inputs:
            if x in born:
                dies[x] = i
    end = len(steps)
    for v in pinned:
        if v in born:
            dies[v] = end
    slot, offset, sizes = {}, {}, []
    by_dtype = {}
    for v in born:
        by_dtype.setdefault(v.dtype, []).append(v)
    for dtype, values in by_dtype.items():
        values.sort(key=lambda v: (-v.size, born[v]))
        n = len(values)
        lo, hi = np.empty(n, np.int64), np.empty(n, np.int64)
        start, stop = np.empty(n, np.int64), np.empty(n, np.int64)
        total = 0
        for k, v in enumerate(values):
            size = (-(-max(v.size, 1) // ALIGN) + (k * 37) % STAGGER) * ALIGN
            b, d = born[v], dies[v]
            # placed values whose lives overlap this one's, in offset order
            hit = np.nonzero((start[:k] <= d) & (stop[:k] >= b))[0]
            off = 0
            if len(hit):
                order = hit[np.argsort(lo[hit], kind="stable")]
                for a, z in zip(lo[order].tolist(), hi[order].tolist()):
                    if a - off >= size:
                        break  # the gap before this region fits
                    off = max(off, z)
            lo[k], hi[k], start[k], stop[k] = off, off + size, b, d
            total = max(total, off + size)
            slot[v], offset[v] = len(sizes), off
        sizes.append((dtype, total))
    return MemoryPlan(buffer_sizes=tuple(sizes), slot=slot, offset=offset)


def plan_memory(graph) -> MemoryPlan:
    """One step per op of the graph."""
    pinned = set(graph.outputs) | {src for _, src in graph.updates}
    return plan_liveness([(v.inputs, (v,)) for v in graph.ops], pinned)
