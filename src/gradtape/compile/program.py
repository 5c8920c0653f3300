"""The compile pipeline (``compile_program``, ``lower``) and ``Program``: a compiled
graph bound to a backend, replayed with new leaf values.

The Program validates feeds (shared by every backend) and hands the backend arrays it can
copy into its own leaf storage.  A leaf keeps its recorded value unless fed in that run
(a leaf fed in the previous run and not in this one is put back to its recorded value);
a leaf that is the target of an update holds state instead: it keeps whatever the last
run wrote into it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..var import Var, fmt_shape
from .checkpoint import checkpoint as checkpoint_pass
from .cse import merge_common
from .decompose import decompose
from .early_updates import early_updates
from .fuse import fuse, plan_schedule_memory, schedule_in_place, unfused
from .graph import build_graph
from .loss_grad import pair_loss_grads
from .merge_matmuls import merge_matmuls
from .remat import rematerialize
from .sink import sink_large

def compile_program(tape, outputs, backend_cls, updates=None, execution=None,
                    checkpoint=False, complete=None, donate=(), arena=None):
    """The pipeline: the backend-independent passes (``passes``), then the passes the
    backend declares (``lower``), bound to ``backend_cls`` (from ``backends.get_backend``)
    with the execution plan it carries out (``execution``: a ``gradtape.plan.Plan``, made
    final for the compiled graph by ``complete(execution, graph)`` where given; None: the
    tape's own arithmetic everywhere).  ``checkpoint``: see ``passes``; ``donate``: see
    ``lower``; ``arena``: a ``backends.base.SharedArena`` the program's intermediates live
    in (None, or a backend that keeps them elsewhere: its own)."""
    graph = passes(tape, outputs, updates, backend_cls, checkpoint)
    if complete is not None:
        execution = complete(execution, graph)
    shared = {"arena": arena} if arena is not None and backend_cls.takes_arena else {}
    return Program(graph, lower(graph, backend_cls, execution=execution, donate=donate,
                                **shared),
                   backend_cls.name)


def passes(tape, outputs, updates, backend_cls, checkpoint=False):
    """Prune (``build_graph``); decompose the fused primitives ``backend_cls`` has no
    kernel for; compute repeated forward ops once (``compile.cse``); with ``checkpoint``,
    recompute in backward what the forward computed from the tape's checkpoints
    (``compile.checkpoint``: True recomputes every checkpointed layer, a number n only
    the first n); rematerialize."""
    graph = decompose(build_graph(tape, outputs, updates), backend_cls.has_kernel)
    graph, new_of = merge_common(graph, tape.backward_marks)
    if checkpoint:
        keep = [new_of.get(v, v) for v in tape.checkpoints]
        layers = None if checkpoint is True else int(checkpoint)
        graph = checkpoint_pass(graph, tape.backward_marks, keep, layers)
    return rematerialize(graph, tape.backward_marks)


def lower(graph, backend_cls, donate=(), **kwargs):
    """``graph`` through the passes ``backend_cls.passes`` names and the memory plan of the
    resulting schedule (``schedule``), then the backend constructed on them (``kwargs``
    go to it).  The state of the update targets in ``donate`` stays in their recorded
    arrays (``MemoryPlan.donated``) on a backend that ``writes_in_place``."""
    graph, schedule, plan = scheduled(graph, backend_cls)
    donated = frozenset(donate) & {leaf for leaf, _ in graph.updates}
    if donated and backend_cls.writes_in_place:
        plan = dataclasses.replace(plan, donated=donated)
    return backend_cls(graph, schedule, plan, **kwargs)


def scheduled(graph, backend_cls):
    """``(graph, schedule, memory plan)`` as ``backend_cls`` runs ``graph``: the passes
    it names (in this order: ``merge_matmuls``, ``pair_loss_grads``, ``fuse``), fused
    primitives it has no kernel for decomposed first (already done where ``passes``
    ran); what follows backward runs as soon as its inputs are ready
    (``early_updates``) and a large value is made just before its first reader
    (``sink_large``).  A backend with
    ``writes_in_place`` gets the state updates it can write straight into their leaves
    in the memory plan (``MemoryPlan.in_place``) and each elementwise group's output over
    an input that dies there where it can (``fuse.plan_schedule_memory``).  Nothing is
    allocated: the memory estimate plans with it too."""
    graph = decompose(graph, backend_cls.has_kernel)
    if "merge_matmuls" in backend_cls.passes:
        graph = merge_matmuls(graph)
    graph = sink_large(early_updates(graph))
    if "pair_loss_grads" in backend_cls.passes:
        graph = pair_loss_grads(graph)
    if "fuse" in backend_cls.passes:
        schedule = fuse(graph, **backend_cls.fusion(graph))
    else:
        schedule = unfused(graph)
    in_place = {}
    reuse = backend_cls.writes_in_place
    if reuse:
        in_place = schedule_in_place(schedule)
    plan = plan_schedule_memory(schedule, in_place, reuse,
                                backend_cls.fuses_scatter_add(graph))
    return graph, schedule, plan


class Program:
    def __init__(self, graph, executable, backend_name):
        self.graph = graph
        self.executable = executable
        self.backend = backend_name
        self._leaves = set(graph.leaves)
        self._state = {leaf for leaf, _ in graph.updates}
        self._fed_last = set()

    @property
    def execution(self):
        """The execution plan the backend carries out (``gradtape.plan.Plan``)."""
        return self.executable.execution

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
        tape = self.graph.leaves[0].tape if self.graph.leaves else None  # None: no leaves
        if not isinstance(leaf, Var) or not leaf.is_leaf or leaf.tape is not tape:
            raise ValueError(f"run: feed key {leaf!r} is not a leaf (param or const) of "
                             "this program's tape")
        arr = np.asarray(value)
        if arr.shape != leaf.shape:
            raise ValueError(f"run: feed for {leaf.op} leaf #{leaf.index} {fmt_shape(leaf.shape)}"
                             f" got an array of shape {fmt_shape(arr.shape)}")
        if np.issubdtype(leaf.dtype, np.integer):
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"run: feed for integer leaf #{leaf.index} "
                                f"{fmt_shape(leaf.shape)} got dtype {arr.dtype}")
        elif not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"run: feed for leaf #{leaf.index} got non-numeric dtype {arr.dtype}")
        return arr.astype(leaf.dtype, copy=False)

    def set_state(self, values):
        """Overwrite leaves' held values ({leaf: array}) without running: restoring a
        checkpoint into a training step's state."""
        for leaf, value in values.items():
            self.executable.set_leaf(leaf, self._check_feed(leaf, value))

    def share_state(self, other, leaves) -> bool:
        """Read ``leaves``, state of the program ``other``, straight from its storage: no
        copy, always its current values (a training step's eval program reading the
        params).  False where a backend cannot: the caller feeds the values instead (a
        leaf fed is copied into this program's own storage, shared or not)."""
        arrays = [other.executable.leaf_array(leaf) for leaf in leaves]
        if any(a is None for a in arrays) or not all(
                self.executable.share_leaf(leaf, a) for leaf, a in zip(leaves, arrays)):
            return False
        self._fed_last -= set(leaves)
        return True

    def state(self, leaf):
        """The current value of a state leaf (or any leaf) held by the program."""
        return self.executable.leaf_value(leaf)
