"""What a run does at each evaluation besides measuring: early stopping and samples.

``EarlyStop`` (``--early-stop N``) keeps the best held-out loss so far, the step it came
from and the evaluations since; each better loss writes the adapter into ``adapter/`` at
once (full fine-tuning: the model into ``model/``), so that it holds the best step's
weights when the run ends (stopped early or not).  Its state travels in the checkpoint
(the counts in its metadata, the best weights as arrays), so a resumed run puts the
checkpoint's best back and stops at the same step with the same weights.  Samples of a
full run decode from a model holding the step's current weights (``train.full``).
``Steering`` joins it with the samples (``train.samples``) for the loop in
``train.finetune``: one call per evaluation, one agreed decision to stop (every MPI rank
stops at the same step), what the checkpoint keeps, the summary.  Not here: the
evaluation itself (the step's), the loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..errors import GradtapeError
from ..formats.safetensors_reader import read_header, read_safetensors
from . import full, samples as samples_mod

META_KEY = "early_stop"
BEST = "best."  # the checkpoint's copy of the best adapter: best.{layer}.{target}.{a|b|m}
BEST_MODEL = "best_model."  # full fine-tuning's: best_model.{weight name}


@dataclass
class EarlyStop:
    """The best eval loss, its step, and the evaluations since it (``patience`` of them
    without a better loss stop the run)."""
    patience: int
    best_loss: float = math.inf
    best_step: int = 0
    since: int = 0

    def update(self, step, loss) -> bool:
        """Count an evaluation; True where ``loss`` is better than every earlier one."""
        if loss < self.best_loss:  # (a NaN is never better)
            self.best_loss, self.best_step, self.since = float(loss), step, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.since >= self.patience

    def meta(self) -> dict:
        """The checkpoint's metadata entry (floats as JSON keeps them: exactly)."""
        return {META_KEY: json.dumps({"best_loss": self.best_loss, "best_step": self.best_step,
                                      "since": self.since})}

    @classmethod
    def from_meta(cls, patience, meta, where):
        """The state a checkpoint kept (a fresh one where it has none: a run that started
        without --early-stop)."""
        if META_KEY not in meta:
            return cls(patience)
        try:
            d = json.loads(meta[META_KEY])
            state = cls(patience, float(d["best_loss"]), int(d["best_step"]), int(d["since"]))
        except (ValueError, KeyError, TypeError) as e:
            raise GradtapeError(f"--resume: {where}: unreadable early-stop state ({e})") from None
        return state


def snapshot(step_prog):
    """The adapter's trained arrays now: ``(weights, magnitudes)`` (DoRA's, else empty);
    full fine-tuning's: ``{name: array}`` of every trained weight, in the step's dtype
    (a copy of the model's weights, kept while no later evaluation is better)."""
    if step_prog.full:
        return {k: step_prog.program.state(leaf) for k, leaf in step_prog.trained.items()}
    return step_prog.adapter_weights(), step_prog.adapter_magnitudes()


def _save_best(out, adapter, model, best, save_gguf=""):
    """Write a ``snapshot``: the adapter into ``out/adapter``, or (full fine-tuning:
    ``adapter`` None) the model with those weights into ``out/model`` (``train.full``:
    each file replaced atomically; the others are the same at every save)."""
    if adapter is not None:
        with_arrays(adapter, best).save(out / "adapter")
        return
    full.save_model(full.trained_model(model, {**model.weights, **best}), out, save_gguf)


def with_arrays(adapter, best):
    """A copy of ``adapter`` holding a ``snapshot``'s arrays."""
    weights, magnitudes = best
    return dataclasses.replace(adapter, weights=weights, magnitudes=magnitudes)


