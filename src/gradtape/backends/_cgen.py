"""C code generation for fused groups (``compile/fuse.py``), and the compile cache.

Each group becomes one ``static void kN(void **p)`` kernel: ``p`` holds the group's
external inputs, then its escaping outputs, as pointers.  Shapes and constants are baked
into the text, so structurally identical groups (every layer, every head) share one
kernel.  ``gt_run(P, calls, n)`` runs ``n`` kernel calls from a table of
``(kernel, offset into P)`` pairs: a stretch of groups between two matmuls costs one
ctypes call.

The math of each primitive comes from ``lowering.py`` (shared with the CUDA generator);
this module renders it as loops.  Float math follows the NumPy forwards of ``ops.py``
operation by operation (same
formulas, the dtype's own precision, no reassociation: ``-ffp-contract=off``, no
``-ffast-math``).  float64 uses libm (exp, log, sqrt, tanh).  float32 ``exp`` is an
inlined Cephes-style polynomial (max error about 1 ulp, measured) that the compiler can
vectorize; libm's ``expf`` is a call that stops vectorization.  Row sums accumulate in
double for both dtypes.

This module knows nothing of buffers or execution; ``cpu.py`` does.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..compile.fuse import prefix_level
from .lowering import ELEMENTWISE, ROW_MATH, CTypes, expr

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-ffp-contract=off", "-fopenmp-simd",
         # on an AVX-512 CPU, 512-bit vectors where GCC would pick 256 for -march=native
         # (no effect elsewhere): SmolLM2's softmax kernel 0.65 -> 0.44 ms (AMX Xeon)
         "-mprefer-vector-width=512")

CSRC = Path(__file__).with_name("csrc")
PRELUDE = (CSRC / "gt_prelude.h").read_text()  # the generated kernels' first lines

# ``gt_denormals(flush)``: a float32 replay flushes denormals (MXCSR's FTZ and DAZ: results
# below 1.2e-38 become zero, such inputs read as zero) on its thread and on every OpenMP
# thread (our kernels', oneDNN's); it returns the caller's previous bits, which a second
# call puts back.  Intel cores take a microcode assist of about a hundred cycles per
# denormal operand or result: an 8B step's attention products, whose softmax underflows
# into denormals, ran at 60 GFLOP/s where they run at 300 (AMX Xeon; TensorFlow flushes
# them the same way).  A no-op (-1) off x86.
DENORMALS = """\
#if defined(__SSE2__)
#include <xmmintrin.h>
int gt_denormals(int flush) {
    const unsigned bits = 0x8040, old = _mm_getcsr() & bits;
    #pragma omp parallel
    _mm_setcsr(flush ? _mm_getcsr() | bits : _mm_getcsr() & ~bits);
    _mm_setcsr(flush ? _mm_getcsr() | bits : _mm_getcsr() & ~bits);
    return (int)old;
}
#else
int gt_denormals(int flush) { (void)flush; return -1; }
#endif
"""


C_ELEMENTWISE = frozenset(ELEMENTWISE)


def _contig_strides(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return st[::-1]


def _bstrides(shape, domain):
    """Element strides of a C-contiguous array of ``shape`` broadcast over ``domain``."""
    k = len(domain)
    padded = (1,) * (k - len(shape)) + tuple(shape)
    st = _contig_strides(padded)
    return [0 if padded[d] == 1 else st[d] for d in range(k)]


def _index(strides, ivars):
    terms = []
    for s, i in zip(strides, ivars):
        if s == 1:
            terms.append(i)
        elif s:
            terms.append(f"{i}*{s}L")
    return " + ".join(terms) if terms else "0"


class _Lowering:
    """Shared pieces: pointer declarations and member statements for one group."""

    def __init__(self, group, ct):
        self.g, self.ct = group, ct
        self.member_id = {m: k for k, m in enumerate(group.ops)}
        self.in_id = {x: k for k, x in enumerate(group.inputs)}
        self.out_id = {m: k for k, m in enumerate(group.outputs)}
        n_in = len(group.inputs)
        t = ct.t
        self.decls = [f"    const {t} *restrict a{k} = (const {t} *)p[{k}];"
                      for k in range(n_in)]
        self.decls += [f"    {t} *restrict o{k} = ({t} *)p[{n_in + k}];"
                       for k in range(len(group.outputs))]

    def operand(self, x, strides_of, ivars):
        if x in self.member_id:
            return f"v{self.member_id[x]}"
        return f"a{self.in_id[x]}[{_index(strides_of[x], ivars)}]"

    def stmt(self, m, strides_of, ivars, write=True):
        args = [self.operand(x, strides_of, ivars) for x in m.inputs]
        k = self.member_id[m]
        s = f"const {self.ct.t} v{k} = {expr(m.op, args, m.attrs, self.ct)};"
        if write and m in self.out_id:
            s += f" o{self.out_id[m]}[{_index(strides_of[m], ivars)}] = v{k};"
        return s


def collapse_domain(dom, strides):
    """Squeeze size-1 domain dims, then merge adjacent dims every array walks contiguously:
    fewer, longer loops.  ``strides``: array -> per-dim element strides (0 = broadcast)."""
    keep = [d for d in range(len(dom)) if dom[d] != 1]
    dom = [dom[d] for d in keep]
    strides = {x: [s[d] for d in keep] for x, s in strides.items()}
    d = len(dom) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * dom[d + 1] for s in strides.values()):
            dom[d] *= dom[d + 1]
            del dom[d + 1]
            for s in strides.values():
                s[d] = s[d + 1]
                del s[d + 1]
        d -= 1
    return dom, strides


def lower_elementwise(group, ct):
    """Loop nest over the (squeezed, collapsed) domain; each member computed at the depth
    of its prefix level, so a [T, 1] member inside a [T, n] group runs once per row."""
    low = _Lowering(group, ct)
    dom = list(group.domain)
    arrays = list(group.inputs) + list(group.ops)
    strides = {x: _bstrides(x.shape, dom) for x in arrays}
    dom, strides = collapse_domain(dom, strides)
    ivars = [f"i{d}" for d in range(len(dom))]

    def level(m):
        s = strides[m]
        return max((d + 1 for d in range(len(dom)) if s[d]), default=0)

    by_level = [[] for _ in range(len(dom) + 1)]
    for m in group.ops:
        by_level[level(m)].append(m)
    lines = list(low.decls)
    # threads split the outermost loop (each iteration writes its own elements)
    par = bool(dom) and dom[0] > 1 and _omp_for(int(np.prod(dom)))
    for depth in range(len(dom) + 1):
        ind = "    " * (depth + 1)
        if depth > 0:
            ind0 = "    " * depth
            if depth == 1 and par and len(dom) == 1:
                lines.append(f"{ind0}#pragma omp parallel for simd schedule(static)")
            elif depth == 1 and par:
                lines.append(f"{ind0}#pragma omp parallel for schedule(static)")
            elif depth == len(dom):
                lines.append(f"{ind0}#pragma GCC ivdep")
            lines.append(f"{ind0}for (long {ivars[depth - 1]} = 0; {ivars[depth - 1]} < "
                         f"{dom[depth - 1]}L; {ivars[depth - 1]}++) {{")
        for m in by_level[depth]:
            lines.append(ind + low.stmt(m, strides, ivars))
    for depth in range(len(dom), 0, -1):
        lines.append("    " * depth + "}")
    return lines


def row_layout(group):
    """A row-reduction group's pieces: ``(reduction, body ops, (R, C), strides, levels)``
    over its ``[R, C]`` domain (a 1-d domain is one row); ``levels``: 1 for a body op
    constant along the row, 2 for one that varies along it."""
    red, body = group.ops[-1], group.ops[:-1]
    dom = tuple(group.domain)
    if len(dom) == 1:
        dom = (1,) + dom
    strides = {x: _bstrides(x.shape, dom) for x in list(group.inputs) + list(body)}
    return red, body, dom, strides, {m: prefix_level(m.shape, dom) for m in body}


def lower_rowreduce(group, ct):
    """Per row: hoisted [R, 1] members, then the reduction's passes over the row, each
    recomputing the [R, C] members it needs (escaping members are written in pass 1)."""
    low = _Lowering(group, ct)
    red, body, (R, C), strides, lv = row_layout(group)
    t = ct.t
    iv = ["i", "j"]
    lines = list(low.decls)
    for m in body:
        if lv[m] == 0:
            lines.append("    " + low.stmt(m, strides, iv))
    if R > 1 and _omp_for(R * C):
        lines.append(_omp_for(R * C))
    lines.append(f"    for (long i = 0; i < {R}L; i++) {{")
    for m in body:
        if lv[m] == 1:
            lines.append("        " + low.stmt(m, strides, iv))
    inner = [m for m in body if lv[m] == 2]
    x = red.inputs[0]
    xs = low.operand(x, strides, iv)
    o = f"o{low.out_id[red]}"

    def row_loop(extra, write, reduction=None):
        out = []
        if reduction:
            out.append(f"        #pragma omp simd reduction({reduction})")
        out.append(f"        for (long j = 0; j < {C}L; j++) {{")
        out += ["            " + low.stmt(m, strides, iv, write) for m in inner]
        out += ["            " + e for e in extra]
        out.append("        }")
        return out

    math = ROW_MATH[red.op]
    names = {"m": "m", "s": "st"}
    if math.max_first:
        # pass 1 also writes the escaping members; an elementwise output row holds x
        # meanwhile (then each term in place), so the row is evaluated once
        lines.append(f"        {t} m = -INFINITY;")
        keep = ["y[j] = xv;"] if math.elem else []
        if math.elem:
            lines.append(f"        {t} *restrict y = {o} + i*{C}L;")
        lines += row_loop([f"const {t} xv = {xs};", *keep, "m = xv > m ? xv : m;"],
                          True, "max:m")
    lines.append("        double s = 0.0;")
    if math.elem:
        term = math.fill(math.term, ct, x="y[j]", **names)
        lines.append("        #pragma omp simd reduction(+:s)")
        lines.append(f"        for (long j = 0; j < {C}L; j++) {{ const {t} e = {term}; "
                     "y[j] = e; s += (double)e; }")
    else:
        term = math.fill(math.term, ct, x=xs, **names)
        lines += row_loop([f"s += (double){term};"], not math.max_first, "+:s")
    lines.append(f"        const {t} st = ({t})s;")
    if math.row:
        lines.append(f"        {o}[i] = {math.fill(math.row, ct, **names)};")
    if math.elem:
        e = math.fill(math.elem, ct, e="y[j]", **names)
        lines.append(f"        for (long j = 0; j < {C}L; j++) y[j] = {e};")
    lines.append("    }")
    return lines


def _split(shape, axis):
    """(outer, n, inner) of a C-contiguous array around ``axis``."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return outer, shape[axis], inner


