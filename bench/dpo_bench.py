"""DPO training steps side by side: gradtape's preference step vs TRL's ``DPOTrainer`` with
a PEFT LoRA on transformers.

Workloads (one pair a step, each of its chosen and rejected rows ``T`` tokens: a prompt
and a completion; finetune's defaults: LoRA r=8, alpha 16 on all seven targets, AdamW,
clipping at 1.0, ``--compute auto``, ``--grad-checkpoint auto``, DPO's sigmoid loss at
beta 0.1):
  smollm2-dpo       SmolLM2-135M-Instruct (the embedded GGUF, loaded as finetune loads it
                    under ``--weights auto``), T=256
  llama8b-q4km-dpo  the 8B-shaped Q4_K_M GGUF of ``bench/quant_bench.py`` (written once,
                    4.2 GiB), kept as stored, T=256
  tiny-dpo          the random 2-layer LLaMA of ``bench/lora_bench.py``, T=32 (checks the
                    benchmark in seconds)

The pairs are random token ids (seeded), the same lists on both sides: each row is a
prompt of ``T / 4`` tokens and a completion filling the rest, so no row is padded.

Ours: the ``TrainStep`` that ``gradtape finetune --method dpo`` builds, and the reference
pass it runs first (``train.preference_run.reference_pass``: the base model's forward
over the pairs, several a call).  Reported: the median step time over ``--reps`` pairs
after ``--warmup`` steps (those ``--reps`` steps are one epoch over the pairs), the
reference pass's time over the same pairs (after one warm-up call of its program, whose
compile and first run are ``ref_warm_s``), its ratio to that epoch (``ref_vs_epoch``; the
issue's target is <= 0.4), and one step's time split by kind of work.

The peer: TRL's ``DPOTrainer`` with ``peft_config`` (the same rank, alpha and targets),
its defaults otherwise (its reference forward in every step, the adapter disabled; its
fused LM-head log-probabilities; gradient checkpointing, unless ``--peer-no-checkpoint``),
given the pairs as the token columns its own dataset preparation makes (``prompt_ids``,
``chosen_ids``, ``rejected_ids``); each optimizer step
of ``trainer.train()`` is timed by a callback (``on_step_begin`` to ``on_step_end``: TRL's
concatenated forward, its loss, backward, clipping, AdamW).  Rows: ``trl-autocast-bf16``
(float32 weights, ``bf16=True``: torch's autocast, only where the CPU has AMX or
AVX512-BF16), ``trl-eager-f32`` (float32), and for the 8B ``trl-bf16`` (bf16 weights and
``bf16=True`` on any CPU: the float32 8B does not fit in 24 GB).

Each side runs alone in a fresh subprocess, one after another (the 8B peer alone holds
about 16 GB), so its peak RSS (VmHWM) is its own.  Every row gives ``step_ratio``
(ours / peer time; target <= 0.8) and ``rss_ratio`` (ours / peer peak memory; target
<= 0.5), names the CPU, its flags and NumPy's BLAS.

    python bench/dpo_bench.py [--json] [--workloads smollm2-dpo,llama8b-q4km-dpo] [--reps 5]
    gradtape bench --workloads smollm2-dpo,llama8b-q4km-dpo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora_bench  # noqa: E402  (the SmolLM2 and tiny models, peak RSS, BLAS)
import quant_bench  # noqa: E402  (the 8B-shaped Q4_K_M file and its peer)


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int  # tokens of each row, chosen and rejected
    reps: int  # pairs: timed steps (one epoch) and the reference pass over them
    warmup: int  # untimed steps first
    peers: tuple  # the peer rows, PEERS' names


# peer row -> (weights dtype, TRL's bf16 flag: torch's autocast)
PEERS = {"trl-autocast-bf16": ("float32", True), "trl-eager-f32": ("float32", False),
         "trl-bf16": ("bfloat16", True)}
WORKLOADS = {"smollm2-dpo": Workload(256, 5, 2, ("trl-autocast-bf16", "trl-eager-f32")),
             "llama8b-q4km-dpo": Workload(256, 3, 1, ("trl-bf16",)),
             "tiny-dpo": Workload(32, 5, 2, ("trl-autocast-bf16", "trl-eager-f32"))}
STEP_TARGET, RSS_TARGET, REF_TARGET = 0.8, 0.5, 0.4  # the (ours / peer)


def defaults():
    """finetune's option defaults for a DPO run on an adapter (``FinetuneConfig``), which
    both sides train with (the learning rate: the one such a run takes)."""
    from gradtape.train.finetune import FinetuneConfig
    d = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}
    return {**d, "lr": FinetuneConfig(data="-", out="-", method="dpo").peak_lr()}


def make_pairs(n, seq_len, vocab, seed=0):
    """``n`` pairs ``(prompt, chosen, rejected)`` of random token ids (3 and up: clear of
    the usual special tokens), the prompt ``seq_len // 4`` long, each completion the rest."""
    rng = np.random.default_rng(seed)
    p = seq_len // 4
    tok = lambda k: [int(t) for t in rng.integers(3, vocab, k)]  # noqa: E731
    return [(tok(p), tok(seq_len - p), tok(seq_len - p)) for _ in range(n)]


