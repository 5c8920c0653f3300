"""C code generation for fused groups (``compile/fuse.py``) and single ops.

Each group becomes one ``static void kN(void **p)`` kernel: ``p`` holds the group's
external inputs, then its escaping outputs, as pointers.  Shapes and constants are baked
into the text, so structurally identical groups (every layer, every head) share one
kernel.  ``gt_run(P, calls, n)`` runs ``n`` kernel calls from a table of
``(kernel, offset into P)`` pairs: a stretch of groups between two matmuls costs one
ctypes call.

The math of each primitive comes from ``lowering.py`` (shared with the CUDA generator);
this module renders it as loops.  Float math follows the NumPy forwards of ``ops/``
operation by operation (same formulas, the dtype's own precision, no reassociation:
``-ffp-contract=off``, no ``-ffast-math``).  float64 uses libm (exp, log, sqrt, tanh).
float32 ``exp`` is an inlined Cephes-style polynomial (max error about 1 ulp) that the
compiler can vectorize; libm's ``expf`` is a call that stops vectorization.  Row sums
accumulate in double for both dtypes.

This module knows nothing of buffers or execution (``backend.py``) nor of compiling the
text (``toolchain.py``).
"""

from __future__ import annotations

import numpy as np

from ...ops import inner_dim
from ..lowering import (ROW_MATH, CTypes, broadcast_strides, collapse_domain,
                        contig_strides, expr, index_expr, row_layout)
from .toolchain import CSRC

PRELUDE = (CSRC / "gt_prelude.h").read_text()  # the generated kernels' first lines

# ``gt_denormals(flush)``: a float32 replay flushes denormals (MXCSR's FTZ and DAZ: results
# below 1.2e-38 become zero, such inputs read as zero) on its thread and on every OpenMP
# thread (our kernels', oneDNN's); it returns the caller's previous bits, which a second
# call puts back.  Intel cores take a microcode assist of about a hundred cycles per
# denormal operand or result, and a softmax that underflows makes many of them (TensorFlow
# flushes them the same way).  A no-op (-1) off x86.
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


class _Lowering:
    """Shared pieces: pointer declarations and member statements for one group."""

    def __init__(self, group, ct, bf16=()):
        self.g, self.ct = group, ct
        self.member_id = {m: k for k, m in enumerate(group.ops)}
        self.in_id = {x: k for k, x in enumerate(group.inputs)}
        self.out_id = {m: k for k, m in enumerate(group.outputs)}
        self.b16_id = {m: k for k, m in enumerate(bf16)}
        n_in, n_out = len(group.inputs), len(group.outputs)
        t = ct.t
        self.decls = [f"    const {t} *restrict a{k} = (const {t} *)p[{k}];"
                      for k in range(n_in)]
        self.decls += [f"    {t} *restrict o{k} = ({t} *)p[{n_in + k}];"
                       for k in range(n_out)]
        self.decls += [f"    uint16_t *restrict b{k} = (uint16_t *)p[{n_in + n_out + k}];"
                       for k in range(len(bf16))]

    def operand(self, x, strides_of, ivars):
        if x in self.member_id:
            return f"v{self.member_id[x]}"
        return f"a{self.in_id[x]}[{index_expr(strides_of[x], ivars)}]"

    def stmt(self, m, strides_of, ivars, write=True, value=None):
        """``m``'s statement: its value (``value``, else its op on its operands), stored
        where it leaves the group."""
        if value is None:
            args = [self.operand(x, strides_of, ivars) for x in m.inputs]
            value = expr(m.op, args, m.attrs, self.ct)
        k = self.member_id[m]
        s = f"const {self.ct.t} v{k} = {value};"
        if write and m in self.out_id:
            s += f" o{self.out_id[m]}[{index_expr(strides_of[m], ivars)}] = v{k};"
        if write and m in self.b16_id:  # its bf16 rounding too (gt_to_bf16's bits)
            s += f" b{self.b16_id[m]}[{index_expr(strides_of[m], ivars)}] = gt_bf16(v{k});"
        return s


