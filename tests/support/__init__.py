"""What the test suites share, written once.

* ``compare.rel_err``: the one error measure (max |got - ref| / max |ref|).
* ``fd``: finite-difference checks (the dot-product test), input samplers, tolerances.
* ``parity``: a program under test against the NumPy reference, for every backend.
* ``adapters.random_adapter``: an adapter that changes the model (non-zero B).
* ``tinymodel``: a small random LLaMA as a model, an HF folder, and its LoRA loss.
* ``filebuilders``: GGUF and safetensors files built byte by byte (valid and hostile).

Fixtures (the real SmolLM2, its HF reference, ``tiny_dir``) live in ``tests/conftest.py``.
"""