C_COPY = frozenset(("slice", "pad", "concat", "reshape", "sum_to"))
C_ROWS = frozenset(("softmax", "sum", "nll_ids", "nll_ids_grad", "transpose", "broadcast_to"))


def c_single_op(v):
    """Whether a non-fused op has a C kernel (``copy_kernel_body`` / ``row_kernel_body``)."""
    if v.op == "sum_to":  # the broadcast-gradient reductions of 2-d values
        x = v.inputs[0]
        return x.ndim == 2 and tuple(v.shape) in ((x.shape[1],), (1, x.shape[1]),
                                                  (x.shape[0], 1))
    if v.op in ("softmax", "sum"):  # over the last axis (any rank), or a full sum
        x = v.inputs[0]
        axis = v.attrs.get("axis")
        return x.size > 0 and (axis is None and v.op == "sum" or
                               axis is not None and axis % x.ndim == x.ndim - 1)
    if v.op in ("transpose", "broadcast_to"):
        return 1 <= v.ndim <= 6 and v.size > 0
    return v.op in C_COPY or v.op in ("nll_ids", "nll_ids_grad")


def row_kernel_body(v, dtype):
    """softmax / sum over the last axis of any rank, a full sum, the fused next-token loss
    (``nll_ids``) and its gradient (``nll_ids_grad``), and transposes: the NumPy forwards
    of ops.py row by row (rows are independent: the threads split rows, and every row
    is computed in the same order whatever the split).  ``p``: inputs, then the output."""
    ct = CTypes(dtype)
    t = ct.t
    x = v.inputs[0] if v.op != "nll_ids_grad" else v.inputs[1]
    C = x.shape[-1] if x.ndim else 1
    R = x.size // max(C, 1)
    par = _omp_for(x.size)
    lines = []
    if v.op == "transpose":
        return _transpose_body(v, t)
    if v.op == "broadcast_to":
        return _broadcast_body(v, t)
    if v.op == "sum" and v.attrs.get("axis") is None:
        # one accumulator in double over everything (NumPy adds float32 pairwise)
        return "\n".join([f"    const {t} *restrict a = (const {t} *)p[0];",
                          f"    {t} *restrict o = ({t} *)p[1];", "    double s = 0.0;",
                          "    #pragma omp simd reduction(+:s)",
                          f"    for (long j = 0; j < {x.size}L; j++) s += (double)a[j];",
                          f"    o[0] = ({t})s;"])
    if v.op == "nll_ids_grad":
        lines += [f"    const {t} *restrict g = (const {t} *)p[0];",
                  f"    const {t} *restrict a = (const {t} *)p[1];",
                  "    const int64_t *restrict ids = (const int64_t *)p[2];",
                  f"    {t} *restrict o = ({t} *)p[3];"]
    else:
        lines += [f"    const {t} *restrict a = (const {t} *)p[0];"]
        if v.op == "nll_ids":
            lines += ["    const int64_t *restrict ids = (const int64_t *)p[1];",
                      f"    {t} *restrict o = ({t} *)p[2];"]
        else:
            lines += [f"    {t} *restrict o = ({t} *)p[1];"]
    if par:
        lines.append(par)
    lines.append(f"    for (long i = 0; i < {R}L; i++) {{")
    lines.append(f"        const {t} *restrict x = a + i*{C}L;")
    math = ROW_MATH[v.op]
    names = {"m": "m", "s": "st", "j": "j", "id": "ids[i]", "xid": "x[ids[i]]", "g": "gi"}
    if math.max_first:
        lines += [f"        {t} m = -INFINITY;", "        #pragma omp simd reduction(max:m)",
                  f"        for (long j = 0; j < {C}L; j++) m = x[j] > m ? x[j] : m;"]
    term = math.fill(math.term, ct, x="x[j]", **names)
    if math.elem:  # the output row keeps each term for the last pass
        lines += [f"        {t} *restrict y = o + i*{C}L;", "        double s = 0.0;",
                  "        #pragma omp simd reduction(+:s)",
                  f"        for (long j = 0; j < {C}L; j++) {{ const {t} e = {term}; "
                  "y[j] = e; s += (double)e; }"]
    else:
        lines += ["        double s = 0.0;", "        #pragma omp simd reduction(+:s)",
                  f"        for (long j = 0; j < {C}L; j++) s += (double){term};"]
    lines.append(f"        const {t} st = ({t})s;")
    if v.op == "nll_ids_grad":
        lines.append(f"        const {t} gi = g[i];")
    if math.row:
        lines.append(f"        o[i] = {math.fill(math.row, ct, **names)};")
    if math.elem:
        e = math.fill(math.elem, ct, e="y[j]", **names)
        lines.append(f"        for (long j = 0; j < {C}L; j++) y[j] = {e};")
    lines.append("    }")
    return "\n".join(lines)


