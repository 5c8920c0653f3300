"""Preference pairs: checked pair records -> token rows a preference step takes.

``records`` reads and checks the pairs (``read_data(..., task="preference")``); this
module tokenizes them as TRL's ``DPOTrainer`` does, so that a batch here is the batch
TRL forwards.  A pair becomes its prompt's tokens and each completion's: the standard
form tokenizes ``prompt`` and ``prompt + completion`` (the model's special tokens added,
an end-of-sequence token after the completion); the conversational forms render the
prompt with the generation prompt and the prompt followed by each completion with the
model's chat template, and tokenize those texts without special tokens.  The prompt is
the tokens both completions' rows begin with (a completion can merge with the prompt's
last token, or a template render the prompt alone differently: the completion then
starts where the token rows part), so the prompt's tokens are the same in both rows.

Rows are ``prompt + completion`` cut to their first ``seq_len`` tokens (TRL's
``keep_start``); a pair where either row keeps no completion token (its prompt fills the
row) is skipped and counted.  Targets are next tokens on completion tokens only (IGNORE
elsewhere).  A batch of N pairs is 2N rows, the chosen rows first and then the rejected
ones (TRL's concatenated order), one sequence a row.

Not here: the losses and log-probabilities (a method's), the reference pass, packing
pairs several to a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError
from .data import IGNORE, Sequences, _targets, empty_rows
from .records import PAIR_KINDS, DataFile, read_data


@dataclass(frozen=True)
class Pair:
    """One tokenized pair: rows ``prompt + chosen`` and ``prompt + rejected``."""
    prompt: np.ndarray  # int64, the tokens both rows begin with
    chosen: np.ndarray  # int64, the chosen completion's tokens
    rejected: np.ndarray  # int64, the rejected completion's tokens


def _encode(tokenizer, text, specials):
    # a rendered chat template holds its special tokens already: adding them again would
    # put a second BOS in front (transformers' apply_chat_template(tokenize=True) does not)
    if specials:
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


def _with_eos(ids, eos):
    # TRL appends the EOS text unless the completion already ends with it
    return ids if eos is None or (ids and ids[-1] == eos) else ids + [eos]


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer, messages, where, **kw):
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except GradtapeError as e:
        raise GradtapeError(f"{where}: {e}") from None


def tokenize_pair(rec, kind, tokenizer, where) -> Pair:
    """A pair record's normal form (``kind``: "pair" or "chat pair") as token ids."""
    if kind == "pair":
        eos = getattr(tokenizer, "eos_id", None)
        prompt = _encode(tokenizer, rec["prompt"], True)
        rows = [_with_eos(_encode(tokenizer, rec["prompt"] + rec[k], True), eos)
                for k in ("chosen", "rejected")]
    elif kind == "chat pair":
        prompt = _encode(tokenizer, _render(tokenizer, rec["prompt"], where,
                                            add_generation_prompt=True), False)
        rows = [_encode(tokenizer, _render(tokenizer, rec["prompt"] + rec[k], where), False)
                for k in ("chosen", "rejected")]
    else:
        raise ValueError(f"tokenize_pair: kind must be one of {', '.join(PAIR_KINDS)}, "
                         f"got {kind!r}")
    n = min(_common(prompt, rows[0]), _common(prompt, rows[1]))
    chosen, rejected = (np.asarray(r[n:], np.int64) for r in rows)
    for name, toks in (("chosen", chosen), ("rejected", rejected)):
        if not len(toks):
            raise GradtapeError(f"{where}: the {name} completion has no tokens after the "
                                "prompt's (an empty completion)")
    if np.array_equal(chosen, rejected):
        raise GradtapeError(f"{where}: 'chosen' and 'rejected' become the same tokens: "
                            "nothing to prefer")
    return Pair(np.asarray(prompt[:n], np.int64), chosen, rejected)


def pair_row(pair, which, seq_len):
    """``(ids, is_target)`` of one of a pair's rows, cut to ``seq_len`` tokens."""
    comp = pair.chosen if which == "chosen" else pair.rejected
    ids = np.concatenate([pair.prompt, comp])[:seq_len]
    mask = np.concatenate([np.zeros(len(pair.prompt), bool), np.ones(len(comp), bool)])
    return ids, mask[:seq_len]


