"""Training data: checked records -> token examples with loss masks -> fixed-shape rows.

``records`` reads the files (formats, schemas, ``--columns``); this module tokenizes.
Each record kind (``records.KINDS``) has its example maker in ``EXAMPLES``: a chat is
rendered with the model's chat template and only the assistant turns are targets; a
prompt/completion pair has the completion and an end-of-sequence token as targets; text
is all targets (a plain-text file, or a ``text`` record with an end-of-sequence token) and
is cut into ``seq_len`` pieces, where an answer too long for a row is truncated.
``train_on_prompt`` makes every token a target.  An example left with no target (an
empty answer, or a prompt that fills the row) is skipped and counted.

A row's targets are next tokens: position ``t`` predicts token ``t + 1`` when that token
is a target; the last position of every example and masked tokens get ``IGNORE``.  Rows
hold one example each, padded (``pad_rows``), or as many as fit (``pack_rows``: each with
its own positions and segment id, which the model turns into rope rows and a
block-diagonal causal mask).  Batch order is a pure function of (seed, step), so a
resumed run sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError
from .records import DataFile, read_data  # noqa: F401  (the data API in one place)

IGNORE = -100


@dataclass(frozen=True)
class Sequences:
    ids: np.ndarray  # [n, T] int64 input tokens (padded)
    targets: np.ndarray  # [n, T] int64 next-token targets, IGNORE where none
    positions: np.ndarray  # [n, T] int64 each token's position within its example
    segments: np.ndarray  # [n, T] int64 each token's example index within its row

    def __len__(self):
        return len(self.ids)

    @property
    def n_target_tokens(self):
        return int((self.targets != IGNORE).sum())

    def take(self, index):
        return Sequences(*self.batch(index))

    def batch(self, index):
        """``(ids, targets, positions, segments)`` of rows ``index``: a micro-batch as
        ``TrainStep.step`` takes it."""
        return self.ids[index], self.targets[index], self.positions[index], self.segments[index]


def load_sequences(path, tokenizer, seq_len, pad_id=0, **kw) -> Sequences:
    """Read a data file and turn it into ``[n, seq_len]`` rows (``kw``: ``tokenize_data``'s)."""
    return tokenize_data(read_data(path), tokenizer, seq_len, pad_id, **kw)


def tokenize_data(data: DataFile, tokenizer, seq_len, pad_id=0, train_on_prompt=False):
    """``[n, seq_len]`` rows from checked data, one example a row."""
    examples, _ = tokenize_examples(data, tokenizer, seq_len, train_on_prompt)
    return pad_rows(examples, seq_len, pad_id)


def tokenize_examples(data: DataFile, tokenizer, seq_len, train_on_prompt=False):
    """``(examples, skipped)``: ``(ids, is_target)`` array pairs of at most ``seq_len``
    tokens, each with a target, and the number of examples that had none."""
    if data.schema is None:  # a plain-text file: one text, no end-of-sequence token
        pieces = [_tokens(tokenizer, [(data.text, True)])]
        if len(pieces[0][0]) < 2:
            raise GradtapeError("the text is too short to train on (fewer than 2 tokens)")
        split = True
    else:
        make, split = EXAMPLES[data.schema.kind]
        pieces = [make(rec, tokenizer, where) for where, rec in data.records]
    out, skipped = [], 0
    for ids, mask in pieces:
        if train_on_prompt:
            mask = np.ones(len(ids), bool)
        for e_ids, e_mask in _cut(ids, mask, seq_len, split):
            if e_mask[1:].any():  # a target is a token after the first
                out.append((e_ids, e_mask))
            elif not split or len(e_ids) >= 2 or len(e_ids) == len(ids):
                skipped += 1  # (but a longer text's last lone token is no example)
    if not out:
        raise GradtapeError(f"no example has a target token within seq_len={seq_len}")
    return out, skipped


def _cut(ids, mask, seq_len, split):
    """The examples of one tokenized record: its ``seq_len`` pieces where it ``split``s
    (text), else its first ``seq_len`` tokens."""
    for s in range(0, len(ids), seq_len) if split else (0,):
        yield ids[s:s + seq_len], mask[s:s + seq_len]


def _tokens(tokenizer, pieces):
    """(ids, is_target) of (text, is_target) pieces encoded one after another."""
    ids, mask = [], []
    for text, is_target in pieces:
        toks = tokenizer.encode(text) if text else []
        ids += toks
        mask += [is_target] * len(toks)
    return np.asarray(ids, np.int64), np.asarray(mask, bool)


def _chat_example(rec, tokenizer, where):
    return _tokens(tokenizer, _chat_pieces(rec["messages"], tokenizer, where))


def _completion_example(rec, tokenizer, where):
    # the end-of-sequence token teaches the model to stop
    ids, mask = _tokens(tokenizer, [(rec["prompt"], False), (rec["completion"], True)])
    return np.append(ids, tokenizer.eos_id), np.append(mask, True)


def _text_example(rec, tokenizer, where):
    ids, mask = _tokens(tokenizer, [(rec["text"], True)])
    return np.append(ids, tokenizer.eos_id), np.append(mask, True)


# record kind -> (example maker (record, tokenizer, where) -> (ids, is_target), whether a
# long example continues into further rows (text) rather than being truncated)
EXAMPLES = {"chat": (_chat_example, False), "completion": (_completion_example, False),
            "text": (_text_example, True)}


def _chat_pieces(msgs, tokenizer, where):
    """Split the rendered conversation into (text, is_assistant) pieces by rendering
    growing prefixes: each assistant turn is what it adds after the generation prompt."""
    pieces, done = [], ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True)
        after = tokenizer.apply_chat_template(msgs[:i + 1])
        if not (before.startswith(done) and after.startswith(before)):
            raise GradtapeError(f"{where}: the model's chat template does not render "
                                "conversations incrementally; cannot mask the prompt")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    full = tokenizer.apply_chat_template(msgs)
    if full.startswith(done):
        pieces.append((full[len(done):], False))
    return pieces


