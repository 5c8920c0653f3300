"""gradtape: an exact, replayable autograd tape for transformer training.

``Tape`` records ops (eagerly evaluated with NumPy by default), ``Tape.backward`` derives
gradients as more ops on the same tape, and ``Tape.compile`` turns any set of Vars into a
``Program`` that replays on a backend.  Layers live in ``gradtape.nn``; the LLaMA
fine-tuner in ``gradtape.models`` and ``gradtape.train`` (``gradtape.llama`` re-exports
the public names).
"""

from . import settings

# $GRADTAPE_ISA reaches oneDNN and NumPy's OpenBLAS only through variables they read when
# they load: set before anything here imports NumPy
settings.cap_libraries()

from .tape import Tape, Var  # noqa: E402  (after the cap)

__version__ = "0.1.0"
__all__ = ["Tape", "Var", "Program", "__version__"]


def __getattr__(name):
    # ``Program`` loads the compile package on first use: ``import gradtape``, recording
    # and ``backward`` stay free of it
    if name == "Program":
        from .compile import Program
        return Program
    raise AttributeError(f"module 'gradtape' has no attribute {name!r}")
