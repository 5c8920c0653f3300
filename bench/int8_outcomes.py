"""int8 judged by what it trains: held-out loss curves of SmolLM2 LoRA runs in each
``--compute`` precision, several seeds, on two data sets.

    .venv/bin/python bench/int8_outcomes.py                       # the full benchmark
    .venv/bin/python bench/int8_outcomes.py --steps 4 --seeds 1 --computes int8 --data records
                                                                  # a smoke run

Each run is ``gradtape.train.finetune`` (what ``gradtape finetune`` runs) on the embedded
SmolLM2-135M-Instruct GGUF, LoRA r=8 alpha 16 on all 7 targets, lr 1e-3 (10 warmup steps,
cosine decay), evaluated on the held-out split every ``--eval-every`` steps and at the
end, once per (data set, compute, seed).  The data sets:

  records       the demo's: ``key=value`` records answered with compact JSON
                (examples/records: 320 to train on, 40 held out)
  instructions  an Alpaca-style set of short rule-based tasks (examples/instructions,
                made by its make_data.py: 360 to train on, 40 held out)

The default settings (200 steps of 2 rows of 128 tokens: each record is 41-87 tokens, so
rows of 128 are 79-84% filled and a step sees about three records; about two epochs of
each set) keep a step at 256 tokens, the size the project times its steps at, so that 18
runs (2 data sets x 3 computes x 3 seeds) take roughly 30-45 minutes on 2 cores; the
script prints its estimate first and a new one after each run.

Each run writes its own folder, ``OUT/DATA/COMPUTE-seedN``: a finished run whose options
are the same is reused, an interrupted one resumes from its checkpoint, one made with
other options starts over.  So the benchmark can be stopped and started again, and a
larger ``--seeds`` adds runs to the ones already made.  What comes out, in ``--out``:

  heldout_loss.png   the held-out loss against the step, a panel per data set, a colour
                     per compute: each seed a thin line, their mean a thick one; below,
                     each curve minus float32's mean (float32's own seeds show its spread)
  results.md         per data set and compute, the final held-out loss's mean and
                     min-max over the seeds, and for each reduced precision whether its
                     mean lies within float32's seed-to-seed range (else how far above
                     or below it); the compute that ran is the plan's (int8 runs bf16 where its
                     GEMMs are not faster on this CPU, and the table says so)
  results.json       the same, with every run's curve

A run's curve is its own held-out loss, computed by its step in its own precision.  The
final adapters are also scored again by one float32 step (the same rows and loss), and
the verdict compares those scores: int8's own evaluation adds its products' error to the
loss, where the question is what the adapter it trained is worth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import checks
from gradtape.cli.options import check_args, option
from gradtape.errors import GradtapeError
from gradtape.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]

DATA = {"records": ROOT / "examples" / "records",
        "instructions": ROOT / "examples" / "instructions"}
COMPUTES = ("float32", "bf16", "int8")
COLOURS = {"float32": "#1f77b4", "bf16": "#2ca02c", "int8": "#d62728"}
# the run's options besides those on the command line
RANK, ALPHA, LR, WARMUP = 8, 16.0, 1e-3, 10
# a prior for the first estimate of the total time, seconds per token of a training step
# by compute on 2 cores of a bf16-capable CPU; replaced by the rate of runs already made
PRIOR_S_PER_TOKEN = {"float32": 3.2e-3, "bf16": 1.4e-3, "int8": 1.3e-3}
SETUP_S = 15  # loading the model and building one run's step
EVAL_COST = 1 / 3  # a held-out token's forward pass, against a training token's step
HELD_TOKENS = 3500  # the tokens of a held-out split's rows (40 records, packed)
# options that do not change what a run computes
NOT_COMPARED = ("resume", "progress", "save_every")


def _names(known):
    """A comma-separated list of some of ``known``, each at most once."""
    def check(name, value):
        items = value.split(",")
        for item in items:
            if item not in known:
                raise GradtapeError(f"{name}: unknown {item!r}; choose among "
                                    f"{', '.join(known)}")
        if len(set(items)) != len(items):
            raise GradtapeError(f"{name}: {value!r} names one twice")
    return check


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    option(ap, "--steps", checks.count(1), type=int, default=200,
           help="optimizer steps per run (default: %(default)s)")
    option(ap, "--seeds", checks.count(1), type=int, default=3,
           help="runs per data set and compute, with seeds 0 .. N-1 (the adapter's "
                "initialisation and the batch order; default: %(default)s)")
    option(ap, "--computes", _names(COMPUTES), default=",".join(COMPUTES),
           help="comma-separated --compute precisions to train with; float32 is the "
                "reference the others are judged against (default: %(default)s)")
    option(ap, "--data", _names(tuple(DATA)), default=",".join(DATA),
           help="comma-separated data sets: records (the demo's key=value -> JSON), "
                "instructions (Alpaca-style tasks; default: %(default)s)")
    option(ap, "--seq-len", checks.count(2), type=int, default=128,
           help="tokens per row; records are packed into rows (default: %(default)s)")
    option(ap, "--batch-size", checks.count(1), type=int, default=2,
           help="rows per step (default: %(default)s)")
    option(ap, "--eval-every", checks.count(1), type=int, default=25,
           help="steps between held-out evaluations; the last step is always evaluated "
                "(default: %(default)s)")
    option(ap, "--out", None, default="runs/int8_outcomes",
           help="folder of the runs and the results (default: %(default)s)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    args.out = checks.output_folder(Path(args.out).expanduser(), "--out")
    args.computes = args.computes.split(",")
    args.data = args.data.split(",")
    return args


def isa_class(flags) -> str:
    """The instruction-set class that decides the GEMM paths: AMX, AVX-512 BF16, AVX-512,
    AVX2, or baseline."""
    for name, needs in (("AMX", "amx_bf16"), ("AVX-512 BF16", "avx512_bf16"),
                        ("AVX-512", "avx512f"), ("AVX2", "avx2")):
        if needs in flags:
            return name
    return "baseline"


def machine() -> str:
    """The CPU, its ISA class and flags (and the class the kernels are capped at, where
    ``$GRADTAPE_ISA`` caps them), the cores and NumPy's BLAS, in a line."""
    from gradtape.backends.cpu.measure import cpu_summary
    from gradtape.backends.cpu.toolchain import cpu_info
    from threadpoolctl import threadpool_info

    info = cpu_info()
    cap = cpu_summary().get("isa", "native")
    wanted = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")
    blas = "; ".join(f"{p.get('internal_api')} {p.get('version')} "
                     f"({p.get('threading_layer')}, {p.get('architecture')})"
                     for p in threadpool_info() if p.get("user_api") == "blas")
    return (f"CPU: {info['model']}, ISA class {isa_class(info['flags'])}"
            + ("" if cap == "native" else f", kernels capped at {cap} ($GRADTAPE_ISA)")
            + f" (flags {' '.join(f for f in wanted if f in info['flags']) or 'none'}), "
            f"{os.cpu_count()} cores; NumPy's BLAS: {blas or 'unknown'}")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run: a data set, a --compute, a seed, and the folder it trains in."""
    data: str
    compute: str
    seed: int
    folder: Path


def plan_runs(args):
    """Every run, data set by data set, compute by compute."""
    return [Run(d, c, s, args.out / d / f"{c}-seed{s}")
            for d in args.data for c in args.computes for s in range(args.seeds)]


def config(args, run):
    """The run's ``FinetuneConfig``: the held-out split is the data set's test.jsonl."""
    from gradtape.train.finetune import FinetuneConfig

    src = DATA[run.data]
    return FinetuneConfig(data=str(src / "train.jsonl"), eval_data=str(src / "test.jsonl"),
                          out=str(run.folder), steps=args.steps, seq_len=args.seq_len,
                          batch_size=args.batch_size, rank=RANK, alpha=ALPHA, lr=LR,
                          warmup=WARMUP, eval_every=args.eval_every,
                          save_every=args.eval_every, seed=run.seed, backend="cpu",
                          compute=run.compute, samples=0)  # the loss alone


def _same(old: dict, cfg) -> bool:
    new = dataclasses.asdict(cfg)
    return all(old.get(k) == v for k, v in new.items() if k not in NOT_COMPARED)


def state(run, cfg) -> str:
    """``finished`` (its outcome is on record with these options), ``partial`` (a
    checkpoint of a run with these options) or ``new``."""
    try:
        outcome = json.loads((run.folder / "outcome.json").read_text())
        if _same(outcome["config"], cfg):
            return "finished"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        marker = json.loads((run.folder / "gradtape-run.json").read_text())
        if (_same(marker["config"], cfg)
                and (run.folder / "checkpoint" / "state.safetensors").is_file()):
            return "partial"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return "new"


def read_log(folder):
    recs = []
    path = folder / "log.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return recs


def train(run, cfg, resume):
    """One finetune run; its outcome (the compute that ran, its curve, its seconds per
    step) written to ``outcome.json``."""
    from gradtape.train.finetune import finetune

    lines = []

    def log(msg):
        lines.append(str(msg))
        print(f"    {msg}", flush=True)

    (run.folder / "outcome.json").unlink(missing_ok=True)  # an earlier run's, other options
    finetune(dataclasses.replace(cfg, resume=resume), log=log)
    ran = next((m.group(1) for m in map(re.compile(r"^training .* compute (\w+) ").match,
                                        lines) if m), run.compute)
    plan = next((ln for ln in lines if ln.startswith("compute: ")), "")
    write_outcome(run, cfg, ran, plan)


def write_outcome(run, cfg, ran, plan):
    recs = read_log(run.folder)
    atomic_write_json(run.folder / "outcome.json", {
        "config": dataclasses.asdict(cfg), "compute_ran": ran, "plan": plan,
        "curve": [[r["step"], r["eval_loss"]] for r in recs if "eval_loss" in r],
        "s_per_step": _seconds_per_step(recs)})


def _seconds_per_step(recs):
    """A run's seconds per step, its held-out evaluations included; ``elapsed_s``
    counts from the run's last (re)start, so only the steps since then."""
    elapsed = [r["elapsed_s"] for r in recs if "elapsed_s" in r]
    if not elapsed:
        return None
    n = 1
    while n < len(elapsed) and elapsed[-n - 1] < elapsed[-n]:
        n += 1
    return elapsed[-1] / n


