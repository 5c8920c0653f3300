"""The cuda backend: the compiled graph replayed on an NVIDIA GPU through CuPy.

``backend.py`` (``CudaBackend``, ``CudaBf16Backend``: lowering, binding, replay and
CUDA-graph capture); ``codegen.py`` (the CUDA C text of every kernel, and a CPU harness
that compiles the same text); ``arena.py`` (storage dtypes and the device memory
layout); ``devices.py`` (the device layer: CuPy and our cuBLAS handle, or the CPU
harness for tests).

Nothing is imported here: ``backends.get_backend("cuda")`` loads ``backend.py``; CuPy is
imported only when a device is made.
"""
