"""A loaded model: config, weights, tokenizer, name and source, as ``models.load`` gives it.

A plain record: it computes nothing and holds no compiled program.  The graph over its
weights is ``graph``'s; logits and generation are ``gradtape.infer``'s, which the public
facade ``gradtape.llama.Llama`` (a ``Model`` with ``logits`` and ``generate``) delegates
to.  ``dataclasses.replace(model, weights=...)`` gives a model of the same class with
other weights (``export.merged_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LlamaConfig


@dataclass(eq=False, repr=False)
class Model:
    """A loaded LLaMA-family model: ``config``, float32 ``weights`` (in our names and
    ``[in, out]`` orientation, ``graph``'s module docstring lists them), ``tokenizer``
    (None where the model has none), ``name`` and ``source`` (the file or folder it was
    read from)."""
    config: LlamaConfig
    weights: dict
    tokenizer: object = None
    name: str = ""
    source: str = ""

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}({self.name!r}: {c.n_layers} layers, dim {c.dim}, "
                f"{c.n_heads}/{c.n_kv_heads} heads, vocab {c.vocab_size})")

    @property
    def eos_id(self):
        if self.tokenizer is not None and self.tokenizer.eos_id is not None:
            return self.tokenizer.eos_id
        return self.config.eos_id

    @property
    def stop_ids(self) -> frozenset:
        if self.tokenizer is not None:
            return self.tokenizer.stop_ids
        return frozenset() if self.config.eos_id is None else frozenset({self.config.eos_id})
