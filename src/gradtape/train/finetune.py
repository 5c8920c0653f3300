"""The fine-tuning run: loading, the step, the loop, evaluations and the run's end.

``finetune(cfg)`` runs the options of a ``FinetuneConfig`` (``options``: every option,
defined once) and writes into ``cfg.out`` (``run_folder``: the checkpoint, the log, the
loss curve):

    adapter/            the trained adapter, PEFT format (adapter_config.json + safetensors)
    model/              --fine-tune-type full: the trained model, a Hugging Face folder
                        (and model.gguf beside it with --save-gguf)
    checkpoint/         state.safetensors: adapter (or every weight), AdamW moments; step
                        and config as metadata
    log.jsonl           one JSON object per step (loss, lr, grad norm, tokens/s) and per eval
                        (eval loss, samples, the best step under --early-stop)
    loss.png            train (and eval) loss curves
    config.yaml         every option's value (``--config`` reads it back)
    gradtape-run.json   marks the folder as ours (we never write into someone else's folder)

Checkpoints are written atomically; ``resume=True`` continues from the last one and, since
batch order is a pure function of (seed, step), ends with the same adapter as a run that
was never interrupted.

Under ``mpiexec -n N`` (see ``distributed``) the N ranks train data-parallel: every step's
global batch (N * batch_size * grad_accum sequences, the batch one process with batch
N * batch_size would take) is split by rank, gradients are summed with one Allreduce, and
only rank 0 writes files and prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GradtapeError
from ..io import atomic_write_json
from . import data as data_mod
from . import config_file, distributed, full, preference_run, samples, steering
from .methods import check_options, method as method_row
from ..blocks import is_block_matrix
from ..models.lora import init_adapter, load_adapter, parse_targets
from ..models.memory import WEIGHT_MODES, GiB, keep_stored, mem_available, resident_bytes
from .memory import OVERHEAD, check as check_memory, estimate as estimate_memory
from .options import FinetuneConfig, flag
from .run_folder import (CHECKPOINT, MARKER, append_log, claim_folder, load_checkpoint,
                         plot_losses, read_log, save_checkpoint)


def finetune(cfg: FinetuneConfig, model=None, log=print):
    """Run (or resume) a fine-tuning job; returns a summary dict (``rank`` tells which MPI
    rank returned it: only rank 0's speaks for the run)."""
    world = distributed.world()
    # an overflow or a NaN is caught by the loop itself (a non-finite loss or state stops
    # the run, naming the step); NumPy's warnings about it would only add noise
    with distributed.Together(world) as together, np.errstate(all="ignore"):
        return _finetune(cfg, model, log if world.is_root else (lambda *a, **k: None),
                         world, together)


@dataclass(frozen=True)
class _Run:
    """What the loop of one run needs besides the step: where it writes, who trains, and
    how many steps of how many sequences."""
    cfg: FinetuneConfig
    out: Path
    world: distributed.World
    together: distributed.Together
    steps: int  # the run's last step (a resumed run starts later)
    micro_size: int  # sequences per global micro-batch

    @property
    def per_step(self):
        return self.micro_size * self.cfg.grad_accum


def _finetune(cfg, model, log, world, together):
    from .step import Schedule

    # the paths first (the config's values were checked when it was made): a mistake
    # costs seconds, before a model is loaded or a step is run
    out = Path(cfg.out).expanduser()
    meth = method_row(cfg.method)
    data_file, eval_file = _read_data(cfg, log, meth.data)
    file_prompts = samples.read_prompts(cfg.sample_prompts) if cfg.sample_prompts else None
    if world.is_root or cfg.resume:  # the other ranks only read (a checkpoint to resume)
        claim_folder(out, cfg.resume)
    model, available = _load_model(cfg, model, log)
    targets = parse_targets(cfg.targets, model.config)
    is_full = cfg.fine_tune_type == "full"
    if meth.data == "preference":
        train, held = preference_run.load(cfg, data_file, eval_file, model.tokenizer,
                                          meth.average, log, world)
        log(f"method {meth.name}: beta {check_options(meth, cfg.options())}"
            + (f", label smoothing {cfg.label_smoothing}" if cfg.label_smoothing else "")
            + (f", gamma {cfg.simpo_gamma}" if meth.name == "simpo" else "")
            + f"; {len(train)} pairs to train on, {len(held)} held out"
            + ("; a reference pass before the first step" if meth.reference else ""))
        held_prompts = [p.prompt for p in held.pairs]
    else:
        held_examples = []
        train, held = _rows(cfg, data_file, eval_file, model.tokenizer, log, held_examples)
        held_prompts = [samples.example_prompt(*e) for e in held_examples]
    steering.refuse_without_held(cfg, len(held))
    micro_size = world.size * cfg.batch_size  # sequences per global micro-batch
    per_step = micro_size * cfg.grad_accum
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(train) / per_step))
    dtype = {"float32": np.float32, "float64": np.float64}[cfg.dtype]

    if is_full:
        adapter = None
    elif cfg.adapter:
        adapter = _starting_adapter(cfg, model, targets, dtype, log)
        targets = adapter.targets
    else:
        adapter = init_adapter(model.config, cfg.rank, cfg.alpha, targets, cfg.seed,
                               base_model=model.name, dtype=dtype, rslora=cfg.rslora,
                               fine_tune_type=cfg.fine_tune_type, weights=model.weights)
    step_prog, build_s = _build_step(cfg, model, adapter, dtype, world, available, log)
    schedule = Schedule(cfg.peak_lr(), steps, min(cfg.warmup, steps))
    if meth.reference:  # before a checkpoint is loaded: the adapter as the run starts
        sets, only = {"train": train, "eval": held}, {"train": train.used(steps)}
        if not (cfg.resume and (out / preference_run.REFERENCE).is_file()
                and preference_run.load_reference(sets, out, log, only)):
            preference_run.reference_pass(step_prog, sets, out, log, world, only)
    start = load_checkpoint(out, step_prog, cfg, world) if cfg.resume else 0
    if world.is_root:
        if not cfg.resume:
            (out / "log.jsonl").write_text("")
        atomic_write_json(out / MARKER, {"tool": "gradtape finetune",
                                         "config": dataclasses.asdict(cfg)})
        config_file.write_resolved(out / "config.yaml", cfg)
    steer = steering.Steering.start(cfg, out, model, held_prompts, file_prompts,
                                    out / "checkpoint" / CHECKPOINT if cfg.resume else None,
                                    adapter, log, writes=world.is_root)
    together.sync()  # every rank is ready (or all stop with the first setup error)
    what = (f"{len(train)} pairs" if meth.data == "preference" else
            f"{len(train)} sequences ({train.n_target_tokens} target tokens)")
    if is_full:
        trained = (f"every weight ({len(step_prog.trained)} tensors, "
                   f"{step_prog.n_param / 1e6:.1f}M values)")
    else:
        trained = (f"{len(targets)} {'DoRA' if adapter.dora else 'LoRA'} targets "
                   f"(r={adapter.rank}"
                   + (", rsLoRA" if adapter.scale_override is not None else "") + ")")
    log(f"training {trained} on {what}, {len(held)} held "
        f"out; {steps} steps "
        f"from step {start} at lr {schedule.lr:g}"
        + ("" if cfg.lr is not None else f" (the default for {meth.name}"
           + (" of every weight" if is_full else " of an adapter") + ")")
        + f", backend {cfg.backend}, compute {step_prog.compute}"
        + (f", {world.size} MPI ranks x {cfg.batch_size} "
           + ("pairs" if meth.data == "preference" else "sequences") if world.size > 1 else "")
        + f" (the step built in {build_s:.1f} s)")

    run = _Run(cfg, out, world, together, steps, micro_size)
    records = read_log(out) if cfg.resume and world.is_root else []
    last = _train_steps(run, step_prog, train, held, schedule, start, records, log, steer,
                        adapter)
    return _finish(dataclasses.replace(run, steps=last), adapter, step_prog, records, log,
                   steer)


