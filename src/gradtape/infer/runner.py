"""``Runner``: logits and generation for one loaded model, and the compiled programs and
C decoder that generation keeps between calls.

``logits`` runs the cached forward (``kv_cache``) over the ids.  ``generate`` checks its
inputs, then hands ``loop.run_loop`` a prefill and a decode function (``_Call``): the
prompt goes through the C decoder's kept rows, one compiled ``PromptStep`` (where
``prompt_choice`` says so and it fits in memory) or row by row; each new token through
the C decoder (``block_decoder``, float32) or a replayed ``DecodeStep``.  Building a
program costs far more than a short answer, so the last ones are kept and reused while
the adapter and sizes allow.  The model math is ``models.graph``'s; this module picks
and keeps the programs that run it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import GradtapeError
from ..models.memory import GiB, mem_available
from . import block_decoder
from .decode_step import DecodeStep
from .inputs import check_ids, lora_arrays, weights_as
from .kv_cache import PREFILL_CHUNK, KVCache, forward_cached
from .loop import Stopping, check_length, run_loop
from .prompt_choice import prompt_compute
from .prompt_step import PromptStep
from .sampling import Sampling

# a prompt program's rows are padded to a multiple of PROMPT_PAD (of 16 below it), so
# that prompts of similar length share a program (the last one is kept)
PROMPT_PAD = 64
# a prompt program runs only where what it holds (PromptStep.nbytes) is at most this
# share of the memory available when it is built; else the prompt is prefilled row by
# row, which needs the decoder's cache alone (an 8B's 8k-row program plans several GB)
PROMPT_MEM_SHARE = 0.8


@dataclass(frozen=True)
class Decoding:
    """How ``generate`` computes logits: ``dtype`` of the decoded rows (float32 or
    float64); ``decoder``: ``"blocks"`` (the one-call C step over the weights as stored,
    float32 only), ``"graph"`` (a replayed ``DecodeStep``) or ``"auto"`` (``"blocks"``
    where it can run); ``compute`` (float32, bf16, int8, auto): the precision of the
    prompt's GEMMs (``prompt_choice``).  Checked where they are used."""
    dtype: object = np.float32
    decoder: str = "auto"
    compute: str = "auto"


def _adapter_key(adapter, lora, scale):
    """What the rows a decoder cached with an adapter depend on: the adapter object, its
    scale and its values (a float64 sum of each matrix, so that an adapter trained in
    place between two calls does not decode from rows of its old values); None without."""
    if lora is None:
        return None
    sums = tuple(float(np.sum(m, dtype=np.float64)) for ab in lora.values() for m in ab)
    return id(adapter), scale, sums


