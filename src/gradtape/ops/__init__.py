"""The primitive table: every op the tape can record, declared once.

Each primitive has a shape rule (checked when the op is recorded), a NumPy forward that
writes into a preallocated ``out`` array (the same function runs eagerly and at replay, so
a replay is bitwise equal to the eager values), and a vector-Jacobian rule written in tape
ops, so that ``backward`` is just more graph.  A VJP rule is a pure function
``(g, out, *inputs, **attrs) -> tuple`` with one entry per input: a thunk building that
input's gradient, or ``None`` where the input is not differentiable (integer indices).
Gradients of broadcast inputs are reduced by the engine (``tape.backward``), not here.

The package also holds the builder functions (``add``, ``matmul``, ``softmax`` ...) that
layers and VJP rules call; they are thin wrappers over ``Tape.record``.  One module per
family of primitives, each declaring its rows of ``PRIMS`` and its builders:

  table          the ``Prim`` record, ``PRIMS``, ``ShapeError``, the shared axis helpers
  elementwise    arithmetic, unary functions, select and comparisons with a constant
  movement       transpose, reshape, slice, pad, concat, row gathers and scatters
  linalg         matmul
  reductions     sum, sum_to, broadcast_to, softmax, logsumexp, nll_ids
  rotary         rotary position embedding (rope), one op forward and backward
  block_weights  products and lookups against frozen weights kept in ggml blocks
  fused          what the tiled (fused) primitives share
  lm_head        the LM head fused with its cross-entropy (head_nll)
  attention      tiled attention (attn)

Everything is re-exported here: ``from gradtape import ops; ops.matmul(...)``.
"""

from .table import PRIMS, Prim, ShapeError, _rec  # noqa: F401  (the table first)
from .elementwise import (  # noqa: F401
    add, addc, detach, div, exp, gtc, log, maxc, mul, neg, powc, rsqrt, scale, select, sigmoid,
    sqrt, sub, tanh)
from .movement import (  # noqa: F401
    concat, pad, pick, put, reshape, scatter_rows, slice_, take_rows, transpose)
from .linalg import _mT, inner_dim, matmul  # noqa: F401
from .reductions import (  # noqa: F401
    _fwd_nll_ids_grad, broadcast_to, logsumexp, nll_ids, nll_ids_grad, reduce_sum, softmax,
    sum_to)
from .rotary import rope  # noqa: F401
from .block_weights import qmatmul, qmatmul_t, qtake_rows  # noqa: F401
from .lm_head import head_nll  # noqa: F401
from .attention import attn  # noqa: F401
