"""One preference step's loss on a tape, and the reference pass.

``pair_batch`` lays ``N`` tokenized pairs out as TRL's concatenated forward does:
``2N`` sequences of ``T`` rows, the chosen ones first, each padded at its end, with the
next-token targets and the weights that turn per-row log-probabilities into the
per-sequence sums (or averages) the method reads (``models.graph.sequence_logps``).
``record_preference`` records the forward of all ``2N`` sequences at once (each attends
only to itself), the log-probabilities and the method's loss (``train.methods``);
``tp.backward(loss)`` then gives every LoRA gradient.  ``reference_logps`` is the same
forward with the adapter as given (none, or a fresh one: the base model), forward only.

What this is not: tokenizing and masking the pairs (``train.data``), the compiled step
and the loop (``train.step``, ``train.finetune``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import nn, ops
from ..errors import GradtapeError
from ..models.graph import logps_fused, record_forward, sequence_logps, weight_consts
from ..tape import Tape
from .methods import Logps, Method, Options, build_loss


@dataclass
class PairBatch:
    """Host arrays of ``N`` pairs as ``2N`` sequences of ``T`` rows (chosen ``0..N-1``,
    rejected ``N..2N-1``): ``ids``, ``targets`` (the next token, 0 where none) and
    ``positions`` int64 ``[2N*T]``; ``weights [2N*T, 2N+1]`` (column ``s``: sequence
    ``s``'s completion rows, 1 or ``1/n_s``; the last: ORPO's chosen NLL, ``1/n`` on
    every next token of the chosen sequences); ``counts [2N]`` the completion tokens;
    ``pair_weights [N]`` each pair's weight in the held-out means (``pair_batch``)."""
    ids: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    weights: np.ndarray
    counts: np.ndarray
    pair_weights: np.ndarray = None

    @property
    def n_pairs(self):
        return len(self.counts) // 2


def pair_batch(pairs, seq_len, average, pad_id=0, where="batch", pair_weights=None,
               nll_tokens=None):
    """``PairBatch`` of ``pairs``: ``[(chosen_ids, chosen_mask, rejected_ids,
    rejected_mask)]``, token lists with a 0/1 list each, 1 on the completion tokens
    (the loss's), prompt included in the ids.  ``average``: the method averages its
    log-probabilities over the completion tokens (``Method.average``).  A sequence
    longer than ``seq_len`` or without a completion token is one error naming it.

    The training step's ORPO NLL is the mean over the batch's chosen next tokens, or
    over ``nll_tokens`` of them (an MPI rank's share of the global micro-batch's).
    ``pair_weights`` (``[N]``, for the held-out evaluation: 0 on padding pairs) weigh
    the pairs in the eval graph's means, its NLL each pair's own token mean."""
    seqs = [(p[0], p[1]) for p in pairs] + [(p[2], p[3]) for p in pairs]
    n, t = len(seqs), int(seq_len)
    ids = np.full((n, t), pad_id, np.int64)
    targets = np.zeros((n, t), np.int64)
    w = np.zeros((n, t, n + 1))
    counts = np.zeros(n)
    n_nll = 0
    for s, (tok, mask) in enumerate(seqs):
        kind = f"{where}: pair {s % len(pairs)}'s {'chosen' if s < len(pairs) else 'rejected'}"
        tok, mask = np.asarray(tok, np.int64), np.asarray(mask, bool)
        if len(tok) != len(mask):
            raise GradtapeError(f"{kind}: {len(tok)} tokens but {len(mask)} mask entries")
        if len(tok) > t:
            raise GradtapeError(f"{kind}: {len(tok)} tokens do not fit in --seq-len {t}")
        counted = mask[1:]  # row r predicts token r + 1
        counts[s] = counted.sum()
        if counts[s] == 0:
            raise GradtapeError(f"{kind}: no completion token to train on")
        ids[s, :len(tok)] = tok
        targets[s, :len(tok) - 1] = tok[1:]
        w[s, :len(tok) - 1, s] = counted / counts[s] if average else counted
        if s < len(pairs):  # ORPO's NLL: every next token of the chosen sequence
            w[s, :len(tok) - 1, n] = 1.0
            n_nll += len(tok) - 1
    if pair_weights is None:
        w[:, :, n] /= max(n_nll, 1) if nll_tokens is None else nll_tokens
        pair_weights = np.full(len(pairs), 1.0 / len(pairs))
    else:  # each pair's NLL is its own mean, weighted as the pair
        pair_weights = np.asarray(pair_weights, np.float64).reshape(len(pairs))
        nexts = np.maximum(w[:len(pairs), :, n].sum(axis=1), 1.0)
        w[:len(pairs), :, n] *= (pair_weights / nexts)[:, None]
    positions = np.tile(np.arange(t, dtype=np.int64), n)
    return PairBatch(ids.reshape(-1), targets.reshape(-1), positions, w.reshape(n * t, n + 1),
                     counts, pair_weights)