def _transpose_body(v, t):
    """out = x.transpose(perm): a loop nest over the output in order; the innermost run
    is a memcpy when the last axis stays last."""
    x = v.inputs[0]
    perm = v.attrs["perm"]
    n = v.ndim
    ist = _contig_strides(x.shape)
    src = [ist[p] for p in perm]  # input stride of each output axis
    shape = list(v.shape)
    inner_copy = perm[-1] == n - 1
    loops = n - 1 if inner_copy else n
    lines = [f"    const {t} *restrict a = (const {t} *)p[0];", f"    {t} *restrict o = ({t} *)p[1];"]
    par = _omp_for(v.size) if shape[0] > 1 else ""
    if par and loops:
        lines.append(par)
    idx = []
    for d in range(loops):
        lines.append("    " * (d + 1) + f"for (long i{d} = 0; i{d} < {shape[d]}L; i{d}++) {{")
        idx.append(d)
    ind = "    " * (loops + 1)
    out_off = " + ".join(f"i{d}*{_contig_strides(shape)[d]}L" for d in idx) or "0"
    in_off = " + ".join(f"i{d}*{src[d]}L" for d in idx) or "0"
    if inner_copy:
        lines.append(f"{ind}memcpy(o + {out_off}, a + {in_off}, {shape[-1]}UL * sizeof({t}));")
    else:
        lines.append(f"{ind}o[{out_off}] = a[{in_off}];")
    for d in range(loops, 0, -1):
        lines.append("    " * d + "}")
    return "\n".join(lines)