def _starting_adapter(cfg, model, targets, dtype, log):
    """The ``--adapter`` folder's adapter in the run's dtype, checked against the model;
    a --rank, --alpha, --targets, --fine-tune-type or --rslora other than its default
    that contradicts it is one line (left at their defaults, they follow the adapter)."""
    adapter = load_adapter(cfg.adapter, model)
    given = {f.name: f.default for f in dataclasses.fields(cfg)
             if f.name in ("rank", "alpha", "targets", "fine_tune_type", "rslora")}
    for name, theirs, ours in (("rank", adapter.rank, cfg.rank),
                               ("alpha", adapter.alpha, cfg.alpha),
                               ("targets", adapter.targets, targets),
                               ("fine_tune_type", "dora" if adapter.dora else "lora",
                                cfg.fine_tune_type),
                               ("rslora", adapter.scale_override is not None, cfg.rslora)):
        if getattr(cfg, name) != given[name] and ours != theirs:
            shown = ",".join(theirs) if name == "targets" else theirs
            raise GradtapeError(f"{flag(name)} {getattr(cfg, name)} contradicts --adapter "
                                f"{cfg.adapter} ({name} {shown}); leave {flag(name)} out: "
                                "the adapter's is used")
    adapter.weights = {k: (a.astype(dtype), b.astype(dtype))
                       for k, (a, b) in adapter.weights.items()}
    adapter.magnitudes = {k: m.astype(dtype) for k, m in adapter.magnitudes.items()}
    adapter.base_model = adapter.base_model or model.name
    log(f"adapter: starting from {cfg.adapter} ({'DoRA' if adapter.dora else 'LoRA'}, "
        f"r={adapter.rank}, alpha {adapter.alpha:g}, "
        f"scale {adapter.scale:g}{' (rsLoRA)' if adapter.scale_override is not None else ''}"
        f", targets {','.join(adapter.targets)} in {len(adapter.weights)} linears)")
    return adapter


