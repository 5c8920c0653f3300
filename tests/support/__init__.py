"""What the test suites share, written once.

* ``compare.rel_err``: the one error measure (max |got - ref| / max |ref|).
* ``fd``: finite-difference checks (the dot-product test), input samplers, tolerances.
* ``parity``: a program under test against the NumPy reference, for every backend.
* ``adapters.random_adapter``: an adapter that changes the model (non-zero B);
  ``adapters.lora_grads``: one LoRA step's loss and gradients through a model's graph.
* ``tinymodel``: a small random LLaMA as a model, an HF folder, and its LoRA loss.
* ``filebuilders``: GGUF and safetensors files built byte by byte (valid and hostile).
* ``greedy``: greedy tokens of two code paths compared where the reference's top-2
  margin exceeds their rounding.
* ``hardware``: the skips a test may take (what the CPU lacks), and ``kernel_isa``, the
  instruction-set classes the kernel parity tests run at (``$GRADTAPE_ISA``).
* ``work``: bounded work, counted in function calls instead of timed.
* ``lanes``: the C kernels rebuilt for 16 emulated lanes (AVX-512's paths on any CPU).

Fixtures (the real SmolLM2, its HF reference, ``tiny_dir``) live in ``tests/conftest.py``.
"""
