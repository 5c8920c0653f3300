"""``Llama``: the public model object of SPEC.md section 3, and ``load``, which returns one.

A thin facade: a ``models.Model`` record (config, weights, tokenizer, name, source) whose
``logits`` and ``generate`` delegate to ``gradtape.infer`` (a ``runner.Runner`` per
model, which keeps the programs generation reuses).  It computes nothing itself; the
training side (``gradtape.train``) needs only the record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import models
from ..infer.loop import Stopping, check_stop_strings
from ..infer.runner import Decoding, Runner
from ..infer.sampling import Sampling


@dataclass(eq=False, repr=False)
class Llama(models.Model):
    """A loaded LLaMA-family model (``config``, ``tokenizer``, float32 ``weights``,
    ``name``, ``source``) with ``logits`` and ``generate``."""

    @property
    def _runner(self) -> Runner:
        """This model's ``Runner``, made on first use; a copy of the model (another
        config, other weights) gets its own rather than the original's programs."""
        runner = self.__dict__.get("_runner_of_model")
        if runner is None or runner.model is not self:
            runner = self.__dict__["_runner_of_model"] = Runner(self)
        return runner

    @classmethod
    def of(cls, model) -> "Llama":
        """The facade over a loaded model record (``model`` itself where it is one)."""
        if isinstance(model, cls):
            return model
        return cls(model.config, model.weights, model.tokenizer, model.name, model.source)

    def logits(self, ids, adapter=None, dtype=np.float32) -> np.ndarray:
        """Next-token logits ``[len(ids), vocab_size]`` (row ``t`` predicts token ``t+1``),
        in ``dtype`` (float32 default, float64 on request)."""
        return self._runner.logits(ids, adapter, dtype)

    def generate(self, ids, max_new_tokens, temperature=0.0, adapter=None, seed=0, *,
                 top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, stop=None,
                 stream=None, dtype=np.float32, stop_ids=None, decoder="auto",
                 compute="auto") -> list[int]:
        """New token ids after the prompt ``ids``: greedy at ``temperature == 0``, else
        sampled from a generator seeded by ``seed``; the prompt plus ``max_new_tokens``
        must fit the context.  The keywords come in three groups:

        * how a token is picked (``infer.sampling.Sampling``): ``temperature``,
          ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``;
        * when generation stops (``infer.loop.Stopping``): after an end-of-sequence
          token (``stop_ids``, default the tokenizer's), after the token that completes
          one of the ``stop`` strings (both included), or after ``max_new_tokens``;
        * how logits are computed (``infer.runner.Decoding``): ``dtype``, ``decoder``
          ("blocks": the one-call C step over the weights as stored, float32 only;
          "graph": the replayed graph; "auto": "blocks" where it can run) and
          ``compute`` (float32, bf16, int8, auto: the precision of the prompt's GEMMs;
          new tokens are always decoded in ``dtype``).

        ``stream(token_id)`` is called for each new token as it is produced."""
        sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty, seed)
        stopping = Stopping(check_stop_strings(stop), stop_ids)
        return self._runner.generate(ids, max_new_tokens, sampling, adapter, stopping,
                                     Decoding(dtype, decoder, compute), stream)


def load(name_or_path=models.DEFAULT_MODEL, **options) -> Llama:
    """``models.load(name_or_path, **options)`` (``"smollm2"``, a ``.gguf`` file or a
    Hugging Face folder; options ``dtype``, ``keep_quantized``, ``check_memory``) as a
    ``Llama``."""
    return Llama.of(models.load(name_or_path, **options))