def tokenize_pairs(data: DataFile, tokenizer, seq_len):
    """``(pairs, skipped)``: the ``Pair`` of every record whose two rows keep a target
    within ``seq_len`` tokens, and how many did not."""
    if data.schema is None or data.schema.kind not in PAIR_KINDS:
        what = "plain text" if data.schema is None else data.schema.name
        raise GradtapeError(f"{data.path}: {what}, not preference pairs")
    pairs, skipped = [], 0
    for where, rec in data.records:
        pair = tokenize_pair(rec, data.schema.kind, tokenizer, where)
        if all(pair_row(pair, w, seq_len)[1][1:].any() for w in ("chosen", "rejected")):
            pairs.append(pair)
        else:  # the prompt fills the row: no completion token is predicted in it
            skipped += 1
    if not pairs:
        raise GradtapeError(f"{data.path}: no pair keeps a completion token within "
                            f"seq_len={seq_len} (rows are cut to their first seq_len tokens; "
                            "a pair whose prompt fills them is skipped)")
    return pairs, skipped


@dataclass(frozen=True)
class PairBatch:
    """A batch of ``n`` pairs laid out as the step takes it: ``2n`` rows, pair ``i``'s
    chosen row ``i`` and its rejected row ``n + i``."""
    ids: np.ndarray  # [2n, T] int64 input tokens (padded)
    targets: np.ndarray  # [2n, T] int64 next-token targets on completion tokens, else IGNORE
    positions: np.ndarray  # [2n, T] int64 each token's position in its sequence
    segments: np.ndarray  # [2n, T] int64 each token's sequence within its row (0: one a row)
    sequence: np.ndarray  # [2n, T] int64 the sequence (0 .. 2n-1) a token is of; -1: padding

    @property
    def n_pairs(self):
        return len(self.ids) // 2

    def rows(self):
        """``(ids, targets, positions, segments)``, as ``TrainStep.step`` takes rows."""
        return self.ids, self.targets, self.positions, self.segments

    def completion_tokens(self):
        """``[2n]``: the completion tokens each sequence scores (its targets): what a
        method averaging its log-probabilities divides by."""
        return (self.targets != IGNORE).sum(axis=1)


@dataclass(frozen=True)
class PairRows:
    """Every pair's two rows: ``chosen`` and ``rejected`` ``Sequences``, row ``i`` pair
    ``i``'s, and each row's length before padding."""
    chosen: Sequences
    rejected: Sequences
    lengths: np.ndarray  # [2, n] int64 tokens of each chosen row, each rejected row

    def __len__(self):
        return len(self.chosen)

    def batch(self, index) -> PairBatch:
        """The pairs ``index`` (a pair index array, e.g. ``data.batch_indices``)."""
        index = np.asarray(index, np.int64)
        parts = [np.concatenate([a, b]) for a, b in zip(self.chosen.batch(index),
                                                         self.rejected.batch(index))]
        lengths = np.concatenate([self.lengths[0][index], self.lengths[1][index]])
        seq_len = parts[0].shape[1]
        sequence = np.where(np.arange(seq_len)[None, :] < lengths[:, None],
                            np.arange(len(lengths))[:, None], -1).astype(np.int64)
        return PairBatch(*parts, sequence)


def pair_rows(pairs, seq_len, pad_id=0) -> PairRows:
    """Each pair's two rows, padded to ``seq_len`` (each cut to its first ``seq_len``
    tokens)."""
    rows, lengths = [], []
    for which in ("chosen", "rejected"):
        seqs, lens = empty_rows(len(pairs), seq_len, pad_id), []
        for i, pair in enumerate(pairs):
            ids, mask = pair_row(pair, which, seq_len)
            seqs.ids[i, :len(ids)] = ids
            seqs.targets[i, :len(ids)] = _targets(ids, mask)
            lens.append(len(ids))
        rows.append(seqs)
        lengths.append(lens)
    return PairRows(*rows, np.asarray(lengths, np.int64).reshape(2, len(pairs)))


def load_pairs(path, tokenizer, seq_len, pad_id=0, columns="", name="data file"):
    """``(PairRows, skipped)`` of a preference data file or dataset folder."""
    pairs, skipped = tokenize_pairs(read_data(path, name, columns, task="preference"),
                                    tokenizer, seq_len)
    return pair_rows(pairs, seq_len, pad_id), skipped
