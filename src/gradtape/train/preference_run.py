"""The preference methods' side of a fine-tuning run: the pairs, their batches, the
reference pass and the held-out evaluation.

``finetune`` reads the data with ``task="preference"`` and asks this module for what the
loop needs: ``PairData.micro(step)`` (a step's pairs as ``train.preference`` lays them
out, with the reference's log-probabilities of those pairs) and ``PairData.evaluate``
(the held-out loss and metrics, under TRL's ``eval_`` names).  The reference pass runs
once, before the first step, with the model as it starts: a fresh adapter adds nothing
and full fine-tuning's policy is the model, so the model's own forward runs, several pairs
a call (``TrainStep.reference_logps``); an adapter given to continue from, or DoRA's, runs
through the step's eval program.  It is saved atomically in the run folder
(``reference.safetensors``) so that ``--resume`` reads it instead of recomputing it.
Under MPI each rank takes its share of every global micro-batch's pairs, and the
reference pass's batches are shared out over the ranks (one Allreduce gathers them).

Not here: the losses (``train.methods``), the recorded step (``train.step``), the loop,
checkpoints and logs (``train.finetune``).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import GradtapeError
from ..io import atomic_write_bytes
from . import data as data_mod
from .pairs import pair_row, tokenize_pairs
from .preference import pair_batch

REFERENCE = "reference.safetensors"


class PairData:
    """Tokenized pairs (``train.pairs.Pair``) and, once the reference pass ran, the
    reference's ``[n, 2]`` log-probabilities (chosen, rejected) of each.  ``rank`` of
    ``ranks`` (MPI): the training batches take that rank's ``batch_size`` pairs of each
    global micro-batch of ``ranks * batch_size``."""

    def __init__(self, pairs, seq_len, average, pad_id, batch_size, seed, grad_accum=1,
                 rank=0, ranks=1):
        self.pairs, self.seq_len, self.average, self.pad_id = pairs, seq_len, average, pad_id
        self.batch_size, self.seed, self.grad_accum = batch_size, seed, grad_accum
        self.rank, self.ranks = rank, ranks
        self.ref = None

    def __len__(self):
        return len(self.pairs)

    def batch(self, idx, where="batch", **kw):
        """The ``train.preference.PairBatch`` of pairs ``idx`` (``kw``: ``pair_batch``'s
        ``pair_weights`` or ``nll_tokens``)."""
        rows = [(*pair_row(self.pairs[i], "chosen", self.seq_len),
                 *pair_row(self.pairs[i], "rejected", self.seq_len)) for i in idx]
        return pair_batch(rows, self.seq_len, self.average, self.pad_id, where, **kw)

    def _ref(self, idx):
        if self.ref is None:
            return None
        ref = np.concatenate([self.ref[idx, 0], self.ref[idx, 1]])
        if np.isnan(ref).any():  # reference_pass / load_reference cover every pair taken
            raise ValueError(f"pairs {idx[np.isnan(self.ref[idx, 0])]} have no reference")
        return ref

    def used(self, steps):
        """The pairs ``steps`` optimizer steps train on, sorted (every pair from one
        epoch on)."""
        per_step = self.batch_size * self.ranks * self.grad_accum
        return data_mod.used_indices(len(self), per_step, steps, self.seed)

    def micro(self, step):
        """``([(PairBatch, ref)] a micro-batch each, completion tokens of the whole
        step)`` of optimizer step ``step``: with MPI, this rank's pairs of each global
        micro-batch, ORPO's NLL a mean over the global micro-batch's tokens."""
        b, size = self.batch_size, self.batch_size * self.ranks
        idx = data_mod.batch_indices(len(self), size * self.grad_accum, step, self.seed)
        if self.ranks == 1:
            micro = [(self.batch(idx[i:i + b]), self._ref(idx[i:i + b]))
                     for i in range(0, len(idx), b)]
            return micro, int(sum(batch.counts.sum() for batch, _ in micro))
        micro = []
        for i in range(0, len(idx), size):
            every = idx[i:i + size]
            mine = every[self.rank * b:(self.rank + 1) * b]
            # the rank's NLL is weighted by ranks / tokens, its loss by 1 / ranks
            nexts = sum(len(pair_row(self.pairs[k], "chosen", self.seq_len)[0]) - 1
                        for k in every)
            micro.append((self.batch(mine, nll_tokens=nexts / self.ranks), self._ref(mine)))
        tokens = sum(int(pair_row(self.pairs[k], w, self.seq_len)[1][1:].sum())
                     for k in idx for w in ("chosen", "rejected"))
        return micro, tokens

    def batches(self, part=0, parts=1, size=None, order=None):
        """The pairs in order (or those of ``order``, an index array), ``batch_size`` (or
        ``size``) at a time, as ``TrainStep.eval_preference`` takes them: the last batch
        filled up by wrapping around to the first pairs, which weigh 0 in its means
        (``pair_weights``), so every pair counts once; each batch weighted by its share
        of the pairs.  ``part`` of ``parts``: every ``parts``-th batch from the
        ``part``-th only (an MPI rank's share of the reference pass)."""
        order = np.arange(len(self)) if order is None else order
        n, b = len(order), size or self.batch_size
        for s in range(part * b, n, parts * b):
            idx = order[np.arange(s, s + b) % n]
            real = min(b, n - s)
            weights = np.where(np.arange(b) < real, 1.0 / real, 0.0)
            yield self.batch(idx, pair_weights=weights), self._ref(idx), real / n

    def evaluate(self, step_prog):
        """``{"eval_loss": ..., "eval_rewards/chosen": ...}`` over every pair."""
        loss, metrics, _ = step_prog.eval_preference(self.batches())
        return {"eval_loss": loss, **{f"eval_{k}": v for k, v in metrics.items()}}


def load(cfg, data_file, eval_file, tokenizer, average, log, world=None):
    """``(train, held)`` ``PairData`` of the checked data files: ``--eval-data``'s pairs,
    else ``--eval-frac`` of ``--data``'s held out (the same seeded split as SFT's);
    ``world`` (MPI): the training pairs are this rank's share of each micro-batch."""
    def tokenized(data, name):
        pairs, skipped = tokenize_pairs(data, tokenizer, cfg.seq_len)
        if skipped:
            log(f"warning: {name}: {skipped} of {skipped + len(pairs)} pairs keep no "
                f"completion token within --seq-len {cfg.seq_len}; skipped")
        return pairs

    pairs = tokenized(data_file, "--data")
    if eval_file is None:
        train, held = data_mod.split_examples(pairs, cfg.eval_frac, cfg.seed)
    else:
        train, held = pairs, tokenized(eval_file, "--eval-data")
    pad = tokenizer.eos_id
    rank, ranks = (0, 1) if world is None else (world.rank, world.size)
    return (PairData(train, cfg.seq_len, average, pad, cfg.batch_size, cfg.seed,
                     cfg.grad_accum, rank, ranks),
            PairData(held, cfg.seq_len, average, pad, cfg.batch_size, cfg.seed, cfg.grad_accum))


def reference_pass(step_prog, datasets, out, log, world=None, only=None):
    """Each of ``datasets``' reference log-probabilities, the model with its adapter as
    it is before the first step (``TrainStep.reference_logps``), saved in ``out /
    REFERENCE``: of every pair, or of ``only[name]``'s (the pairs the run's steps take;
    NaN for the others), less those a resumed run's file holds already (``d.ref``, from
    ``load_reference``).  ``world`` (MPI): each rank computes every ``size``-th batch,
    one Allreduce of the rows (each filled by one rank, zeros elsewhere: the sum is
    exact) gives every rank all of them, and rank 0 writes the file."""
    from safetensors.numpy import save

    rank, size = (0, 1) if world is None else (world.rank, world.size)
    t0 = time.perf_counter()
    arrays, calls, counts = {}, set(), []
    more = any(d.ref is not None for d in datasets.values())  # resumed: new pairs only
    for name, d in datasets.items():
        if not len(d):
            continue
        known = d.ref if d.ref is not None else np.full((len(d), 2), np.nan)
        d.ref = None  # the batches' own references: none yet
        order = (only or {}).get(name, np.arange(len(d)))
        order = order[np.isnan(known[order, 0])]
        n = len(order)
        ref = np.zeros((n, 2))
        if n:
            b = step_prog.reference_pairs(n)
            logps = step_prog.reference_logps(d.batches(rank, size, b, order))
            calls.add(b)
            for k, lp in zip(range(rank, n, size), logps):  # a batch: b chosen, b rejected
                idx = np.arange(k * b, k * b + b)
                keep = idx < n
                ref[idx[keep], 0], ref[idx[keep], 1] = lp[:b][keep], lp[b:][keep]
            if size > 1:
                world.allreduce_sum(ref)
        d.ref = arrays[name] = known.copy()
        d.ref[order] = ref
        counts.append((name, n, len(d)))
    step_prog.release_reference()
    if rank == 0:
        atomic_write_bytes(out / REFERENCE, save(arrays))
    seconds = time.perf_counter() - t0
    done = sum(n for _, n, _ in counts)
    what = f"{done} {'more ' if more else ''}pairs"
    if done < sum(of for *_, of in counts):
        what += (" (" + "; ".join(f"{name}: {n}" + (f" of {of}" if n < of else "")
                                  for name, n, of in counts) + "), "
                 + ("the new ones " if more else "those ") + "the steps take")
    log(f"reference pass: {what} in {seconds:.1f} s"
        + (f" ({' or '.join(map(str, sorted(calls)))} a call)" if calls else "")
        + f", saved in {out / REFERENCE}")
    return seconds


def load_reference(datasets, out, log, only=None):
    """The reference log-probabilities a resumed run saved (``reference_pass``); True
    where they cover ``only[name]``'s pairs (those the run's steps take), else False: a
    run resumed for more steps than it started with, whose new pairs ``reference_pass``
    computes before the checkpoint loads (the model is then as the run started)."""
    from ..formats.safetensors_reader import read_safetensors

    path = out / REFERENCE
    try:
        arrays, _ = read_safetensors(path, float32=False, floats_only=False)
    except (GradtapeError, OSError, ValueError) as e:
        raise GradtapeError(f"--resume: {path} is not a readable reference pass ({e})") \
            from None
    covered = True
    for name, d in datasets.items():
        if not len(d):
            continue
        ref = arrays.get(name)
        if ref is None or ref.shape != (len(d), 2):
            raise GradtapeError(f"--resume: {path} has no reference for the {len(d)} "
                                f"{name} pairs (the data changed?)")
        d.ref = np.asarray(ref, np.float64)
        order = (only or {}).get(name, np.arange(len(d)))
        covered = covered and not np.isnan(d.ref[order]).any()
    log(f"reference pass: read from {path}"
        + ("" if covered else "; these steps take pairs it does not hold"))
    return covered
