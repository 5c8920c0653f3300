"""The NumPy backend: the reference definition of every primitive.

Leaves live in storage the backend owns (a copy is made only for leaves that are fed or
updated; others share the tape's recorded array read-only).  Intermediates live in the
buffers of the MemoryPlan, allocated once here.  Each run is a loop over prebound
``(forward, out, inputs, attrs)`` steps: no per-step allocation of intermediates.
"""

from __future__ import annotations

import numpy as np

from ..ops import PRIMS


class NumpyBackend:
    def __init__(self, graph, plan):
        self.graph = graph
        self.plan = plan
        buffers = [np.empty(n, dtype) for dtype, n in plan.buffer_sizes]
        self._values = {}  # Var -> ndarray it lives in
        for leaf in graph.leaves:
            self._values[leaf] = leaf._value
        self._owned = set()
        for leaf, _ in graph.updates:
            self._own(leaf)
        for v in graph.ops:
            self._values[v] = plan.view(buffers, v)
        self._bind()

    def _own(self, leaf):
        self._values[leaf] = np.array(leaf._value, copy=True)
        self._owned.add(leaf)

    def _bind(self):
        val = self._values
        self._steps = [(PRIMS[v.op].forward, val[v], tuple(val[x] for x in v.inputs), v.attrs)
                       for v in self.graph.ops]
        # updates are simultaneous: a source that is itself an updated leaf is read
        # before any update is written (snapshot flag), so {a: b, b: a} swaps
        targets = {leaf for leaf, _ in self.graph.updates}
        self._updates = [(val[leaf], val[src], src in targets)
                         for leaf, src in self.graph.updates]
        self._outputs = [val[v] for v in self.graph.outputs]

    def leaf_value(self, leaf):
        return self._values[leaf].copy()

    def set_leaf(self, leaf, arr):
        """Copy ``arr`` into the leaf's storage (taking a private copy first if shared)."""
        if leaf not in self._values:
            return  # pruned: nothing reads this leaf
        if leaf not in self._owned:
            self._own(leaf)
            self._bind()
        np.copyto(self._values[leaf], arr)

    def run(self, arrays):
        for leaf, arr in arrays.items():
            self.set_leaf(leaf, arr)
        for forward, out, inputs, attrs in self._steps:
            forward(out, *inputs, **attrs)
        outs = [o.copy() for o in self._outputs]
        staged = [(dst, src.copy() if snap else src) for dst, src, snap in self._updates]
        for dst, src in staged:
            np.copyto(dst, src)
        return outs