# --- ours ---------------------------------------------------------------------------------

def ours_model(name, compute, backend, layers):
    """``(model, how its weights are held)``, as ``finetune`` loads it (``--weights auto``),
    the 8B kept as stored."""
    from gradtape import llama
    from gradtape.blocks import is_block_matrix
    if name == "llama8b-q4km-dpo":
        return llama.load(str(quant_bench.model_file(layers, log=lambda *a: None)),
                          keep_quantized=True), "stored"
    if name == "tiny-dpo":
        return llama.load(lora_bench._tiny_folder()), "float32"
    # one pair a micro-batch: two sequences' rows, as finetune asks reads_blocks
    model = lora_bench._workload("smollm2-lora")[1](compute, backend,
                                                    2 * WORKLOADS[name].seq_len)
    kept = any(is_block_matrix(w) for w in model.weights.values())
    return model, "stored" if kept else "float32"


def run_gradtape(name, warmup, reps, backend, compute="auto", layers=32):
    """Our side alone: build the step, the reference pass over ``reps`` pairs, then
    ``warmup`` + ``reps`` steps of one pair each."""
    from gradtape.models.lora import init_adapter, parse_targets
    from gradtape.models.memory import mem_available
    from gradtape.optim import AdamWConfig
    from gradtape.train.methods import Options, method
    from gradtape.train.pairs import Pair
    from gradtape.train.preference_run import PairData, reference_pass
    from gradtape.train.step import TrainStep

    d, t = defaults(), WORKLOADS[name].seq_len
    t0 = time.perf_counter()
    available = mem_available()  # before the weights take their share, as finetune does
    model, weights = ours_model(name, compute, backend, layers)
    adapter = init_adapter(model.config, d["rank"], d["alpha"],
                           parse_targets(d["targets"], model.config), 0, base_model=model.name)
    step = TrainStep(model, adapter, 1, t, opt=AdamWConfig(weight_decay=d["weight_decay"]),
                     clip=d["clip"], backend=backend, dtype=np.float32, compute=compute,
                     grad_checkpoint=d["grad_checkpoint"], memory_limit=available,
                     method="dpo", options=Options())
    build_s = time.perf_counter() - t0
    pad = getattr(model.tokenizer, "eos_id", None) or 0
    pairs = [Pair(*(np.asarray(x, np.int64) for x in p))
             for p in make_pairs(reps, t, model.config.vocab_size)]
    data = PairData(pairs, t, method("dpo").average, pad, 1, 0)
    t1 = time.perf_counter()
    # the reference program's compile and first run
    step.reference_logps(list(data.batches(size=step.reference_pairs(len(data))))[:1])
    ref_warm_s = time.perf_counter() - t1
    with tempfile.TemporaryDirectory() as out:
        ref_s = reference_pass(step, {"train": data}, Path(out), log=lambda *a: None)
    times = []
    for i in range(warmup + reps):
        k = i % reps
        micro = [(data.batch([k]), data.ref[k])]  # [chosen, rejected] reference log-probs
        t1 = time.perf_counter()
        step.step(micro, i + 1, d["lr"])
        times.append(time.perf_counter() - t1)
    profile = runpy.run_path(str(Path(__file__).with_name("profile_step.py")))["profile"]
    _, kinds = profile(step.program.executable)
    return {"build_s": build_s, "step_times": times[warmup:], "first_step_s": times[0],
            "ref_s": ref_s, "ref_warm_s": ref_warm_s, "epoch_s": sum(times[warmup:]),
            "compute": step.compute, "compute_why": step.compute_why,
            "checkpointed": step.checkpointed, "weights": weights,
            "split_s": {k: round(v, 3) for k, v in kinds.most_common()}}