def _read_data(cfg, log, task="sft"):
    """The training (and eval) data files, every record checked (its file and line or row
    in a message), each one's schema stated; ``task``: the method's (sft, preference)."""
    data_file = data_mod.read_data(cfg.data, "--data", cfg.columns, task=task)
    log(f"data: {data_file.describe()}")
    eval_file = None
    if cfg.eval_data:
        eval_file = data_mod.read_data(cfg.eval_data, "--eval-data", cfg.columns, split="eval",
                                       task=task)
        log(f"eval data: {eval_file.describe()}")
    return data_file, eval_file


def _load_model(cfg, model, log):
    """``(model, bytes available for the run)``: the model loaded as ``--weights`` says
    (``model`` itself when the caller loaded one), checked against ``--seq-len``."""
    from .. import models

    if cfg.weights not in WEIGHT_MODES:
        raise GradtapeError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, got "
                            f"{cfg.weights!r}")
    if model is None and cfg.fine_tune_type == "full":
        # from the header: refused before the weights are read; the stored matrices
        # stay mapped, each dequantized once into its float32 param (train.full)
        available = mem_available()
        path, _ = models.model_source(cfg.model)
        full.check_fits(path, available, cfg.model, OVERHEAD, cfg.ignore_memory,
                        itemsize=np.dtype(cfg.dtype).itemsize, early_stop=bool(cfg.early_stop))
        model = models.load(cfg.model, keep_quantized=True)
    elif model is None:
        available = mem_available()  # before the weights take their share
        path, kind = models.model_source(cfg.model)
        keep = _keep_quantized(cfg, path, available, log)
        model = models.load(cfg.model, keep_quantized=keep or kind == "gguf",
                            check_memory=not cfg.ignore_memory)
        if not keep and kind == "gguf":
            if cfg.weights == "auto" and cfg.dtype == "float32" and reads_blocks(
                    cfg.compute, cfg.backend, cfg.micro_rows, model):
                log("weights: kept in their stored type (the bf16 products read bf16 "
                    "copies made from the file's blocks; no float32 copy)")
            else:  # float32 products: the float32 copy the GEMMs read
                model = models.load(cfg.model, keep_quantized=False,
                                    check_memory=not cfg.ignore_memory)
    else:  # a model loaded by the caller: its weights are already resident
        available = mem_available()
        available = None if available is None else available + resident_bytes(model.weights)
    if cfg.seq_len > model.config.max_seq_len:
        raise GradtapeError(f"--seq-len {cfg.seq_len} is longer than the model's context "
                            f"({model.config.max_seq_len})")
    return model, available


