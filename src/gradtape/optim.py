"""Optimizers as graph: the update is recorded on the tape and replayed with the step.

``adamw`` records PyTorch's AdamW (decoupled weight decay, bias correction) for a list of
params.  Moments are const leaves that the returned ``updates`` turn into program state;
the per-step scalars (learning rate and bias corrections) are const leaves fed every step
from ``AdamWScalars.values`` — nothing is re-traced.  ``clip_by_global_norm`` records
``g * min(1, clip / (||g|| + 1e-6))`` (PyTorch's ``clip_grad_norm_``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import ops


@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


class AdamWScalars:
    """The per-step scalar leaves of a recorded AdamW: feed ``values(step, lr)``."""

    def __init__(self, tp, cfg: AdamWConfig):
        self.cfg = cfg
        self.decay = tp.const(np.ones((), tp.dtype))  # 1 - lr * wd
        self.step_size = tp.const(np.zeros((), tp.dtype))  # lr / (1 - b1^t)
        self.inv_sqrt_bc2 = tp.const(np.ones((), tp.dtype))  # 1 / sqrt(1 - b2^t)

    def values(self, step: int, lr: float) -> dict:
        """Feeds for optimizer step ``step`` (1-based) at learning rate ``lr``."""
        c = self.cfg
        return {self.decay: np.asarray(1.0 - lr * c.weight_decay),
                self.step_size: np.asarray(lr / (1.0 - c.beta1 ** step)),
                self.inv_sqrt_bc2: np.asarray(1.0 / math.sqrt(1.0 - c.beta2 ** step))}


def global_norm(grads):
    """sqrt(sum of squares of every gradient): a () Var.  Each gradient is seen flat
    (a reshape: no copy), so its squares and their sum are one row reduction that a
    backend fuses: the squares are never stored."""
    total = None
    for g in grads:
        flat = g if g.ndim == 1 else ops.reshape(g, (g.size,))
        s = ops.reduce_sum(ops.mul(flat, flat))
        total = s if total is None else ops.add(total, s)
    return ops.sqrt(total)


def clip_by_global_norm(grads, clip):
    """(clipped grads, norm before clipping)."""
    norm = global_norm(grads)
    coef = ops.div(norm.tape.const(np.asarray(clip, norm.dtype)), ops.maxc(ops.addc(norm, 1e-6), clip))
    return [ops.mul(g, coef) for g in grads], norm


def adamw(tp, params, grads, cfg: AdamWConfig):
    """Record one AdamW step.  Returns ``(new, scalars, moments)``: ``new`` maps each
    param and each moment leaf to its updated Var (pass as ``updates=`` to ``compile``),
    ``scalars`` the leaves to feed each step, ``moments`` the ``(m, v)`` leaves per param
    (what a checkpoint saves)."""
    sc = AdamWScalars(tp, cfg)
    new, moments = {}, []
    for p, g in zip(params, grads):
        m = tp.const(np.zeros(p.shape, tp.dtype))
        v = tp.const(np.zeros(p.shape, tp.dtype))
        m_new = ops.add(ops.scale(m, cfg.beta1), ops.scale(g, 1.0 - cfg.beta1))
        v_new = ops.add(ops.scale(v, cfg.beta2), ops.scale(ops.mul(g, g), 1.0 - cfg.beta2))
        # p <- p (1 - lr wd) - lr/bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        denom = ops.addc(ops.mul(ops.sqrt(v_new), sc.inv_sqrt_bc2), cfg.eps)
        p_new = ops.sub(ops.mul(p, sc.decay), ops.mul(sc.step_size, ops.div(m_new, denom)))
        new[p], new[m], new[v] = p_new, m_new, v_new
        moments.append((m, v))
    return new, sc, moments
