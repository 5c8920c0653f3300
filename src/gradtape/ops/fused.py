"""What the fused (tiled) primitives share.

A fused primitive (``lm_head``'s ``head_nll``, ``attention``'s ``attn``) exists for
memory and speed: its NumPy forward lives in ``tiled.py`` and works a block at a time,
so memory stays linear in T.  Its gradients are primitives of their own that recompute
each block from saved row statistics; those have no VJP (no second order through a
fused op: differentiate the composed version).  Each declares ``decompose``: the same
value recorded from composed primitives, for a backend without a kernel
(``compile.decompose``); ``decomposed_vjp`` builds that rule for a gradient primitive.
"""

from __future__ import annotations

from .elementwise import mul
from .movement import concat, reshape
from .reductions import reduce_sum


def decomposed_vjp(fwd, n_fwd, wrt):
    """The decomposition of a gradient primitive ``(g, *fwd_inputs, y, *rest)``: the
    composed forward's own VJP with cotangent ``g``, w.r.t. the forward inputs ``wrt``
    (flattened and joined when more than one)."""
    def rule(tp, g, *ins, **attrs):
        xs = ins[:n_fwd] + ins[n_fwd + 1:]  # the forward inputs, without y
        grads = tp.backward(reduce_sum(mul(fwd(tp, *xs, **attrs), g)))
        if len(wrt) == 1:
            return grads[xs[wrt[0]]]
        return concat([reshape(grads[xs[i]], (xs[i].size,)) for i in wrt], 0)
    return rule
