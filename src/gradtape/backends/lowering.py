"""The lowering table: each primitive's math as C text, written once for every generator.

``ELEMENTWISE`` maps an elementwise primitive to a function of its operand expressions
(``args``), its attrs and a ``CTypes`` (the dtype's spellings) returning one C
expression; it mirrors the NumPy forward in ``ops/``.  ``ROW_MATH`` describes each
reduction over a row ``x[0..C)`` (sum, softmax, logsumexp, the next-token loss and its
gradient) as the same three steps: an optional running max ``m``; ``s = sum_j term``;
then one value per row (``row``) or one per element (``elem``).  The C generator
(``cpu/codegen.py``, loops with SIMD reductions, sums in double) and the CUDA generator
(``cuda/codegen.py``, threads striding over a row, block reductions) render the steps
their own way; neither writes the math again.  Both index arrays the same way: the
stride helpers at the end (broadcast strides, collapsed loop domains, a row group's
layout) are theirs too.  A new elementwise primitive is one row of
``ELEMENTWISE``; a new row reduction one row of ``ROW_MATH``.

Placeholders in ``ROW_MATH`` templates: ``{x}`` the row's value at ``j``, ``{m}`` the
row max, ``{s}`` the sum, ``{e}`` the term at ``j`` (a generator may keep it in the output
row instead of recomputing it), ``{j}``, ``{id}`` the row's target id, ``{xid}`` the
value at it, ``{g}`` the row's incoming gradient, ``{exp}``, ``{log}``, ``{one}``,
``{zero}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compile.fuse import prefix_level


class CTypes:
    """Per-dtype spellings: C type, math function names, literals."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        f32 = self.dtype == np.float32
        self.t = "float" if f32 else "double"
        self.exp = "gt_expf" if f32 else "exp"
        self.log = "logf" if f32 else "log"
        self.sqrt = "sqrtf" if f32 else "sqrt"
        self.tanh = "tanhf" if f32 else "tanh"
        self.pow = "powf" if f32 else "pow"
        self.f32 = f32

    def lit(self, c):
        """An exact literal of ``c`` rounded to the dtype (as NumPy casts a Python float
        scalar to the array's dtype)."""
        c = float(self.dtype.type(c))
        if c != c:
            return "NAN" if not self.f32 else "((float)NAN)"
        if c in (float("inf"), float("-inf")):
            s = "INFINITY" if c > 0 else "(-INFINITY)"
            return s if not self.f32 else f"((float){s})"
        return f"({c.hex()}{'f' if self.f32 else ''})"


def _powc(a, attrs, ct):
    p = float(attrs["p"])
    special = {1.0: f"({a})", 2.0: f"({a} * {a})", 0.5: f"{ct.sqrt}({a})",
               -1.0: f"({ct.lit(1.0)} / {a})"}
    return special.get(p, f"{ct.pow}({a}, {ct.lit(p)})")


def _maxc(a, attrs, ct):  # np.maximum propagates NaN
    c = ct.lit(attrs["c"])
    return f"((({a} >= {c}) || ({a} != {a})) ? {a} : {c})"


