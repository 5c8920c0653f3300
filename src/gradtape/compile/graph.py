"""The compiled graph IR: the pruned, ordered ops a set of outputs needs."""

from __future__ import annotations

from dataclasses import dataclass

from ..var import Var


@dataclass(frozen=True)
class Graph:
    leaves: tuple  # leaf Vars the ops read, in recording order
    ops: tuple  # non-leaf Vars to evaluate, in recording (topological) order
    outputs: tuple  # Vars returned by each run, in the caller's order
    updates: tuple  # (leaf, source Var) pairs: after each run, leaf <- source


def build_graph(tape, outputs, updates) -> Graph:
    """Prune: keep only what ``outputs`` and the update sources depend on."""
    outputs = list(outputs)
    updates = dict(updates or {})
    for i, v in enumerate(outputs):
        if not isinstance(v, Var) or v.tape is not tape:
            raise ValueError(f"compile: output {i} is not a Var of this tape")
    for leaf, src in updates.items():
        if not isinstance(leaf, Var) or leaf.tape is not tape or not leaf.is_leaf:
            raise ValueError("compile: update targets must be leaves of this tape")
        if not isinstance(src, Var) or src.tape is not tape:
            raise ValueError("compile: update sources must be Vars of this tape")
        if src.shape != leaf.shape or src.dtype != leaf.dtype:
            raise ValueError(f"compile: update of {leaf!r} from {src!r}: shape or dtype differs")
    needed = set()
    stack = outputs + list(updates.values())
    while stack:
        v = stack.pop()
        if v in needed:
            continue
        needed.add(v)
        stack.extend(v.inputs)
    ordered = sorted(needed, key=lambda v: v.index)
    return Graph(leaves=tuple(v for v in ordered if v.is_leaf),
                 ops=tuple(v for v in ordered if not v.is_leaf),
                 outputs=tuple(outputs), updates=tuple(updates.items()))
