"""The fine-tuning run: config, loop, checkpoints, logs and the loss curve.

``FinetuneConfig`` is the single definition of every option (the CLI is generated from
its fields and help texts).  ``finetune(cfg)`` writes into ``cfg.out``:

    adapter/            the trained adapter, PEFT format (adapter_config.json + safetensors)
    checkpoint/         state.safetensors: adapter, AdamW moments; step and config as metadata
    log.jsonl           one JSON object per step (loss, lr, grad norm, tokens/s) and per eval
    loss.png            train (and eval) loss curves
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
import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GradtapeError
from ..io import atomic_write_bytes, atomic_write_json
from . import data as data_mod
from . import distributed
from ..models.lora import init_adapter, parse_targets

MARKER = "gradtape-run.json"
CHECKPOINT = "state.safetensors"


def _opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class FinetuneConfig:
    model: str = _opt("smollm2", "base model: 'smollm2' (embedded), a .gguf file or a "
                                 "Hugging Face folder")
    data: str = _opt("", "training data: plain text, or JSONL with {\"messages\": [...]} "
                         "or {\"prompt\", \"completion\"} per line", required=True)
    out: str = _opt("", "output folder (adapter, checkpoint, log.jsonl, loss.png)",
                    required=True)
    steps: int = _opt(0, "optimizer steps (0: derive from --epochs)")
    epochs: float = _opt(1.0, "passes over the training split when --steps is 0")
    seq_len: int = _opt(256, "tokens per sequence (longer examples are truncated)")
    batch_size: int = _opt(4, "sequences per micro-batch")
    grad_accum: int = _opt(1, "micro-batches per optimizer step (weighted by token count)")
    rank: int = _opt(8, "LoRA rank r")
    alpha: float = _opt(16.0, "LoRA alpha (scale = alpha / r)")
    targets: str = _opt("all", "comma-separated LoRA targets among q,k,v,o,gate,up,down")
    lr: float = _opt(1e-3, "peak learning rate")
    warmup: int = _opt(10, "linear warmup steps (then cosine decay to 10%% of --lr)")
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay")
    clip: float = _opt(1.0, "clip gradients to this global norm (0: off)")
    eval_frac: float = _opt(0.1, "fraction of examples held out for the eval loss")
    eval_every: int = _opt(20, "evaluate the held-out loss every N steps (0: only at the end)")
    save_every: int = _opt(50, "write a checkpoint every N steps")
    seed: int = _opt(0, "seed for the adapter init, the split and the batch order")
    backend: str = _opt("cpu", "execution backend: cpu (generated C + BLAS; falls back to "
                               "numpy, with a warning, without a C compiler) or numpy "
                               "(the reference)")
    dtype: str = _opt("float32", "float32 or float64")
    compute: str = _opt("float32", "precision of the frozen-weight GEMMs: float32, bf16 (bf16 "
                                   "inputs, float32 accumulation; where the CPU runs it "
                                   "faster, else a notice and float32) or auto")
    resume: bool = _opt(False, "continue from the checkpoint in --out")
    progress: bool = _opt(True, "show a progress bar", cli=False)


def finetune(cfg: FinetuneConfig, model=None, log=print):
    """Run (or resume) a fine-tuning job; returns a summary dict (``rank`` tells which MPI
    rank returned it: only rank 0's speaks for the run)."""
    world = distributed.world()
    with distributed.Together(world) as together:
        return _finetune(cfg, model, log if world.is_root else (lambda *a, **k: None),
                         world, together)


def _finetune(cfg, model, log, world, together):
    from .. import models
    from .step import Schedule, TrainStep
    from ..optim import AdamWConfig

    from ..backends import BACKENDS

    if cfg.backend not in BACKENDS:
        raise GradtapeError(f"unknown backend {cfg.backend!r}; known backends: "
                            f"{', '.join(sorted(BACKENDS))}")
    out = Path(cfg.out)
    if world.is_root or cfg.resume:  # the other ranks only read (a checkpoint to resume)
        _claim_folder(out, cfg.resume)
    model = model or models.load(cfg.model)
    if cfg.seq_len > model.config.max_seq_len:
        raise GradtapeError(f"--seq-len {cfg.seq_len} is longer than the model's context "
                            f"({model.config.max_seq_len})")
    targets = parse_targets(cfg.targets)
    seqs = data_mod.load_sequences(cfg.data, model.tokenizer, cfg.seq_len,
                                   pad_id=model.tokenizer.eos_id)
    train, held = data_mod.split_eval(seqs, cfg.eval_frac, cfg.seed)
    micro_size = world.size * cfg.batch_size  # sequences per global micro-batch
    per_step = micro_size * cfg.grad_accum
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(train) / per_step))
    dtype = {"float32": np.float32, "float64": np.float64}.get(cfg.dtype)
    if dtype is None:
        raise GradtapeError(f"--dtype must be float32 or float64, got {cfg.dtype!r}")
    if cfg.compute not in ("float32", "bf16", "auto"):
        raise GradtapeError(f"--compute must be float32, bf16 or auto, got {cfg.compute!r}")

    adapter = init_adapter(model.config, cfg.rank, cfg.alpha, targets, cfg.seed,
                           base_model=model.name, dtype=dtype)
    step_prog = TrainStep(model, adapter, cfg.batch_size, cfg.seq_len,
                          opt=AdamWConfig(weight_decay=cfg.weight_decay), clip=cfg.clip,
                          grad_accum=cfg.grad_accum, backend=cfg.backend, dtype=dtype,
                          world=world, compute=cfg.compute)
    schedule = Schedule(cfg.lr, steps, min(cfg.warmup, steps))
    start = _load_checkpoint(out, step_prog, cfg, world) if cfg.resume else 0
    if world.is_root:
        if not cfg.resume:
            (out / "log.jsonl").write_text("")
        atomic_write_json(out / MARKER, {"tool": "gradtape finetune",
                                         "config": dataclasses.asdict(cfg)})
    together.sync()  # every rank is ready (or all stop with the first setup error)
    log(f"training {len(targets)} LoRA targets (r={cfg.rank}) on {len(train)} sequences "
        f"({train.n_target_tokens} target tokens), {len(held)} held out; {steps} steps "
        f"from step {start}, backend {cfg.backend}"
        + (f", compute {step_prog.compute}" if cfg.compute != "float32" else "")
        + (f", {world.size} MPI ranks x {cfg.batch_size} sequences" if world.size > 1 else ""))

    records = _read_log(out) if cfg.resume and world.is_root else []
    bar = _progress(steps, start, cfg.progress and world.is_root)
    t0, tokens_done = time.perf_counter(), 0
    with _deferred_interrupt() as interrupted:
        for step in range(start, steps):
            idx = data_mod.batch_indices(len(train), per_step, step, cfg.seed)
            # this rank's rows of each global micro-batch
            mine = [idx[i:i + micro_size][world.rank * cfg.batch_size:][:cfg.batch_size]
                    for i in range(0, per_step, micro_size)]
            micro = [(train.ids[m], train.targets[m]) for m in mine]
            n_tokens = int((train.targets[idx] != data_mod.IGNORE).sum())  # whole global step
            lr = schedule(step)
            loss, gnorm = step_prog.step(micro, step + 1, lr, n_tokens=n_tokens,
                                         stop=interrupted())
            if not math.isfinite(loss):  # the summed loss: every rank stops here
                bar.close()
                raise together.everywhere(
                    f"loss became {loss} at step {step + 1}; stopped, the last good "
                    f"checkpoint in {out / 'checkpoint'} is kept")
            # ranks stop together, at the step where any of them got the signal
            stopping = step_prog.stop_agreed if world.size > 1 else interrupted()
            tokens_done += n_tokens
            elapsed = time.perf_counter() - t0
            rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": gnorm,
                   "tokens_per_s": tokens_done / elapsed, "elapsed_s": elapsed}
            if world.is_root and len(held) and (
                    (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == steps):
                rec["eval_loss"] = step_prog.eval_loss(held)
            records.append(rec)
            if world.is_root:
                _append_log(out, rec)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}",
                            tok_s=f"{rec['tokens_per_s']:.0f}")
            if world.is_root and ((step + 1) % cfg.save_every == 0 or step + 1 == steps
                                  or stopping):
                _save_checkpoint(out, step_prog, step + 1, cfg, world.size)
            if stopping:
                bar.close()
                if world.is_root:
                    plot_losses(records, out / "loss.png")
                log(f"interrupted: checkpoint at step {step + 1} saved in "
                    f"{out / 'checkpoint'}; continue with --resume")
                raise KeyboardInterrupt
    bar.close()
    if world.is_root:
        adapter.weights = step_prog.adapter_weights()
        adapter.save(out / "adapter")
        plot_losses(records, out / "loss.png")
    summary = {"steps": steps, "final_loss": records[-1]["loss"] if records else None,
               "eval_loss": next((r["eval_loss"] for r in reversed(records)
                                  if "eval_loss" in r), None),
               "tokens_per_s": records[-1]["tokens_per_s"] if records else None,
               "out": str(out), "rank": world.rank}
    log(f"done: adapter in {out / 'adapter'}, loss curve in {out / 'loss.png'}")
    return summary


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


