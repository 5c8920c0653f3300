"""The cpu backend: the compiled graph as generated C kernels, BLAS and oneDNN GEMMs.

``backend.py`` (``CpuBackend``: binds a schedule to kernels and GEMMs and replays it);
``codegen.py`` (the C text of fused groups and single ops) and ``toolchain.py`` (the C
compiler, the on-disk build cache, what the machine offers); ``measure.py`` (the cached
timings that decide precision and GEMM layouts on this CPU); ``onednn.py`` (oneDNN's
matmul through ctypes), ``blas.py`` (NumPy's own BLAS) and ``narrow.py`` (float32
products with a narrow side, LoRA's rank-r ones, in our own loops); the products of weights kept
in their ggml blocks: ``qgemm.py`` (the C library and the float products),
``qgemm_tiles.py`` (how a product is cut into tiles), ``qgemm_bf16.py`` and
``qgemm_int8.py`` (the low-precision ways); ``tiled.py`` (the C side of the tiled
attention and LM head); ``ggml_vec.py`` (matrix-vector products from ggml blocks, the C
decode step); ``csrc/`` (the hand-written C those load).

Nothing is imported here: ``backends.get_backend("cpu")`` loads ``backend.py``.
"""