def lower_elementwise(group, ct, bf16=()):
    """Loop nest over the (squeezed, collapsed) domain; each member computed at the depth
    of its prefix level, so a [T, 1] member inside a [T, n] group runs once per row.
    ``bf16``: escaping members whose bf16 rounding is written too, each into one more
    pointer after the outputs (a trained weight's copy, written by its update)."""
    low = _Lowering(group, ct, bf16)
    dom = list(group.domain)
    products = [m for m in group.ops if m.op == "matmul"]
    operands = {x for m in products for x in m.inputs}
    arrays = [x for x in group.inputs if x not in operands or any(
        x in m.inputs for m in group.ops if m.op != "matmul")] + list(group.ops)
    strides = {x: broadcast_strides(x.shape, dom) for x in arrays}
    if not products:  # a product's [T, n] stays two loops: its sums index rows and columns
        dom, strides = collapse_domain(dom, strides)
    ivars = [f"i{d}" for d in range(len(dom))]

    def level(m):
        s = strides[m]
        return max((d + 1 for d in range(len(dom)) if s[d]), default=0)

    by_level = [[] for _ in range(len(dom) + 1)]
    for m in group.ops:
        by_level[level(m)].append(m)
    lines = list(low.decls)
    for m in products:
        lines += _product_prelude(low, m)
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
            value = _product_sum(low, m, ivars) if m.op == "matmul" else None
            lines.append(ind + low.stmt(m, strides, ivars, value=value))
    for depth in range(len(dom), 0, -1):
        lines.append("    " * depth + "}")
    return lines


def _product_prelude(low, m):
    """A product member's right operand as ``[k, n]`` rows (``w{K}``): a transposed one
    copied once per call, so that the sums read it along the columns the loop walks."""
    k, n = inner_dim(m), m.shape[1]
    src = f"a{low.in_id[m.inputs[1]]}"
    if not m.attrs.get("tb"):
        return [f"    const {low.ct.t} *restrict w{low.member_id[m]} = {src};"]
    w = f"w{low.member_id[m]}"
    return [f"    {low.ct.t} {w}[{k * n}];",
            f"    for (long j = 0; j < {n}L; j++) for (long q = 0; q < {k}L; q++) "
            f"{w}[q*{n}L + j] = {src}[j*{k}L + q];"]


def _product_sum(low, m, ivars):
    """``sum_q a[i, q] w[q, j]`` of a product member, ``q`` in order, as multiply-adds
    (``GT_FMAF``: fused where the CPU has them; a GEMM's sums, which no two paths promise
    bitwise, ours or a BLAS's)."""
    i, j = ivars
    k, n, rows = inner_dim(m), m.shape[1], m.shape[0]
    a, w = f"a{low.in_id[m.inputs[0]]}", f"w{low.member_id[m]}"
    av = [f"{a}[{q}*{rows}L + {i}]" if m.attrs.get("ta") else f"{a}[{i}*{k}L + {q}]"
          for q in range(k)]
    fma = "GT_FMAF" if low.ct.t == "float" else "GT_FMA"
    acc = f"{av[0]} * {w}[{j}]"
    for q in range(1, k):
        acc = f"{fma}({av[q]}, {w}[{q * n}L + {j}], {acc})"
    return acc


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
C_ROWS = frozenset(("softmax", "sum", "nll_ids", "nll_ids_grad", "transpose", "broadcast_to",
                    "rope"))


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
    return v.op in C_COPY or v.op in ("nll_ids", "nll_ids_grad", "rope")


