"""Backends: each lowers a compiled schedule + memory plan into something that runs it.

``base.Backend`` is the interface (``compile.lower`` constructs one as ``Backend(graph,
schedule, plan, compute=...)``; it offers ``run``, ``set_leaf``, ``leaf_value``,
``plan``, ``compute``), and ``base.HostBackend`` the host storage the numpy and cpu
backends share; ``lowering.py`` is each primitive's math as C text, which the C and CUDA
generators share.  NumPy (``numpy.py``) is the reference every other backend is tested
against; each other backend is a package of its own (``cpu/``, ``cuda/``).
"""

from __future__ import annotations

import importlib
import warnings

# name -> "module:Class"; imported on first use so optional backends cost nothing unless used
BACKENDS = {
    "numpy": "gradtape.backends.numpy:NumpyBackend",
    "cpu": "gradtape.backends.cpu.backend:CpuBackend",
    # needs CuPy: pip install 'gradtape[cuda]'
    "cuda": "gradtape.backends.cuda.backend:CudaBackend",
    "cuda-bf16": "gradtape.backends.cuda.backend:CudaBf16Backend",  # bfloat16 storage
}


def get_backend(name):
    """The backend class that runs ``name`` here: the named one, or its ``fallback``
    (with one RuntimeWarning saying why) where it cannot run on this machine."""
    if name not in BACKENDS:
        raise ValueError(f"compile: unknown backend {name!r}; known backends: "
                         f"{', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    why = backend.fallback and backend.unavailable()
    if why:
        warnings.warn(f"gradtape: backend {name!r} runs on the {backend.fallback} fallback "
                      f"({why})", RuntimeWarning, stacklevel=3)
        return get_backend(backend.fallback)
    return backend

