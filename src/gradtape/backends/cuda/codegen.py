"""CUDA C generation for the cuda backend, and a CPU harness that runs the same text.

Every kernel is generated as one ``GT_KERNEL void GT_NAME(<pointer params>)`` definition
written against a thin macro layer (``GT_KERNEL``, ``GT_DEV``, ``__shared__``,
``__syncthreads()``, ``threadIdx`` / ``blockIdx`` / ``blockDim`` / ``gridDim``, bit casts).
``CUDA_PRELUDE`` maps the layer onto CUDA for NVRTC (``cupy.RawModule``);
``HARNESS_PRELUDE`` maps it onto C99 + pthreads for the system ``cc``: a launch runs the
blocks one after another, each block as ``blockDim.x`` threads meeting at a pthread
barrier, ``__shared__`` locals become ``static`` (one block at a time shares them).  So the
exact text NVRTC compiles is also compiled and run on the CPU in the tests.

The math is shared with the C backend (``backends/lowering.py``): ``ELEMENTWISE`` turns each
elementwise primitive into an expression over a ``CTypes``, ``ROW_MATH`` gives each row
reduction's steps; ``CudaTypes`` only changes the spellings
(CUDA's ``expf``, decimal literals, no libm macros).

Storage: each array has a storage code, ``float32`` / ``float64`` / ``int64`` / ``int32``
or ``bf16`` (bfloat16 bits in an ``unsigned short``: loads widen to float, stores round
to nearest even).  Arithmetic runs in the tape dtype (float for float32 and bf16 storage).

Kernel kinds (all grid-stride, so any grid size is correct):
* elementwise fused group: one thread per element of the collapsed domain; a member whose
  shape is a prefix of the domain (a ``[T, 1]`` column) is recomputed per element and
  written only where the indices it does not vary along are 0.
* rowreduce fused group and the standalone reductions (``sum``, ``sum_to``, ``softmax``,
  ``logsumexp`` over any axes): one block per output row, threads stride over the row,
  shared-memory tree reductions (``blockDim.x`` a power of two).
* data movement (reshape, transpose, broadcast_to, slice, pad, concat, take_rows, pick,
  put) as gathers over the output: one thread per output element; scatter_rows as a zero
  fill and an atomic add.

This module knows nothing of devices or memory (``devices.py``, ``backend.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ...compile.fuse import FusedGroup, is_row_reduction
from ..cpu.toolchain import build
from ..lowering import (C_ELEMENTWISE, ROW_MATH, CTypes, broadcast_strides, collapse_domain,
                        contig_strides, expr, index_expr, row_layout)

STORAGE_CTYPE = {"float32": "float", "float64": "double", "bf16": "unsigned short",
                 "int64": "long long", "int32": "int"}
STORAGE_NPTYPE = {"float32": np.float32, "float64": np.float64, "bf16": np.uint16,
                  "int64": np.int64, "int32": np.int32}
MAX_BLOCK = 1024  # the shared reduction arrays' size; blockDim.x must not exceed it

_COMMON = r"""
GT_DEV float gt_bf2f(unsigned short h) { return GT_U2F(((unsigned int)h) << 16); }
/* float -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN */
GT_DEV unsigned short gt_f2bf(float f) {
    unsigned int u = GT_F2U(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
GT_DEV float gt_maxf(float a, float b) { return (a > b || a != a) ? a : b; }
GT_DEV double gt_maxd(double a, double b) { return (a > b || a != a) ? a : b; }
/* block-wide reductions over sh[0 .. blockDim.x); every thread of the block calls them */
#define GT_BLOCK_REDUCE(NAME, T, COMBINE)                                          \
GT_DEV T NAME(T v, T *sh) {                                                        \
    sh[threadIdx.x] = v;                                                           \
    __syncthreads();                                                               \
    for (unsigned int s = blockDim.x >> 1; s > 0; s >>= 1) {                       \
        if (threadIdx.x < s) sh[threadIdx.x] = COMBINE(sh[threadIdx.x], sh[threadIdx.x + s]); \
        __syncthreads();                                                           \
    }                                                                              \
    const T r = sh[0];                                                             \
    __syncthreads();                                                               \
    return r;                                                                      \
}
#define GT_ADD(a, b) ((a) + (b))
GT_BLOCK_REDUCE(gt_bsumf, float, GT_ADD)
GT_BLOCK_REDUCE(gt_bmaxf, float, gt_maxf)
GT_BLOCK_REDUCE(gt_bsumd, double, GT_ADD)
GT_BLOCK_REDUCE(gt_bmaxd, double, gt_maxd)
"""

CUDA_PRELUDE = r"""
#define GT_KERNEL extern "C" __global__
#define GT_DEV static __device__ __forceinline__
#define GT_F2U(x) __float_as_uint(x)
#define GT_U2F(x) __uint_as_float(x)
#define GT_INFF __int_as_float(0x7f800000)
#define GT_NANF __int_as_float(0x7fc00000)
#define GT_INFD __longlong_as_double(0x7ff0000000000000LL)
#define GT_NAND __longlong_as_double(0x7ff8000000000000LL)
#define GT_ATOMIC_ADD(p, v) atomicAdd((p), (v))
""" + _COMMON

HARNESS_PRELUDE = r"""
#include <math.h>
#include <pthread.h>
#include <string.h>
typedef struct { unsigned int x, y, z; } gt_dim3;
static __thread gt_dim3 threadIdx, blockIdx;
static gt_dim3 blockDim, gridDim;
static pthread_barrier_t gt_bar;
static pthread_mutex_t gt_mu = PTHREAD_MUTEX_INITIALIZER;
#define GT_KERNEL static
#define GT_DEV static inline
#define __shared__ static
#define __restrict__ restrict
#define __syncthreads() pthread_barrier_wait(&gt_bar)
static inline unsigned int GT_F2U(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float GT_U2F(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
#define GT_INFF ((float)INFINITY)
#define GT_NANF ((float)NAN)
#define GT_INFD ((double)INFINITY)
#define GT_NAND ((double)NAN)
#define GT_ATOMIC_ADD(p, v) do { pthread_mutex_lock(&gt_mu); *(p) += (v); \
                                 pthread_mutex_unlock(&gt_mu); } while (0)
typedef struct { void **P; unsigned int t, b; } gt_tinfo;
static void gt_launch(void *(*f)(void *), void **P, int grid, int block) {
    pthread_t th[1024];
    gt_tinfo ti[1024];
    blockDim.x = (unsigned int)block; blockDim.y = blockDim.z = 1;
    gridDim.x = (unsigned int)grid; gridDim.y = gridDim.z = 1;
    for (int b = 0; b < grid; b++) {
        pthread_barrier_init(&gt_bar, 0, (unsigned int)block);
        for (int t = 0; t < block; t++) {
            ti[t].P = P; ti[t].t = (unsigned int)t; ti[t].b = (unsigned int)b;
            pthread_create(&th[t], 0, f, &ti[t]);
        }
        for (int t = 0; t < block; t++) pthread_join(th[t], 0);
        pthread_barrier_destroy(&gt_bar);
    }
}
""" + _COMMON


class CudaTypes(CTypes):
    """``CTypes`` with CUDA spellings: the math functions NVRTC provides without headers,
    and decimal literals (exact: ``repr`` round-trips the dtype-rounded value)."""

    def __init__(self, dtype):
        super().__init__(dtype)
        sfx = "f" if self.f32 else ""
        self.exp, self.log, self.sqrt = "exp" + sfx, "log" + sfx, "sqrt" + sfx
        self.tanh, self.pow = "tanh" + sfx, "pow" + sfx
        self.acc = "f" if self.f32 else "d"  # suffix of the gt_bsum / gt_bmax helpers

    def lit(self, c):
        c = float(self.dtype.type(c))
        sfx = "F" if self.f32 else "D"
        if c != c:
            return f"GT_NAN{sfx}"
        if c in (float("inf"), float("-inf")):
            return f"GT_INF{sfx}" if c > 0 else f"(-GT_INF{sfx})"
        return f"({c!r}{'f' if self.f32 else ''})"


def compute_types(dtype):
    return CudaTypes(np.float32 if np.dtype(dtype) == np.float32 else np.float64)


# --- storage-aware loads and stores ---------------------------------------------------------

def load(code, ref, t):
    """Read ``ref`` (an element of storage ``code``) as compute type ``t``."""
    if code == "bf16":
        return f"gt_bf2f({ref})" if t == "float" else f"(({t})gt_bf2f({ref}))"
    if STORAGE_CTYPE[code] == t:
        return ref
    return f"(({t}){ref})"


def store(code, ref, value, t):
    if code == "bf16":
        return f"{ref} = gt_f2bf((float)({value}));"
    if STORAGE_CTYPE[code] == t:
        return f"{ref} = {value};"
    return f"{ref} = ({STORAGE_CTYPE[code]})({value});"


@dataclass(frozen=True)
class Kernel:
    """One generated kernel: its text (named ``GT_NAME``), its parameters' C types, and
    how it is launched: ``("elem", n)`` one thread per element, ``("rows", n)`` one block
    per row."""
    text: str
    params: tuple
    launch: tuple


def _signature(ins, outs):
    """Parameter declarations: inputs ``a0..`` (const), then outputs ``o0..``."""
    ps, types = [], []
    for k, code in enumerate(ins):
        ct = STORAGE_CTYPE[code]
        ps.append(f"const {ct} *__restrict__ a{k}")
        types.append(f"const {ct} *")
    for k, code in enumerate(outs):
        ct = STORAGE_CTYPE[code]
        ps.append(f"{ct} *__restrict__ o{k}")
        types.append(f"{ct} *")
    return ", ".join(ps), tuple(types)


def _decompose(var, dims, names, indent):
    """Lines splitting the flat index ``var`` over ``dims`` (C order) into ``names``."""
    lines = []
    if len(dims) == 1:
        return [f"{indent}const long {names[0]} = {var};"]
    lines.append(f"{indent}long gt_r = {var};")
    for d in range(len(dims) - 1, 0, -1):
        lines.append(f"{indent}const long {names[d]} = gt_r % {dims[d]}L; gt_r /= {dims[d]}L;")
    lines.append(f"{indent}const long {names[0]} = gt_r;")
    return lines


_GRID_LOOP = ("for (long {e} = (long)blockIdx.x * blockDim.x + threadIdx.x; {e} < {n}L; "
              "{e} += (long)gridDim.x * blockDim.x) {{")
_ROW_LOOP = "for (long {b} = blockIdx.x; {b} < {n}L; {b} += gridDim.x) {{"


# --- fused groups -------------------------------------------------------------------------

class _GroupLowering:
    def __init__(self, group, storage):
        self.g = group
        self.ct = compute_types(group.ops[-1].inputs[0].dtype if group.kind == "rowreduce"
                                else group.ops[0].dtype)
        self.st = storage
        self.member_id = {m: k for k, m in enumerate(group.ops)}
        self.in_id = {x: k for k, x in enumerate(group.inputs)}
        self.out_id = {m: k for k, m in enumerate(group.outputs)}
        self.sig, self.params = _signature([storage[x] for x in group.inputs],
                                           [storage[m] for m in group.outputs])

    def operand(self, x, strides, ivars):
        if x in self.member_id:
            return f"v{self.member_id[x]}"
        ref = f"a{self.in_id[x]}[{index_expr(strides[x], ivars)}]"
        return load(self.st[x], ref, self.ct.t)

    def value(self, m, strides, ivars):
        args = [self.operand(x, strides, ivars) for x in m.inputs]
        return (f"const {self.ct.t} v{self.member_id[m]} = "
                f"{expr(m.op, args, m.attrs, self.ct)};")

    def write(self, m, strides, ivars):
        k = self.out_id[m]
        return store(self.st[m], f"o{k}[{index_expr(strides[m], ivars)}]",
                     f"v{self.member_id[m]}", self.ct.t)


def elementwise_kernel(group, storage) -> Kernel:
    low = _GroupLowering(group, storage)
    dom = list(group.domain)
    arrays = list(group.inputs) + list(group.ops)
    dom, strides = collapse_domain(dom, {x: broadcast_strides(x.shape, dom) for x in arrays})
    if not dom:
        dom = [1]
        strides = {x: [0] for x in arrays}
    n = int(np.prod(dom, dtype=np.int64))
    ivars = [f"i{d}" for d in range(len(dom))]
    lines = [f"GT_KERNEL void GT_NAME({low.sig}) {{",
             "    " + _GRID_LOOP.format(e="e", n=n)]
    lines += _decompose("e", dom, ivars, "        ")
    for m in group.ops:
        lines.append("        " + low.value(m, strides, ivars))
        if m in low.out_id:
            # written once: at index 0 of every dim the member does not vary along
            guard = [f"{ivars[d]} == 0" for d in range(len(dom))
                     if strides[m][d] == 0 and dom[d] > 1]
            w = low.write(m, strides, ivars)
            lines.append("        " + (f"if ({' && '.join(guard)}) {w}" if guard else w))
    lines += ["    }", "}"]
    return Kernel("\n".join(lines), low.params, ("elem", n))


def _row_math(op, ct, row_pass, store_row, store_elem, **names):
    """The lines of ``ROW_MATH[op]`` over one row, in a block: ``row_pass(extra, first)``
    loops the threads over the row with ``xv`` bound to x at j (``first``: the first pass,
    which also writes a fused group's escaping members); the max and the sum are block
    reductions; ``store_row(value)`` / ``store_elem(value)`` write the outputs.  The row
    is recomputed in each pass (no scratch row: bf16 outputs would round it)."""
    math = ROW_MATH[op]
    t = ct.t
    names = {"m": "m", "s": "s", **names}
    L = []
    if math.max_first:
        L.append(f"        {t} m = -GT_INF{'F' if ct.f32 else 'D'};")
        L += row_pass([f"m = gt_max{ct.acc}(m, xv);"], True)
        L.append(f"        m = gt_bmax{ct.acc}(m, gt_sh);")
    term = math.fill(math.term, ct, x="xv", **names)
    L.append(f"        {t} s = {ct.lit(0.0)};")
    L += row_pass([f"s += {term};"], not math.max_first)
    L.append(f"        s = gt_bsum{ct.acc}(s, gt_sh);")
    if math.row:
        L.append(f"        if (threadIdx.x == 0) {store_row(math.fill(math.row, ct, **names))}")
    if math.elem:
        L += row_pass([store_elem(math.fill(math.elem, ct, e=term, **names))], False)
    return L


def rowreduce_kernel(group, storage) -> Kernel:
    """One block per row of the reduced input: hoisted members first, then the
    reduction's passes over the row, each recomputing the row members it needs (members
    that leave the group are written in the first pass)."""
    low = _GroupLowering(group, storage)
    ct, t = low.ct, low.ct.t
    red, body, (R, C), strides, lv = row_layout(group)
    iv = ["i", "j"]
    inner = [m for m in body if lv[m] == 2]
    L = [f"GT_KERNEL void GT_NAME({low.sig}) {{",
         f"    __shared__ {t} gt_sh[{MAX_BLOCK}];",
         "    " + _ROW_LOOP.format(b="i", n=R)]
    for level, guard in ((0, "i == 0 && threadIdx.x == 0"), (1, "threadIdx.x == 0")):
        for m in body:
            if lv[m] == level:
                L.append("        " + low.value(m, strides, iv))
                if m in low.out_id:
                    L.append(f"        if ({guard}) {low.write(m, strides, iv)}")
    x = red.inputs[0]
    o = f"o{low.out_id[red]}"
    so = storage[red]

    def row_pass(extra, write):
        out = [f"        for (long j = threadIdx.x; j < {C}L; j += blockDim.x) {{"]
        for m in inner:
            out.append("            " + low.value(m, strides, iv))
            if write and m in low.out_id:
                out.append("            " + low.write(m, strides, iv))
        out.append(f"            const {t} xv = {low.operand(x, strides, iv)};")
        out += ["            " + e for e in extra]
        out.append("        }")
        return out

    L += _row_math(red.op, ct, row_pass, lambda val: store(so, f"{o}[i]", val, t),
                   lambda val: store(so, f"{o}[i*{C}L + j]", val, t))
    L += ["    }", "}"]
    return Kernel("\n".join(L), low.params, ("rows", R))


def group_kernel(group, storage) -> Kernel:
    if group.kind == "elementwise":
        return elementwise_kernel(group, storage)
    return rowreduce_kernel(group, storage)


def single_group(v):
    """A lone elementwise op or row reduction as a FusedGroup of one member."""
    kind = "rowreduce" if is_row_reduction(v) else "elementwise"
    ins = []
    for x in v.inputs:
        if x not in ins:
            ins.append(x)
    dom = v.inputs[0].shape if kind == "rowreduce" else v.shape
    return FusedGroup(kind=kind, ops=(v,), inputs=tuple(ins), outputs=(v,), domain=tuple(dom))


# --- reductions over any axes -------------------------------------------------------------

def _reduced_axes(v):
    x = v.inputs[0]
    n = x.ndim
    if v.op == "sum_to":
        shape = tuple(v.attrs["shape"])
        lead = n - len(shape)
        return tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                          if d == 1 and x.shape[lead + i] != 1)
    axis = v.attrs.get("axis")
    if axis is None:
        return tuple(range(n))
    return (axis % n,)


def reduce_kernel(v, storage) -> Kernel:
    """sum / sum_to / softmax / logsumexp over arbitrary axes: one block per kept index
    (in C order, which is also the order of a sum's or logsumexp's output)."""
    x = v.inputs[0]
    ct = compute_types(x.dtype)
    t = ct.t
    red = set(_reduced_axes(v))
    xst = contig_strides(x.shape)
    kept = [d for d in range(x.ndim) if d not in red]
    rax = sorted(red)
    K = int(np.prod([x.shape[d] for d in kept], dtype=np.int64))
    Rn = int(np.prod([x.shape[d] for d in rax], dtype=np.int64))
    sig, params = _signature([storage[x]], [storage[v]])
    L = [f"GT_KERNEL void GT_NAME({sig}) {{",
         f"    __shared__ {t} gt_sh[{MAX_BLOCK}];",
         "    " + _ROW_LOOP.format(b="b", n=K)]
    if kept:
        names = [f"k{d}" for d in kept]
        L += ["    " + s for s in _decompose("b", [x.shape[d] for d in kept], names, "    ")]
        base = " + ".join(f"{nm}*{xst[d]}L" for nm, d in zip(names, kept))
    else:
        base = "0"
    L.append(f"        const long base = {base};")

    def row_pass(extra):
        out = [f"        for (long r = threadIdx.x; r < {Rn}L; r += blockDim.x) {{"]
        if rax:
            rn = [f"r{d}" for d in rax]
            out += ["    " + s for s in _decompose("r", [x.shape[d] for d in rax], rn,
                                                  "        ")]
            off = " + ".join(f"{nm}*{xst[d]}L" for nm, d in zip(rn, rax))
        else:
            off = "0"
        out.append(f"            const long off = base + {off};")
        out.append(f"            const {t} xv = {load(storage[x], 'a0[off]', t)};")
        out += ["            " + e for e in extra]
        out.append("        }")
        return out

    so = storage[v]
    L += _row_math("sum" if v.op == "sum_to" else v.op, ct,
                   lambda extra, first: row_pass(extra), lambda val: store(so, "o0[b]", val, t),
                   lambda val: store(so, "o0[off]", val, t))
    L += ["    }", "}"]
    return Kernel("\n".join(L), params, ("rows", K))


def nll_kernel(v, storage) -> Kernel:
    """nll_ids: out[t] = logsumexp(x[t]) - x[t, ids[t]]; nll_ids_grad: out[t, j] =
    (softmax(x[t])_j - [j == ids[t]]) * g[t].  One block per row, as ops/ computes them
    (max, sum of exp(x - max), then the row)."""
    grad = v.op == "nll_ids_grad"
    ins = list(v.inputs)
    g, x, ids = ins if grad else (None, *ins)
    ct = compute_types(x.dtype)
    t = ct.t
    R, V = x.shape
    sig, params = _signature([storage[a] for a in ins], [storage[v]])
    ax, ai = ("a1", "a2") if grad else ("a0", "a1")
    sx = storage[x]
    L = [f"GT_KERNEL void GT_NAME({sig}) {{",
         f"    __shared__ {t} gt_sh[{MAX_BLOCK}];",
         "    " + _ROW_LOOP.format(b="i", n=R),
         f"        const long id = (long){ai}[i];"]

    def row_pass(extra):
        return ([f"        for (long j = threadIdx.x; j < {V}L; j += blockDim.x) {{",
                 f"            const {t} xv = {load(sx, f'{ax}[i*{V}L + j]', t)};"]
                + ["            " + e for e in extra] + ["        }"])

    so = storage[v]
    if grad:
        L.append(f"        const {t} gi = {load(storage[g], 'a0[i]', t)};")
    L += _row_math(v.op, ct, lambda extra, first: row_pass(extra),
                   lambda val: store(so, "o0[i]", val, t),
                   lambda val: store(so, f"o0[i*{V}L + j]", val, t),
                   j="j", id="id", g="gi", xid=load(sx, f"{ax}[i*{V}L + id]", t))
    L += ["    }", "}"]
    return Kernel("\n".join(L), params, ("rows", R))


# --- data movement ------------------------------------------------------------------------

def _split(shape, axis):
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return outer, shape[axis], inner


def _move_type(v):
    return "double" if v.dtype == np.float64 else (
        "float" if v.dtype.kind == "f" else STORAGE_CTYPE[str(v.dtype)])


def gather_kernel(v, storage) -> Kernel:
    """One thread per output element reads its source element (or 0)."""
    ins = list(v.inputs)
    t = _move_type(v)
    sig, params = _signature([storage[x] for x in ins], [storage[v]])
    n = v.size
    so = storage[v]
    L = [f"GT_KERNEL void GT_NAME({sig}) {{", "    " + _GRID_LOOP.format(e="e", n=max(n, 1))]
    ld = lambda k, ref: load(storage[ins[k]], ref, t)  # noqa: E731
    zero = "0"
    op = v.op
    if op == "reshape":
        L.append("        " + store(so, "o0[e]", ld(0, "a0[e]"), t))
    elif op in ("transpose", "broadcast_to"):
        x = ins[0]
        if op == "transpose":
            xs = contig_strides(x.shape)
            src = [xs[p] for p in v.attrs["perm"]]
        else:
            src = broadcast_strides(x.shape, v.shape)
        names = [f"i{d}" for d in range(v.ndim)]
        if v.ndim:
            L += _decompose("e", list(v.shape), names, "        ")
        L.append("        " + store(so, "o0[e]", ld(0, f"a0[{index_expr(src, names)}]"), t))
    elif op in ("slice", "pad", "concat"):
        axis = v.attrs["axis"] % v.ndim
        outer, n_out, inner = _split(v.shape, axis)
        L.append(f"        const long q = e / {n_out * inner}L, a = (e / {inner}L) % {n_out}L, "
                 f"r = e % {inner}L;")
        if op == "slice":
            n_in = ins[0].shape[axis]
            ref = f"a0[q*{n_in * inner}L + (a + {v.attrs['start']}L)*{inner}L + r]"
            L.append("        " + store(so, "o0[e]", ld(0, ref), t))
        elif op == "pad":
            n_in, b = ins[0].shape[axis], v.attrs["before"]
            ref = f"a0[q*{n_in * inner}L + (a - {b}L)*{inner}L + r]"
            L.append(f"        if (a >= {b}L && a < {b + n_in}L) "
                     f"{store(so, 'o0[e]', ld(0, ref), t)}")
            L.append(f"        else {store(so, 'o0[e]', zero, t)}")
        else:
            off = 0
            for k, x in enumerate(ins):
                n_in = x.shape[axis]
                if n_in:
                    ref = f"a{k}[q*{n_in * inner}L + (a - {off}L)*{inner}L + r]"
                    L.append(f"        {'if' if off == 0 else 'else if'} (a < {off + n_in}L) "
                             f"{store(so, 'o0[e]', ld(k, ref), t)}")
                off += n_in
    elif op == "take_rows":
        table, ids = ins
        D = table.shape[1]
        L.append(f"        const long row = e / {D}L, d = e % {D}L;")
        L.append("        const long id = (long)a1[row];")
        L.append("        " + store(so, "o0[e]", ld(0, f"a0[id*{D}L + d]"), t))
    elif op == "pick":
        x, idx = ins
        Vn = x.shape[1]
        L.append("        " + store(so, "o0[e]", ld(0, f"a0[e*{Vn}L + (long)a1[e]]"), t))
    elif op == "put":
        ncols = v.attrs["ncols"]
        L.append(f"        const long row = e / {ncols}L, c = e % {ncols}L;")
        L.append(f"        if (c == (long)a1[row]) {store(so, 'o0[e]', ld(0, 'a0[row]'), t)}")
        L.append(f"        else {store(so, 'o0[e]', zero, t)}")
    else:
        raise KeyError(op)
    L += ["    }", "}"]
    return Kernel("\n".join(L), params, ("elem", max(n, 1)))


def zero_kernel(code, n) -> Kernel:
    sig, params = _signature([], [code])
    z = "0" if code != "bf16" else "(unsigned short)0"
    text = "\n".join([f"GT_KERNEL void GT_NAME({sig}) {{",
                      "    " + _GRID_LOOP.format(e="e", n=n),
                      f"        o0[e] = {z};", "    }", "}"])
    return Kernel(text, params, ("elem", n))


def scatter_add_kernel(v, storage) -> Kernel:
    """out[ids[i], d] += src[i, d] (after a zero fill); out's storage is float32/64."""
    src, ids = v.inputs
    so = storage[v]
    if so not in ("float32", "float64"):
        raise ValueError(f"scatter_rows: output storage {so} has no atomic add")
    t = STORAGE_CTYPE[so]
    D = src.shape[1]
    sig, params = _signature([storage[src], storage[ids]], [so])
    text = "\n".join([f"GT_KERNEL void GT_NAME({sig}) {{",
                      "    " + _GRID_LOOP.format(e="e", n=src.size),
                      f"        const long row = e / {D}L, d = e % {D}L;",
                      f"        GT_ATOMIC_ADD(&o0[(long)a1[row]*{D}L + d], "
                      f"{load(storage[src], 'a0[e]', t)});", "    }", "}"])
    return Kernel(text, params, ("elem", max(src.size, 1)))


def cast_kernel(src_code, dst_code, n) -> Kernel:
    """Element-by-element storage conversion (a float32 matmul operand to bf16)."""
    sig, params = _signature([src_code], [dst_code])
    text = "\n".join([f"GT_KERNEL void GT_NAME({sig}) {{",
                      "    " + _GRID_LOOP.format(e="e", n=n),
                      "        " + store(dst_code, "o0[e]", load(src_code, "a0[e]", "float"),
                                         "float"), "    }", "}"])
    return Kernel(text, params, ("elem", n))


GATHER_OPS = frozenset(("reshape", "transpose", "broadcast_to", "slice", "pad", "concat",
                        "take_rows", "pick", "put"))
REDUCE_OPS = frozenset(("sum", "sum_to", "softmax", "logsumexp"))
NLL_OPS = frozenset(("nll_ids", "nll_ids_grad"))


# --- program source -----------------------------------------------------------------------

class ProgramSource:
    """Unique kernels of one program; ``cuda_source()`` is the NVRTC translation unit,
    ``harness_source()`` the same kernels as C with launchers ``launch_kN``."""

    def __init__(self):
        self.kernels = {}  # (text, params) -> index
        self.params = []

    def add(self, kernel: Kernel) -> int:
        key = (kernel.text, kernel.params)
        if key not in self.kernels:
            self.kernels[key] = len(self.kernels)
            self.params.append(kernel.params)
        return self.kernels[key]

    def _bodies(self):
        return [text.replace("GT_NAME", f"k{k}", 1) for (text, _), k in self.kernels.items()]

    def cuda_source(self):
        return "\n".join([CUDA_PRELUDE, *self._bodies()]) + "\n"

    def harness_source(self):
        parts = [HARNESS_PRELUDE, *self._bodies()]
        for k, params in enumerate(self.params):
            args = ", ".join(f"({p})ti->P[{i}]" for i, p in enumerate(params))
            parts.append(f"static void *gt_thr_k{k}(void *arg) {{\n"
                         f"    gt_tinfo *ti = (gt_tinfo *)arg;\n"
                         f"    threadIdx.x = ti->t; threadIdx.y = threadIdx.z = 0;\n"
                         f"    blockIdx.x = ti->b; blockIdx.y = blockIdx.z = 0;\n"
                         f"    k{k}({args});\n    return 0;\n}}\n"
                         f"void launch_k{k}(void **P, int grid, int block) "
                         f"{{ gt_launch(gt_thr_k{k}, P, grid, block); }}\n")
        return "\n".join(parts) + "\n"

    def names(self):
        return [f"k{k}" for k in range(len(self.kernels))]


def source_hash(text):
    return hashlib.sha256(text.encode()).hexdigest()[:32]


HARNESS_FLAGS = ("-O1", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
                 "-Wall", "-Wno-unused-variable", "-Wno-unused-function")


def build_harness(source, directory=None):
    """Compile ``harness_source()`` text with the system C compiler (cached by hash)."""
    return build(source, HARNESS_FLAGS, prefix="gtcuh", directory=directory)[0]


def fusible(v):
    """Elementwise ops the generator lowers (the same set as the C backend)."""
    return v.op in C_ELEMENTWISE and v.dtype.kind == "f"
