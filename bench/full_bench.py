"""Side-by-side full fine-tuning step: gradtape vs Hugging Face transformers.

Workloads (every weight trained, float32 master weights, AdamW, one sequence a step):
  smollm2-full  SmolLM2-135M-Instruct (the embedded GGUF, dequantized), T=256
  tiny-full     a random 2-layer LLaMA (dim 64, 4 heads, 2 KV heads, ffn 176, vocab 256),
                T=32 (a smoke run: seconds)

Sides: gradtape's ``TrainStep(..., fine_tune_type="full")`` as ``finetune
--fine-tune-type full`` builds it (under ``--compute auto``: bf16 where this CPU runs it
faster: ``train/full.py``), the
peer eager in float32 and the peer under ``torch.autocast("cpu", torch.bfloat16)``, each
``loss.backward()`` then ``torch.optim.AdamW.step()`` over every parameter.  Each side
runs in its own process (torch's OpenMP pool and NumPy's BLAS never share one), their
steps alternate so that machine drift hits all alike; each row compares gradtape with
one peer as ``ratio = peer_s / gradtape_s`` and ``rss_ratio = gradtape peak / peer
peak`` (VmHWM of each process), and names the CPU and NumPy's BLAS.

    python bench/full_bench.py [--json] [--workloads smollm2-full,tiny-full] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("smollm2-full", "tiny-full")
SEQ_LEN = {"smollm2-full": 256, "tiny-full": 32}
REPS = {"smollm2-full": 5, "tiny-full": 20}
PEERS = ("hf-eager", "hf-autocast-bf16")
LR = 1e-5


def _lora_bench():
    """The LoRA bench's helpers (the models, peak RSS, BLAS info): one definition."""
    return runpy.run_path(os.path.join(HERE, "lora_bench.py"))


def _ours(workload):
    from gradtape import llama

    lb = _lora_bench()
    if workload == "tiny-full":
        return llama.load(lb["_tiny_folder"]())
    # as finetune --fine-tune-type full loads it: blocks mapped, each dequantized once
    # into its float32 param
    return llama.load(str(lb["_smollm2_path"]()), keep_quantized=True)


def _theirs(workload):
    import torch
    from transformers import AutoModelForCausalLM

    lb = _lora_bench()
    if workload == "tiny-full":
        return lb["_tiny_hf_model"]()
    p = lb["_smollm2_path"]()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=torch.float32)


def _ids(vocab, t):
    return np.random.default_rng(0).integers(0, vocab, (1, t))


def side_worker(name, workload, backend):
    """One side alone in this process, driven over stdin: ``step`` -> its seconds,
    ``peak`` -> its peak RSS in MB; one JSON line each (and one when built)."""
    t = SEQ_LEN[workload]
    lb = _lora_bench()
    if name == "gradtape":
        from gradtape.models.memory import mem_available
        from gradtape.train.step import TrainStep

        model = _ours(workload)
        st = TrainStep(model, None, 1, t, backend=backend, clip=0.0, grad_checkpoint="auto",
                       memory_limit=mem_available(), fine_tune_type="full")
        ids = _ids(model.config.vocab_size, t)
        targets = np.roll(ids, -1, axis=1)
        targets[:, -1] = -100
        n = [0]

        def fn():
            n[0] += 1
            st.step([(ids, targets)], n[0], LR)
        info = {"compute": st.compute, "compute_why": st.compute_why,
                "checkpointed": st.checkpointed, "n_param": st.n_param}
    else:
        import torch

        torch.manual_seed(0)
        model = _theirs(workload)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        x = torch.tensor(_ids(model.config.vocab_size, t))
        cast = name == "hf-autocast-bf16"

        def fn():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                out = model(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        info = {"threads": torch.get_num_threads(),
                "n_param": sum(p.numel() for p in model.parameters())}
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            t0 = time.perf_counter()
            fn()
            print(json.dumps({"t": time.perf_counter() - t0}), flush=True)
        elif line.strip() == "peak":
            print(json.dumps({"peak_mb": lb["_peak_mb"]()}), flush=True)


class _Side:
    def __init__(self, name, workload, backend):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--side-worker", name, "--workloads", workload,
             "--backend", backend], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.read()

    def read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench: the {self.name} worker stopped "
                                   f"(exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def bench(workload, reps, warmup, backend, peers, log):
    sides = []
    try:
        for name in ("gradtape",) + tuple(peers):
            t0 = time.perf_counter()
            sides.append(_Side(name, workload, backend))
            log(f"[{workload}] {name} built in {time.perf_counter() - t0:.1f} s")
        for _ in range(warmup):
            for s in sides:
                s.ask("step")
        times = {s.name: [] for s in sides}
        for i in range(reps):  # alternate: drift hits every side alike
            for s in sides:
                times[s.name].append(s.ask("step")["t"])
            log(f"[{workload}] rep {i + 1}/{reps}: "
                + ", ".join(f"{n} {ts[-1]:.4f} s" for n, ts in times.items()))
        peak = {s.name: s.ask("peak")["peak_mb"] for s in sides}
    finally:
        for s in sides:
            try:
                s.close()
            except (OSError, subprocess.TimeoutExpired):
                s.proc.kill()
    med = {n: statistics.median(ts) for n, ts in times.items()}
    ours = sides[0].info
    return [{"workload": workload, "gradtape": "gradtape", "peer": p, "backend": backend,
             "seq_len": SEQ_LEN[workload], "reps": reps, "gradtape_s": med["gradtape"],
             "peer_s": med[p], "ratio": med[p] / med["gradtape"],
             "gradtape_peak_mb": peak["gradtape"], "peer_peak_mb": peak[p],
             "rss_ratio": peak["gradtape"] / peak[p], "compute": ours["compute"],
             "compute_why": ours["compute_why"], "checkpointed": ours["checkpointed"],
             "n_param": ours["n_param"],
             "threads": next(s.info.get("threads") for s in sides[1:])} for p in peers]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--workloads", default="smollm2-full",
                    help="comma-separated among " + ", ".join(WORKLOADS)
                    + " (default: %(default)s)")
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
    ap.add_argument("--reps", type=int, default=0,
                    help="timed steps per side (default: 5 for smollm2-full, 20 for tiny-full)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per side (default 2)")
    ap.add_argument("--no-autocast", action="store_true",
                    help="leave out the peer under torch.autocast(cpu, bfloat16)")
    ap.add_argument("--side-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.side_worker:
        side_worker(args.side_worker, names[0], args.backend)
        return 0
    from gradtape.backends.cpu.measure import cpu_summary

    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    blas, cpu = _lora_bench()["blas_info"](), cpu_summary()
    log(f"CPU: {cpu['cpu']} (flags: {' '.join(cpu['flags'])}); NumPy's BLAS: "
        f"{'; '.join(blas)}")
    peers = PEERS[:1] if args.no_autocast else PEERS
    for w in names:
        for row in bench(w, args.reps or REPS[w], args.warmup, args.backend, peers, log):
            row.update(blas=blas, **cpu)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['workload']:13s} gradtape ({row['compute']}) vs {row['peer']:17s} "
                      f"{row['gradtape_s']:.4f} s vs {row['peer_s']:.4f} s -> "
                      f"{row['ratio']:.2f}x; peak RSS {row['gradtape_peak_mb']:.0f} MB vs "
                      f"{row['peer_peak_mb']:.0f} MB ({row['rss_ratio']:.2f}x); {row['cpu']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
