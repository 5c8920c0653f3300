"""Random adapters for tests: PEFT's initialisation (``init_adapter``) with a random,
non-zero ``B``, so that the adapter changes the model (a fresh one, B = 0, does not), also
as DoRA (magnitudes moved off their start); and
one LoRA step's loss and adapter gradients through a model's graph (``lora_grads``)."""

from __future__ import annotations

import numpy as np

from gradtape import nn
from gradtape.models.lora import init_adapter
from gradtape.models.graph import record_forward, weight_consts
from gradtape.tape import Tape


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


def random_dora_adapter(cfg, weights, rank=4, alpha=8.0, b_scale=0.05, seed=3, targets="all",
                        rslora=False):
    """``random_adapter`` made a DoRA one: magnitudes ``||w0_j||`` (PEFT's init) times
    ``1 + N(0, 0.1²)``, so the magnitudes matter as much as A and B; ``rslora``: scale
    ``alpha / sqrt(rank)``."""
    from gradtape.models.dora import init_magnitudes
    ad = random_adapter(cfg, rank, alpha, b_scale, seed, targets)
    rng = np.random.default_rng(seed + 200)
    ad.magnitudes = {k: (m * (1 + 0.1 * rng.standard_normal(m.shape))).astype(np.float32)
                     for k, m in init_magnitudes(weights, ad.weights).items()}
    if rslora:
        ad.scale_override = alpha / np.sqrt(rank)
    return ad


def lora_grads(model, adapter, ids, targets, backend, dtype=np.float32, compute="float32"):
    """``[loss, dA, dB, ...]`` of one sequence ``ids`` (targets as ``nn.ce_targets_fill``
    takes them) through ``model`` with ``adapter``, compiled for ``backend`` and
    ``compute``."""
    tp = Tape(dtype, eager=False)
    lora = {key: (tp.param(a), tp.param(b)) for key, (a, b) in adapter.weights.items()}
    logits = record_forward(tp, model.config, weight_consts(tp, model), tp.const(ids), 1,
                            lora, adapter.scale)
    tid, wts = nn.ce_targets_fill(targets)
    loss = nn.cross_entropy_ids(tp, logits, tp.const(tid), tp.const(wts.astype(dtype)))
    g = tp.backward(loss)
    params = [p for pair in lora.values() for p in pair]
    return tp.compile([loss, *(g[p] for p in params)], backend=backend,
                      compute=compute).run()
