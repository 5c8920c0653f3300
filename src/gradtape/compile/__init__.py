"""Compilation: from recorded Vars to a replayable Program.

``compile_program`` runs the pipeline: ``build_graph`` prunes to the ops the requested
outputs (and state updates) need, in recording order; ``merge_common`` computes repeated
forward ops once; ``rematerialize`` recomputes cheap
activations in backward instead of keeping them; then the passes the backend declares
(``Backend.passes``: ``merge_matmuls``, ``fuse``) and the memory plan of the resulting
schedule, every value a slice of a reusable buffer by liveness.  The backend lowers that
schedule and plan into an executable that ``Program`` drives.  This package knows
backends only as the class it is handed (``backends.get_backend`` resolves a name).
"""

from .fuse import FusedGroup, Schedule, fuse
from .graph import Graph, build_graph
from .memplan import MemoryPlan, plan_memory
from .program import Program, compile_program, lower

__all__ = ["FusedGroup", "Graph", "MemoryPlan", "Program", "Schedule", "build_graph",
           "compile_program", "fuse", "lower", "plan_memory"]
