"""What every backend shares: the interface ``compile`` drives, and host leaf storage.

A backend class declares which of the optional compile passes it wants (``passes``:
``"merge_matmuls"``, ``"fuse"``) and how to fuse (``fusion``); ``compile.lower`` runs
them and constructs it as ``Backend(graph, schedule, plan, execution)``: the memory plan
and the execution plan (``gradtape.plan``) it carries out.  It then offers
``run(arrays)`` (copy the given leaf arrays in, evaluate, apply the state updates,
return copies of the outputs), ``set_leaf``, ``leaf_value``, ``plan`` and ``compute``
(the precision that runs: "float32", or "bf16" / "int8" where a backend took it).

``HostBackend`` holds values in host NumPy arrays (the numpy and cpu backends): leaves
share the tape's recorded arrays read-only until fed or updated, then get storage of
their own; intermediates live in the buffers of the memory plan, allocated once, or in a
``SharedArena`` that programs which never run at the same time draw from (a training
step and its eval program: one arena sized for the larger); state updates are
simultaneous (a source that is itself an updated leaf is snapshotted into a
preallocated buffer first, so ``{a: b, b: a}`` swaps); an update the memory plan writes
in place (``MemoryPlan.in_place``: AdamW's new param and moments) has its source bound to
the leaf's own array, so nothing is copied.  A subclass says how to run the schedule
(``_bind_steps``).
"""

from __future__ import annotations

import numpy as np


class Backend:
    name = ""
    passes = ()  # optional compile passes this backend wants, run in compile.lower
    # whether compile.lower may plan a value into storage its step reads: a state update
    # into its leaf, an elementwise group's output over an input that dies there
    writes_in_place = False
    fallback = None  # the backend that runs where this one cannot (see ``unavailable``)
    takes_arena = False  # whether it keeps intermediates in a ``SharedArena`` it is given

    @classmethod
    def fuses_scatter_add(cls, graph) -> bool:
        """Whether it runs each row scatter and the one add reading it as one kernel
        (``compile.fuse.scatter_adds``) in ``graph``: the plan then gives the scatter no
        region of its own."""
        return False

    @classmethod
    def fusion(cls, graph) -> dict:
        """Keyword arguments of ``compile.fuse.fuse`` for ``graph`` (with "fuse" in
        ``passes``)."""
        return {}

    @classmethod
    def unavailable(cls):
        """Why this backend cannot run on this machine, or None."""
        return None

    @classmethod
    def has_kernel(cls, op) -> bool:
        """Whether this backend runs the fused primitive ``op`` (``ops.Prim.decompose``)
        itself; compile decomposes the others into composed primitives."""
        return False

    def __init__(self, graph, schedule, plan, execution=None):
        """``plan``: the memory plan; ``execution``: the execution plan to carry out
        (``gradtape.plan.Plan``; None: everything in the tape's own precision)."""
        self.graph, self.schedule, self.plan = graph, schedule, plan
        self.execution = execution
        self.compute = "float32"  # a backend that takes bf16 says so

    def run(self, arrays) -> list:
        raise NotImplementedError

    def set_leaf(self, leaf, arr):
        raise NotImplementedError

    def leaf_value(self, leaf):
        raise NotImplementedError

    def leaf_array(self, leaf):
        """The host array a leaf's value lives in, not a copy (None: not on the host)."""
        return None

    def share_leaf(self, leaf, arr) -> bool:
        """Read ``leaf`` from ``arr`` itself from now on, an array another program owns
        and updates in place (this one never writes it); False where it cannot."""
        return False


