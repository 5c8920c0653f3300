"""Random adapters for tests: PEFT's initialisation (``init_adapter``) with a random,
non-zero ``B``, so that the adapter changes the model (a fresh one, B = 0, does not)."""

from __future__ import annotations

import numpy as np

from gradtape.models.lora import init_adapter


def random_adapter(cfg, rank=4, alpha=8.0, b_scale=0.05, seed=3, targets="all", layers=None,
                   base_model=""):
    """An adapter of ``cfg``'s model on ``targets`` (``init_adapter``'s spec) with ``B ~
    N(0, b_scale²)``; ``layers``: only these layers' linears (default: every layer)."""
    ad = init_adapter(cfg, rank=rank, alpha=alpha, targets=targets, seed=seed,
                      base_model=base_model)
    rng = np.random.default_rng(seed + 100)
    ad.weights = {k: (a, (b_scale * rng.standard_normal(b.shape)).astype(np.float32))
                  for k, (a, b) in ad.weights.items() if layers is None or k[0] in layers}
    return ad
