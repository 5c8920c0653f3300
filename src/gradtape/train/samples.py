"""Samples during a run: greedy answers to a few prompts at each evaluation, with the
adapter as trained so far (``finetune --samples N``, ``--sample-tokens``,
``--sample-prompts FILE``).

The prompts are the held-out examples' (their tokens before the first trained token: a
chat's conversation up to the assistant's turn, rendered by the chat template as in
training; a completion's prompt; a text's first tokens) or a file's, one prompt a line or
a JSON Lines file of strings, ``{"prompt": ...}`` or ``{"messages": [...]}``, sent through
the model's chat template where it has one (as ``generate --chat``).  Answers come from
``infer``'s generation loop (the C decoder where it runs, the adapter set per call; full
fine-tuning's: a model holding the step's weights, with a runner of its own): the
training program is never recompiled.  Not here: when to sample (the loop's evaluations).
"""

from __future__ import annotations

import json

import numpy as np

from .. import checks
from ..errors import GradtapeError
from ..infer.loop import Stopping
from ..infer.runner import Decoding, Runner
from ..infer.sampling import Sampling

# a text example (every token trained on) is prompted with its first quarter, at most this
TEXT_PROMPT_MAX = 32


def read_prompts(path, name="--sample-prompts") -> list:
    """The prompts of a file: strings, or message lists (a chat), one per line; one-line
    errors naming the file and line."""
    p = checks.input_path(path, name, "file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise GradtapeError(f"{name} {p}: is not UTF-8 text (byte {e.start})") from None
    jsonl = p.suffix == ".jsonl"
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        out.append(_json_prompt(line, f"{name} {p}:{n}") if jsonl else line)
    if not out:
        raise GradtapeError(f"{name} {p}: holds no prompt")
    return out


def _json_prompt(line, where):
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise GradtapeError(f"{where}: malformed JSON ({e.msg})") from None
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    if isinstance(rec, str):
        return rec
    msgs = rec.get("messages") if isinstance(rec, dict) else None
    if (isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in msgs)):
        return msgs
    raise GradtapeError(f"{where}: a prompt is a string, {{\"prompt\": text}} or "
                        "{\"messages\": [{\"role\", \"content\"}, ...]}")


def example_prompt(ids, is_target) -> np.ndarray:
    """The prompt of a tokenized example: its tokens before the first one trained on (a
    target is a token after the first); a text's first quarter where all are."""
    later = np.flatnonzero(np.asarray(is_target)[1:])
    t = int(later[0]) + 1 if len(later) else len(ids)
    if t <= 1:
        t = max(1, min(TEXT_PROMPT_MAX, len(ids) // 4))
    return np.asarray(ids[:t], np.int64)


def encode_prompt(tokenizer, prompt) -> np.ndarray:
    """A file's prompt as ids: through the chat template where the tokenizer has one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, list):
        if hasattr(tokenizer, "chat_template") and not template:
            raise GradtapeError("--sample-prompts: a messages prompt needs a chat template, "
                                "and the model has none")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    elif template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True)
    else:
        text = prompt
    return np.asarray(tokenizer.encode(text), np.int64)


class Sampler:
    """Greedy answers of at most ``tokens`` new tokens to ``prompts`` (id arrays) from
    ``model`` with an adapter; its ``Runner`` keeps the decoder between evaluations."""

    def __init__(self, model, prompts, tokens):
        self.model, self.tokenizer = model, model.tokenizer
        ctx = model.config.max_seq_len
        self.tokens = max(1, min(tokens, ctx - 1))
        keep = ctx - self.tokens  # the prompt's last tokens that fit with the answer
        self.prompts = [p[-keep:] for p in prompts if len(p)]
        stops = getattr(model, "stop_ids", None)
        if stops is None:
            eos = getattr(self.tokenizer, "eos_id", None)
            stops = frozenset() if eos is None else frozenset({eos})
        self.stops = frozenset(stops)
        self.runner = Runner(model)

    def __len__(self):
        return len(self.prompts)

    def answers(self, adapter, model=None) -> list[dict]:
        """``[{"prompt": text, "answer": text}]``, one per prompt (float32, greedy);
        ``model``: another model of the same config and tokenizer to answer from (full
        fine-tuning's weights now: a ``Runner`` of its own, dropped after)."""
        runner = self.runner if model is None else Runner(model)
        out = []
        for ids in self.prompts:
            new = runner.generate(ids, self.tokens, Sampling(0.0), adapter,
                                       Stopping(ids=self.stops), Decoding(np.float32))
            new = [t for t in new if t not in self.stops]
            out.append({"prompt": self.tokenizer.decode(ids.tolist()),
                        "answer": self.tokenizer.decode(new)})
        return out


def show(samples, width=100) -> list[str]:
    """Lines to print under the progress bar: each prompt's end and its answer, one line
    each (newlines shown as spaces)."""
    lines = []
    for s in samples:
        prompt = " ".join(s["prompt"].split())
        prompt = prompt if len(prompt) <= width // 2 else "..." + prompt[-(width // 2):]
        lines.append(f"  sample: {prompt}")
        lines.append(f"    -> {' '.join(s['answer'].split())[:width]}")
    return lines