def _broadcast_body(v, t):
    """out = broadcast_to(x, shape): a loop nest over the (collapsed) output domain."""
    x = v.inputs[0]
    dom, st = collapse_domain(list(v.shape), {"x": _bstrides(x.shape, v.shape),
                                               "o": _contig_strides(v.shape)})
    iv = [f"i{d}" for d in range(len(dom))]
    lines = [f"    const {t} *restrict a = (const {t} *)p[0];",
             f"    {t} *restrict o = ({t} *)p[1];"]
    for d, n in enumerate(dom):
        lines.append("    " * (d + 1) + f"for (long i{d} = 0; i{d} < {n}L; i{d}++) {{")
    lines.append("    " * (len(dom) + 1) +
                 f"o[{_index(st['o'], iv)}] = a[{_index(st['x'], iv)}];")
    for d in range(len(dom), 0, -1):
        lines.append("    " * d + "}")
    return "\n".join(lines)


OMP_MIN_WORK = 1 << 15  # elements: below this a parallel region costs more than it saves


def _omp_for(work):
    """The pragma that splits an outer row loop over threads when the work pays for it
    (``-fopenmp``: see ``threads_flags``; without it the pragma is ignored)."""
    return "    #pragma omp parallel for schedule(static)" if work >= OMP_MIN_WORK else ""