# --- the peer -----------------------------------------------------------------------------

def peer_hf_model(name, dtype, layers):
    """The peer's transformers model (no adapter) in ``dtype``."""
    import torch
    if name == "llama8b-q4km-dpo":
        model = quant_bench.peer_model(layers)
    elif name == "tiny-dpo":
        model = lora_bench._tiny_hf_model()
    else:
        model = lora_bench._workload("smollm2-lora")[2]()
        # the GGUF's weights were dequantized as it loaded: only its quantization marker,
        # which the Trainer refuses to train, remains (transformers' own removal of it)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
    return model.to(getattr(torch, dtype))


def _pad_tokenizer():
    """A tokenizer holding only TRL's pad / end token (id 0, ours too): the pairs come as
    token ids, so nothing is tokenized; rows are full, so nothing is padded either."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                   eos_token="<pad>", unk_token="<unk>")


def run_peer(name, peer, warmup, reps, layers=32, checkpoint=True):
    """The peer alone: ``trainer.train()`` for ``warmup`` + ``reps`` optimizer steps;
    ``checkpoint``: gradient checkpointing (``DPOConfig``'s default: on)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # already TRL's tokenized columns

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    d, t = defaults(), WORKLOADS[name].seq_len
    dtype, bf16 = PEERS[peer]
    t0 = time.perf_counter()
    model = peer_hf_model(name, dtype, layers)
    pairs = make_pairs(reps, t, model.config.vocab_size)
    rows = [dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), pairs[i % reps]))
            for i in range(warmup + reps)]
    lora = LoraConfig(r=d["rank"], lora_alpha=d["alpha"], lora_dropout=0.0,
                      target_modules=lora_bench.TARGETS, task_type="CAUSAL_LM")
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=1, max_steps=warmup + reps,
                         learning_rate=d["lr"], max_grad_norm=d["clip"],
                         weight_decay=d["weight_decay"], bf16=bf16, use_cpu=True,
                         save_strategy="no", logging_strategy="no", report_to="none",
                         disable_tqdm=True, dataloader_num_workers=0, seed=0,
                         gradient_checkpointing=checkpoint)
        trainer = Pretokenized(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=_pad_tokenizer(), peft_config=lora,
                               callbacks=[timer])
        build_s = time.perf_counter() - t0
        trainer.train()
    return {"build_s": build_s, "step_times": timer.times[warmup:],
            "first_step_s": timer.times[0], "torch_threads": torch.get_num_threads(),
            "weights": dtype, "autocast": bf16, "grad_checkpoint": checkpoint}


def worker(side, name, warmup, reps, backend, compute, layers, peer_checkpoint):
    if side == "gradtape":
        res = run_gradtape(name, warmup, reps, backend, compute, layers)
    else:
        res = run_peer(name, side, warmup, reps, layers, peer_checkpoint)
    res["peak_mb"] = lora_bench._peak_mb()
    print(json.dumps(res), flush=True)


