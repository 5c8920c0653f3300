"""Training data: files -> token sequences with loss masks -> fixed-shape batches.

Formats: plain text (tokenized and packed into ``seq_len`` sequences, every token a
target), JSONL of ``{"messages": [{"role", "content"}, ...]}`` (rendered with the model's
chat template; only assistant tokens are targets) and JSONL of ``{"prompt",
"completion"}`` (only the completion and its end-of-sequence token are targets).

A sequence's targets are next tokens: position ``t`` predicts token ``t + 1`` when that
token is a target; the last position and masked tokens get ``IGNORE``.  Batch order is a
pure function of (seed, step), so a resumed run sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GradtapeError

IGNORE = -100


@dataclass(frozen=True)
class Sequences:
    ids: np.ndarray  # [n, T] int64 input tokens (padded)
    targets: np.ndarray  # [n, T] int64 next-token targets, IGNORE where none

    def __len__(self):
        return len(self.ids)

    @property
    def n_target_tokens(self):
        return int((self.targets != IGNORE).sum())

    def take(self, index):
        return Sequences(self.ids[index], self.targets[index])


@dataclass(frozen=True)
class DataFile:
    """A data file read and checked before any model (or tokenizer) is loaded: plain
    ``text``, or the ``records`` of a JSONL file as (line number, object) pairs whose
    structure has been checked."""
    path: Path
    text: str = ""
    records: tuple = ()


def load_sequences(path, tokenizer, seq_len, pad_id=0) -> Sequences:
    """Read a data file and turn it into ``[n, seq_len]`` sequences."""
    return tokenize_data(read_data(path), tokenizer, seq_len, pad_id)


def read_data(path, name="data file") -> DataFile:
    """Read and check a data file (``name`` is how messages call it): a readable regular
    file of UTF-8 text without NUL bytes (else: the byte offset and line of the first bad
    byte), not empty; a JSONL file (``.jsonl``, or text starting with ``{``) must have a
    well-formed record on every non-blank line (else: the line)."""
    from ..checks import input_path

    path = input_path(path, name, "file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GradtapeError(f"{name} {path}: cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
        bad = raw.find(b"\0")  # valid UTF-8, but no text has it: a binary file
        what, why = "not text", "a NUL byte"
    except UnicodeDecodeError as e:
        bad, what, why = e.start, "not UTF-8 text", f"byte 0x{raw[e.start]:02x}"
    if bad >= 0:
        line = raw.count(b"\n", 0, bad) + 1
        raise GradtapeError(f"{name} {path}: {what} ({why} at byte offset {bad}, line "
                            f"{line}); data must be UTF-8 text or JSONL")
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the text
    if not text.strip():
        raise GradtapeError(f"{name} {path}: is empty")
    if path.suffix == ".jsonl" or text.lstrip().startswith("{"):
        return DataFile(path, records=tuple(
            (n, _check_record(obj, path, n)) for n, obj in _jsonl_records(text, path)))
    return DataFile(path, text=text)


def tokenize_data(data: DataFile, tokenizer, seq_len, pad_id=0) -> Sequences:
    """``[n, seq_len]`` sequences from a checked data file: JSONL records padded one per
    sequence, plain text packed."""
    if data.records:
        examples = [_jsonl_example(obj, tokenizer, data.path, n) for n, obj in data.records]
        return _pad_examples(examples, seq_len, pad_id)
    return _pack_text(tokenizer.encode(data.text), seq_len, pad_id)


def _jsonl_records(text, path):
    # JSON Lines end at "\n" only: str.splitlines would also split at U+2028 and other
    # characters that are valid inside a JSON string, and misnumber the lines
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise GradtapeError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise GradtapeError(f"{path}:{n}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise GradtapeError(f"{path}:{n}: each line must be a JSON object")
        yield n, obj


def _check_record(obj, path, n):
    """The structure of one JSONL record, checked without a tokenizer."""
    if "messages" in obj:
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs)):
            raise GradtapeError(f"{path}:{n}: 'messages' must be a non-empty list of "
                                "{\"role\": str, \"content\": str}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise GradtapeError(f"{path}:{n}: no assistant message to learn from")
        texts = [s for m in msgs for s in (m["role"], m["content"])]
    elif "prompt" in obj and "completion" in obj:
        if not (isinstance(obj["prompt"], str) and isinstance(obj["completion"], str)):
            raise GradtapeError(f"{path}:{n}: 'prompt' and 'completion' must be strings")
        texts = [obj["prompt"], obj["completion"]]
    else:
        raise GradtapeError(f"{path}:{n}: expected {{\"messages\": [...]}} or "
                            "{\"prompt\": ..., \"completion\": ...}")
    for t in texts:  # JSON may escape a lone surrogate ("\\ud800"): not text
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise GradtapeError(f"{path}:{n}: a string holds an unpaired surrogate "
                                "escape (\\ud800-\\udfff), which is not text") from None
    return obj


def _jsonl_example(obj, tokenizer, path, n):
    """(ids, is_target) for one checked JSONL record."""
    if "messages" in obj:
        pieces = _chat_pieces(obj["messages"], tokenizer, path, n)
    else:
        pieces = [(obj["prompt"], False), (obj["completion"], True)]
    ids, mask = [], []
    for text, is_target in pieces:
        toks = tokenizer.encode(text) if text else []
        ids += toks
        mask += [is_target] * len(toks)
    if "prompt" in obj:
        ids.append(tokenizer.eos_id)  # teach the model to stop
        mask.append(True)
    return np.asarray(ids, np.int64), np.asarray(mask, bool)


def _chat_pieces(msgs, tokenizer, path, n):
    """Split the rendered conversation into (text, is_assistant) pieces by rendering
    growing prefixes: each assistant turn is what it adds after the generation prompt."""
    pieces, done = [], ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True)
        after = tokenizer.apply_chat_template(msgs[:i + 1])
        if not (before.startswith(done) and after.startswith(before)):
            raise GradtapeError(f"{path}:{n}: the model's chat template does not render "
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


def _pad_examples(examples, seq_len, pad_id):
    n = len(examples)
    ids = np.full((n, seq_len), pad_id, np.int64)
    targets = np.full((n, seq_len), IGNORE, np.int64)
    for i, (e_ids, e_mask) in enumerate(examples):
        e_ids, e_mask = e_ids[:seq_len], e_mask[:seq_len]  # longer examples are truncated
        ids[i, :len(e_ids)] = e_ids
        targets[i, :len(e_ids)] = _targets(e_ids, e_mask)
    keep = (targets != IGNORE).any(axis=1)
    if not keep.any():
        raise GradtapeError(f"no example has a target token within seq_len={seq_len}")
    return Sequences(ids[keep], targets[keep])


def _pack_text(tokens, seq_len, pad_id):
    if len(tokens) < 2:
        raise GradtapeError("the text is too short to train on (fewer than 2 tokens)")
    chunks = [np.asarray(tokens[s:s + seq_len], np.int64) for s in range(0, len(tokens), seq_len)]
    chunks = [c for c in chunks if len(c) >= 2]
    return _pad_examples([(c, np.ones(len(c), bool)) for c in chunks], seq_len, pad_id)


def split_eval(seqs: Sequences, fraction, seed):
    """(train, eval): a seeded held-out split; eval is empty when ``fraction`` is 0."""
    n = len(seqs)
    n_eval = 0 if fraction <= 0 or n < 2 else max(1, min(n - 1, round(n * fraction)))
    order = np.random.default_rng([seed, 1]).permutation(n)
    return seqs.take(np.sort(order[n_eval:])), seqs.take(np.sort(order[:n_eval]))


def batch_indices(n, batch_size, step, seed):
    """The example indices of global batch ``step``: consecutive slices of a stream of
    seeded per-epoch permutations, a pure function of its arguments."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, 2, epoch]).permutation(n)
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return np.asarray(out)