def outcome(run):
    return json.loads((run.folder / "outcome.json").read_text())


def rescore(args, runs):
    """Each run's final adapter scored again on its held-out split by one float32 step
    (the same rows, the same loss), so that the precisions' adapters are compared by one
    measure; the loss kept in the run's ``outcome.json`` as ``final_f32``."""
    from gradtape import models
    from gradtape.formats.safetensors_reader import read_safetensors
    from gradtape.models.lora import init_adapter, parse_targets
    from gradtape.train import data as data_mod
    from gradtape.train.step import TrainStep

    todo = [r for r in runs if "final_f32" not in outcome(r)]
    if not todo:
        return
    print(f"scoring {len(todo)} final adapter(s) on the held-out splits in float32")
    model = models.load("smollm2")  # a float32 copy of the weights
    cfg = config(args, todo[0])
    adapter = init_adapter(model.config, cfg.rank, cfg.alpha,
                           parse_targets(cfg.targets, model.config), 0,
                           base_model=model.name, dtype=np.float32)
    step = TrainStep(model, adapter, cfg.batch_size, cfg.seq_len, backend="cpu",
                     dtype=np.float32, compute="float32")
    for d in dict.fromkeys(r.data for r in todo):
        held_file = data_mod.read_data(str(DATA[d] / "test.jsonl"), "--eval-data", "",
                                       split="eval")
        examples, _ = data_mod.tokenize_examples(held_file, model.tokenizer, cfg.seq_len,
                                                 cfg.train_on_prompt)
        held = data_mod.pack_rows(examples, cfg.seq_len, model.tokenizer.eos_id)
        for r in (r for r in todo if r.data == d):
            arrays, _ = read_safetensors(r.folder / "checkpoint" / "state.safetensors",
                                         float32=False, floats_only=False)
            step.load_state_arrays(arrays)
            o = outcome(r)
            o["final_f32"] = step.eval_loss(held)
            print(f"  {d}, --compute {r.compute}, seed {r.seed}: {o['final_f32']:.5f} "
                  f"(in its own run: {o['curve'][-1][1]:.5f})", flush=True)
            atomic_write_json(r.folder / "outcome.json", o)