def _side(side, name, args, warmup, reps, compute="auto"):
    """``worker`` in a fresh interpreter; its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, __file__, "--worker", side, "--workloads", name, "--warmup",
           str(warmup), "--reps", str(reps), "--backend", args.backend, "--compute", compute,
           "--layers", str(args.layers)] + ["--peer-no-checkpoint"] * args.peer_no_checkpoint
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode == -signal.SIGKILL:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return {"error": f"killed (SIGKILL): out of memory, most likely (this machine has "
                         f"{total:.1f} GiB)"}
    if res.returncode != 0:
        return {"error": res.stderr.strip()[-1500:] or f"exit status {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- the comparison -----------------------------------------------------------------------

def bench_workload(name, args, log):
    """The workload's rows: each side alone in its subprocess, one per (our compute, peer)."""
    w = WORKLOADS[name]
    reps = args.reps or w.reps
    warmup = w.warmup if args.warmup is None else args.warmup
    cpu = quant_bench.cpu_info()
    if name == "llama8b-q4km-dpo":
        quant_bench.model_file(args.layers, log)  # written once, before any side is timed
    results = {}
    sides = [("gradtape-" + c, "gradtape", c) for c in args.compute.split(",")]
    for peer in w.peers:
        if args.no_autocast and peer == "trl-autocast-bf16":
            continue
        if peer == "trl-autocast-bf16" and not (cpu["amx_bf16"] or cpu["avx512_bf16"]):
            log(f"[{name}] {peer} left out: this CPU has no bf16 instructions (no AMX, no "
                "AVX512-BF16); torch's autocast would emulate them")
            continue
        sides.append((peer, peer, "float32"))
    for label, side, compute in sides:
        log(f"[{name}] {label}: {warmup} warm-up + {reps} timed steps, alone in a "
            "subprocess ...")
        r = _side(side, name, args, warmup, reps, compute)
        if "error" in r:
            log(f"[{name}] {label} failed: {r['error']}")
        else:
            r["step_s"] = statistics.median(r["step_times"])
            log(f"[{name}] {label}: step {r['step_s']:.3f} s, peak RSS "
                f"{r['peak_mb'] / 1024:.2f} GiB"
                + (f", reference pass {r['ref_s']:.3f} s over {reps} pairs "
                   f"({r['ref_s'] / r['epoch_s']:.2f}x the epoch)" if "ref_s" in r else ""))
        results[label] = r
    rows = []
    for label, side, compute in sides:
        ours = results[label]
        if side != "gradtape" or "error" in ours:
            continue
        for peer in [p for p in w.peers if p in results]:
            theirs = results[peer]
            row = {"workload": name, "gradtape": label, "compute_requested": compute,
                   "compute": ours["compute"], "compute_why": ours["compute_why"],
                   "weights": ours["weights"], "checkpointed": ours["checkpointed"],
                   "peer": peer, "peer_weights": PEERS[peer][0], "peer_autocast": PEERS[peer][1],
                   "peer_reference": "a forward in every step (TRL's default)",
                   "seq_len": w.seq_len, "pairs_per_step": 1, "reps": reps, "warmup": warmup,
                   "gradtape_s": ours["step_s"], "gradtape_peak_mb": ours["peak_mb"],
                   "ref_pass_s": ours["ref_s"], "epoch_s": ours["epoch_s"],
                   "ref_vs_epoch": ours["ref_s"] / ours["epoch_s"],
                   "ref_warm_s": ours["ref_warm_s"], "build_s": ours["build_s"],
                   "split_s": ours["split_s"], "backend": args.backend,
                   "default": compute == "auto", **cpu}
            if name == "llama8b-q4km-dpo":
                row["layers"] = args.layers
            if "error" in theirs:
                row["peer_error"] = theirs["error"]
            else:
                row.update({"peer_s": theirs["step_s"], "peer_peak_mb": theirs["peak_mb"],
                            "peer_threads": theirs["torch_threads"],
                            "peer_grad_checkpoint": theirs["grad_checkpoint"],
                            "step_ratio": ours["step_s"] / theirs["step_s"],
                            "rss_ratio": ours["peak_mb"] / theirs["peak_mb"]})
            rows.append(row)
    return rows