# op -> (args, attrs, ct) -> C expression
ELEMENTWISE = {
    "add": lambda x, at, ct: f"({x[0]} + {x[1]})",
    "sub": lambda x, at, ct: f"({x[0]} - {x[1]})",
    "mul": lambda x, at, ct: f"({x[0]} * {x[1]})",
    "div": lambda x, at, ct: f"({x[0]} / {x[1]})",
    "neg": lambda x, at, ct: f"(-{x[0]})",
    "scale": lambda x, at, ct: f"({x[0]} * {ct.lit(at['c'])})",
    "addc": lambda x, at, ct: f"({x[0]} + {ct.lit(at['c'])})",
    "powc": lambda x, at, ct: _powc(x[0], at, ct),
    "exp": lambda x, at, ct: f"{ct.exp}({x[0]})",
    "log": lambda x, at, ct: f"{ct.log}({x[0]})",
    "sqrt": lambda x, at, ct: f"{ct.sqrt}({x[0]})",
    "rsqrt": lambda x, at, ct: f"({ct.lit(1.0)} / {ct.sqrt}({x[0]}))",
    "sigmoid": lambda x, at, ct: f"({ct.lit(1.0)} / ({ct.lit(1.0)} + {ct.exp}(-{x[0]})))",
    "tanh": lambda x, at, ct: f"{ct.tanh}({x[0]})",
    "select": lambda x, at, ct: f"(({x[0]} != {ct.lit(0.0)}) ? {x[1]} : {x[2]})",
    "maxc": lambda x, at, ct: _maxc(x[0], at, ct),
    "gtc": lambda x, at, ct: f"(({x[0]} > {ct.lit(at['c'])}) ? {ct.lit(1.0)} : {ct.lit(0.0)})",
    "detach": lambda x, at, ct: f"({x[0]})",
}


C_ELEMENTWISE = frozenset(ELEMENTWISE)  # the elementwise ops both generators lower


def expr(op, args, attrs, ct):
    """The C expression of elementwise primitive ``op`` over operand expressions."""
    return ELEMENTWISE[op](args, attrs, ct)


@dataclass(frozen=True)
class RowMath:
    max_first: bool  # a running max m before the sum (the stable exp forms)
    term: str  # the summand at j
    row: str | None = None  # the row's one output value
    elem: str | None = None  # the output at j (the row's output row)

    def fill(self, template, ct, **names):
        """``template`` with the dtype's spellings and the generator's expressions."""
        return template.format(exp=ct.exp, log=ct.log, one=ct.lit(1.0), zero=ct.lit(0.0),
                               **names)


_EXP_TERM = "{exp}({x} - {m})"
ROW_MATH = {
    "sum": RowMath(False, "{x}", row="{s}"),
    # log(sum(exp(x - max))) + max
    "logsumexp": RowMath(True, _EXP_TERM, row="{log}({s}) + {m}"),
    # exp(x - max) / sum(exp(x - max))
    "softmax": RowMath(True, _EXP_TERM, elem="{e} / {s}"),
    # logsumexp(x) - x[id]
    "nll_ids": RowMath(True, _EXP_TERM, row="({log}({s}) + {m}) - {xid}"),
    # (softmax(x) - onehot(id)) * g, in that order as in ops._fwd_nll_ids_grad
    "nll_ids_grad": RowMath(True, _EXP_TERM,
                            elem="(({e} / {s}) - (({j} == {id}) ? {one} : {zero})) * {g}"),
}


# --- indexing, shared by the generators --------------------------------------------------

def contig_strides(shape):
    """Element strides of a C-contiguous array of ``shape``."""
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return st[::-1]


def broadcast_strides(shape, domain):
    """Element strides of a C-contiguous array of ``shape`` broadcast over ``domain``."""
    k = len(domain)
    padded = (1,) * (k - len(shape)) + tuple(shape)
    st = contig_strides(padded)
    return [0 if padded[d] == 1 else st[d] for d in range(k)]


def index_expr(strides, ivars):
    """The C offset expression of loop variables ``ivars`` over ``strides``."""
    terms = []
    for s, i in zip(strides, ivars):
        if s == 1:
            terms.append(i)
        elif s:
            terms.append(f"{i}*{s}L")
    return " + ".join(terms) if terms else "0"


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


def row_layout(group):
    """A row-reduction group's pieces: ``(reduction, body ops, (R, C), strides, levels)``
    over its ``[R, C]`` domain (a 1-d domain is one row); ``levels``: 1 for a body op
    constant along the row, 2 for one that varies along it."""
    red, body = group.ops[-1], group.ops[:-1]
    dom = tuple(group.domain)
    if len(dom) == 1:
        dom = (1,) + dom
    strides = {x: broadcast_strides(x.shape, dom) for x in list(group.inputs) + list(body)}
    return red, body, dom, strides, {m: prefix_level(m.shape, dom) for m in body}