def _resumed(patience, checkpoint):
    """``(EarlyStop, best snapshot or None)`` from a checkpoint's metadata and arrays."""
    entries, meta, _, _ = read_header(checkpoint)
    early = EarlyStop.from_meta(patience, meta, checkpoint)
    names = [n for n in entries if n.startswith((BEST, BEST_MODEL))]
    if not names:
        return early, None
    arrays, _ = read_safetensors(checkpoint, float32=False, floats_only=False,
                                 skip=set(entries) - set(names))
    if names[0].startswith(BEST_MODEL):
        return early, {n[len(BEST_MODEL):]: arrays[n] for n in names}
    best, magnitudes = {}, {}
    for name in names:
        parts = name[len(BEST):].split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[2] not in ("a", "b", "m"):
            raise GradtapeError(f"--resume: {checkpoint}: unreadable best adapter ({name})")
        key = (int(parts[0]), parts[1])
        if parts[2] == "m":
            magnitudes[key] = arrays[name]
            continue
        pair = best.setdefault(key, [None, None])
        pair["ab".index(parts[2])] = arrays[name]
    if any(x is None for pair in best.values() for x in pair) or set(magnitudes) - set(best):
        raise GradtapeError(f"--resume: {checkpoint}: the best adapter lacks an A or a B")
    return early, ({k: tuple(v) for k, v in best.items()}, magnitudes)


def check_options(cfg):
    """The steering options against the others, before anything is loaded."""
    if cfg.early_stop and not cfg.eval_every:
        raise GradtapeError("--early-stop counts evaluations: it needs --eval-every > 0")
    if cfg.early_stop and not cfg.eval_data and not cfg.eval_frac:
        raise GradtapeError("--early-stop needs held-out data: give --eval-data, or an "
                            "--eval-frac > 0")
    if cfg.sample_prompts and not cfg.samples:
        raise GradtapeError("--sample-prompts needs --samples > 0 (0 turns samples off)")


def refuse_without_held(cfg, n_held):
    """``--early-stop`` measures the held-out loss: refuse a run that has none."""
    if cfg.early_stop and not n_held:
        raise GradtapeError("--early-stop needs held-out data, and this run has none: give "
                            "--eval-data, or an --eval-frac that holds out an example")