@dataclass
class PreferenceGraph:
    """A recorded preference loss: ``loss`` (one element), ``metrics`` (TRL's names),
    ``logps [2N, 1]`` the policy's, the const leaves ``feeds`` fills, and the held-out
    evaluation's ``eval_loss``, ``eval_metrics`` (the same, each pair weighted by the
    batch's ``pair_weights``) and ``eval_logps``: the same values from a head that folds
    in nothing for a backward (``sequence_logps(training=False)``)."""
    loss: object
    metrics: dict
    logps: object
    leaves: dict
    eval_loss: object = None
    eval_metrics: dict = None
    eval_logps: object = None
    nll: bool = True  # whether the loss reads the chosen sequences' NLL (ORPO's)

    def feeds(self, batch: PairBatch, ref=None, no_target=0) -> dict:
        """``{leaf: array}`` for ``Program.run`` of ``batch`` (and the reference's
        ``[2N]`` log-probabilities, for a method with a reference; ``no_target`` as
        ``_feeds``')."""
        lv, dt = self.leaves, self.loss.dtype
        n = batch.n_pairs
        out = _feeds(lv, batch, dt, no_target, self.nll)
        if "pair_weights" in lv:
            out[lv["pair_weights"]] = np.asarray(batch.pair_weights, dt).reshape(n, 1)
        if "ref" in lv:
            if ref is None:
                raise GradtapeError("this method needs the reference log-probabilities")
            out[lv["ref"]] = np.asarray(ref, dt).reshape(2 * n, 1)
        return out


def _leaves(tp, batch: PairBatch):
    return {k: tp.const(v) for k, v in _arrays(batch, tp.dtype).items()}


def _arrays(batch: PairBatch, dt):
    """The arrays of ``batch`` that the forward and the sums read, by leaf name."""
    return {"ids": batch.ids, "targets": batch.targets, "positions": batch.positions,
            "segments": np.zeros_like(batch.ids), "weights": batch.weights.astype(dt),
            "counts": batch.counts.astype(dt)[:, None]}


def _feeds(lv, batch: PairBatch, dt, no_target=0, nll=True):
    """``no_target``: the target id of a row that no sum read counts (a prompt's, padding;
    ``nll``: the last column, the chosen sequences' NLL, is read), -1 where the programs'
    fused head skips it (``step.no_target_id``)."""
    arrays = _arrays(batch, dt)
    if no_target:
        counted = batch.weights if nll else batch.weights[:, :-1]
        arrays["targets"] = np.where(counted.any(axis=1), batch.targets, no_target)
    return {lv[k]: v for k, v in arrays.items() if k in lv}


def _forward_logps(tp, cfg, W, lora, lora_scale, lv, n_seq, training, evaluated=False,
                   fused_from=None):
    """The sums ``[2N+1, 1]`` of ``sequence_logps``; ``evaluated``: ``(sums, the same
    from a head recorded with training=False)`` (one head where both are the same).
    ``fused_from``: ``record_forward``'s (the plan's attention route)."""
    ones = nn.ones(tp, cfg.dim)
    hidden = record_forward(tp, cfg, W, lv["ids"], n_seq, lora, lora_scale, ones=ones,
                            positions=lv["positions"], segments=lv["segments"], head=False,
                            fused_from=fused_from)
    sums = sequence_logps(tp, cfg, W, hidden, lv["targets"], lv["weights"], ones,
                          training=training)
    if not evaluated:
        return sums
    if not training or not logps_fused(cfg, hidden.shape[0]):
        return sums, sums  # the composed head: nothing folded in for a backward
    return sums, sequence_logps(tp, cfg, W, hidden, lv["targets"], lv["weights"], ones,
                                training=False)


