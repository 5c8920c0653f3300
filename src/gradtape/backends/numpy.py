"""The NumPy backend: the reference definition of every primitive.

Each op of the graph runs its NumPy forward from ``ops/`` (the very function the eager
tape runs, so a replay is bitwise the eager values), prebound as ``(forward, out,
inputs, attrs)`` into the buffers of the memory plan: no per-step allocation of
intermediates.  Storage and state updates are ``base.HostBackend``'s.
"""

from __future__ import annotations

import functools

from ..compile.memplan import views_in_place
from ..ops import PRIMS
from .base import HostBackend


class NumpyBackend(HostBackend):
    name = "numpy"

    def __init__(self, graph, schedule, plan, execution=None, arena=None):
        super().__init__(graph, schedule, plan, execution, arena)
        self._bind()

    def _bind_steps(self, val):
        return [functools.partial(PRIMS[v.op].forward, val[v], *(val[x] for x in v.inputs),
                                  **v.attrs) for v in self.schedule.steps
                if not views_in_place(v, val)]
