"""Backends: each lowers a compiled Graph + MemoryPlan into something that runs it.

A backend class is constructed as ``Backend(graph, plan)`` and offers ``run(arrays)``
(copy the given leaf arrays in, evaluate the ops, apply state updates, return copies of
the outputs), ``leaf_value(leaf)`` and ``plan``.  NumPy is the reference every other
backend is tested against.
"""

from __future__ import annotations

import importlib

# name -> "module:Class"; imported lazily so optional backends cost nothing unless used
BACKENDS = {
    "numpy": "gradtape.backends.numpy:NumpyBackend",
    "cpu": "gradtape.backends.cpu:CpuBackend",
    "cuda": "gradtape.backends.cuda:CudaBackend",  # needs CuPy: pip install 'gradtape[cuda]'
    "cuda-bf16": "gradtape.backends.cuda:CudaBf16Backend",  # cuda, bfloat16 storage
}


def get_backend(name):
    if name not in BACKENDS:
        raise ValueError(f"compile: unknown backend {name!r}; known backends: "
                         f"{', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
