"""Compilation: from recorded Vars to a replayable Program.

The passes are backend-independent and run in this order: ``prune`` keeps only the ops the
requested outputs (and state updates) need, in recording order; ``plan_memory`` assigns
every intermediate a slice of a reusable buffer by liveness.  A backend then lowers the
resulting ``Graph`` and ``MemoryPlan`` into an executable that ``Program`` drives.
"""

from .graph import Graph, build_graph
from .memplan import MemoryPlan, plan_memory
from .program import Program, compile_program

__all__ = ["Graph", "build_graph", "MemoryPlan", "plan_memory", "Program", "compile_program"]