class Steering:
    """The per-evaluation work of one run: ``early`` (an ``EarlyStop`` or None) and
    ``sampler`` (a ``samples.Sampler`` or None)."""

    def __init__(self, cfg, out, early, sampler, log, best=None, model=None):
        """``model``: the model as the run loaded it (full fine-tuning writes the best
        weights into a copy of it; None for an adapter)."""
        self.cfg, self.out, self.early, self.sampler, self.log = cfg, out, early, sampler, log
        self.best = best  # the best evaluation's ``snapshot``
        self.model = model
        self.folder = "adapter/" if model is None else "model/"
        self.stopped_at = None

    @classmethod
    def start(cls, cfg, out, model, held_prompts, file_prompts, checkpoint, adapter, log,
              writes=True):
        """``held_prompts``: id arrays of held-out prompts; ``file_prompts``: what
        ``samples.read_prompts`` read (or None); ``checkpoint``: the path of the
        checkpoint a resumed run continues from (or None), whose best adapter is written
        into ``adapter/`` (a copy of ``adapter`` with those weights; full fine-tuning's
        best model into ``model/``) where ``writes``."""
        early, best = None, None
        folder = "adapter/" if adapter is not None else "model/"
        if cfg.early_stop:
            early = EarlyStop(cfg.early_stop)
            if checkpoint is not None:
                early, best = _resumed(cfg.early_stop, checkpoint)
            if best is not None and writes:  # undo a later best of a run killed after it
                _save_best(out, adapter, model, best, cfg.save_gguf)
            log(f"early stop: after {cfg.early_stop} evaluations without a lower held-out "
                f"loss; {folder} keeps the best evaluation's weights"
                + (f" (so far step {early.best_step}'s, eval loss {early.best_loss:.4f})"
                   if early.best_step else ""))
        sampler = None
        if cfg.samples:
            if file_prompts is not None:
                prompts = [samples_mod.encode_prompt(model.tokenizer, p) for p in file_prompts]
            else:
                prompts = held_prompts[:cfg.samples]
            sampler = samples_mod.Sampler(model, prompts, cfg.sample_tokens) if prompts else None
        return cls(cfg, out, early, sampler, log, best, None if adapter is not None else model)

    def at_eval(self, step, eval_loss, step_prog, adapter, write) -> dict:
        """After the evaluation of ``step``: the samples (printed with ``write``), the
        early-stop state; writes the adapter where the loss is the best so far.  Returns
        what the step's log record gains."""
        rec = {}
        if self.sampler is not None and adapter is None:
            # full: a model holding the step's weights where the step keeps them (no
            # copy; read before the next step changes them)
            now = full.trained_model(step_prog.model, step_prog.model_weights(live=True))
            rec["samples"] = self.sampler.answers(None, model=now)
        elif self.sampler is not None:
            # a new adapter object: generation keeps programs and cached rows per adapter
            now = with_arrays(adapter, snapshot(step_prog))
            rec["samples"] = self.sampler.answers(now)
        if "samples" in rec:
            for line in samples_mod.show(rec["samples"]):
                write(line)
        if self.early is not None:
            if self.early.update(step, eval_loss):
                self.best = None  # the earlier best's copy goes before the new one's
                self.best = snapshot(step_prog)
                # PEFT's two files (a model's), each replaced atomically; the others are
                # the same at every save, so a kill between them leaves a whole adapter
                _save_best(self.out, adapter, self.model, self.best, self.cfg.save_gguf)
            rec.update(best_step=self.early.best_step, best_eval_loss=self.early.best_loss,
                       evals_without_improvement=self.early.since)
        return rec

    def stop_now(self, world, evaluated) -> bool:
        """Whether the run stops after this step (the early-stop patience is spent):
        decided by rank 0, which evaluates, and agreed by every rank at the steps where
        rank 0 evaluates (``evaluated``: the same on every rank)."""
        if self.early is None or not evaluated:
            return False
        mine = "early stop" if (world.is_root and self.early.exhausted) else None
        return world.agree(mine) is not None

    def finished(self) -> bool:
        """A resumed run whose early stop had already ended it."""
        return self.early is not None and self.early.best_step > 0 and self.early.exhausted

    def checkpoint_meta(self) -> dict:
        return self.early.meta() if self.early is not None else {}

    def checkpoint_arrays(self) -> dict:
        """The best adapter's arrays, for the checkpoint."""
        out = {}
        if self.best is None:
            return out
        if isinstance(self.best, dict):  # full fine-tuning: every trained weight
            return {f"{BEST_MODEL}{k}": a for k, a in self.best.items()}
        weights, magnitudes = self.best
        for (layer, target), (a, b) in sorted(weights.items()):
            out[f"{BEST}{layer}.{target}.a"], out[f"{BEST}{layer}.{target}.b"] = a, b
        for (layer, target), m in sorted(magnitudes.items()):
            out[f"{BEST}{layer}.{target}.m"] = m
        return out

    @property
    def keeps_adapter(self) -> bool:
        """Whether ``adapter/`` (``model/``) already holds the run's result (the best
        evaluation's)."""
        return self.early is not None and self.early.best_step > 0

    def summary(self, last_step) -> dict:
        if self.early is None:
            return {}
        e = self.early
        stopped = e.exhausted and self.stopped_at is not None
        self.log((f"early stop at step {last_step}: no lower held-out loss in "
                  f"{e.patience} evaluations; " if stopped else "")
                 + f"{self.folder} holds step {e.best_step}'s weights (eval loss "
                 f"{e.best_loss:.4f}, the lowest)")
        return {"best_step": e.best_step, "best_eval_loss": e.best_loss,
                "stopped_early": stopped}
