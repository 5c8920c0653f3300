"""Where the cuda backend keeps its values: one device arena per storage dtype.

``storage_codes`` gives every value its storage (``float32``, ``float64``, ``int64``,
``int32``, or ``bf16``: bfloat16 bits, for the big float32 values of a ``bfloat16``
program); ``plan_arena`` lays out the liveness plan's buffers, then every leaf and the
backend's extra slots, at ``ALIGN``-aligned offsets of their dtype's arena; the host-side
conversions to and from storage round as the kernels' ``gt_f2bf`` does.  This module
allocates nothing (``devices.py`` does) and knows no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...compile.fuse import step_inputs, step_outputs
from ...compile.memplan import plan_liveness
from .codegen import STORAGE_NPTYPE

ALIGN = 256  # bytes; every buffer in an arena starts on this boundary
BF16_MIN_SIZE = 65536  # elements: smaller float32 values keep float32 storage


def storage_codes(graph, schedule, storage="float32", bf16_min_size=BF16_MIN_SIZE):
    """Var -> storage code for every leaf and every value that leaves a step."""
    if storage not in ("float32", "bfloat16"):
        raise ValueError(f"cuda backend: storage must be 'float32' or 'bfloat16', got "
                         f"{storage!r}")
    keep32 = set(graph.outputs) | {leaf for leaf, _ in graph.updates} | \
        {src for _, src in graph.updates}
    values = list(graph.leaves)
    for s in schedule.steps:
        values += list(step_outputs(s))
    codes = {}
    for v in values:
        dt = np.dtype(v.dtype)
        if dt == np.float32:
            big = v.size >= bf16_min_size and v not in keep32 and v.op != "scatter_rows"
            codes[v] = "bf16" if storage == "bfloat16" and big else "float32"
        elif dt == np.float64:
            if storage == "bfloat16":
                raise ValueError("cuda backend: bfloat16 storage needs a float32 tape")
            codes[v] = "float64"
        elif dt in (np.int64, np.int32):
            codes[v] = str(dt)
        else:
            raise ValueError(f"cuda backend: values of dtype {dt} are not supported "
                             f"({v.op} #{v.index})")
    return codes


class _Val:
    """A stand-in Var for the liveness planner: the value's size in its storage dtype."""
    __slots__ = ("var", "size", "dtype")

    def __init__(self, var, code):
        self.var, self.size = var, var.size
        self.dtype = np.dtype(STORAGE_NPTYPE[code])


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Arena:
    nbytes: dict  # storage code -> total bytes of that arena
    loc: dict  # Var -> (storage code, byte offset)
    buffers: tuple  # (code, offset, nbytes) per planned (shared) buffer, then per leaf
    plan: object  # the MemoryPlan of intermediates (in storage dtypes)
    extra: dict  # name -> (code, offset, nbytes): snapshots and scratch


def plan_arena(graph, schedule, codes, extra=()) -> Arena:
    """Lay out the liveness plan of the schedule's values (in their storage dtypes) and
    then one slot per leaf and per ``extra`` request ``(name, code, nbytes)``, each at
    an ALIGN-aligned offset of its dtype's arena."""
    vals = {}

    def val(v):
        p = vals.get(v)
        if p is None:
            p = vals[v] = _Val(v, codes[v])
        return p

    steps = [(tuple(val(x) for x in step_inputs(s) if not x.is_leaf),
              tuple(val(m) for m in step_outputs(s))) for s in schedule.steps]
    pinned = {val(v) for v in graph.outputs if not v.is_leaf} | \
        {val(src) for _, src in graph.updates if not src.is_leaf}
    plan = plan_liveness(steps, pinned)
    code_of = {}
    for p, b in plan.slot.items():
        code_of[b] = codes[p.var]
    nbytes, buf_off, buffers = {}, {}, []
    for b, (dt, n) in enumerate(plan.buffer_sizes):
        c = code_of[b]
        off = nbytes.get(c, 0)
        size = max(n, 1) * dt.itemsize
        buf_off[b] = off
        buffers.append((c, off, size))
        nbytes[c] = off + _align(size)
    # a planner may place several values in one buffer (element offsets in plan.offset)
    offset = getattr(plan, "offset", None) or {}
    loc = {p.var: (codes[p.var], buf_off[b] + offset.get(p, 0) * p.dtype.itemsize)
           for p, b in plan.slot.items()}
    for leaf in graph.leaves:
        c = codes[leaf]
        off = nbytes.get(c, 0)
        size = max(leaf.size, 1) * np.dtype(STORAGE_NPTYPE[c]).itemsize
        loc[leaf] = (c, off)
        buffers.append((c, off, size))
        nbytes[c] = off + _align(size)
    ex = {}
    for name, c, size in extra:
        off = nbytes.get(c, 0)
        ex[name] = (c, off, size)
        nbytes[c] = off + _align(max(size, 1))
    return Arena(nbytes=nbytes, loc=loc, buffers=tuple(buffers), plan=plan, extra=ex)


# --- host-side bfloat16 conversion (the same rounding as gt_f2bf) --------------------------

def f32_to_bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), out)
    return out.astype(np.uint16)


def bf16_bits_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_storage(arr, code):
    if code == "bf16":
        return f32_to_bf16_bits(arr)
    return np.ascontiguousarray(arr, dtype=STORAGE_NPTYPE[code])


def from_storage(raw, code, dtype, shape):
    if code == "bf16":
        raw = bf16_bits_to_f32(raw)
    return np.asarray(raw).astype(dtype, copy=False).reshape(shape)
