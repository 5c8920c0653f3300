"""The generate loop: when to stop (end-of-sequence ids, stop strings, the length) and the
prompt-then-decode loop behind ``Llama.generate``.

The loop is independent of how logits are computed: it is given a ``prefill(ids)``
function (logits of the prompt's last row, filling a cache) and a ``decode(token)``
function (logits of one more token).  ``generator`` supplies them (the float32 graph
replay, or the block-weight decode step of ``block_decoder``); ``sampling`` picks each
token.  This module computes no model math.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError
from .sampling import Sampling, sample_next


@dataclass(frozen=True)
class Stopping:
    """When generation stops besides its length: after a token in ``ids`` (any iterable
    of token ids; None: the model's own ``stop_ids``), or after the token that completes
    one of the ``strings`` (checked by ``check_stop_strings``)."""
    strings: tuple = ()
    ids: object = None


def check_stop_strings(stop) -> tuple:
    """``stop`` (None, one string or several) as a tuple of non-empty strings."""
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    for s in stop:
        if not isinstance(s, str) or not s:
            raise GradtapeError(f"stop strings (--stop) must be non-empty text, got {s!r}")
    return tuple(stop)


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """``(text before the first stop string, whether one was found)``."""
    cut = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cut)], True) if cut else (text, False)


def held_back(text: str, stop) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (and
    must not be shown yet)."""
    n = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


# --- the loop -----------------------------------------------------------------------------

def check_length(n_prompt, max_new_tokens, context):
    """The prompt plus ``max_new_tokens`` must fit the model's context."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise GradtapeError(f"max_new_tokens (--max-new-tokens) must be an integer, "
                            f"got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise GradtapeError(f"max_new_tokens (--max-new-tokens) must be >= 0, got "
                            f"{max_new_tokens}")
    if n_prompt + max_new_tokens > context:
        hint = ("shorten the prompt" if n_prompt >= context else
                f"allow at most {context - n_prompt} new tokens (--max-new-tokens "
                f"{context - n_prompt} or less)")
        raise GradtapeError(f"the prompt ({n_prompt} tokens) plus max_new_tokens "
                            f"{max_new_tokens} is longer than the model's context "
                            f"({context} tokens); {hint}")


def run_loop(prompt, max_new_tokens, s: Sampling, prefill, decode, stop_ids=(),
             stop=(), decode_text=None, stream=None) -> list[int]:
    """New token ids: ``prefill(prompt)`` gives the logits after the prompt, then each
    picked token is fed to ``decode(token)``.  Stops after a token in ``stop_ids``, after
    the token that completes one of the ``stop`` strings (``decode_text(ids) -> str``
    turns the new ids into text; both tokens are included in the result), or after
    ``max_new_tokens``.  ``stream(token)`` sees every new token as it is picked."""
    out = []
    if max_new_tokens == 0:
        return out
    rng = np.random.default_rng(s.seed)
    seen = list(prompt) if s.repetition_penalty != 1.0 else ()
    last = prefill(prompt)
    while True:
        tok = sample_next(last, s, rng, seen)
        out.append(tok)
        if seen != ():
            seen.append(tok)
        if stream is not None:
            stream(tok)
        if tok in stop_ids or len(out) >= max_new_tokens:
            return out
        if stop and cut_at_stop(decode_text(out), stop)[1]:
            return out
        last = decode(tok)