def estimate(args, runs, done):
    """Seconds the runs not in ``done`` should take, and the scoring of their adapters
    in float32: each compute's rate from its finished runs (their steps include the
    held-out evaluations), else the prior."""
    tokens = args.batch_size * args.seq_len
    rate = {}
    for r in done:
        o = outcome(r)
        if o.get("s_per_step"):
            rate.setdefault(r.compute, []).append(o["s_per_step"])
    evals = -(-args.steps // args.eval_every)
    held = HELD_TOKENS * EVAL_COST  # one evaluation, in training tokens
    todo = [r for r in runs if r not in done]
    total = (SETUP_S + len(todo) * held * PRIOR_S_PER_TOKEN["float32"]) if todo else 0.0
    for r in todo:
        if r.compute in rate:
            total += SETUP_S + args.steps * float(np.median(rate[r.compute]))
        else:
            total += SETUP_S + PRIOR_S_PER_TOKEN[r.compute] * (args.steps * tokens
                                                               + evals * held)
    return total


def _minutes(s):
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def _spread(finals):
    return {"mean": float(np.mean(finals)), "min": min(finals), "max": max(finals)}


def summarise(args, runs):
    """Per data set and compute: the final held-out losses over the seeds, as each run
    measured them (in its own precision) and scored again in float32; where each reduced
    precision's float32-scored mean falls against float32's runs' range."""
    rows = []
    for d in args.data:
        by = {}
        for r in runs:
            if r.data == d:
                by.setdefault(r.compute, []).append(outcome(r))
        ref = [o["final_f32"] for o in by.get("float32", [])]
        for c, outs in by.items():
            own = _spread([o["curve"][-1][1] for o in outs])
            f32 = _spread([o["final_f32"] for o in outs])
            row = {"data": d, "compute": c, "ran": sorted({o["compute_ran"] for o in outs}),
                   "seeds": len(outs), "final": own, "final_f32": f32,
                   "s_per_step": float(np.median([o["s_per_step"] for o in outs])),
                   "plan": outs[0]["plan"], "curves": [o["curve"] for o in outs]}
            if c != "float32" and ref:
                lo, hi, mean = min(ref), max(ref), f32["mean"]
                miss = 0.0 if lo <= mean <= hi else (mean - hi if mean > hi else mean - lo)
                row["vs_float32"] = {"range": [lo, hi], "miss": miss}
            rows.append(row)
    return rows


def verdict(row) -> str:
    v = row.get("vs_float32")
    if v is None:
        return "(the reference)" if row["compute"] == "float32" else "no float32 runs"
    lo, hi = v["range"]
    if v["miss"] == 0.0:
        return f"within float32's range [{lo:.4f}, {hi:.4f}]"
    width, miss = hi - lo, v["miss"]
    return (f"{'above' if miss > 0 else 'below'} float32's range [{lo:.4f}, {hi:.4f}] by "
            f"{abs(miss):.2g} ({abs(miss) / ((lo + hi) / 2):.2%} of its middle"
            + (f", {abs(miss) / width:.1f}x its width)" if width > 0 else ")")
            + ("" if miss > 0 else ": a lower loss"))


def table(args, rows) -> str:
    def cell(x):
        return f"{x['mean']:.4f} ({x['min']:.4f} - {x['max']:.4f})"

    head = (f"SmolLM2-135M-Instruct LoRA r={RANK}, {args.steps} steps of {args.batch_size} x "
            f"{args.seq_len} tokens, lr {LR:g}, {args.seeds} seed(s); the final held-out "
            "loss (nats per target token), mean (min - max) over the seeds, as each run "
            "measured it (in its own precision) and scored again in float32; the verdict "
            f"compares the float32 scores.\n\n{machine()}\n\n"
            "| data | --compute | ran | final, in the run | final, float32-scored | "
            "s/step (evals included) | against float32's seeds |\n"
            "|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['data']} | {r['compute']} | {', '.join(r['ran'])} | {cell(r['final'])} | "
        f"{cell(r['final_f32'])} | {r['s_per_step']:.2f} | {verdict(r)} |\n" for r in rows)
    notes = "".join(f"\n- {r['data']}, {r['compute']}: {r['plan']}" for r in rows
                    if r["plan"])
    return head + body + ("\nThe plan's compute per run:" + notes + "\n" if notes else "")


def _mean_curve(curves):
    """``(steps, mean over the curves that have each step)``."""
    steps = sorted({s for curve in curves for s, _ in curve})
    return steps, [float(np.mean([dict(c)[s] for c in curves if s in dict(c)]))
                   for s in steps]


def plot(args, rows, path):
    """A panel per data set: the held-out loss of every run (thin) and each compute's mean
    over the seeds (thick); with float32 among the computes, a second row gives each
    curve's difference from float32's mean, where float32's own seeds show its spread."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diff = "float32" in args.computes
    fig, axes = plt.subplots(1 + diff, len(args.data), figsize=(6 * len(args.data),
                             4.2 + 3 * diff), dpi=110, squeeze=False,
                             sharex="col", height_ratios=[4.2, 3][:1 + diff])
    for col, d in enumerate(args.data):
        mine = [r for r in rows if r["data"] == d]
        ref = next((dict(zip(*_mean_curve(r["curves"]))) for r in mine
                    if r["compute"] == "float32"), None)
        ax = axes[0][col]
        for r in mine:
            colour = COLOURS[r["compute"]]
            label = r["compute"] + ("" if r["ran"] == [r["compute"]]
                                    else f" (ran {', '.join(r['ran'])})")
            for curve in r["curves"]:
                ax.plot(*zip(*curve), color=colour, lw=0.8, alpha=0.45)
            ax.plot(*_mean_curve(r["curves"]), "o-", color=colour, lw=2, ms=3,
                    label=f"{label}: {r['final']['mean']:.3f}")
            if diff and ref:
                for curve in r["curves"]:
                    pts = [(s, v - ref[s]) for s, v in curve if s in ref]
                    axes[1][col].plot(*zip(*pts), color=colour, lw=1, alpha=0.7)
        ax.set_title(f"{d}: held-out loss, {args.seeds} seed(s) each")
        ax.set_ylabel("held-out loss (nats / target token)")
        ax.legend(title="compute: final mean")
        if diff:
            axes[1][col].axhline(0, color="grey", lw=0.8)
            axes[1][col].set_ylabel("minus float32's mean")
        axes[-1][col].set_xlabel("step")
        for a in axes[:, col]:
            a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = plan_runs(args)
    print(machine())
    configs = {r: config(args, r) for r in runs}
    states = {r: state(r, configs[r]) for r in runs}
    done = [r for r in runs if states[r] == "finished"]
    print(f"{len(runs)} runs ({', '.join(args.data)} x {', '.join(args.computes)} x "
          f"{args.seeds} seed(s)), {len(done)} finished earlier; estimated time "
          f"{_minutes(estimate(args, runs, done))}; results in {args.out}", flush=True)
    for i, r in enumerate(runs, 1):
        what = f"[{i}/{len(runs)}] {r.data}, --compute {r.compute}, seed {r.seed}"
        if r in done:
            print(f"{what}: finished earlier, reused ({r.folder})")
            continue
        print(f"{what}: {'resuming' if states[r] == 'partial' else 'training'} in "
              f"{r.folder}", flush=True)
        t = time.perf_counter()
        train(r, configs[r], resume=states[r] == "partial")
        done.append(r)
        print(f"{what}: done in {_minutes(time.perf_counter() - t)}; about "
              f"{_minutes(estimate(args, runs, done))} to go", flush=True)
    rescore(args, runs)
    rows = summarise(args, runs)
    text = table(args, rows)
    (args.out / "results.md").write_text(text)
    atomic_write_json(args.out / "results.json", {"machine": machine(), "rows": rows,
                                                  "options": {k: str(v) for k, v in
                                                              vars(args).items()}})
    plot(args, rows, args.out / "heldout_loss.png")
    print()
    print(text)
    print(f"plot: {args.out / 'heldout_loss.png'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GradtapeError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: run the same command again to continue")