def copy_kernel_body(v, dtype):
    """slice / pad / concat / reshape as block copies (``p``: inputs, then the output):
    they move data without arithmetic, so they run inside a kernel batch instead of
    costing a Python call each."""
    t = CTypes(dtype).t
    sz = np.dtype(dtype).itemsize
    ins = v.inputs
    lines = [f"    const {t} *restrict a{k} = (const {t} *)p[{k}];" for k in range(len(ins))]
    lines.append(f"    {t} *restrict o = ({t} *)p[{len(ins)}];")
    if v.op == "reshape":
        lines.append(f"    memcpy(o, a0, {v.size * sz}UL);")
        return "\n".join(lines)
    if v.op == "sum_to":
        R, C = ins[0].shape
        if tuple(v.shape) == (R, 1):  # row sums (double accumulator)
            lines.append(f"    for (long i = 0; i < {R}L; i++) {{ double s = 0.0;")
            lines.append("        #pragma omp simd reduction(+:s)")
            lines.append(f"        for (long j = 0; j < {C}L; j++) s += (double)a0[i*{C}L + j];")
            lines.append(f"        o[i] = ({t})s; }}")
        else:  # column sums, row by row in the dtype, as NumPy adds them
            lines.append(f"    memcpy(o, a0, {C * sz}UL);")
            lines.append(f"    for (long i = 1; i < {R}L; i++)")
            lines.append(f"        for (long j = 0; j < {C}L; j++) o[j] += a0[i*{C}L + j];")
        return "\n".join(lines)
    axis = v.attrs["axis"] % v.ndim
    outer, n_out, inner = _split(v.shape, axis)
    if v.op == "slice":
        _, n_in, _ = _split(ins[0].shape, axis)
        blk = (v.attrs["stop"] - v.attrs["start"]) * inner
        lines.append(f"    for (long q = 0; q < {outer}L; q++) memcpy(o + q*{n_out * inner}L, "
                     f"a0 + q*{n_in * inner}L + {v.attrs['start'] * inner}L, {blk * sz}UL);")
    elif v.op == "pad":
        _, n_in, _ = _split(ins[0].shape, axis)
        lines.append(f"    memset(o, 0, {v.size * sz}UL);")
        lines.append(f"    for (long q = 0; q < {outer}L; q++) memcpy(o + q*{n_out * inner}L + "
                     f"{v.attrs['before'] * inner}L, a0 + q*{n_in * inner}L, "
                     f"{n_in * inner * sz}UL);")
    elif v.op == "concat":
        off = 0
        for k, x in enumerate(ins):
            _, n_in, _ = _split(x.shape, axis)
            if n_in:
                lines.append(f"    for (long q = 0; q < {outer}L; q++) memcpy(o + q*"
                             f"{n_out * inner}L + {off * inner}L, a{k} + q*{n_in * inner}L, "
                             f"{n_in * inner * sz}UL);")
            off += n_in
    else:
        raise KeyError(v.op)
    return "\n".join(lines)


def group_kernel_body(group, dtype):
    ct = CTypes(dtype)
    if group.kind == "elementwise":
        return "\n".join(lower_elementwise(group, ct))
    return "\n".join(lower_rowreduce(group, ct))