def _targets(ids, mask):
    """Next-token targets: ids[t+1] where that token is a target, IGNORE elsewhere."""
    t = np.full(len(ids), IGNORE, np.int64)
    t[:-1] = np.where(mask[1:], ids[1:], IGNORE)
    return t


def empty_rows(n, seq_len, pad_id=0) -> Sequences:
    """``n`` empty rows: padding, no targets, positions counting from 0, segment 0."""
    return Sequences(np.full((n, seq_len), pad_id, np.int64),
                     np.full((n, seq_len), IGNORE, np.int64),
                     np.tile(np.arange(seq_len, dtype=np.int64), (n, 1)),
                     np.zeros((n, seq_len), np.int64))


def pad_rows(examples, seq_len, pad_id) -> Sequences:
    """One example per row, padded to ``seq_len``."""
    rows = empty_rows(len(examples), seq_len, pad_id)
    for i, (e_ids, e_mask) in enumerate(examples):
        rows.ids[i, :len(e_ids)] = e_ids
        rows.targets[i, :len(e_ids)] = _targets(e_ids, e_mask)
    return rows


def pack_rows(examples, seq_len, pad_id) -> Sequences:
    """Examples packed into ``seq_len`` rows, best-fit decreasing: longest first, each into
    the row it fills most tightly (a new row when none has room).  Within a row every
    example has its own positions (from 0) and segment (its index in the row), so that
    the model's attention keeps it to itself; the padding after the last one is a segment
    of its own.  A pure function of the examples, as the batch order needs."""
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))  # stable
    content = []  # per row: its examples
    spaces, rows_with = [], {}  # the distinct free spaces, sorted; space -> rows (a stack)
    for i in order:
        n = len(examples[i][0])
        k = bisect.bisect_left(spaces, n)  # the smallest free space that fits
        if k == len(spaces):
            row, space = len(content), seq_len
            content.append([])
        else:
            space = spaces[k]
            row = rows_with[space].pop()
            if not rows_with[space]:
                del rows_with[space], spaces[k]
        content[row].append(i)
        space -= n
        if space:
            if space not in rows_with:
                bisect.insort(spaces, space)
            rows_with.setdefault(space, []).append(row)
    rows = empty_rows(len(content), seq_len, pad_id)
    for r, members in enumerate(content):
        at = 0
        for seg, i in enumerate(members):
            e_ids, e_mask = examples[i]
            n = len(e_ids)
            rows.ids[r, at:at + n] = e_ids
            rows.targets[r, at:at + n] = _targets(e_ids, e_mask)
            rows.positions[r, at:at + n] = np.arange(n)
            rows.segments[r, at:at + n] = seg
            at += n
        rows.positions[r, at:] = np.arange(seq_len - at)
        rows.segments[r, at:] = len(members)
    return rows


def _pack_text(tokens, seq_len, pad_id):
    """Plain-text tokens cut into ``seq_len`` rows, every token a target."""
    ids = np.asarray(tokens, np.int64)
    if len(ids) < 2:
        raise GradtapeError("the text is too short to train on (fewer than 2 tokens)")
    return pad_rows([e for e in _cut(ids, np.ones(len(ids), bool), seq_len, True)
                     if len(e[0]) >= 2], seq_len, pad_id)


def _split_index(n, fraction, seed):
    n_eval = 0 if fraction <= 0 or n < 2 else max(1, min(n - 1, round(n * fraction)))
    order = np.random.default_rng([seed, 1]).permutation(n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def split_eval(seqs: Sequences, fraction, seed):
    """(train, eval) rows: a seeded held-out split; eval is empty when ``fraction`` is 0."""
    keep, held = _split_index(len(seqs), fraction, seed)
    return seqs.take(keep), seqs.take(held)


def split_examples(examples, fraction, seed):
    """(train, eval) examples: the split ``split_eval`` makes of rows, made of examples
    before they are put into rows (so packing them or not holds out the same ones)."""
    keep, held = _split_index(len(examples), fraction, seed)
    return [examples[i] for i in keep], [examples[i] for i in held]


def _stream(n, start, count, seed):
    """Indices ``start .. start + count`` of the stream of seeded per-epoch permutations
    of ``range(n)`` that the batches are cut from."""
    out = []
    while len(out) < count:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, 2, epoch]).permutation(n)
        out.extend(perm[offset:offset + count - len(out)].tolist())
    return np.asarray(out, np.int64)


def batch_indices(n, batch_size, step, seed):
    """The example indices of global batch ``step``: consecutive slices of a stream of
    seeded per-epoch permutations, a pure function of its arguments."""
    return _stream(n, step * batch_size, batch_size, seed)


def used_indices(n, batch_size, steps, seed):
    """The sorted indices of the examples that ``steps`` global batches (``batch_indices``
    of steps ``0 .. steps - 1``) take: all ``n`` from one epoch on."""
    if steps * batch_size >= n:
        return np.arange(n)
    return np.sort(_stream(n, 0, steps * batch_size, seed))
