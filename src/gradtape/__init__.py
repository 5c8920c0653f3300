"""gradtape: an exact, replayable autograd tape for transformer training.

``Tape`` records ops (eagerly evaluated with NumPy by default), ``Tape.backward`` derives
gradients as more ops on the same tape, and ``Tape.compile`` turns any set of Vars into a
``Program`` that replays on a backend.  Layers live in ``gradtape.nn``; the LLaMA
fine-tuner in ``gradtape.models`` and ``gradtape.train`` (``gradtape.llama`` re-exports
the public names).
"""

import os as _os

# NumPy's OpenBLAS keeps its idle threads polling for 2^28 cycles (~0.1 s) after each
# GEMM, on the cores our OpenMP kernels (the generated C, the fused attention) run on
# next; 2^20 cycles (~0.4 ms) still bridges back-to-back GEMMs.  SmolLM2's T=2048 step
# on 2 Zen 3 cores: 19.4 s -> 15.0 s.  OpenBLAS reads it once, when NumPy loads it: it
# takes effect where gradtape is imported first (the CLI), else set it by hand.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

from .compile import Program  # noqa: E402
from .tape import Tape, Var  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Tape", "Var", "Program", "__version__"]