def row_kernel_body(v, dtype, with_loss=False):
    """softmax / sum over the last axis of any rank, a full sum, the fused next-token loss
    (``nll_ids``) and its gradient (``nll_ids_grad``), and transposes: the NumPy forwards
    of ops/ row by row (rows are independent: the threads split rows, and every row
    is computed in the same order whatever the split).  ``p``: inputs, then the output.
    ``with_loss`` (``nll_ids_grad``): also the loss ``nll_ids`` of the same rows, from the
    same max and sum, into ``p[4]`` (``fuse.loss_pairs``): the logits are read once."""
    ct = CTypes(dtype)
    t = ct.t
    x = v.inputs[0] if v.op != "nll_ids_grad" else v.inputs[1]
    C = x.shape[-1] if x.ndim else 1
    R = x.size // max(C, 1)
    par = _omp_for(x.size)
    lines = []
    if v.op == "transpose":
        return _transpose_body(v, t)
    if v.op == "rope":
        return _rope_body(v, t, par)
    if v.op == "broadcast_to":
        return _broadcast_body(v, t)
    if v.op == "sum" and v.attrs.get("axis") is None:
        # one accumulator in double over everything (NumPy adds float32 pairwise)
        return "\n".join([f"    const {t} *restrict a = (const {t} *)p[0];",
                          f"    {t} *restrict o = ({t} *)p[1];", "    double s = 0.0;",
                          "    #pragma omp simd reduction(+:s)",
                          f"    for (long j = 0; j < {x.size}L; j++) s += (double)a[j];",
                          f"    o[0] = ({t})s;"])
    # nll_ids_grad may write its output over the logits (fuse.overwritten_inputs): every
    # pass reads x[j] before y[j] is stored, and the one reading and writing both is
    # "omp simd" (vectorized whatever the pointers may alias); x[id] is read first
    alias = "" if v.op == "nll_ids_grad" else "restrict "
    if v.op == "nll_ids_grad":
        lines += [f"    const {t} *restrict g = (const {t} *)p[0];",
                  f"    const {t} *a = (const {t} *)p[1];",
                  "    const int64_t *restrict ids = (const int64_t *)p[2];",
                  f"    {t} *o = ({t} *)p[3];"]
        if with_loss:
            lines.append(f"    {t} *restrict loss = ({t} *)p[4];")
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
    lines.append(f"        const {t} *{alias}x = a + i*{C}L;")
    math = ROW_MATH[v.op]
    names = {"m": "m", "s": "st", "j": "j", "id": "ids[i]", "xid": "x[ids[i]]", "g": "gi"}
    if math.max_first:
        lines += [f"        {t} m = -INFINITY;", "        #pragma omp simd reduction(max:m)",
                  f"        for (long j = 0; j < {C}L; j++) m = x[j] > m ? x[j] : m;"]
    if with_loss:
        lines.append(f"        const {t} xid = x[ids[i]];")
        names["xid"] = "xid"
    term = math.fill(math.term, ct, x="x[j]", **names)
    if math.elem:  # the output row keeps each term for the last pass
        lines += [f"        {t} *{alias}y = o + i*{C}L;", "        double s = 0.0;",
                  "        #pragma omp simd reduction(+:s)",
                  f"        for (long j = 0; j < {C}L; j++) {{ const {t} e = {term}; "
                  "y[j] = e; s += (double)e; }"]
    else:
        lines += ["        double s = 0.0;", "        #pragma omp simd reduction(+:s)",
                  f"        for (long j = 0; j < {C}L; j++) s += (double){term};"]
    lines.append(f"        const {t} st = ({t})s;")
    if v.op == "nll_ids_grad":
        lines.append(f"        const {t} gi = g[i];")
        if with_loss:
            lines.append(f"        loss[i] = {math.fill(ROW_MATH['nll_ids'].row, ct, **names)};")
    if math.row:
        lines.append(f"        o[i] = {math.fill(math.row, ct, **names)};")
    if math.elem:
        e = math.fill(math.elem, ct, e="y[j]", **names)
        lines.append(f"        for (long j = 0; j < {C}L; j++) y[j] = {e};")
    lines.append("    }")
    return "\n".join(lines)


def _rope_body(v, t, par):
    """ops.rotary's rotation of each row: both halves from one read of the row, the
    products and their sum or difference as its NumPy forward forms them."""
    R, hd = v.shape
    h = hd // 2
    first, second = ("+", "-") if v.attrs.get("inverse") else ("-", "+")
    return "\n".join([
        f"    const {t} *restrict a = (const {t} *)p[0];",
        f"    const {t} *restrict c = (const {t} *)p[1];",
        f"    const {t} *restrict s = (const {t} *)p[2];",
        f"    {t} *restrict o = ({t} *)p[3];",
        *([par] if par else []),
        f"    for (long i = 0; i < {R}L; i++) {{",
        f"        const {t} *restrict x = a + i*{hd}L, *restrict ci = c + i*{h}L, "
        f"*restrict si = s + i*{h}L;",
        f"        {t} *restrict y = o + i*{hd}L;",
        f"        for (long j = 0; j < {h}L; j++) {{",
        f"            y[j] = (x[j] * ci[j]) {first} (x[j + {h}L] * si[j]);",
        f"            y[j + {h}L] = (x[j + {h}L] * ci[j]) {second} (x[j] * si[j]);",
        "        }",
        "    }"])