def page_aligned(n, dtype, page=4096):
    """``np.empty(n, dtype)`` starting on a page boundary.  NumPy's own large arrays start
    16 bytes into a page, so every 64-byte vector of a kernel over them straddles two
    cache lines (a memory plan's regions are cache-line multiples from the arena's
    start), which costs the C kernels a large share of their time."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + page, np.uint8)
    start = -raw.ctypes.data % page
    return raw[start:start + n * dtype.itemsize].view(dtype)


class SharedArena:
    """The intermediates' storage of several programs that never run at the same time
    (a training step, its eval program, ...): one page-aligned buffer per dtype, as large
    as the largest program's plan asks.  Sharing is sound because a replay reads no
    intermediate it did not write in that same replay: every value is written by its step
    before any step reads it, outputs are copied out and update sources copied into their
    leaves before ``run`` returns.  A program asking for more than the buffer holds gets a
    larger one; the programs on the smaller one move to it before their next replay
    (``version`` counts the moves), so it is freed.  Not for programs run from two
    threads at once."""

    def __init__(self):
        self._buffers = {}  # dtype -> its buffer
        self._kept = {}  # key -> a backend's scratch object (``kept``)
        self.version = 0

    def kept(self, key, make):
        """The scratch object ``key`` a backend keeps from call to call (the cpu
        backend's tiles of the fused primitives, ``make()`` once), one for all the
        programs: the same reasoning, a call writes its scratch before reading it."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def buffers(self, sizes) -> list:
        """The buffers for a memory plan's ``buffer_sizes`` (each at least that long)."""
        out = []
        for dtype, n in sizes:
            dtype = np.dtype(dtype)
            buf = self._buffers.get(dtype)
            if buf is None or buf.size < n:
                buf = self._buffers[dtype] = page_aligned(max(n, 1), dtype)
                self.version += 1
            out.append(buf)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class HostBackend(Backend):
    writes_in_place = True
    takes_arena = True

    @classmethod
    def has_kernel(cls, op):
        return True  # every primitive's NumPy forward runs on the host

    def __init__(self, graph, schedule, plan, execution=None, arena=None):
        """``arena``: a ``SharedArena`` for the intermediates (None: buffers of this
        program's own)."""
        super().__init__(graph, schedule, plan, execution)
        self._arena = arena
        self._values = {leaf: leaf._value for leaf in graph.leaves}  # Var -> its array
        self._owned = set()
        for leaf, _ in graph.updates:
            self._own(leaf, adopt=leaf in plan.donated)
        self._in_place = {leaf: src for src, leaf in plan.in_place.items()}
        self._view_buffers()

    def _view_buffers(self):
        """Every intermediate's array in the buffers: this program's own, or the shared
        arena's as they are now; an update written in place where its leaf lives."""
        if self._arena is None:
            self._buffers = [page_aligned(n, dtype) for dtype, n in self.plan.buffer_sizes]
        else:
            self._arena_version = self._arena.version
            self._buffers = self._arena.buffers(self.plan.buffer_sizes)
        for v in self.plan.slot:
            self._values[v] = self.plan.view(self._buffers, v)
        for leaf, src in self._in_place.items():
            self._values[src] = self._values[leaf]
        self._stale = True

    def _arena_moved(self):
        """The shared arena got a larger buffer since this program was bound: its values
        move there (a subclass also drops what it bound to the old arrays)."""
        self._view_buffers()

    def _own(self, leaf, adopt=False):
        """Storage of the program's own for ``leaf``: a copy of its recorded value, or
        with ``adopt`` (a donated leaf) that very array where it is writeable C-order."""
        v = leaf._value
        if not (adopt and isinstance(v, np.ndarray) and v.flags.c_contiguous
                and v.flags.writeable and v.dtype == leaf.dtype):
            v = np.array(v, copy=True, order="C")
        self._values[leaf] = v
        self._owned.add(leaf)
        src = getattr(self, "_in_place", {}).get(leaf)
        if src is not None:  # its new value is written where it lives
            self._values[src] = self._values[leaf]

    def _bind(self):
        """(Re)bind every step to the arrays values live in (after a leaf got storage)."""
        self._stale = False
        val = self._values
        self._steps = self._bind_steps(val)
        targets = {leaf for leaf, _ in self.graph.updates}
        self._snaps = [(val[src], np.empty_like(val[src])) for _, src in self.graph.updates
                       if src in targets]
        snap_of = {id(a): b for a, b in self._snaps}
        self._updates = [(val[leaf], snap_of[id(val[src])] if src in targets else val[src])
                         for leaf, src in self.graph.updates if leaf not in self._in_place]
        self._outputs = [val[v] for v in self.graph.outputs]

    def _bind_steps(self, values) -> list:
        """The schedule as a list of callables over ``values`` (Var -> array)."""
        raise NotImplementedError

    def _execute(self):
        for step in self._steps:
            step()

    def leaf_value(self, leaf):
        return self._values[leaf].copy()

    def leaf_array(self, leaf):
        return self._values.get(leaf)

    def share_leaf(self, leaf, arr) -> bool:
        if leaf not in self._values:
            return True  # pruned: nothing reads it
        if any(leaf is dst for dst, _ in self.graph.updates):
            return False  # this program's own state
        self._values[leaf] = arr  # a later set_leaf copies it first (not owned)
        self._owned.discard(leaf)
        self._stale = True
        return True

    def set_leaf(self, leaf, arr):
        """Copy ``arr`` into the leaf's storage (taking a private copy first if shared:
        the steps are bound to it again before the next replay, once however many
        leaves got storage, not once per leaf: a big adapter has hundreds)."""
        if leaf not in self._values:
            return  # pruned: nothing reads this leaf
        if leaf not in self._owned:
            self._own(leaf)
            self._stale = True
        np.copyto(self._values[leaf], arr)

    def run(self, arrays):
        for leaf, arr in arrays.items():
            self.set_leaf(leaf, arr)
        if self._arena is not None and self._arena.version != self._arena_version:
            self._arena_moved()
        if self._stale:
            self._bind()
        self._execute()
        outs = [o.copy() for o in self._outputs]
        for src, snap in self._snaps:
            np.copyto(snap, src)
        for dst, src in self._updates:
            np.copyto(dst, src)
        return outs
