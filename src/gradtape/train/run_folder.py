"""A run's folder on disk: claiming it, the checkpoint, the step log and the loss curve.

``claim_folder`` marks a folder as a gradtape run (never writing into someone else's);
``save_checkpoint`` writes the training state atomically, one array at a time, with the
step and the options as metadata; ``load_checkpoint`` reads it back for ``--resume``,
refusing a checkpoint of another run (``SAME_RUN``); ``log.jsonl`` gets a line per step
and evaluation; ``plot_losses`` draws ``loss.png``.  Not here: when they are called (the
loop in ``finetune``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from .. import checks
from ..errors import GradtapeError
from ..io import atomic_write_bytes
from . import distributed
from ..models.export import write_safetensors

MARKER = "gradtape-run.json"
CHECKPOINT = "state.safetensors"


def check_out_folder(out: Path, resume: bool):
    """The run folder, before any work: for ``resume``, a run with a checkpoint; else a
    new or empty folder, or an earlier run's (ours to overwrite); writable either way."""
    checks.output_folder(out, "--out")  # a folder, or creatable; writable
    if resume:
        if not (out / "checkpoint" / CHECKPOINT).is_file():
            raise GradtapeError(f"--resume: no checkpoint in {out}")
        return
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise GradtapeError(f"--out {out} exists and is not a gradtape run folder; "
                            "choose a new or empty folder")


def claim_folder(out: Path, resume: bool):
    check_out_folder(out, resume)
    if resume:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GradtapeError(f"--out {out}: cannot be created ({e.strerror or e})") from None


def save_checkpoint(out, step_prog, step, cfg, world_size=1, extra_meta=None,
                     extra_arrays=None):
    """One file, written atomically: the state arrays, with the step and the run's config
    in its metadata, so a kill at any moment leaves the previous checkpoint or this one."""
    ck = out / "checkpoint"
    arrays = step_prog.state_arrays()  # read one array at a time: twice, to check first
    for k, a in (extra_arrays or {}).items():  # one file, one dtype (float32 values exact)
        arrays[k] = np.asarray(a, step_prog.tape.dtype)
    shapes = {}
    for k in sorted(arrays):
        a = arrays[k]
        if not np.isfinite(a).all():  # never replace a good checkpoint with a diverged state
            raise GradtapeError(f"the training state became non-finite at step {step} ({k}); "
                                f"stopped, the last good checkpoint in {ck} is kept "
                                "(lower --lr?)")
        shapes[k] = a.shape
    meta = {"step": str(step), "config": json.dumps(dataclasses.asdict(cfg)),
            "world_size": str(world_size), **(extra_meta or {})}
    try:
        ck.mkdir(exist_ok=True)
        for stale in ck.glob(f".{CHECKPOINT}.*.tmp"):  # left by a run killed mid-write
            stale.unlink()
        write_safetensors(ck / CHECKPOINT, [(k, shape, functools.partial(arrays.get, k))
                                            for k, shape in shapes.items()],
                          step_prog.tape.dtype, meta)
    except OSError as e:
        raise GradtapeError(f"cannot write the checkpoint for step {step} ({e}); the "
                            f"previous checkpoint in {ck} is kept") from None


SAME_RUN = ("model", "data", "eval_data", "columns", "packing", "train_on_prompt",
             "seq_len", "batch_size", "grad_accum", "fine_tune_type", "rank", "alpha", "rslora",
             "targets", "seed", "dtype", "eval_frac", "method", "beta", "label_smoothing",
             "simpo_gamma", "adapter")


def load_checkpoint(out, step_prog, cfg, world=distributed.World()):
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
    if isinstance(old.get("seq_len"), int):  # a run from before packing padded its rows
        old.setdefault("packing", False)
    # the rate may change on resume, but not by leaving --lr out: that would take the
    # default, which need not be the rate the run was given (or had by default then)
    if cfg.lr is None and isinstance(old.get("lr"), (int, float)) and \
            old["lr"] != cfg.peak_lr():
        raise GradtapeError(f"--resume: the checkpoint's run trained at --lr {old['lr']:g}; "
                            f"give --lr {old['lr']:g} to continue it so (without --lr it "
                            f"would take the default, {cfg.peak_lr():g})")
    changed = [k for k in SAME_RUN if k in old and old[k] != getattr(cfg, k)]
    if changed:
        raise GradtapeError("--resume: options differ from the checkpoint's run: "
                            + ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {getattr(cfg, k)}"
                                        for k in changed))
    try:
        step_prog.load_state_arrays(arrays)
    except ValueError as e:
        raise GradtapeError(f"--resume: {path}: {e}") from None
    if world.is_root:  # keep the log consistent with the checkpoint: drop steps after it
        recs = [r for r in read_log(out) if r["step"] <= step]
        (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return step


def read_log(out):
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


def append_log(out, rec):
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def plot_losses(records, path):
    """Train loss per step (and its moving average) and the eval loss, as a PNG; a
    preference run's held-out reward accuracy and margin too."""
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
    pref = [(r["step"], r["eval_rewards/accuracies"], r["eval_rewards/margins"])
            for r in records if "eval_rewards/accuracies" in r]
    ax.set_ylabel("loss" if pref else "next-token loss (nats)")
    ax.set_title("gradtape finetune")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    if pref:  # a preference run: the held-out reward accuracy and margin, on their own axis
        steps_, acc, margin = zip(*pref)
        ax2 = ax.twinx()
        ax2.plot(steps_, acc, "s--", color="#31a354", label="eval reward accuracy")
        ax2.plot(steps_, margin, "^--", color="#756bb1", label="eval reward margin")
        ax2.set_ylabel("reward accuracy / margin")
        more = ax2.get_legend_handles_labels()
        handles = (handles[0] + more[0], handles[1] + more[1])
    ax.legend(*handles)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
