"""The execution plan: every choice a run makes, decided once and written down.

A ``Plan`` says, for one model, shape and machine, how a compiled program runs: the
precision of the frozen-weight products (``compute``), where float32 GEMMs run
(``f32_gemms``: oneDNN on OpenMP's threads, or NumPy's BLAS), whose bf16 GEMMs the
block-weight products may take (``bf16_gemms``: oneDNN's, and MKL's where installed and
faster), from how many rows a sequence's attention is the fused primitive (``attention_from``), which ways of a
block-weight product may be timed (``product_ways``), whether block weights read by bf16
products keep one bf16 copy each (``resident_weights``), how many layers backward
recomputes (``checkpoint``), whether products with trained weights take bf16 too
(``trained_bf16``: full fine-tuning) and the threads.  Each choice carries the sentence
that says why.  Where a measurement decides (bf16 against float32, the attention's two
routes), it is made here once per CPU and cached (``backends.cpu.measure.rates``);
settings come from ``settings``.  ``compile``, the backends, ``TrainStep`` and generation
receive the plan and carry it out: a backend that cannot honour a choice says so, and
the caller records the plan it ran (``Plan.replace``).

Not here: the per-product timings of a block-weight GEMM's tile layouts, which the CPU
backend makes as it binds each product, among the ways the plan leaves open.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import settings, tiled
from .backends import get_backend
from .compile import compile_program
from .errors import GradtapeError

BLOCK_PRODUCTS = ("qmatmul", "qmatmul_t")

COMPUTE_CHOICES = ("float32", "bf16", "int8", "auto")
DEFAULT_COMPUTE = "auto"
PRODUCT_WAYS = ("blocked", "plain", "swapped", "fused", "amx", "amx-rows", "direct",
                "resident")

# the attention is fused from this many rows of a sequence on (it keeps no [T, T]
# scores); below it, with at most two query tiles, the tiled walk skips at most a
# quarter of the scores and its per-tile work costs more than that
ATTN_TILED_MIN = 2 * tiled.ATTN_TILE + 1

# a float32 program whose main matmul has fewer FLOPs keeps NumPy's BLAS, unmeasured
F32_MEASURED_FLOPS = 1 << 26

# a prompt runs as one compiled bf16 program from this much GEMM work on (compiling and
# converting cost about that much), as one float32 program from PROMPT_F32_ROWS rows on
PROMPT_BF16_FLOPS = 1e11
PROMPT_F32_ROWS = 2048

# the reference pass's base-model forward takes up to this many rows a call: each call
# reads (dequantizes) every weight once, so pairs run together where they fit
REFERENCE_ROWS = 2048


def reference_pairs(n, seq_len) -> int:
    """Pairs per call of a base-model reference pass over ``n`` pairs of two ``seq_len``
    rows each: at most ``REFERENCE_ROWS`` rows, the calls as even as they can be (the
    last one's padding is less than a call)."""
    most = max(1, REFERENCE_ROWS // (2 * seq_len))
    calls = -(-max(n, 1) // most)
    return -(-max(n, 1) // calls)


class Decision(NamedTuple):
    """One choice of the plan and the sentence that says why (a pair: ``value, why =
    decision``)."""
    value: object
    why: str = ""

    def __str__(self):
        return f"{self.value}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class Plan:
    backend: str = "numpy"
    compute: Decision = Decision("float32", "asked for")
    f32_gemms: Decision | None = None  # None: decided from the compiled graph
    # the libraries of block-weight products' bf16 GEMMs: onednn, or mkl (MKL's plain
    # ways timed beside oneDNN's)
    bf16_gemms: Decision = Decision("onednn", "")
    attention_from: Decision = Decision(ATTN_TILED_MIN, "")
    product_ways: tuple = ()  # the only ways a block-weight product may take; () = any
    product_tile: str = ""  # the only tile size it may take; "" = any
    checkpoint: Decision = Decision(0, "off")
    # whether each block weight read by bf16 products keeps a bf16 copy of itself
    # (dequantized once) rather than dequantizing its tiles at every step
    resident_weights: Decision = Decision(False, "")
    # whether the products with a trained weight (a float param: full fine-tuning) take
    # bf16 inputs as the frozen-weight ones do, the weight converted once per replay
    trained_bf16: Decision = Decision(False, "")
    threads: int = 1

    def replace(self, **changes) -> "Plan":
        """This plan with some choices changed (``Decision`` values, or plain values for
        the fields that are not decisions)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The plan, a line per choice."""
        lines = [f"backend: {self.backend}, {self.threads} threads",
                 f"compute: {self.compute}"]
        if self.f32_gemms is not None and self.f32_gemms.why:
            lines.append(f"float32 GEMMs: {self.f32_gemms}")
        if self.bf16_gemms.why:
            lines.append(f"bf16 GEMMs: {self.bf16_gemms}")
        if self.attention_from.why:
            lines.append(f"attention: fused from {self.attention_from}")
        if self.product_ways or self.product_tile:
            lines.append(f"block-weight products: only {' '.join(self.product_ways)} "
                         f"{self.product_tile}".rstrip())
        if self.checkpoint.value:
            lines.append(f"activation checkpointing: {self.checkpoint}")
        if self.resident_weights.value:
            lines.append(f"block weights: {self.resident_weights.why}")
        if self.trained_bf16.value:
            lines.append(f"trained weights: {self.trained_bf16.why}")
        return "\n".join(lines)


_WARNED = set()


def _warn_once(said):
    if said not in _WARNED:
        _WARNED.add(said)
        warnings.warn(f"gradtape: {said}", RuntimeWarning, stacklevel=4)


# the GEMM shape measured where the caller names none: SmolLM2's FFN at T=256
DEFAULT_SHAPE = (256, 576, 1536)


def _measure():
    """The CPU backend's measurements, imported when a choice needs one: a program
    compiled for another backend loads no CPU backend module."""
    from .backends.cpu import measure
    return measure


def decide_compute(requested: str, applies=True, shape=DEFAULT_SHAPE) -> Decision:
    """The precision that will run for ``requested`` (one of COMPUTE_CHOICES): "float32",
    "bf16" or "int8", and why.  ``bf16`` where its GEMMs are not fast (or oneDNN is
    missing) warns once and gives "float32"; ``int8`` where int8 GEMMs are not faster
    than bf16 ones warns once and gives bf16's answer; ``auto`` gives bf16 where its
    GEMMs are the faster at ``shape`` (``(m, k, n)``), silently.  ``applies``: False, or a
    string saying why, where the caller has no bf16 path (another backend, a float64
    program, generation)."""
    if requested not in COMPUTE_CHOICES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, "
                         f"got {requested!r}")
    if requested == "float32":
        return Decision("float32", "asked for")
    shape = tuple(int(d) for d in shape)
    if applies is True:
        fast, why = _measure().bf16_fast(shape)
    else:
        fast, why = False, applies or ("bf16 and int8 compute apply to float32 steps "
                                       "on the cpu backend only")
    if fast and requested == "int8":
        fast8, why8 = _measure().int8_fast(shape)
        if fast8:
            return Decision("int8", f"{why8}; the other frozen-weight GEMMs bf16 ({why})")
        _warn_once(f"int8 compute asked for, running bf16: {why8}")
    if fast:
        return Decision("bf16", why)
    if requested in ("bf16", "int8"):
        _warn_once(f"{requested} compute asked for, running float32: {why}")
    return Decision("float32", why)


def resolve_compute(requested: str, applies=True, shape=DEFAULT_SHAPE) -> str:
    """``decide_compute(...).value``."""
    return decide_compute(requested, applies, shape).value


def f32_gemms(shape) -> Decision:
    """Where a float32 program's GEMMs run ("onednn" or "blas"), decided at ``shape``,
    the ``(m, k, n)`` that carries most of its matmul work (None: it has none)."""
    if shape is None:
        return Decision("blas", "")
    if 2 * np.prod(shape) < F32_MEASURED_FLOPS:
        return Decision("blas", "float32 GEMMs in NumPy's BLAS (small ones, not measured)")
    in_dnnl, why = _measure().f32_onednn(tuple(int(d) for d in shape))
    return Decision("onednn" if in_dnnl else "blas", why)


def bf16_gemms(compute: Decision, backend: str, shape) -> Decision:
    """The libraries whose bf16 GEMMs block-weight products may take: "mkl" (MKL's plain
    ways timed beside oneDNN's, per product) where the products are bf16 or int8 on the
    cpu backend, MKL may run here (``backends.cpu.mkl``, an optional dependency) and its
    plain GEMMs measured faster than oneDNN's at ``shape``, the model's FFN ``(m, k,
    n)``; else "onednn", unsaid where MKL is not in question."""
    if backend != "cpu" or compute.value not in ("bf16", "int8"):
        return Decision("onednn", "")
    value, why = _measure().bf16_provider(tuple(int(d) for d in shape))
    return Decision(value, why)


def _forced_ways():
    """The ways and tile size ``$GRADTAPE_BF16_LAYOUT`` / ``$GRADTAPE_BF16_TILE`` leave."""
    layout = settings.get("GRADTAPE_BF16_LAYOUT")
    if layout and layout not in PRODUCT_WAYS:
        raise GradtapeError(f"$GRADTAPE_BF16_LAYOUT must be one of {', '.join(PRODUCT_WAYS)}, "
                            f"got {layout!r}")
    return ((layout,) if layout else ()), settings.get("GRADTAPE_BF16_TILE")


def for_program(backend: str, compute="float32") -> Plan:
    """The plan of a program compiled on its own (``Tape.compile``): ``compute`` as
    given ("float32", "bf16" or "int8"; ``decide_compute`` resolves "auto"), the ways
    of block-weight products the settings leave, the threads; where float32 GEMMs run
    is decided from the compiled graph (``complete``)."""
    if compute not in COMPUTE_CHOICES[:3]:
        raise ValueError(f"compile: compute must be 'float32', 'bf16' or 'int8' (resolve "
                         f"'auto' with gradtape.plan.decide_compute), got {compute!r}")
    ways, tile = _forced_ways()
    return Plan(backend=backend, compute=Decision(compute, "asked for"),
                product_ways=ways, product_tile=tile, threads=settings.omp_threads())


def _main_matmul(graph):
    """The ``(m, k, n)`` of the dense matmuls that carry most of ``graph``'s work (None
    where it has none)."""
    flops = collections.Counter()
    for v in graph.ops:
        if v.op == "matmul":
            a = v.inputs[0]
            mkn = (int(np.prod(v.shape[:-1])),
                   int(a.shape[-2] if v.attrs.get("ta") else a.shape[-1]), int(v.shape[-1]))
            flops[mkn] += 2 * int(np.prod(mkn))
    return max(flops, key=flops.get) if flops else None


def complete(plan: Plan, graph) -> Plan:
    """``plan`` with what depends on the compiled ``graph`` decided: where a float32
    program's GEMMs run on the cpu backend (NumPy's BLAS beside float32 block-weight
    tiles, whose GEMMs run there: one thread pool either way; else ``f32_gemms`` at the
    main matmul's shape)."""
    if plan.f32_gemms is not None:
        return plan
    f32 = Decision("blas", "")
    dtypes = {v.dtype for v in graph.ops}
    if plan.backend == "cpu" and plan.compute.value == "float32" and dtypes == {np.dtype(np.float32)}:
        if any(v.op in BLOCK_PRODUCTS for v in graph.ops):
            f32 = Decision("blas", "float32 GEMMs in NumPy's BLAS, as the block-weight tiles'")
        else:
            f32 = f32_gemms(_main_matmul(graph))
    return plan.replace(f32_gemms=f32)


def compile_tape(tape, outputs, backend="numpy", updates=None, compute="float32",
                 checkpoint=False, plan=None, donate=(), arena=None):
    """``Tape.compile``'s body, the core's one door to compilation: the backend named
    resolved (``backends.get_backend``, which may fall back), and the compile pipeline
    carrying out ``plan`` (or one for ``compute``), completed for the compiled graph."""
    cls = get_backend(backend)
    plan = for_program(cls.name, compute) if plan is None else plan.replace(backend=cls.name)
    return compile_program(tape, outputs, cls, updates, plan, checkpoint, complete=complete,
                           donate=donate, arena=arena)


def attention_route(cfg, n_seq, t, backend, compute, probe,
                    tiled_min=ATTN_TILED_MIN) -> Decision:
    """The rows per sequence from which a training step's attention is the fused
    primitive: ``ATTN_TILED_MIN``, or ``t`` where ``t`` spans two query tiles (129-256
    rows) and the fused attention measured faster than the composed one on this CPU
    (``probe(cfg, n_seq, t, compute)`` gives both times: a few layers' attention forward
    and backward at the step's shape, timed in turn; cached per CPU).  Other backends,
    and a machine without oneDNN to key the cache by: ``ATTN_TILED_MIN``.
    ``$GRADTAPE_ATTENTION`` = fused | composed decides instead of the timing.
    ``tiled_min``: the graph's own threshold (``models.graph.ATTN_TILED_MIN``)."""
    if backend != "cpu" or not tiled.ATTN_TILE < t <= 2 * tiled.ATTN_TILE or t >= tiled_min:
        return Decision(tiled_min, "")
    forced = settings.get("GRADTAPE_ATTENTION")
    if forced in ("fused", "composed"):
        return Decision(t if forced == "fused" else tiled_min, f"{forced} ($GRADTAPE_ATTENTION)")
    if forced:
        _warn_once(f"$GRADTAPE_ATTENTION={forced} is neither fused nor composed: timing both")
    measure = _measure()
    shape = (n_seq, t, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim)
    try:
        (composed, fused), cached = measure.rates(
            f"attention {compute}", shape, lambda *_: probe(cfg, n_seq, t, compute),
            kernels=True)
    except measure.onednn.DnnlError:  # no oneDNN: nothing to key the cached timing by
        return Decision(tiled_min, "")
    why = (f"fused {1e3 * fused:.1f} vs composed {1e3 * composed:.1f} ms at {t} rows, "
           f"timed {'before ' if cached else ''}on this CPU")
    return Decision(t if fused < composed else tiled_min,
                    ("fused" if fused < composed else "composed") + f" ({why})")


def for_training(cfg, n_seq, t, backend, dtype, compute, attention) -> Plan:
    """The plan of a training step over ``n_seq`` sequences of ``t`` rows of a model of
    config ``cfg``: the frozen-weight GEMMs' precision (bf16 only on the cpu backend of a
    float32 step, where this CPU runs it faster at the model's FFN shape), the
    attention's route (``attention(cfg, n_seq, t, backend, compute)``, the model's
    ``attention_route`` with its probe), the ways of block-weight products and the
    threads.  Checkpointing is the
    step's to add (``Plan.replace``): it is decided from the compiled step's memory."""
    rows = n_seq * t
    applies = backend == "cpu" and np.dtype(dtype) == np.float32
    shape = (rows, cfg.dim, cfg.ffn_dim)
    precision = decide_compute(compute, applies=applies, shape=shape)
    return for_program(backend, precision.value).replace(
        compute=precision, bf16_gemms=bf16_gemms(precision, backend, shape),
        attention_from=attention(cfg, n_seq, t, backend, precision.value))


# bf16 copies of the block weights (2 bytes a value) are kept where they take at most this
# share of the memory available; beyond it the products dequantize tiles at every step
RESIDENT_SHARE = 0.25


def resident_weights(plan: Plan, copy_bytes: int, available) -> Plan:
    """``plan`` with ``resident_weights`` decided: where its products are bf16 and the
    bf16 copies of the block weights (``copy_bytes``) fit in ``RESIDENT_SHARE`` of the
    ``available`` bytes (None: unknown, no copies), each block weight is dequantized once
    into a bf16 copy the products read (the tiles' very values)."""
    if plan.compute.value != "bf16" or not copy_bytes:
        return plan
    if available is None or copy_bytes > RESIDENT_SHARE * available:
        return plan.replace(resident_weights=Decision(False, (
            f"dequantized tile by tile: their bf16 copies ({copy_bytes / 2**30:.2f} GiB) "
            "would not fit")))
    return plan.replace(resident_weights=Decision(True, (
        f"read from bf16 copies made once ({copy_bytes / 2**30:.2f} GiB)")))


def prompt_compute(cfg, compute, rows, dtype, vector_rows, linear_weights) -> Decision:
    """How generation runs a prompt of ``rows`` rows: as one compiled program in "bf16"
    (or "int8"), in "float32", or row by row in the decoder's own prefill (None).  bf16
    under ``auto`` where this CPU's bf16 GEMMs are faster and the prompt's work pays for
    compiling the program (``PROMPT_BF16_FLOPS``), under ``bf16`` wherever the prompt has
    more rows than the matrix-vector kernels take (``vector_rows``) and this CPU's bf16
    GEMMs are fast at the model's width; else float32 from ``PROMPT_F32_ROWS`` rows on
    (the program's tiled attention).  ``linear_weights``: the model's weights per token
    of work."""
    if compute not in COMPUTE_CHOICES:
        raise GradtapeError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, "
                            f"got {compute!r}")
    small = compute == "auto" and 2 * rows * linear_weights < PROMPT_BF16_FLOPS
    if compute != "float32" and rows > vector_rows and not small:
        applies = np.dtype(dtype) == np.float32 or "generation in float64 runs float64"
        # asked for by name: wherever this CPU's bf16 GEMMs are fast at the model's width
        m = rows if compute == "auto" else DEFAULT_SHAPE[0]
        precision = decide_compute(compute, applies, shape=(m, cfg.dim, cfg.ffn_dim))
        if precision.value != "float32":
            return precision
    if np.dtype(dtype) == np.float32 and rows >= PROMPT_F32_ROWS:
        return Decision("float32", f"{rows} rows: one program")
    return Decision(None, f"{rows} rows: row by row")