class ProgramSource:
    """Collects unique kernels; ``source()`` is the translation unit of one program."""

    def __init__(self):
        self.bodies = {}  # body text -> kernel index

    def kernel(self, group, dtype):
        body = group_kernel_body(group, dtype)
        return self._add(body)

    def copy_kernel(self, v, dtype):
        if v.op in C_ROWS:
            return self._add(row_kernel_body(v, dtype))
        return self._add(copy_kernel_body(v, dtype))

    def bf16_kernel(self, n):
        """A kernel converting ``n`` float32 values (``p[0]``) to bf16 bits (``p[1]``): the
        activation operand of a bf16-compute GEMM, converted inside the kernel batch."""
        call = "gt_bf16_par" if _omp_for(n) else "gt_bf16_n"
        return self._add(f"    {call}((const float *)p[0], (uint16_t *)p[1], {n}L);")

    def _add(self, body):
        if body not in self.bodies:
            self.bodies[body] = len(self.bodies)
        return self.bodies[body]

    def source(self):
        parts = [PRELUDE]
        for body, k in self.bodies.items():
            parts.append(f"static void k{k}(void **p) {{\n{body}\n}}\n")
        table = ", ".join(f"k{k}" for k in range(len(self.bodies))) or "0"
        parts.append(f"static const gt_kernel K[] = {{{table}}};\n")
        parts.append("void gt_run(void **P, const int32_t *calls, int32_t n) {\n"
                     "    for (int32_t c = 0; c < n; c++) K[calls[2*c]](P + calls[2*c+1]);\n"
                     "}\n")
        parts.append(DENORMALS)
        # weights are converted to bf16 once, when a bf16-compute program is bound
        parts.append("void gt_to_bf16(const float *restrict x, uint16_t *restrict o, long n) {\n"
                     "    gt_bf16_par(x, o, n);\n"
                     "}\n")
        return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# compiling and caching

class CompilerMissing(RuntimeError):
    pass


_VERSIONS = {}


_THREADS = {}


def threads_flags(flags=FLAGS):
    """``flags`` plus ``-fopenmp`` where the compiler and its runtime support it (the
    row and elementwise loops then split over the cores), else ``flags`` unchanged.

    Before the first OpenMP library is loaded, libgomp's idle-thread policy is set
    (``quiet_openmp``): by default they spin for milliseconds after each parallel loop,
    taking a core from the OpenBLAS threads of the GEMM that follows, and with other
    processes on the cores a spinning team made steps 4x slower (measured); a sleeping
    one costs a wake-up of microseconds per loop, a short spin neither where every
    thread is OpenMP's."""
    cc, version = compiler()
    if (cc, version) not in _THREADS:
        probe = "int gt_probe(float *x, long n) {\n#pragma omp parallel for\n" \
                "for (long i = 0; i < n; i++) x[i] += 1.0f;\nreturn 0; }\n"
        try:
            build(probe, flags + ("-fopenmp",), prefix="probe")
            ok = True
        except RuntimeError:
            ok = False
        _THREADS[(cc, version)] = ok
    if not _THREADS[(cc, version)]:
        return tuple(flags)
    quiet_openmp()
    return tuple(flags) + ("-fopenmp",)


# GOMP_SPINCOUNT where every thread of a step is OpenMP's (our kernels, oneDNN's bf16
# GEMMs and, where measured fast, its float32 ones: compute.f32_onednn; NumPy's BLAS idle
# or on one thread): idle threads spin this long, so the next parallel region of a replay
# (there are thousands) finds them awake instead of paying a futex wake-up.  SmolLM2's
# bf16 step on an AVX512-BF16 EPYC: 0.79-0.98 s sleeping, 0.64-0.69 s with 5000 (20000:
# the same; the default, 300000, slowed steps 4x beside other processes); its float32
# step with the GEMMs in oneDNN (Zen 4): 1.19-1.21 s sleeping, 1.04-1.09 s with 5000.
# Beside OpenBLAS's own threads a spinning team slows a float32 step (1.11-1.57 s
# sleeping, 1.44-1.80 s with 5000), which a CPU whose BLAS wins f32_onednn then pays.
SPIN_BF16 = "5000"