def _build_step(cfg, model, adapter, dtype, world, available, log):
    """``(TrainStep, seconds it took to build)``, its choices and memory logged; refuses
    a step that would not fit in ``available`` bytes (unless ``--ignore-memory``)."""
    from ..optim import AdamWConfig
    from .step import TrainStep

    hint = (": use a shorter --seq-len or a smaller --batch-size"
            + (", or --fine-tune-type lora" if adapter is None else
               "" if any(is_block_matrix(w) for w in model.weights.values())
               else ", or --weights stored") + " (or --ignore-memory to try anyway)")
    log("building the step (the first run on this CPU also times its GEMM "
        "layouts and attention at these shapes: up to a minute for an 8B model)")
    t_build = time.perf_counter()
    step_prog = TrainStep(model, adapter, cfg.batch_size, cfg.seq_len,
                          opt=AdamWConfig(weight_decay=cfg.weight_decay), clip=cfg.clip,
                          grad_accum=cfg.grad_accum, backend=cfg.backend, dtype=dtype,
                          world=world, compute=cfg.compute, grad_checkpoint=cfg.grad_checkpoint,
                          memory_limit=None if cfg.ignore_memory else available,
                          memory_hint=hint, method=cfg.method, options=cfg.options(),
                          fine_tune_type=cfg.fine_tune_type)
    build_s = time.perf_counter() - t_build
    plan = step_prog.plan  # every choice of the run, with its reason
    f32 = plan.f32_gemms
    log(f"compute: {plan.compute}" + (f"; {f32.why}" if f32 is not None and f32.why else ""))
    if plan.attention_from.why:
        log(f"attention: {plan.attention_from.why}")
    if plan.resident_weights.why:
        log(f"block weights: {plan.resident_weights.why}")
    if plan.trained_bf16.value:
        log(f"trained weights: {plan.trained_bf16.why}")
    if step_prog.checkpointed:
        log(f"activation checkpointing: {plan.checkpoint.why}")
    est = estimate_memory(model, step_prog)
    log(f"memory: this run needs {est.describe()}"
        + (f", with activation checkpointing ({step_prog.checkpointed} of "
           f"{model.config.n_layers} layers recomputed)"
           if step_prog.checkpointed else "")
        + (f"; {available / GiB:.1f} GiB available" if available is not None else ""))
    if not cfg.ignore_memory:
        check_memory(est, available, hint=hint)
    return step_prog, build_s