class Runner:
    """Logits and generation for ``model`` (a ``models.Model``), with what generation
    reuses across calls: ``decode_steps`` ``{(dtype, capacity): (adapter, DecodeStep)}``,
    ``prompt`` ``(adapter, rows, compute, PromptStep)`` (the last one), ``blocks`` (the
    block views of the weights, taken once) and ``block_dec`` ``(adapter key,
    BlockDecoder)`` with its KV cache."""

    def __init__(self, model):
        self.model = model
        self.decode_steps = {}
        self.prompt = None
        self.blocks = None
        self.block_dec = None

    def logits(self, ids, adapter=None, dtype=np.float32) -> np.ndarray:
        """Next-token logits ``[len(ids), vocab_size]`` (row ``t`` predicts token ``t+1``),
        in ``dtype`` (float32 default, float64 on request)."""
        cfg = self.model.config
        ids = check_ids(cfg, ids)
        if ids.size == 0:
            raise GradtapeError("logits: needs at least one token")
        W = weights_as(self.model.weights, dtype)
        lora, scale = lora_arrays(adapter, cfg, dtype, self.model.weights)
        cache = KVCache.empty(cfg)
        rows = [forward_cached(cfg, W, ids[a:a + PREFILL_CHUNK], cache, lora, scale, dtype)
                for a in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(rows, 0) if len(rows) > 1 else rows[0]

    def generate(self, ids, max_new_tokens, sampling: Sampling, adapter=None,
                 stopping: Stopping = Stopping(), decoding: Decoding = Decoding(),
                 stream=None) -> list[int]:
        """New token ids after the prompt ``ids`` (``llama.Llama.generate`` says what
        each option does); ``stream(token_id)`` sees each new token as it is picked."""
        model = self.model
        if stopping.strings and model.tokenizer is None:
            raise GradtapeError("stop strings need a tokenizer, and this model has none")
        ids = check_ids(model.config, ids)
        if ids.size == 0:
            raise GradtapeError("generate: needs a prompt of at least one token")
        check_length(len(ids), max_new_tokens, model.config.max_seq_len)
        stops = model.stop_ids if stopping.ids is None else frozenset(stopping.ids)
        call = _Call(self, len(ids), max_new_tokens, adapter, decoding)
        text = model.tokenizer.decode if stopping.strings else None
        return run_loop(ids, max_new_tokens, sampling, call.prefill, call.decode, stops,
                        stopping.strings, text, stream)

    # --- the programs kept between calls ---

    def decode_step(self, adapter, W, lora, scale, dtype, cap):
        """A DecodeStep of at least ``cap`` rows, reused across calls with the same adapter
        (compiling one costs far more than a short answer); capacities are rounded up to
        a multiple of 64 so that prompts of similar length share one."""
        cap = -(-cap // 64) * 64
        key = (np.dtype(dtype).str, cap)
        hit = self.decode_steps.get(key)
        if hit is None or hit[0] is not adapter:
            if hit is not None and hit[0] is not adapter:
                self.decode_steps.clear()  # another adapter: drop the old programs
            hit = self.decode_steps[key] = (adapter, DecodeStep(self.model.config, W, lora,
                                                                scale, dtype, cap))
        return hit[1]

    def prompt_step(self, adapter, lora, scale, rows, compute):
        """A PromptStep of ``rows`` rounded up to a multiple of ``PROMPT_PAD`` (of 16
        below it); the last one is kept and reused by the next prompt of its size,
        adapter and precision (a chat's prompts only grow: older sizes are not).  None,
        with a warning, where the program would hold more than ``PROMPT_MEM_SHARE`` of
        the memory available: the caller prefills row by row."""
        pad = PROMPT_PAD if rows > PROMPT_PAD else 16
        key = (adapter, -(-rows // pad) * pad, compute)
        hit = self.prompt
        if hit is None or hit[0] is not key[0] or hit[1:3] != key[1:]:
            self.prompt = None  # its buffers go before the next program's are made
            available = mem_available()
            try:  # its arena is allocated here, its pages touched on the first run
                step = PromptStep(self.model.config, self.model.weights, lora, scale,
                                  key[1], compute)
            except MemoryError:  # more than the kernel lets one allocation have
                step = None
            if step is None or (available is not None
                                and step.nbytes > PROMPT_MEM_SHARE * available):
                held = f"{step.nbytes / GiB:.2f} GiB" if step else "more than it can have"
                free = "" if available is None else f", {available / GiB:.2f} GiB available"
                warnings.warn(f"gradtape: a prompt of {rows} rows as one program would "
                              f"hold {held}{free}: prefilling it row by row",
                              RuntimeWarning, stacklevel=3)
                return None
            hit = self.prompt = (*key, step)
        return hit[3]

    def use_blocks(self, decoder, dtype, lora) -> bool:
        """Whether the C decoder runs (``Decoding.decoder``), checked."""
        if decoder not in ("auto", "blocks", "graph"):
            raise GradtapeError(f"decoder must be 'auto', 'blocks' or 'graph', got {decoder!r}")
        if decoder == "graph":
            return False
        ok = (np.dtype(dtype) == np.float32 and block_decoder.supported(self.model)
              and all(ab[0].shape[1] <= block_decoder.MAX_RANK for ab in (lora or {}).values()))
        if decoder == "blocks" and not ok:
            raise GradtapeError("decoder 'blocks' needs float32, a C compiler, row lengths "
                                "that are multiples of 16 and a LoRA rank <= "
                                f"{block_decoder.MAX_RANK}")
        return ok

    def block_decoder(self, adapter, lora, scale, need):
        """A ``block_decoder.BlockDecoder`` with room for ``need`` rows (capacity rounded
        up to a multiple of 256), reused across calls (its KV cache and the block views
        of the weights, taken once per model); the adapter is set afresh every call, and
        the cached rows are forgotten where they were computed with another adapter, or
        with this one before its values changed (``_adapter_key``)."""
        if self.blocks is None:
            self.blocks = block_decoder.block_weights(self.model)
        hit = self.block_dec
        if hit is None or hit[1].cap < need:  # (a larger one takes over the cached rows)
            cap = min(-(-need // 256) * 256, max(need, self.model.config.max_seq_len))
            grown = block_decoder.BlockDecoder(self.model, self.blocks, cap=cap)
            if hit is not None:
                grown.take(hit[1])
            hit = (hit and hit[0], grown)
        key, dec = _adapter_key(adapter, lora, scale), hit[1]
        if key != hit[0]:
            dec.ids = []
        dec.set_lora(lora, scale)
        dec.set_dots()  # $GRADTAPE_DECODE_DOTS as it is now
        self.block_dec = (key, dec)
        return dec


class _Call:
    """One ``generate`` call: its inputs in the dtype asked for, the decoder and prompt
    precision chosen, and ``run_loop``'s two functions, ``prefill`` and ``decode``."""

    def __init__(self, runner, n_prompt, max_new_tokens, adapter, decoding):
        cfg = runner.model.config
        self.runner, self.cfg, self.adapter, self.decoding = runner, cfg, adapter, decoding
        self.n_prompt, self.max_new = n_prompt, max_new_tokens
        self.W = weights_as(runner.model.weights, decoding.dtype)
        self.lora, self.scale = lora_arrays(adapter, cfg, decoding.dtype, runner.model.weights)
        self.cache = KVCache.empty(cfg)
        self.fast = runner.use_blocks(decoding.decoder, decoding.dtype, self.lora)
        self.compiled = prompt_compute(cfg, decoding.compute, n_prompt, decoding.dtype)
        self.dec = None  # the C decoder, where it runs
        self.step = None  # the DecodeStep, where the graph decodes

    def prefill(self, prompt):
        """Logits ``[V]`` after ``prompt``: the C decoder's kept rows and the rest, or one
        compiled program where it fits (the decoder takes over its cache), or row by
        row (the C decoder's prefill, or the batched graph in chunks)."""
        if self.fast:
            dec = self.dec = self.runner.block_decoder(self.adapter, self.lora, self.scale,
                                                       len(prompt) + self.max_new)
            # a chat's history: the rest only (float32 asked for keeps float32 rows)
            kept = dec.kept(prompt) if self.decoding.compute != "float32" or dec.exact else 0
            if kept and kept >= len(prompt) - kept:
                dec.length = kept
                return dec.prefill(prompt[kept:])
        program = self.compiled and self.runner.prompt_step(self.adapter, self.lora,
                                                            self.scale, len(prompt),
                                                            self.compiled)
        if program:
            logits = program(prompt, self.cache)
            if self.fast:
                self.dec.load(self.cache, prompt)
                self.dec.exact = self.compiled == "float32"
            return logits
        if self.fast:  # many rows per C call, GEMMs from the stored blocks
            self.dec.length, self.dec.exact = 0, True
            return self.dec.prefill(prompt)
        for a in range(0, len(prompt), PREFILL_CHUNK):  # the batched graph, in chunks
            last = forward_cached(self.cfg, self.W, prompt[a:a + PREFILL_CHUNK], self.cache,
                                  self.lora, self.scale, self.decoding.dtype,
                                  last_only=True)[-1]
        return last

    def decode(self, tok):
        """Logits ``[V]`` after one more token: the C decoder's step, or the DecodeStep's,
        (re)built with room to grow where it is full."""
        if self.fast:
            return self.dec.step(tok)
        step = self.step
        if step is None or step.length >= step.cap:
            need = self.n_prompt + self.max_new - 1
            cap = min(need, max(2 * (step.cap if step else 0), self.n_prompt + 256))
            grown = self.runner.decode_step(self.adapter, self.W, self.lora, self.scale,
                                            self.decoding.dtype, cap)
            if step is None:
                grown.load(self.cache)
            else:
                grown.take(step)
            step = self.step = grown
        return step(tok)