def record_preference(tp, cfg, W, lora, lora_scale, m: Method, batch: PairBatch,
                      opt: Options = Options(), ref=None, fused_from=None) -> PreferenceGraph:
    """Record method ``m``'s loss over ``batch`` on ``tp``: the ``2N`` sequences in one
    forward (``W`` from ``weight_consts``, ``lora`` ``{(layer, target): (A, B)}`` params,
    as ``record_forward`` takes them), their log-probabilities, and the loss with its
    metrics.  ``ref``: the reference's ``[2N]`` log-probabilities (``reference_logps``),
    a const leaf fed each step; required where the method has a reference.
    ``fused_from``: the rows per sequence from which attention is the fused primitive
    (``record_forward``'s; a training step's ``attention_from``)."""
    n = batch.n_pairs
    lv = _leaves(tp, batch)
    # the held-out evaluation (and the reference pass) reads a head of its own: the
    # training one's forward also folds up what its backward needs
    sums, eval_sums = _forward_logps(tp, cfg, W, lora, lora_scale, lv, 2 * n, training=True,
                                     evaluated=True, fused_from=fused_from)
    logps = _rows(sums, 0, 2 * n)
    rc = rr = None
    if m.reference:
        if ref is None:
            raise GradtapeError(f"method {m.name} needs the reference log-probabilities")
        lv["ref"] = tp.const(np.asarray(ref, tp.dtype).reshape(2 * n, 1))
        rc, rr = _rows(lv["ref"], 0, n), _rows(lv["ref"], n, 2 * n)
    counts = lv["counts"]

    def logps_of(s):  # column 2N of the sums: -NLL
        nll = ops.neg(ops.reduce_sum(_rows(s, 2 * n, 2 * n + 1))) if m.nll else None
        return Logps(_rows(s, 0, n), _rows(s, n, 2 * n), rc, rr, nll,
                     _rows(counts, 0, n), _rows(counts, n, 2 * n))
    loss, metrics = build_loss(m, logps_of(sums), opt)
    # the held-out means: the same loss with each pair weighted (a batch's padding by 0)
    lv["pair_weights"] = tp.const(np.full((n, 1), 1.0 / n, tp.dtype))
    eval_lp = logps if eval_sums is sums else _rows(eval_sums, 0, 2 * n)
    eval_loss, eval_metrics = build_loss(m, replace(logps_of(eval_sums),
                                                    weight=lv["pair_weights"]), opt)
    return PreferenceGraph(loss, metrics, logps, lv, eval_loss, eval_metrics, eval_lp, m.nll)


@dataclass
class BaseLogps:
    """A recorded base-model forward over ``n_pairs`` pairs (``record_base_logps``):
    ``logps [2N, 1]`` and the const leaves ``feeds`` fills."""
    logps: object
    leaves: dict

    def feeds(self, batch: PairBatch, no_target=0) -> dict:
        return _feeds(self.leaves, batch, self.logps.dtype, no_target, nll=False)


def record_base_logps(tp, cfg, W, n_pairs, seq_len, fused_from=None) -> BaseLogps:
    """The base model's log-probabilities of ``n_pairs`` pairs of ``seq_len`` rows: the
    policy's forward without the adapter.  A fresh LoRA (B = 0) adds exactly zero, so
    they are the eval program's values without the adapter's products (to rounding: a
    GEMM over another number of rows may sum in another order): the reference pass's
    program where the reference is the base model, over any number of pairs."""
    lv = _leaves(tp, pair_batch([([0, 0], [0, 1], [0, 0], [0, 1])] * n_pairs, seq_len, False))
    del lv["counts"]  # the sums are weighted already (``pair_batch``'s weights)
    sums = _forward_logps(tp, cfg, W, None, 1.0, lv, 2 * n_pairs, training=False,
                          fused_from=fused_from)
    return BaseLogps(_rows(sums, 0, 2 * n_pairs), lv)


def _rows(v, a, b):
    return ops.slice_(v, 0, a, b)


def reference_logps(model, adapter, m: Method, batch: PairBatch, dtype=np.float64,
                    backend="numpy"):
    """The reference's ``[2N]`` log-probabilities of ``batch`` (chosen, then rejected):
    ``model`` with ``adapter`` as given (``None``, or a fresh one whose B = 0: the base
    model), forward only, summed or averaged as ``m`` says."""
    tp = Tape(dtype, eager=False)
    W = weight_consts(tp, {k: w if not isinstance(w, np.ndarray) else w.astype(dtype, copy=False)
                           for k, w in model.weights.items()})
    lora = None if adapter is None else {
        k: (tp.const(a.astype(dtype)), tp.const(b.astype(dtype)))
        for k, (a, b) in adapter.weights.items()}
    lv = _leaves(tp, batch)
    n = batch.n_pairs
    sums = _forward_logps(tp, model.config, W, lora, 1.0 if adapter is None else adapter.scale,
                          lv, 2 * n, training=False)
    out = tp.compile([_rows(sums, 0, 2 * n)], backend=backend).run()[0]
    return np.asarray(out, np.float64).reshape(-1)