def _claim_folder(out: Path, resume: bool):
    if out.exists() and not out.is_dir():
        raise GradtapeError(f"--out {out} exists and is not a folder")
    if resume:
        if not (out / "checkpoint" / CHECKPOINT).is_file():
            raise GradtapeError(f"--resume: no checkpoint in {out}")
        return
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise GradtapeError(f"--out {out} exists and is not a gradtape run folder; "
                            "choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)


def _save_checkpoint(out, step_prog, step, cfg, world_size=1):
    """One file, written atomically: the state arrays, with the step and the run's config
    in its metadata, so a kill at any moment leaves the previous checkpoint or this one."""
    from safetensors.numpy import save

    ck = out / "checkpoint"
    arrays = step_prog.state_arrays()
    bad = [k for k, a in arrays.items() if not np.isfinite(a).all()]
    if bad:  # never replace a good checkpoint with a diverged state
        raise GradtapeError(f"the training state became non-finite at step {step} ({bad[0]}); "
                            f"stopped, the last good checkpoint in {ck} is kept (lower --lr?)")
    meta = {"step": str(step), "config": json.dumps(dataclasses.asdict(cfg)),
            "world_size": str(world_size)}
    try:
        ck.mkdir(exist_ok=True)
        for stale in ck.glob(f".{CHECKPOINT}.*.tmp"):  # left by a run killed mid-write
            stale.unlink()
        atomic_write_bytes(ck / CHECKPOINT, save(arrays, metadata=meta))
    except OSError as e:
        raise GradtapeError(f"cannot write the checkpoint for step {step} ({e}); the "
                            f"previous checkpoint in {ck} is kept") from None


_SAME_RUN = ("model", "data", "seq_len", "batch_size", "grad_accum", "rank", "alpha",
             "targets", "seed", "dtype", "eval_frac")


def _load_checkpoint(out, step_prog, cfg, world=distributed.World()):
    from ..formats.safetensors_reader import read_safetensors

    path = out / "checkpoint" / CHECKPOINT
    try:
        arrays, meta = read_safetensors(path, float32=False, floats_only=False)
        step, old = int(meta["step"]), json.loads(meta["config"])
        old_world = int(meta.get("world_size", "1"))
        if not isinstance(old, dict):
            raise ValueError("config is not an object")
    except (GradtapeError, KeyError, ValueError) as e:
        raise GradtapeError(f"--resume: {path} is not a readable checkpoint ({e})") from None
    # another number of MPI ranks is fine when the global batch stays the same
    if isinstance(old.get("batch_size"), int) and old_world * old["batch_size"] == \
            world.size * cfg.batch_size:
        old = {**old, "batch_size": cfg.batch_size}
    elif old_world != world.size:
        raise GradtapeError(f"--resume: the checkpoint's run took {old_world} x "
                            f"{old.get('batch_size')} sequences per micro-batch (ranks x "
                            f"--batch-size), this one {world.size} x {cfg.batch_size}; keep "
                            "their product")
    changed = [k for k in _SAME_RUN if k in old and old[k] != getattr(cfg, k)]
    if changed:
        raise GradtapeError("--resume: options differ from the checkpoint's run: "
                            + ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {getattr(cfg, k)}"
                                        for k in changed))
    try:
        step_prog.load_state_arrays(arrays)
    except ValueError as e:
        raise GradtapeError(f"--resume: {path}: {e}") from None
    if world.is_root:  # keep the log consistent with the checkpoint: drop steps after it
        recs = [r for r in _read_log(out) if r["step"] <= step]
        (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return step


def _read_log(out):
    path = out / "log.jsonl"
    if not path.is_file():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a kill: everything after it is gone too
    return recs


def _append_log(out, rec):
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _progress(total, initial, enabled):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, desc="finetune")


def plot_losses(records, path):
    """Train loss per step (and its moving average) and the eval loss, as a PNG."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    loss = np.array([r["loss"] for r in records])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, loss, color="#9ecae1", lw=1, label="train loss")
    if len(loss) >= 5:
        k = max(2, len(loss) // 10)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color="#08519c", lw=2, label=f"train ({k}-step mean)")
    ev = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", color="#e6550d", lw=2, label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("gradtape finetune")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
