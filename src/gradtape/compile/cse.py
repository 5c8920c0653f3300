"""Common subexpressions: an op recorded twice on the same inputs is computed once.

Model code records per layer what is the same in every layer; the rope tables that
``nn.tiled_attention`` broadcasts to its heads are the example.  Each copy is a
forward value that backward reads again, so each stays alive to the end of backward:
one copy of four [T*n, hd/2] tables per layer.  Here the second and later copies read
the first instead.

Only forward values merge (recorded before the first backward mark): a backward op equal
to a forward one would keep the forward value alive across the step, the memory that
``remat`` and ``checkpoint`` exist to give back.  The survivor computes the same op on
the same inputs, so every value is bitwise what it was.  The pass returns a new Graph and
the map from merged Vars to the Vars that stand for them now; the tape is not modified.
"""

from __future__ import annotations

import dataclasses

from .graph import Graph
from .remat import _with_inputs


def merge_common(graph: Graph, marks) -> tuple[Graph, dict]:
    """Merge the forward ops of ``graph`` that repeat an earlier op on the same inputs
    with the same attributes; ``(new graph, {old Var: its replacement})``."""
    first = min(marks) if marks else None
    seen = {}  # (op, input ids, frozen attrs) -> the first Var computing it
    new_of = {}
    ops = []
    for v in graph.ops:
        ins = tuple(new_of.get(x, x) for x in v.inputs)
        key = _key(v, ins) if first is None or v.index < first else None
        if key is not None and key in seen:
            new_of[v] = seen[key]
            continue
        if ins != v.inputs:
            new_of[v] = _with_inputs(v, ins)
        w = new_of.get(v, v)
        if key is not None:
            seen[key] = w
        ops.append(w)
    if not new_of:
        return graph, {}
    outputs = tuple(new_of.get(v, v) for v in graph.outputs)
    updates = tuple((leaf, new_of.get(src, src)) for leaf, src in graph.updates)
    return Graph(leaves=graph.leaves, ops=tuple(ops), outputs=outputs, updates=updates), new_of


def _key(v, inputs):
    """A hashable identity of ``v``'s computation, or None where an attribute is not a
    plain value, or a container or dataclass of them (such an op is never merged)."""
    attrs = _frozen(v.attrs)
    if attrs is None:
        return None
    return v.op, tuple(id(x) for x in inputs), v.shape, str(v.dtype), attrs


def _frozen(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__, value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # AttentionSpec
        items = tuple((f.name, _frozen(getattr(value, f.name)))
                      for f in dataclasses.fields(value))
        return None if any(x is None for _, x in items) else (type(value).__name__, items)
    if isinstance(value, (tuple, list)):
        items = tuple(_frozen(x) for x in value)
        return None if None in items else items
    if isinstance(value, dict):
        items = tuple((k, _frozen(x)) for k, x in sorted(value.items()))
        return None if any(x is None for _, x in items) else items
    return None