def _transpose_body(v, t):
    """out = x.transpose(perm): a loop nest over the output in order; the innermost run
    is a memcpy when the last axis stays last."""
    x = v.inputs[0]
    perm = v.attrs["perm"]
    n = v.ndim
    ist = contig_strides(x.shape)
    src = [ist[p] for p in perm]  # input stride of each output axis
    shape = list(v.shape)
    inner_copy = perm[-1] == n - 1
    loops = n - 1 if inner_copy else n
    lines = [f"    const {t} *restrict a = (const {t} *)p[0];",
             f"    {t} *restrict o = ({t} *)p[1];"]
    par = _omp_for(v.size) if shape[0] > 1 else ""
    if par and loops:
        lines.append(par)
    idx = []
    for d in range(loops):
        lines.append("    " * (d + 1) + f"for (long i{d} = 0; i{d} < {shape[d]}L; i{d}++) {{")
        idx.append(d)
    ind = "    " * (loops + 1)
    out_off = " + ".join(f"i{d}*{contig_strides(shape)[d]}L" for d in idx) or "0"
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
    dom, st = collapse_domain(list(v.shape), {"x": broadcast_strides(x.shape, v.shape),
                                               "o": contig_strides(v.shape)})
    iv = [f"i{d}" for d in range(len(dom))]
    lines = [f"    const {t} *restrict a = (const {t} *)p[0];",
             f"    {t} *restrict o = ({t} *)p[1];"]
    for d, n in enumerate(dom):
        lines.append("    " * (d + 1) + f"for (long i{d} = 0; i{d} < {n}L; i{d}++) {{")
    lines.append("    " * (len(dom) + 1) +
                 f"o[{index_expr(st['o'], iv)}] = a[{index_expr(st['x'], iv)}];")
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
        if tuple(v.shape) == (R, 1):  # row sums (double accumulator), rows split over threads
            if _omp_for(R * C):
                lines.append(_omp_for(R * C))
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
    # one loop over the output's blocks (row: block q), split over the threads where the
    # copy is large enough to pay for it; a single block in chunks of whole cache lines
    row, body = f"o + q*{n_out * inner}L", []
    if v.op == "slice" and outer == 1 and _omp_for(v.size):
        start, n = v.attrs["start"] * inner, v.size
        chunk = -(-n // (64 * 64)) * 64
        lines += [_omp_for(v.size), f"    for (long q = 0; q < {-(-n // chunk)}L; q++) {{",
                  f"        const long lo = q*{chunk}L, len = {n}L - lo < {chunk}L ? "
                  f"{n}L - lo : {chunk}L;",
                  f"        memcpy(o + lo, a0 + {start}L + lo, (size_t)len * {sz}UL);", "    }"]
        return "\n".join(lines)
    if v.op == "slice":
        _, n_in, _ = _split(ins[0].shape, axis)
        blk = (v.attrs["stop"] - v.attrs["start"]) * inner
        body.append(f"memcpy({row}, a0 + q*{n_in * inner}L + {v.attrs['start'] * inner}L, "
                    f"{blk * sz}UL);")
    elif v.op == "pad":
        _, n_in, _ = _split(ins[0].shape, axis)
        before, after = v.attrs["before"] * inner, (n_out - n_in - v.attrs["before"]) * inner
        if before:
            body.append(f"memset({row}, 0, {before * sz}UL);")
        body.append(f"memcpy({row} + {before}L, a0 + q*{n_in * inner}L, {n_in * inner * sz}UL);")
        if after:
            body.append(f"memset({row} + {before + n_in * inner}L, 0, {after * sz}UL);")
    elif v.op == "concat":
        off = 0
        for k, x in enumerate(ins):
            _, n_in, _ = _split(x.shape, axis)
            if n_in:
                body.append(f"memcpy({row} + {off * inner}L, a{k} + q*{n_in * inner}L, "
                            f"{n_in * inner * sz}UL);")
            off += n_in
    else:
        raise KeyError(v.op)
    if outer > 1 and _omp_for(v.size):
        lines.append(_omp_for(v.size))
    lines.append(f"    for (long q = 0; q < {outer}L; q++) {{ " + " ".join(body) + " }")
    return "\n".join(lines)


def scatter_add_body(group, scatter, dtype):
    """``b + scatter_rows(src, ids, n)``: a one-add group and the row scatter that only it
    reads (a tied embedding's two gradients), without the scatter's ``[n, d]`` of zeros.
    ``p``: b, src, ids, the output (which may be b's storage), then scratch for one row
    per id (``[len(ids), d]``) and each id's first position (int64).  The same sums in
    the same order as the two ops: each id's rows added into zero one after another, as
    ``np.add.at`` adds them, then b's row plus that; every other row b + 0."""
    t = CTypes(dtype).t
    n, d = scatter.inputs[0].shape
    rows = scatter.shape[0]
    return "\n".join([
        f"    const {t} *b = (const {t} *)p[0];",
        f"    const {t} *restrict src = (const {t} *)p[1];",
        "    const int64_t *restrict ids = (const int64_t *)p[2];",
        f"    {t} *o = ({t} *)p[3];",
        f"    {t} *restrict acc = ({t} *)p[4];",
        "    int64_t *restrict first = (int64_t *)p[5];",
        f"    for (long j = 0; j < {n}L; j++) {{",
        f"        const int64_t id = ids[j] < 0 ? ids[j] + {rows}L : ids[j];",
        "        long k = 0;",
        f"        while ((ids[k] < 0 ? ids[k] + {rows}L : ids[k]) != id) k++;",
        f"        first[j] = (id >= 0 && id < {rows}L) ? k : -1;",
        f"        {t} *restrict a = acc + k*{d}L;",
        f"        const {t} *restrict r = src + j*{d}L;",
        f"        if (k == j) for (long c = 0; c < {d}L; c++) a[c] = ({t})0 + r[c];",
        f"        else for (long c = 0; c < {d}L; c++) a[c] += r[c];",
        "    }",
        "    /* b's rows of the ids read before o (perhaps b itself) is written */",
        f"    for (long j = 0; j < {n}L; j++) if (first[j] == j) {{",
        f"        const int64_t id = ids[j] < 0 ? ids[j] + {rows}L : ids[j];",
        f"        for (long c = 0; c < {d}L; c++) acc[j*{d}L + c] = b[id*{d}L + c] + "
        f"acc[j*{d}L + c];",
        "    }",
        _omp_for(rows * d).replace("schedule(static)", "simd schedule(static)"),
        f"    for (long i = 0; i < {rows * d}L; i++) o[i] = b[i] + ({t})0;",
        f"    for (long j = 0; j < {n}L; j++) if (first[j] == j) {{",
        f"        const int64_t id = ids[j] < 0 ? ids[j] + {rows}L : ids[j];",
        f"        memcpy(o + id*{d}L, acc + j*{d}L, {d}UL * sizeof({t}));",
        "    }"])


def group_kernel_body(group, dtype, bf16=()):
    ct = CTypes(dtype)
    if group.kind == "elementwise":
        return "\n".join(lower_elementwise(group, ct, bf16))
    if bf16:
        raise ValueError("a bf16 copy is written only by an elementwise group")
    return "\n".join(lower_rowreduce(group, ct))


class ProgramSource:
    """Collects unique kernels; ``source()`` is the translation unit of one program."""

    def __init__(self):
        self.bodies = {}  # body text -> kernel index

    def kernel(self, group, dtype, bf16=()):
        """The kernel of a fused group; ``bf16``: its members whose bf16 rounding it
        writes too (``lower_elementwise``)."""
        return self._add(group_kernel_body(group, dtype, bf16))

    def scatter_add_kernel(self, group, scatter, dtype):
        """``scatter_add_body``'s kernel."""
        return self._add(scatter_add_body(group, scatter, dtype))

    def loss_grad_kernel(self, v, dtype):
        """The kernel of an ``nll_ids_grad`` writing its ``nll_ids`` too."""
        return self._add(row_kernel_body(v, dtype, with_loss=True))

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