def _text(row):
    ref = (f"reference pass {row['ref_pass_s']:.3f} s = {row['ref_vs_epoch']:.2f}x an epoch "
           f"of {row['reps']} pairs (target <= {REF_TARGET})")
    if "peer_error" in row:
        return (f"{row['workload']:16s} {row['gradtape']} ({row['compute']}) "
                f"{row['gradtape_s']:.3f} s/step, {row['gradtape_peak_mb']:.0f} MB; "
                f"{row['peer']} failed; {ref}; {row['cpu']}")
    return (f"{row['workload']:16s} {row['gradtape']} ({row['compute']}) vs {row['peer']:17s} "
            f"{row['gradtape_s']:.3f} s vs {row['peer_s']:.3f} s -> {row['step_ratio']:.2f}x "
            f"(target <= {STEP_TARGET}); peak RSS {row['gradtape_peak_mb']:.0f} MB vs "
            f"{row['peer_peak_mb']:.0f} MB -> {row['rss_ratio']:.2f}x (target <= "
            f"{RSS_TARGET}); {ref}; {row['cpu']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    ap.add_argument("--workloads", default="smollm2-dpo",
                    help="comma-separated among " + ", ".join(WORKLOADS)
                    + " (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=0,
                    help="pairs: timed steps (one epoch over them) and the reference pass's "
                         "pairs (default: 5; 3 for the 8B)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first, each side (default: 2; 1 for the 8B)")
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
    ap.add_argument("--compute", default="auto",
                    help="our GEMM precisions, comma-separated among auto (finetune's "
                         "default), float32, bf16, int8 (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=32,
                    help="llama8b-q4km-dpo's decoder layers (32: the 8B shape; fewer to check "
                         "the benchmark)")
    ap.add_argument("--no-autocast", action="store_true",
                    help="leave out trl-autocast-bf16 (TRL's bf16=True on float32 weights)")
    ap.add_argument("--peer-no-checkpoint", action="store_true",
                    help="the peer without gradient checkpointing (DPOConfig's default is "
                         "on: every layer's forward recomputed in backward)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per side")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from gradtape.plan import COMPUTE_CHOICES
    names = [n for n in args.workloads.split(",") if n]
    for n in names or [""]:
        if n not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {n!r}; this script runs "
                     f"{', '.join(WORKLOADS)}")
    for c in args.compute.split(","):
        if c not in COMPUTE_CHOICES:
            ap.error(f"--compute: expected among {', '.join(COMPUTE_CHOICES)}, got {c!r}")
    for flag, v, lo in (("--reps", args.reps, 0), ("--warmup", args.warmup, 0),
                        ("--layers", args.layers, 1), ("--timeout", args.timeout, 1)):
        if v is not None and v < lo:
            ap.error(f"{flag} must be >= {lo}, got {v}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        worker(args.worker, names[0], args.warmup, args.reps, args.backend, args.compute,
               args.layers, not args.peer_no_checkpoint)
        return 0
    from gradtape.backends.cpu.measure import cpu_summary

    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    blas, cpu = lora_bench.blas_info(), cpu_summary()
    log(f"CPU: {cpu['cpu']} (flags: {' '.join(cpu['flags'])}); NumPy's BLAS: "
        f"{'; '.join(blas)}")
    for name in names:
        for row in bench_workload(name, args, log):
            row.update(blas=blas, flags=cpu["flags"])
            print(json.dumps(row) if args.json else _text(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
