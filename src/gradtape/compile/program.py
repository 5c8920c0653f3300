"""``Program``: a compiled graph bound to a backend, replayed with new leaf values.

The Program validates feeds (shared by every backend) and hands the backend arrays it can
copy into its own leaf storage.  A leaf keeps its recorded value unless fed in that run
(a leaf fed in the previous run and not in this one is put back to its recorded value);
a leaf that is the target of an update holds state instead: it keeps whatever the last
run wrote into it.
"""

from __future__ import annotations

import numpy as np

from .graph import build_graph
from .memplan import plan_memory
from .remat import rematerialize


def compile_program(tape, outputs, backend="numpy", updates=None, compute="float32"):
    """``compute``: "float32" (the tape's own arithmetic everywhere), or "bf16": the
    frozen-weight GEMMs take bf16 inputs and accumulate in float32 (the ``cpu`` backend
    on a float32 tape; decided by ``backends.compute.resolve``, which says when it
    cannot be had).  Other backends and float64 tapes run their own arithmetic."""
    from ..backends import get_backend

    if compute not in ("float32", "bf16"):
        raise ValueError(f"compile: compute must be 'float32' or 'bf16' (resolve 'auto' with "
                         f"gradtape.backends.compute.resolve), got {compute!r}")
    backend_cls = get_backend(backend)
    graph = rematerialize(build_graph(tape, outputs, updates), tape.backward_marks)
    extra = {"compute": compute} if compute != "float32" and backend == "cpu" else {}
    return Program(graph, backend_cls(graph, plan_memory(graph), **extra), backend)


class Program:
    def __init__(self, graph, executable, backend_name):
        self.graph = graph
        self.executable = executable
        self.backend = backend_name
        self._leaves = set(graph.leaves)
        self._state = {leaf for leaf, _ in graph.updates}
        self._fed_last = set()

    @property
    def memory(self):
        """The MemoryPlan (n_buffers, nbytes) of intermediates."""
        return self.executable.plan

    def run(self, feeds=None) -> list:
        """Replay with ``feeds`` ({leaf Var: array}); return the outputs as new arrays."""
        feeds = dict(feeds or {})
        arrays = {}
        for leaf, value in feeds.items():
            arrays[leaf] = self._check_feed(leaf, value)
        # leaves fed last time and not now go back to their recorded values
        for leaf in self._fed_last - arrays.keys() - self._state:
            arrays[leaf] = leaf._value
        self._fed_last = set(feeds) & self._leaves
        return self.executable.run(arrays)

    def _check_feed(self, leaf, value):
        from ..tape import Var, _fmt_shape

        tape = self.graph.leaves[0].tape if self.graph.leaves else None  # None: no leaves
        if not isinstance(leaf, Var) or not leaf.is_leaf or leaf.tape is not tape:
            raise ValueError(f"run: feed key {leaf!r} is not a leaf (param or const) of "
                             "this program's tape")
        arr = np.asarray(value)
        if arr.shape != leaf.shape:
            raise ValueError(f"run: feed for {leaf.op} leaf #{leaf.index} {_fmt_shape(leaf.shape)}"
                             f" got an array of shape {_fmt_shape(arr.shape)}")
        if np.issubdtype(leaf.dtype, np.integer):
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"run: feed for integer leaf #{leaf.index} "
                                f"{_fmt_shape(leaf.shape)} got dtype {arr.dtype}")
        elif not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"run: feed for leaf #{leaf.index} got non-numeric dtype {arr.dtype}")
        return arr.astype(leaf.dtype, copy=False)

    def set_state(self, values):
        """Overwrite leaves' held values ({leaf: array}) without running: restoring a
        checkpoint into a training step's state."""
        for leaf, value in values.items():
            self.executable.set_leaf(leaf, self._check_feed(leaf, value))

    def state(self, leaf):
        """The current value of a state leaf (or any leaf) held by the program."""
        return self.executable.leaf_value(leaf)
