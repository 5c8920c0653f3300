"""The training methods: one table, a row per method, each a loss over per-sequence
log-probabilities (DESIGN section 6).

A row says which data the method takes (``sft`` rows or ``preference`` pairs), whether
it needs a reference pass, whether its log-probabilities are summed or averaged over the
completion tokens, its default ``beta`` (TRL's config default), and its loss builder in
tape ops.  A builder takes a ``Logps`` (``[N, 1]`` Vars of the chosen and rejected
sequences, the reference's where the method has one, the chosen NLL for ORPO, the
completion token counts) and the method's ``Options``, and returns the loss (one
element) and the metric Vars under TRL's names.  The formulas are TRL 1.16's:
``DPOTrainer`` (``loss_type`` ``sigmoid``, ``robust``, ``ipo``), ``ORPOTrainer`` and
``CPOTrainer`` with ``loss_type="simpo"`` and ``cpo_alpha=0`` (pure SimPO).

This module records no model: ``train.preference`` records the forward and the
log-probabilities; ``sft``'s loss is the step's own next-token loss
(``models.graph.head_loss``), so its row has no builder.  Nothing outside this table
knows which method runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import ops
from ..errors import GradtapeError


@dataclass(frozen=True)
class Logps:
    """The per-sequence quantities a preference loss reads, each ``[N, 1]`` (``nll``: one
    element): ``chosen`` / ``rejected`` the policy's log-probabilities (summed or
    averaged as the row says), ``ref_*`` the reference's (``None`` without one), ``nll``
    the chosen sequences' mean next-token loss over prompt and completion (ORPO),
    ``n_chosen`` / ``n_rejected`` the completion token counts (consts); ``weight``
    ``None`` (a loss and metrics are plain means over the ``N`` pairs, as TRL's) or an
    ``[N, 1]`` const of per-pair weights (the held-out evaluation: 0 on a batch's padding
    pairs, so each held-out pair counts once)."""
    chosen: object
    rejected: object
    ref_chosen: object = None
    ref_rejected: object = None
    nll: object = None
    n_chosen: object = None
    n_rejected: object = None
    weight: object = None

    def mean(self, v):
        """The mean of ``v [N, 1]`` over the pairs, weighted by ``weight`` where given."""
        return mean(v) if self.weight is None else ops.reduce_sum(ops.mul(v, self.weight))


@dataclass(frozen=True)
class Options:
    """A method's numbers: ``beta`` (``None``: the row's default), ``label_smoothing``
    (robust DPO, and CPO/SimPO's conservative form), ``simpo_gamma`` (SimPO's target
    margin, TRL's default 0.5)."""
    beta: float | None = None
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


@dataclass(frozen=True)
class Method:
    name: str
    data: str  # "sft" | "preference"
    reference: bool  # needs the reference model's log-probabilities
    average: bool  # log-probabilities averaged over completion tokens (else summed)
    beta: float | None  # TRL's default
    nll: bool  # needs the chosen sequences' NLL over prompt and completion
    loss: Callable | None  # (Logps, beta, Options) -> (loss, {metric name: Var})


# --- stable pieces -----------------------------------------------------------------------

def log_sigmoid(x):
    """``log(sigmoid(x)) = -(max(-x, 0) + log(1 + exp(-|x|)))``: no overflow for any x,
    from existing primitives (``|x| = 2 max(-x, 0) + x``).  ``log(1 + e)`` stands for
    log1p: its error is an ulp of 1, against terms of order one in these losses."""
    m = ops.maxc(ops.neg(x), 0.0)
    a = ops.add(ops.scale(m, 2.0), x)  # |x|
    return ops.neg(ops.add(m, ops.log(ops.addc(ops.exp(ops.neg(a)), 1.0))))


def log1mexp(x):
    """``log(1 - exp(x))`` for ``x < 0`` (an average log-probability): TRL's branches
    avoid cancellation near 0, where ``x`` would be a near-certain completion; the
    relative error here is an ulp over ``|x|``."""
    return ops.log(ops.addc(ops.neg(ops.exp(x)), 1.0))


def mean(v):
    """The mean of all elements of ``v`` (one element)."""
    return ops.scale(ops.reduce_sum(v), 1.0 / v.size)


def _metrics(chosen_rewards, rejected_rewards, lp):
    margins = ops.sub(chosen_rewards, rejected_rewards)
    return {"rewards/chosen": lp.mean(chosen_rewards),
            "rewards/rejected": lp.mean(rejected_rewards),
            # a > b exactly when a - b > 0 (IEEE subtraction of distinct floats is never 0)
            "rewards/accuracies": lp.mean(ops.gtc(margins, 0.0)),
            "rewards/margins": lp.mean(margins),
            "logps/chosen": lp.mean(lp.chosen), "logps/rejected": lp.mean(lp.rejected)}


def _smoothed(z, eps):
    """``-(1-eps) log sigmoid(z) - eps log sigmoid(-z)`` (eps = 0: the plain logistic)."""
    loss = ops.neg(log_sigmoid(z))
    if eps == 0.0:
        return loss
    return ops.sub(ops.scale(loss, 1.0 - eps), ops.scale(log_sigmoid(ops.neg(z)), eps))


# --- the builders ------------------------------------------------------------------------

def _dpo(lp, beta, opt):
    """DPO: ``-log sigmoid(beta * d)``, ``d`` the chosen minus the rejected log-ratio
    against the reference; with ``label_smoothing`` eps > 0 robust DPO (TRL's
    ``loss_type="robust"``): ``(-(1-eps) ls(beta d) + eps ls(-beta d)) / (1 - 2 eps)``."""
    cr, rr = ops.sub(lp.chosen, lp.ref_chosen), ops.sub(lp.rejected, lp.ref_rejected)
    z = ops.scale(ops.sub(cr, rr), beta)
    eps = opt.label_smoothing
    if eps == 0.0:
        per = ops.neg(log_sigmoid(z))
    else:
        per = ops.scale(ops.add(ops.scale(log_sigmoid(z), -(1.0 - eps)),
                                ops.scale(log_sigmoid(ops.neg(z)), eps)), 1.0 / (1.0 - 2.0 * eps))
    return lp.mean(per), _metrics(ops.scale(cr, beta), ops.scale(rr, beta), lp)


def _ipo(lp, beta, opt):
    """IPO (TRL's): ``(d_avg - 1/(2 beta))^2``, each log-ratio divided by its completion
    length; the rewards are the summed log-ratios times beta."""
    cr, rr = ops.sub(lp.chosen, lp.ref_chosen), ops.sub(lp.rejected, lp.ref_rejected)
    d = ops.sub(ops.div(cr, lp.n_chosen), ops.div(rr, lp.n_rejected))
    per = ops.powc(ops.addc(d, -1.0 / (2.0 * beta)), 2.0)
    return lp.mean(per), _metrics(ops.scale(cr, beta), ops.scale(rr, beta), lp)


def _orpo(lp, beta, opt):
    """ORPO: the chosen NLL minus ``beta * mean(log sigmoid(log odds))``, the log odds of
    the averaged log-probabilities ``(c - r) - (log(1 - e^c) - log(1 - e^r))``."""
    log_odds = ops.sub(ops.sub(lp.chosen, lp.rejected),
                       ops.sub(log1mexp(lp.chosen), log1mexp(lp.rejected)))
    ratio = log_sigmoid(log_odds)
    loss = ops.sub(lp.nll, lp.mean(ops.scale(ratio, beta)))
    m = _metrics(ops.scale(lp.chosen, beta), ops.scale(lp.rejected, beta), lp)
    m.update({"nll_loss": lp.nll, "log_odds_ratio": lp.mean(ratio),
              "log_odds_chosen": lp.mean(log_odds)})
    return loss, m


def _simpo(lp, beta, opt):
    """SimPO (CPO's ``simpo``, ``cpo_alpha=0``): ``-log sigmoid(beta (c - r) - gamma)`` over
    averaged log-probabilities, written as TRL does: ``beta * ((c - r) - gamma / beta)``;
    ``label_smoothing`` gives CPO's conservative form."""
    z = ops.scale(ops.addc(ops.sub(lp.chosen, lp.rejected), -opt.simpo_gamma / beta), beta)
    return (lp.mean(_smoothed(z, opt.label_smoothing)),
            _metrics(ops.scale(lp.chosen, beta), ops.scale(lp.rejected, beta), lp))


METHODS = {m.name: m for m in (
    Method("sft", "sft", reference=False, average=False, beta=None, nll=False, loss=None),
    Method("dpo", "preference", reference=True, average=False, beta=0.1, nll=False, loss=_dpo),
    Method("ipo", "preference", reference=True, average=False, beta=0.1, nll=False, loss=_ipo),
    Method("orpo", "preference", reference=False, average=True, beta=0.1, nll=True, loss=_orpo),
    Method("simpo", "preference", reference=False, average=True, beta=0.1, nll=False,
           loss=_simpo),
)}


def method(name) -> Method:
    """The row of ``name``; an unknown name is one line listing the methods."""
    if name not in METHODS:
        raise GradtapeError(f"unknown method {name!r}: the methods are {', '.join(METHODS)}")
    return METHODS[name]


def check_options(m: Method, opt: Options) -> float:
    """``beta`` to use (the row's default where ``opt.beta`` is ``None``), after checking
    the options against the method; each mistake is one line."""
    beta = m.beta if opt.beta is None else float(opt.beta)
    if m.data != "preference":
        if opt.beta is not None:
            raise GradtapeError(f"--beta applies to the preference methods, not {m.name}")
        return beta
    if not beta > 0.0 or beta != beta or beta == float("inf"):
        raise GradtapeError(f"--beta {opt.beta} is out of range: it must be a finite number > 0")
    eps = opt.label_smoothing
    if eps != 0.0 and m.name not in ("dpo", "simpo"):
        raise GradtapeError(f"--label-smoothing applies to dpo and simpo, not {m.name}")
    if not 0.0 <= eps < 0.5:
        raise GradtapeError(f"--label-smoothing {eps} is out of range: it must be in [0, 0.5)")
    if opt.simpo_gamma != 0.5 and m.name != "simpo":
        raise GradtapeError(f"--simpo-gamma applies to simpo, not {m.name}")
    return beta


def build_loss(m: Method, lp: Logps, opt: Options = Options()):
    """``(loss, metrics)`` of preference method ``m`` over ``lp`` (see ``Logps``)."""
    if m.loss is None:
        raise GradtapeError(f"method {m.name} has no preference loss (it trains on "
                            f"{m.data} rows)")
    return m.loss(lp, check_options(m, opt), opt)
