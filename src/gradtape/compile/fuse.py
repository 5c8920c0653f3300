"""Fusion: grouping a pruned Graph's elementwise ops into kernels, and planning memory
around the groups.

A ``FusedGroup`` is backend-independent IR: its member ops (in topological order), the
external Vars it reads, the members whose values leave it (the only ones that need a
buffer), and its iteration ``domain``.  Two kinds:

* ``"elementwise"``: a connected DAG of elementwise ops.  Every member's shape is a
  *prefix* of the domain (``domain[:L] + (1,) * rest``): a ``[T, 1]`` column inside a
  ``[T, n]`` group is computed once per row (hoisted out of the inner loop), a scalar
  once.  External inputs broadcast freely (``[n]`` rows, ``[T, 1]`` columns, scalars).
* ``"rowreduce"``: an elementwise DAG (possibly empty) feeding one reduction over the
  last axis of a 1-d or 2-d value: ``sum(axis=-1)``, ``softmax(axis=-1)`` or
  ``logsumexp(axis=-1)``; the reduction is the last member, and the group is closed.

Groups never contain a matmul or any other non-elementwise op.  A ``Schedule`` is the
ordered list of steps (a single op Var or a FusedGroup) a backend executes.

Grouping rule (what keeps the schedule acyclic): ops are visited in recording order; an
op joins the group(s) of its producers only if no member of those groups has already
been read by an op outside them.  A group then runs at the position of its last member,
and every edge goes from an earlier step to a later one.  An op recorded a few ops
after such a "sealed" group (``LATE_JOIN_SPAN``) still joins it where everything else it
reads exists before the group and no elementwise op reads it (which it could fuse with
later instead): it is then computed early, at the group's position (a LoRA scale of a
gradient the group computes, feeding a product: one pass over the gradient saved).

A backend may also let a product with a short inner dimension start an elementwise group
(``products``: LoRA's ``(x A) B`` at rank r, r multiply-adds per element): its readers
then take it where it is computed, and the ``[T, n]`` product is never written.  Such a
group keeps the product's shape as its domain, and never holds what the product reads.

This module does not generate code; backends lower the groups (``backends/cpu/backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops import PRIMS
from .memplan import MemoryPlan, in_place_updates, plan_liveness, reshape_views

REDUCE_OPS = ("sum", "softmax", "logsumexp")
# how many ops after a sealed group an op may still join it (computed early there): a few,
# so that a value recomputed late on purpose (remat.py) never moves back into forward
LATE_JOIN_SPAN = 64


@dataclass(frozen=True, eq=False)
class FusedGroup:
    kind: str  # "elementwise" | "rowreduce"
    ops: tuple  # member Vars, topological order (a rowreduce's last member is the reduction)
    inputs: tuple  # external Vars read by members, first-use order
    outputs: tuple  # members read outside the group (or returned / used by an update)
    domain: tuple  # iteration shape: largest member shape, or the reduced input's shape

    def __repr__(self):
        ops = ",".join(f"{v.op}#{v.index}" for v in self.ops)
        return f"FusedGroup<{self.kind} {list(self.domain)} [{ops}] -> {len(self.outputs)} out>"


@dataclass(frozen=True)
class Schedule:
    steps: tuple  # Var (one op, run on its own) or FusedGroup, in execution order
    graph: object

    @property
    def groups(self):
        return tuple(s for s in self.steps if isinstance(s, FusedGroup))


def prefix_level(shape, domain):
    """L such that ``shape`` (left-padded with 1s to the domain's rank) equals
    ``domain[:L] + (1,) * (rank - L)``, the smallest such L; None when it is not a prefix
    (e.g. an ``[n]`` row inside a ``[T, n]`` domain varies along the inner axis only)."""
    k = len(domain)
    if len(shape) > k:
        return None
    padded = (1,) * (k - len(shape)) + tuple(shape)
    level = 0
    for d in range(k):
        if padded[d] != 1:
            level = d + 1
    return level if padded[:level] == tuple(domain[:level]) else None


def merge_domains(a, b):
    """The domain of a group holding both shapes, or None when neither is a prefix of
    the other."""
    if prefix_level(a, b) is not None and len(b) >= len(a):
        return tuple(b)
    if prefix_level(b, a) is not None and len(a) >= len(b):
        return tuple(a)
    return None


def is_row_reduction(v):
    """A reduction over the last axis of a 1-d or 2-d input that a rowreduce group ends in."""
    if v.op not in REDUCE_OPS or not v.inputs:
        return False
    x = v.inputs[0]
    if x.ndim not in (1, 2):
        return False
    axis = v.attrs.get("axis")
    if v.op == "sum" and axis is None:
        return x.ndim == 1
    return axis is not None and axis % x.ndim == x.ndim - 1


def default_fusible(v):
    return PRIMS[v.op].elementwise


class _Building:
    __slots__ = ("members", "domain", "sealed", "closed", "kind", "at", "fixed")

    def __init__(self, members, domain, at, kind="elementwise"):
        self.members = list(members)
        self.domain = tuple(domain)
        self.sealed = False  # some member was read by an op outside the group
        self.closed = kind == "rowreduce"
        self.kind = kind
        self.at = at  # the position in graph.ops the group runs at (its last member's)
        self.fixed = False  # it holds a product: its domain is the product's shape


def _may_merge(groups, v, dom):
    """Whether ``groups`` and ``v`` may form one group over ``dom``: a group holding a
    product keeps its domain and holds nothing the product reads."""
    members = {m for g in groups for m in g.members} | {v}
    return (all(dom == g.domain for g in groups if g.fixed)
            and not any(x in members for g in groups if g.fixed
                        for m in g.members if m.op == "matmul" for x in m.inputs))


def _late_join(v, at, cands, group_of, where):
    """The sealed group among ``cands`` (groups of ``v``'s inputs) that ``v``, at position
    ``at``, joins without moving it, or None: at most ``LATE_JOIN_SPAN`` ops before ``v``,
    every input of ``v`` outside it made before it runs, a domain holding ``v``'s shape."""
    for g in sorted(cands, key=lambda g: -g.at):
        if (not g.sealed or g.closed or at - g.at > LATE_JOIN_SPAN
                or merge_domains(tuple(v.shape), g.domain) != g.domain):
            continue
        if all(x.is_leaf or (group_of[x].at if x in group_of else where.get(x, -1)) < g.at
               for x in v.inputs if group_of.get(x) is not g):
            return g
    return None


def fuse(graph, fusible=default_fusible, reductions=True, products=None) -> Schedule:
    """Group ``graph.ops`` into FusedGroups; everything else stays a single-op step.

    ``fusible(v)`` says whether an elementwise op may join a group (a backend passes a
    narrower test when it lacks a kernel for some primitive); ``reductions`` allows
    rowreduce groups; ``products(v)``, whether a 2-d matmul may start an elementwise
    group (see the module docstring).
    """
    group_of = {}  # Var -> _Building
    where = {}  # Var -> its position in graph.ops

    def seal_inputs(v, own):
        for x in v.inputs:
            g = group_of.get(x)
            if g is not None and g is not own:
                g.sealed = True

    # values an elementwise op reads: they may fuse with their readers, never join late
    read_elementwise = {x for u in graph.ops if fusible(u) and PRIMS[u.op].elementwise
                        for x in u.inputs}
    for at, v in enumerate(graph.ops):
        where[v] = at
        if fusible(v) and PRIMS[v.op].elementwise:
            producers = list(dict.fromkeys(group_of[x] for x in v.inputs if x in group_of))
            cands = [g for g in producers if not g.sealed and not g.closed]
            target = None
            # all producer groups at once, else the largest compatible one alone
            for choice in ([cands] if len(cands) > 1 else []) + [[g] for g in sorted(
                    cands, key=lambda g: -len(g.members))]:
                dom = tuple(v.shape)
                for g in choice:
                    dom = merge_domains(dom, g.domain) if dom is not None else None
                if dom is not None and _may_merge(choice, v, dom):
                    target = choice
                    break
            late = (_late_join(v, at, producers, group_of, where)
                    if target is None and v not in read_elementwise else None)
            if late is not None:  # computed early, where the group runs
                g = late
                g.members.append(v)
            elif target is None:
                g = _Building([v], v.shape, at)
            else:
                g = target[0]
                g.fixed = any(x.fixed for x in target)
                for other in target[1:]:
                    g.members.extend(other.members)
                    for m in other.members:
                        group_of[m] = g
                g.members.append(v)
                g.members.sort(key=lambda m: m.index)
                g.domain = dom
                g.at = at
            group_of[v] = g
            seal_inputs(v, g)
        elif products is not None and v in read_elementwise and products(v):
            # computed where its elementwise readers are
            g = _Building([v], v.shape, at)
            g.fixed = True
            group_of[v] = g
            seal_inputs(v, g)
        elif reductions and is_row_reduction(v):
            x = v.inputs[0]
            g = group_of.get(x)
            if (g is not None and not g.sealed and not g.closed and not g.fixed
                    and tuple(g.domain) == tuple(x.shape)):
                g.members.append(v)
                g.kind, g.closed, g.at = "rowreduce", True, at
                g.domain = tuple(x.shape)
            else:
                g = _Building([v], x.shape, at, kind="rowreduce")
            group_of[v] = g
            seal_inputs(v, g)
        else:
            seal_inputs(v, None)

    # consumers, to find which members escape their group
    escapes = set(graph.outputs) | {src for _, src in graph.updates}
    for v in graph.ops:
        gv = group_of.get(v)
        for x in v.inputs:
            if x in group_of and group_of[x] is not gv:
                escapes.add(x)

    steps = []
    # each group lands at its last member's position (in graph.ops: a clone remat.py
    # makes keeps its original's tape index, so the index alone could place it twice)
    for at, v in enumerate(graph.ops):
        g = group_of.get(v)
        if g is None:
            steps.append((v.index, v))
            continue
        if g.at != at:
            continue
        members = tuple(g.members)
        mset = set(members)
        inputs = []
        for m in members:
            for x in m.inputs:
                if x not in mset and x not in inputs:
                    inputs.append(x)
        fg = FusedGroup(kind=g.kind, ops=members, inputs=tuple(inputs),
                        outputs=tuple(m for m in members if m in escapes),
                        domain=tuple(g.domain))
        steps.append((v.index, fg))
    return Schedule(steps=tuple(s for _, s in steps), graph=graph)


def unfused(graph) -> Schedule:
    """Every op a step of its own (a backend without the fuse pass)."""
    return Schedule(steps=graph.ops, graph=graph)


def step_inputs(step):
    return step.inputs


def step_outputs(step):
    return step.outputs if isinstance(step, FusedGroup) else (step,)


def reads_same_index(step, x, v) -> bool:
    """Whether the group ``step`` may write its member ``v`` over its input ``x``: an
    elementwise group over exactly their shape (one loop, each element read, computed
    and written in turn) in which every member reading ``x`` is ``v`` or feeds it, so
    each element of ``x`` is read before ``v``'s value there exists to be stored (true
    however the compiler orders the loads of ``restrict`` pointers)."""
    if not (isinstance(step, FusedGroup) and step.kind == "elementwise"
            and tuple(step.domain) == tuple(x.shape) == tuple(v.shape)
            and x.dtype == v.dtype and v in step.ops):
        return False
    if any(m.op == "matmul" and x in m.inputs for m in step.ops):
        return False  # a product reads a whole row of x for each element
    feeds = {v}  # v and the members it is computed from
    for m in reversed(step.ops):
        if m in feeds:
            feeds.update(m.inputs)
    return all(m in feeds for m in step.ops if x in m.inputs)


def schedule_in_place(schedule) -> dict:
    """``{src: leaf}``: the schedule's state updates written straight into their leaves
    (``memplan.in_place_updates``)."""
    return in_place_updates([(s, step_inputs(s), step_outputs(s)) for s in schedule.steps],
                            schedule.graph.updates, set(schedule.graph.outputs),
                            reads_same_index)


def scatter_adds(schedule) -> dict:
    """``{group: (scatter, b)}``: one-add groups adding a ``scatter_rows`` that nothing else
    reads to a computed value of its shape, the scatter the step right before the group
    (its inputs are then still where it read them).  A backend that runs each such pair
    as one kernel (``Backend.fuses_scatter_add``: the cpu's ``codegen.scatter_add_body``)
    never writes the scatter's ``[n, d]`` of zeros, so the memory plan gives it no region
    of its own (``plan_schedule_memory``)."""
    steps = schedule.steps
    readers = {}
    pos = {st: i for i, st in enumerate(steps)}
    for st in steps:
        for x in step_inputs(st):
            readers.setdefault(x, []).append(st)
    graph = schedule.graph
    keep = set(graph.outputs) | {src for _, src in graph.updates}
    out = {}
    for g in schedule.groups:
        if g.kind != "elementwise" or [v.op for v in g.ops] != ["add"] or len(g.inputs) != 2:
            continue
        for sc, b in (g.inputs, g.inputs[::-1]):
            if (sc.op == "scatter_rows" and not sc.is_leaf and sc not in keep
                    and readers.get(sc) == [g] and pos.get(sc, -2) + 1 == pos[g]
                    and b.shape == sc.shape == g.ops[0].shape
                    and sc.inputs[1].dtype == np.int64 and b is not sc):
                out[g] = (sc, b)
                break
    return out


def loss_pairs(schedule) -> dict:
    """``{grad: loss}``: each ``nll_ids_grad`` step right after the ``nll_ids`` step of the
    same logits and ids (``loss_grad.pair_loss_grads`` places them so), which a backend
    may run as one pass over each row writing both (the cpu's ``row_kernel_body``)."""
    steps = schedule.steps
    return {d: n for n, d in zip(steps, steps[1:])
            if not isinstance(n, FusedGroup) and not isinstance(d, FusedGroup)
            and n.op == "nll_ids" and d.op == "nll_ids_grad" and d.inputs[1:] == n.inputs}


def overwritten_inputs(steps, pinned, views) -> dict:
    """``{v: x}``: an elementwise group's output ``v`` placed over its input ``x``, a
    computed value of the same shape and dtype whose last reader is that group
    (``reads_same_index``), or the logits' gradient ``nll_ids_grad`` over the logits
    (its kernels read each row before writing it); ``v`` then needs no region of its
    own.  Inputs that are pinned or part of a reshape view stay apart; an output that is
    itself a view does too (a value viewed in another shape, or holding a fused
    scatter's region, may move)."""
    last = {}
    for i, s in enumerate(steps):
        for x in step_inputs(s):
            last[x] = i
    apart = set(pinned) | set(views) | set(views.values())
    out = {}
    for i, s in enumerate(steps):
        if not isinstance(s, FusedGroup):  # the logits' gradient over the logits
            if (s.op == "nll_ids_grad" and s not in pinned and s not in views
                    and _dies_into(s, s.inputs[1], i, last, apart)):
                out[s] = s.inputs[1]
            continue
        if s.kind != "elementwise":
            continue
        taken = set()
        for v in s.outputs:
            if v in pinned or v in views:
                continue
            x = next((x for x in s.inputs if x not in taken
                      and _dies_into(v, x, i, last, apart) and reads_same_index(s, x, v)),
                     None)
            if x is not None:
                out[v] = x
                taken.add(x)
    return out


def _dies_into(v, x, i, last, apart):
    """Whether step ``i``'s output ``v`` may take the region of its input ``x``: a computed
    value of its shape and dtype, not kept apart, that step ``i`` reads last."""
    return (not x.is_leaf and x not in apart and last.get(x) == i
            and x.shape == v.shape and x.dtype == v.dtype)


def plan_schedule_memory(schedule, in_place=None, reuse=False,
                         fused_scatters=False) -> MemoryPlan:
    """Liveness planning over the schedule's steps, like ``plan_memory`` over ops, but
    only values that leave a step get a buffer (group-internal values live in registers).

    A step's outputs are placed before its inputs are released, so no step writes over
    what it reads.  Outputs and update sources keep buffers of their own.  A lone reshape
    is its input's region seen in another shape (``reshape_views``): a copy saved.
    ``in_place``: update sources that live in their leaves' storage instead
    (``schedule_in_place``).  ``reuse``: an elementwise group's output may take the
    region of an input that dies there (``overwritten_inputs``).  ``fused_scatters``: the
    backend runs each ``scatter_adds`` pair as one kernel, so the scatter (never written)
    shares its add's region.
    """
    graph = schedule.graph
    in_place = in_place or {}
    pinned = set(graph.outputs) | {src for _, src in graph.updates if src not in in_place}
    views = {v: x for v, x in reshape_views(schedule.steps).items() if x not in in_place}
    shares = dict(views)
    if fused_scatters:
        shares.update({sc: g.ops[0] for g, (sc, _) in scatter_adds(schedule).items()})
    if reuse:
        shares.update(overwritten_inputs(schedule.steps, pinned | set(in_place), views))
    return plan_liveness([(step_inputs(s), step_outputs(s)) for s in schedule.steps], pinned,
                         shares, in_place)
