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
# vector (4K aliasing).
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
    """The scratch of ``graph``'s fused primitives, in bytes, outside the plan: the fused
    head's (its logits block, products, dequantized rows), which the cpu backend keeps
    from call to call (its ``CTiles.buffer``), and the largest other one's
    (attention's score tiles), allocated while it runs."""
    kept, other = [0], [0]
    for v in graph.ops:
        if PRIMS[v.op].scratch is not None:
            (kept if v.op.startswith("head_nll") else other).append(
                PRIMS[v.op].scratch(v) * v.dtype.itemsize)
    return max(kept) + max(other)


def plan_liveness(steps, pinned, views=None) -> MemoryPlan:
    """Plan regions for ``steps``, a list of ``(inputs, outputs)`` Var tuples in execution
    order; every output gets a region, ``pinned`` ones live to the end.  ``views``: ``{v:
    x}`` for outputs that are the values of ``x`` reshaped: ``v`` shares ``x``'s region
    (where ``x`` has one here), which then lives as long as either, and the step making
    ``v`` has nothing left to do (``views_in_place``)."""
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
    views = views or {}
    root = {}  # a view -> the value whose region it shares
    for v in born:
        r = v
        while r in views and views[r] in born:
            r = views[r]
        if r is not v:
            root[v] = r
            dies[r] = max(dies[r], dies[v])
    slot, offset, sizes = {}, {}, []
    by_dtype = {}
    for v in born:
        if v not in root:
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
    for v, r in root.items():
        slot[v], offset[v] = slot[r], offset[r]
    return MemoryPlan(buffer_sizes=tuple(sizes), slot=slot, offset=offset)


def reshape_views(steps):
    """``{v: x}`` for the steps that are a lone ``reshape`` of a computed value: ``x``'s
    region in a row-major arena already holds ``v`` (``plan_liveness``'s ``views``)."""
    return {s: s.inputs[0] for s in steps
            if getattr(s, "op", None) == "reshape" and not s.inputs[0].is_leaf}


def views_in_place(step, values) -> bool:
    """Whether ``step`` is a reshape the plan put on its input's region (nothing to run;
    ``values``: Var -> its array)."""
    return (getattr(step, "op", None) == "reshape"
            and values[step].ctypes.data == values[step.inputs[0]].ctypes.data)


def plan_memory(graph) -> MemoryPlan:
    """One step per op of the graph."""
    pinned = set(graph.outputs) | {src for _, src in graph.updates}
    return plan_liveness([(v.inputs, (v,)) for v in graph.ops], pinned)