def quiet_openmp():
    """Set libgomp's idle-thread policy before anything loads it (our kernels, oneDNN:
    it is read once): a short spin on a CPU with bf16 matrix instructions (every thread
    of a step is OpenMP's there) and sleeping elsewhere (see ``threads_flags``).  A
    user's ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if {"amx_bf16", "avx512_bf16"} & cpu_info()["flags"]:
        os.environ["GOMP_SPINCOUNT"] = SPIN_BF16
    else:
        os.environ["OMP_WAIT_POLICY"] = "passive"


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """``{"model": str, "flags": frozenset}`` from /proc/cpuinfo (empty where absent)."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and val.strip():
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(val.split())
    except OSError:
        pass
    return {"model": model, "flags": flags}


def compiler():
    """The C compiler command ($GRADTAPE_CC, default ``cc``) and its version line;
    raises CompilerMissing when it cannot run."""
    cc = os.environ.get("GRADTAPE_CC", "cc")
    if cc not in _VERSIONS:
        try:
            r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise CompilerMissing(f"C compiler {cc!r} not usable: {e}") from None
        if r.returncode != 0:
            raise CompilerMissing(f"C compiler {cc!r} not usable: {r.stderr.strip()[:200]}")
        _VERSIONS[cc] = (r.stdout.strip().splitlines() or [""])[0]
    return cc, _VERSIONS[cc]


def _csrc_texts():
    return [p.read_text() for p in sorted(CSRC.glob("*.[ch]"))]


def build_csrc(names, flags=FLAGS, prefix="gt"):
    """The files ``names`` of ``csrc/`` compiled as one translation unit (each includes
    the headers it needs; each also compiles alone), cached like ``build``: the key
    covers every file in ``csrc/``.  The unit starts with ``iq_tables``."""
    unit = iq_tables() + "".join(f'#include "{name}"\n' for name in names)
    return build(unit, (*flags, f"-I{CSRC}"), prefix, depends=_csrc_texts())


@functools.cache
def iq_tables():
    """C definitions of the tables the IQ2 / IQ3 types index (``GB_IQ_TABLES`` in
    ``csrc/ggml_blocks.h``): the sign bytes and value grids as gguf's own dequantizer
    builds them, so that the C blocks index the very tables gguf.quants does."""
    from gguf import quants

    def array(name, a):  # a 1-d or 2-d array of bytes
        rows = [",".join(map(str, r)) for r in a.reshape(-1, a.shape[-1])]
        body = rows[0] if a.ndim == 1 else ",\n".join("{" + r + "}" for r in rows)
        dims = "".join(f"[{n}]" for n in a.shape)
        return f"static const uint8_t {name}{dims} = {{\n{body}}};\n"

    out = ["#include <stdint.h>\n#define GB_IQ_TABLES 1\n",
           array("gb_ksigns", np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))]
    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"):
        t = getattr(quants, name)  # gguf's dequantizer of the type (gguf >= 0.10)
        t.init_grid()
        grid = t.grid.reshape(t.grid_shape)
        assert np.array_equal(grid, grid.astype(np.uint8)), name  # small whole values
        out.append(array(f"gb_grid_{name.lower()}", grid.astype(np.uint8)))
    return "".join(out)


@functools.cache
def csrc_version():
    """A short hash of every file in ``csrc/``: what a cached timing of these kernels
    (``compute.rates``) was measured with."""
    return hashlib.sha256("\0".join(_csrc_texts()).encode()).hexdigest()[:12]


def cache_dir():
    d = os.environ.get("GRADTAPE_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "gradtape"


def _cpu_signature():
    # -march=native: a shared cache directory must not serve a build for another CPU
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return os.uname().machine


def build(source, flags=FLAGS, prefix="gt", directory=None, depends=()):
    """Compile ``source`` to a shared library, or reuse the cached one.

    Returns ``(path, hit)``.  The cache key hashes the source, the texts of the files it
    includes (``depends``), the flags, the compiler's version line and the CPU's feature
    flags; the library is written under a temporary name and renamed into place, so
    concurrent builds never see a torn file.
    """
    cc, version = compiler()
    key = hashlib.sha256("\0".join([source, *depends, " ".join(flags), cc, version,
                                    _cpu_signature()]).encode()).hexdigest()[:32]
    d = Path(directory) if directory else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{prefix}_{key}.so"
    if path.exists():
        return path, True
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = Path(tmp) / "k.c"
        src.write_text(source)
        so = Path(tmp) / "k.so"
        r = subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"gradtape: compiling generated C ({prefix}) failed:\n"
                               f"{r.stderr[-4000:]}")
        (d / f"{prefix}_{key}.c").write_text(source)  # kept beside the library to read
        os.replace(so, path)
    return path, False
