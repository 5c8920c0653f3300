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
    # update source -> its state leaf: written straight into the leaf's storage, no region
    in_place: dict = field(default_factory=dict)
    # update targets whose state lives in their recorded arrays (the tape's), not a copy
    donated: frozenset = frozenset()

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


def in_place_updates(steps, updates, outputs=(), same_index=lambda step, x, v: False) -> dict:
    """``{src: leaf}`` for the updates ``leaf <- src`` whose source can be written straight
    into the leaf's storage (AdamW's new param and moments: no region for the new value,
    no copy after the run).  ``steps``: ``(step, inputs, outputs)`` in execution order.
    Safe where every step reading the leaf's old value runs before the step writing
    ``src``, or is that step and reads the leaf at each element before writing it there
    (``same_index(step, leaf, src)``: an elementwise kernel over the leaf's shape); never for
    a source that is a leaf or another update's target, nor one feeding two updates, nor
    for a leaf that is itself one of the run's ``outputs`` (read after the run)."""
    targets = {leaf for leaf, _ in updates}
    count = {}
    for _, src in updates:
        count[src] = count.get(src, 0) + 1
    writer, reads = {}, {}
    for i, (_, reads_, writes) in enumerate(steps):
        for v in writes:
            writer[v] = i
        for x in reads_:
            if x in targets:
                reads.setdefault(x, []).append(i)
    out = {}
    for leaf, src in updates:
        k = writer.get(src)
        if (k is None or src.is_leaf or src in targets or count[src] > 1
                or leaf in count or leaf in outputs):
            continue
        if all(i < k or (i == k and same_index(steps[k][0], leaf, src))
               for i in reads.get(leaf, ())):
            out[src] = leaf
    return out


def plan_liveness(steps, pinned, views=None, in_place=None) -> MemoryPlan:
    """Plan regions for ``steps``, a list of ``(inputs, outputs)`` Var tuples in execution
    order; every output gets a region, ``pinned`` ones live to the end.  ``views``: ``{v:
    x}`` for outputs that are the values of ``x`` reshaped: ``v`` shares ``x``'s region
    (where ``x`` has one here), which then lives as long as either, and the step making
    ``v`` has nothing left to do (``views_in_place``).  ``in_place``: ``{src: leaf}``
    (``in_place_updates``), sources that live in their leaf's storage, not here."""
    in_place = dict(in_place or {})
    born, dies = {}, {}
    for i, (inputs, outputs) in enumerate(steps):
        for v in outputs:
            if v not in in_place:
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
    return MemoryPlan(buffer_sizes=tuple(sizes), slot=slot, offset=offset, in_place=in_place)


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


def plan_memory(graph, in_place=False) -> MemoryPlan:
    """One step per op of the graph; ``in_place``: update sources written into their
    leaves where they can be (``in_place_updates``), as a host backend runs them."""
    pinned = set(graph.outputs) | {src for _, src in graph.updates}
    steps = [(v.inputs, (v,)) for v in graph.ops]
    donated = (in_place_updates([(v, v.inputs, (v,)) for v in graph.ops], graph.updates,
                                set(graph.outputs)) if in_place else {})
    return plan_liveness(steps, pinned, in_place=donated)