def _train_steps(run, step_prog, train, held, schedule, start, records, log, steer, adapter):
    """Steps ``start`` to ``run.steps``, each appended to ``records`` (and, on rank 0, to
    the log file), checkpoints saved as ``--save-every`` says.  A non-finite loss stops
    every rank with an error; an interrupt saves a checkpoint and raises
    ``KeyboardInterrupt`` at the same step on every rank.  ``steer``
    (``steering.Steering``) samples and may stop the run early after an evaluation.
    Returns the last step done."""
    cfg, out, world = run.cfg, run.out, run.world
    if steer.finished():  # resumed after its early stop: nothing left to train
        steer.stopped_at = start
        return start
    bar = _progress(run.steps, start, cfg.progress and world.is_root)
    write = bar.write if cfg.progress and world.is_root else log
    t0, tokens_done = time.perf_counter(), 0
    # closing: the bar ends its line before an error message is printed
    with _deferred_interrupt() as interrupted, contextlib.closing(bar):
        for step in range(start, run.steps):
            micro, n_tokens = _micro_batches(run, train, step)
            lr = schedule(step)
            loss, gnorm = step_prog.step(micro, step + 1, lr, n_tokens=n_tokens,
                                         stop=interrupted())
            if not math.isfinite(loss):  # the summed loss: every rank stops here
                bar.close()
                raise _diverged(run, loss, step)
            # ranks stop together, at the step where any of them got the signal
            stopping = step_prog.stop_agreed if world.size > 1 else interrupted()
            tokens_done += n_tokens
            elapsed = time.perf_counter() - t0
            rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": gnorm,
                   **step_prog.metrics,
                   "tokens_per_s": tokens_done / elapsed, "elapsed_s": elapsed}
            evaluated = len(held) > 0 and (
                (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == run.steps)
            if world.is_root and evaluated:
                if isinstance(held, preference_run.PairData):
                    rec.update(held.evaluate(step_prog))
                else:
                    rec["eval_loss"] = step_prog.eval_loss(held)
                rec.update(steer.at_eval(step + 1, rec["eval_loss"], step_prog, adapter, write))
            early = steer.stop_now(world, evaluated)
            if early:
                rec["early_stop"] = True
                steer.stopped_at = step + 1
            records.append(rec)
            if world.is_root:
                append_log(out, rec)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}",
                            tok_s=f"{rec['tokens_per_s']:.0f}")
            if world.is_root and ((step + 1) % cfg.save_every == 0 or step + 1 == run.steps
                                  or stopping or early):
                save_checkpoint(out, step_prog, step + 1, cfg, world.size,
                                 steer.checkpoint_meta(), steer.checkpoint_arrays())
            if early:
                bar.close()
                return step + 1
            if stopping:
                bar.close()
                if world.is_root:
                    plot_losses(records, out / "loss.png")
                log(f"interrupted: checkpoint at step {step + 1} saved in "
                    f"{out / 'checkpoint'}; continue with --resume")
                raise KeyboardInterrupt
    bar.close()
    return run.steps


def _micro_batches(run, train, step):
    """``(micro-batches, target tokens of the whole global step)`` of step ``step``: this
    rank's rows of each global micro-batch; a preference run's pairs
    (``preference_run.PairData.micro``)."""
    if isinstance(train, preference_run.PairData):
        return train.micro(step)
    cfg, world = run.cfg, run.world
    idx = data_mod.batch_indices(len(train), run.per_step, step, cfg.seed)
    mine = [idx[i:i + run.micro_size][world.rank * cfg.batch_size:][:cfg.batch_size]
            for i in range(0, run.per_step, run.micro_size)]
    n_tokens = int((train.targets[idx] != data_mod.IGNORE).sum())  # whole global step
    return [train.batch(m) for m in mine], n_tokens


def _diverged(run, loss, step):
    """The error every rank raises when the loss of step ``step`` is not finite."""
    kept = (f"the last good checkpoint in {run.out / 'checkpoint'} is kept"
            if (run.out / "checkpoint" / CHECKPOINT).is_file() else
            "no checkpoint was written yet")
    return run.together.everywhere(f"loss became {loss} at step {step + 1}; stopped, "
                                   f"{kept} (lower --lr or --alpha?)")


