"""The memory a training step will need, known before it runs, and the check against
what the machine has.

A compiled step's memory is fixed before its first run: the weights (float arrays, or
block matrices whose mapped pages are read every step, and the bf16 copies a bf16 step's
GEMMs read), every program's memory plan (one
arena per dtype, allocated once; its pages are touched on the first run), the
dequantization scratch of frozen weights kept in their stored type and the scratch blocks
of fused primitives (``ops.Prim.scratch``), and the adapter with
its optimizer state.  ``estimate`` adds them up from the compiled programs; ``check``
compares the sum with MemAvailable and raises one ``GradtapeError`` saying what is
needed, what is there and what to change, instead of meeting the OOM killer mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import get_backend
from ..blocks import is_block_matrix
from ..compile.memplan import fused_scratch_bytes
from ..compile.program import passes, scheduled
from ..errors import GradtapeError
from ..models.memory import GiB, resident_bytes

# the interpreter, NumPy / OpenBLAS thread buffers, the tokenizer, compiled kernels,
# batches: a margin above what SmolLM2 runs were seen to need
OVERHEAD = 400 << 20


@dataclass(frozen=True)
class Estimate:
    weights: int
    activations: int
    scratch: int
    state: int
    overhead: int = OVERHEAD
    state_name: str = "adapter + optimizer"  # "params + optimizer" for full fine-tuning
    flops: int = 0  # the step program's matrix products, per replay (``planned`` only)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.scratch + self.state + self.overhead

    def describe(self) -> str:
        parts = [("weights", self.weights), ("activations", self.activations),
                 ("scratch", self.scratch), (self.state_name, self.state),
                 ("runtime", self.overhead)]
        return (f"about {self.total / GiB:.1f} GiB ("
                + ", ".join(f"{name} {b / GiB:.2f}" for name, b in parts if b) + ")")


def _programs(step):
    return [p for p in (getattr(step, "program", None), getattr(step, "eval_program", None),
                        getattr(step, "grads_program", None)) if p is not None]


def _scratch(prog, weights, dtype):
    ex = prog.executable
    if hasattr(ex, "scratch_bytes"):  # the cpu backend: its tiles and operands
        return int(ex.scratch_bytes())
    if not any(v.op in ("qmatmul", "qmatmul_t") for v in prog.graph.ops):
        return 0
    # the NumPy reference dequantizes one whole weight at a time (float32, then the
    # tape's dtype)
    big = max((w.shape[0] * w.shape[1] for w in weights.values() if is_block_matrix(w)),
              default=0)
    return big * (4 + (np.dtype(dtype).itemsize if np.dtype(dtype) != np.float32 else 0))


def planned(model, tape, outputs, updates, n_param, checkpoint, backend,
            built=(), copies=5, full=False, shared=False) -> Estimate:
    """What a step compiled from ``outputs`` / ``updates`` for ``backend`` would hold, from
    the backend-independent passes and their memory plan, before any backend allocates
    anything (the cpu backend's own plan differs by a few percent), with what the programs
    ``built`` beside it hold (the eval program: its arena, its bf16 weight copies, which
    the step shares, and its scratch); ``copies`` of each of the ``n_param`` trained
    values (``TrainStep.state_copies``), ``full``: they are the model's weights;
    ``shared``: the programs' intermediates share one arena (``SharedArena``)."""
    backend_cls = get_backend(backend)
    graph, _, plan = scheduled(passes(tape, outputs, updates, backend_cls, checkpoint),
                               backend_cls)
    built = list(built)
    return Estimate(weights=resident_bytes(model.weights) + _bf16_copies(built),
                    activations=_arenas([plan]
                                        + [p.memory for p in built], shared),
                    scratch=max([fused_scratch_bytes(graph)]
                                + [_scratch(p, model.weights, tape.dtype)
                                   + fused_scratch_bytes(p.graph) for p in built]),
                    state=n_param * tape.dtype.itemsize * copies,
                    state_name=_STATE_NAME[full], flops=product_flops(graph))


_STATE_NAME = {False: "adapter + optimizer", True: "params + optimizer"}


def product_flops(graph) -> int:
    """The floating-point operations of ``graph``'s matrix products (dense and with
    block weights), ``2 m k n`` each: most of a step's work, and what recomputing a
    layer adds (the fused primitives' own products are left out)."""
    total = 0
    for v in graph.ops:
        if v.op == "matmul":
            a = v.inputs[0]
            total += 2 * v.size * a.shape[-2 if v.attrs.get("ta") else -1]
        elif v.op in ("qmatmul", "qmatmul_t"):
            total += 2 * v.size * v.inputs[0].shape[-1]
    return total


def _arenas(plans, shared) -> int:
    """Bytes of the memory plans' buffers: their sum, or ``shared`` in one arena per
    dtype, as large as the largest plan's."""
    if not shared:
        return sum(int(p.nbytes) for p in plans)
    most = {}
    for p in plans:
        for dtype, n in p.buffer_sizes:
            most[dtype] = max(most.get(dtype, 0), n * dtype.itemsize)
    return sum(most.values())


def _bf16_copies(progs):
    """Bytes of the bf16 weight copies the programs' GEMMs read (shared ones once)."""
    arrays = {id(a): a for p in progs
              for a in getattr(p.executable, "bf16_weights", list)()}
    return sum(int(a.nbytes) for a in arrays.values())


def estimate(model, step) -> Estimate:
    """What ``step`` (a compiled ``TrainStep``) on ``model`` holds once it runs."""
    progs = _programs(step)
    dtype = step.tape.dtype
    # params, two moments, an accumulator, and a copy of each in the eval program
    state = step.n_param * dtype.itemsize * step.state_copies
    return Estimate(weights=resident_bytes(model.weights) + _bf16_copies(progs),
                    # a shared arena, where the backend took it (cuda keeps its own)
                    activations=(getattr(getattr(step, "arena", None), "nbytes", 0)
                                 or sum(int(p.memory.nbytes) for p in progs)),
                    scratch=max((_scratch(p, model.weights, dtype)
                                 + fused_scratch_bytes(p.graph) for p in progs), default=0),
                    state=state,
                    state_name=_STATE_NAME[step.full])


def check(est: Estimate, available, hint=""):
    """Raise when ``est`` needs more than ``available`` bytes (None: unknown, no check)."""
    if available is None or est.total <= available:
        return
    raise GradtapeError(f"not enough memory: this run needs {est.describe()}, but only "
                        f"{available / GiB:.1f} GiB is available{hint}")