def _finish(run, adapter, step_prog, records, log, steer):
    """Rank 0 writes the adapter, or the trained model (unless ``adapter/`` or ``model/``
    holds the best evaluation's: ``--early-stop``), and the loss curve; the run's
    summary."""
    out, world = run.out, run.world
    wrote = f"adapter in {out / 'adapter'}"
    if world.is_root:
        if adapter is None and steer.keeps_adapter:  # model/ holds the best evaluation's
            wrote = f"model in {out / 'model'}"
        elif adapter is None:  # full fine-tuning: the model itself
            trained = full.trained_model(step_prog.model, step_prog.model_weights())
            wrote = full.save_model(trained, out, run.cfg.save_gguf)
        elif not steer.keeps_adapter:
            adapter.weights = step_prog.adapter_weights()
            adapter.magnitudes = step_prog.adapter_magnitudes()
            adapter.save(out / "adapter")
        if records:
            plot_losses(records, out / "loss.png")
    summary = {"steps": run.steps, "final_loss": records[-1]["loss"] if records else None,
               "eval_loss": next((r["eval_loss"] for r in reversed(records)
                                  if "eval_loss" in r), None),
               "tokens_per_s": records[-1]["tokens_per_s"] if records else None,
               "out": str(out), "rank": world.rank, **steer.summary(run.steps)}
    log(f"done: {wrote}, loss curve in {out / 'loss.png'}")
    return summary


def _examples(cfg, data, tokenizer, log, name):
    examples, skipped = data_mod.tokenize_examples(data, tokenizer, cfg.seq_len,
                                                   cfg.train_on_prompt)
    if skipped:
        log(f"warning: {name}: {skipped} of {skipped + len(examples)} examples have no "
            f"target token within --seq-len {cfg.seq_len} (an empty answer, or a prompt "
            "that fills the row); skipped")
    return examples


def _rows(cfg, data_file, eval_file, tokenizer, log, held_examples=None):
    """(train, held-out) rows: the held-out examples are chosen before rows are made
    (and added to ``held_examples`` where given: the samples' prompts)."""
    examples = _examples(cfg, data_file, tokenizer, log, "--data")
    if eval_file is None:
        train, held = data_mod.split_examples(examples, cfg.eval_frac, cfg.seed)
    else:
        train, held = examples, _examples(cfg, eval_file, tokenizer, log, "--eval-data")
    if held_examples is not None:
        held_examples.extend(held)
    rows = data_mod.pack_rows if cfg.packing else data_mod.pad_rows
    pad = tokenizer.eos_id
    out = rows(train, cfg.seq_len, pad), rows(held, cfg.seq_len, pad)
    tokens = sum(len(ids) for ids, _ in train)
    log(f"{'packed' if cfg.packing else 'padded'} {len(train)} examples into {len(out[0])} "
        f"rows of {cfg.seq_len} tokens ({tokens / (len(out[0]) * cfg.seq_len):.0%} filled)")
    return out


def reads_blocks(compute, backend, rows, model) -> bool:
    """Whether a float32 training step over ``rows`` rows a micro-batch (``--compute``
    ``compute``) reads a GGUF's matrices from their blocks, so that ``--weights auto``
    keeps them there: where the execution plan runs its frozen-weight products in bf16
    (``plan.decide_compute``, as the step will ask it), they read bf16 copies of the
    blocks and a float32 copy would only take memory.  ``model``: loaded with its
    blocks kept (memory-mapped)."""
    from .. import plan

    if compute == "float32":
        return False
    c = model.config
    precision = plan.decide_compute(compute, applies=backend == "cpu",
                                    shape=(rows, c.dim, c.ffn_dim))
    return precision.value == "bf16"


def _keep_quantized(cfg, path, available, log) -> bool:
    """Whether to keep the frozen weights in their stored type (``--weights``; int8
    compute keeps them under auto); refuses float32 weights that alone exceed the memory
    available, before loading them (``models.memory.keep_stored``)."""
    if cfg.weights == "auto" and cfg.compute == "int8":
        log("weights: kept in their stored type (--compute int8 computes from the file's "
            "blocks)")
        return True
    return keep_stored(cfg.weights, path, available, log, cfg.model, OVERHEAD,
                       cfg.ignore_memory)


@contextlib.contextmanager
def _deferred_interrupt():
    """Ctrl-C during a step only raises a flag, so the step finishes and the state that
    gets checkpointed is never half-updated.  Yields a function telling whether it came."""
    got = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    # SIGTERM (a scheduler stopping the job) is treated like Ctrl-C
    old = {s: signal.signal(s, lambda *_: got.append(True))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(got)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _progress(total, initial, enabled):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, desc="finetune")
