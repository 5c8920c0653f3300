"""LoRA on a quantized GGUF as it is: an 8B-shaped Q4_K_M model, gradtape vs Hugging
Face transformers + PEFT in bf16.

Workload ``llama8b-q4km-lora``: Llama-3-8B's blocks (32 layers, dim 4096, 32 heads, 8 KV
heads, head_dim 128, ffn 14336, rope base 500000) with SmolLM2's tokenizer (vocab 49152,
untied output) and random weights, one LoRA training step of r=16 (alpha 32) on all 7
targets, one sequence of T=256 (``--batch 4``: four), AdamW.  Workload
``llama8b-q4km-lora-2k``: the same at T=2048, the peer with gradient checkpointing.

The model file is written once and cached (``~/.cache/gradtape/bench/``, or
``$GRADTAPE_CACHE/bench``; about 4.2 GiB for 32 layers).  Its blocks are random but valid:
random quant bytes with float16 scales of sane size (``blocks.random_blocks``), laid out
as llama.cpp's Q4_K_M scheme lays them out: Q4_K everywhere except Q6_K for the output
matrix and for ``attn_v`` / ``ffn_down`` in the layers llama.cpp gives more bits (the
first and last eighth of the layers and every third one between: its ``use_more_bits``).
No quantizer runs; writing takes about a minute, mostly disk.

gradtape loads it with ``keep_quantized=True`` (blocks memory-mapped, dequantized tile by
tile in the matmuls) on the ``cpu`` backend, with finetune's memory defaults
(``--grad-checkpoint auto`` against MemAvailable: at long rows it recomputes the fewest
layers that fit; the row's ``checkpointed`` says how many).  The peer is
``LlamaForCausalLM`` of the same shape in bfloat16, built on the ``meta`` device, then
``to_empty`` and a random uniform fill (a normal init of 8B weights takes minutes), LoRA
by PEFT, torch's AdamW;
with ``--peer-checkpoint``, transformers' gradient checkpointing (every layer recomputed:
without it the peer's T=2048 step needs more than 24 GB).

The two sides cannot share one process here (the peer alone holds about 16 GB), so each
runs alone in a fresh subprocess, one after the other: ``--warmup`` steps, then ``--reps``
timed steps; reported are the median step time, tokens/s and the peak RSS (VmHWM) of
each, the ratio, and the CPU (model name, AMX / AVX-512-BF16 flags, BLAS).  Each gradtape
row also gets ``vs_floor``: its step against the step's float32 GEMM floor (``floor_s``,
``floor_attention_s``: lora_bench.py's, timed in a clean process; ``--no-floor`` leaves
it out).  ``--sides gradtape`` runs our side alone (where the peer does not fit, as
float32 8B weights do not in 24 GB).  gradtape runs
once per ``--compute`` precision: auto (finetune's default: the row ``gradtape_default``,
with ``compute_why``), float32 (tiles dequantized to float32, OpenBLAS sgemm) and bf16
(tiles dequantized to bf16, oneDNN's bf16 matmul); on request int8 (``--compute int8``:
tiles quantized to int8, oneDNN's int8 matmul; not exact, see the README).  Each
gradtape row splits one step's time by kind of work (``split_s``,
``profile_step.profile``: block-weight GEMMs with their dequantization, other GEMMs, C
kernels, attention, the LM head, the rest).

    python bench/quant_bench.py [--json] [--layers 32] [--reps 3] [--sides gradtape,peer]
    GRADTAPE_ISA=avx2 python bench/quant_bench.py --sides gradtape --compute auto --reps 2
    python bench/quant_bench.py --seq-len 2048 --peer-checkpoint --compute auto --reps 1
    gradtape bench --workloads llama8b-q4km-lora
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

WORKLOAD = "llama8b-q4km-lora"
# the workloads: (rows of a sequence, peer with gradient checkpointing, default --reps);
# at T=2048 the peer's step fits in 24 GB only checkpointed
WORKLOADS = {WORKLOAD: (256, False, 3), f"{WORKLOAD}-2k": (2048, True, 1)}
SHAPE = dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336, vocab=49152,
             rope_base=500000.0, eps=1e-5)
RANK, ALPHA, LR = 16, 32.0, 1e-4
T = 256  # the rows of a sequence (--seq-len sets it in each side's process)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cache_dir():
    d = os.environ.get("GRADTAPE_CACHE")
    return (Path(d) if d else Path.home() / ".cache" / "gradtape") / "bench"


def use_more_bits(i, n):
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(layers, qtype=None):
    """``[(gguf name, qtype, rows, k)]`` of the model, in file order (matrices) and
    ``[(name, "F32", 0, n)]`` for norms; ``qtype``: every matrix of that type instead."""
    s = SHAPE
    q_out, kv_out = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", "Q4_K", s["vocab"], s["dim"])]
    for i in range(layers):
        more = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", "F32", 0, s["dim"]),
                (p + "attn_q.weight", "Q4_K", q_out, s["dim"]),
                (p + "attn_k.weight", "Q4_K", kv_out, s["dim"]),
                (p + "attn_v.weight", more, kv_out, s["dim"]),
                (p + "attn_output.weight", "Q4_K", s["dim"], q_out),
                (p + "ffn_norm.weight", "F32", 0, s["dim"]),
                (p + "ffn_gate.weight", "Q4_K", s["ffn"], s["dim"]),
                (p + "ffn_up.weight", "Q4_K", s["ffn"], s["dim"]),
                (p + "ffn_down.weight", more, s["dim"], s["ffn"])]
    out += [("output_norm.weight", "F32", 0, s["dim"]),
            ("output.weight", "Q6_K", s["vocab"], s["dim"])]
    if qtype:
        out = [(name, t if t == "F32" else qtype, rows, k) for name, t, rows, k in out]
    return out


def model_file(layers, log=print, qtype=None):
    """The cached 8B-shaped Q4_K_M GGUF with ``layers`` layers (written on first use);
    ``qtype``: every matrix of that block type instead (generate_isa.py's files)."""
    import gguf

    from gradtape.blocks import BLOCK_TYPES, random_blocks, row_bytes
    from gradtape.llama import default_model_path
    from gradtape.models.export import _copied_tokenizer_fields

    name = f"llama8b-{qtype.lower()}" if qtype else WORKLOAD
    path = cache_dir() / f"{name}-{layers}l.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"writing {path} (random valid {qtype or 'Q4_K / Q6_K'} blocks, once) ...")
    s = SHAPE
    plan = tensor_plan(layers, qtype)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{name} ({layers} layers, random)")
    w.add_context_length(8192)
    w.add_embedding_length(s["dim"])
    w.add_block_count(layers)
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv_heads"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(s["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value, vtype, sub in _copied_tokenizer_fields(default_model_path()):
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, qtype, rows, k in plan:
        if qtype == "F32":
            w.add_tensor_info(name, (k,), np.dtype(np.float32), 4 * k)
        else:
            rb = row_bytes(qtype, k)
            w.add_tensor_info(name, (rows, rb), np.dtype(np.uint8), rows * rb,
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, qtype, rows, k in plan:
        if qtype == "F32":
            w.write_tensor_data((1.0 + 0.05 * rng.standard_normal(k)).astype(np.float32))
        else:
            assert qtype in BLOCK_TYPES
            w.write_tensor_data(random_blocks(qtype, rows, k, rng, std=0.02).data)
    w.close()
    os.replace(tmp, path)
    log(f"  {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
    return path


# --- the two sides, each alone in a subprocess ----------------------------------------------

def _peak_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _batch(vocab, batch=1):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, T))
    targets = np.roll(ids, -1, axis=1)
    targets[:, -1] = -100
    return ids, targets


def run_gradtape(path, warmup, reps, backend, compute="auto", batch=1):
    from gradtape import llama
    from gradtape.models.lora import init_adapter
    from gradtape.models.memory import mem_available
    from gradtape.train.memory import estimate
    from gradtape.train.step import TrainStep

    t0 = time.perf_counter()
    model = llama.load(str(path), keep_quantized=True)
    ad = init_adapter(model.config, RANK, ALPHA, seed=0)
    # finetune's memory defaults: layers recomputed only where the step would not fit
    step = TrainStep(model, ad, batch, T, backend=backend, clip=0.0, compute=compute,
                     grad_checkpoint="auto", memory_limit=mem_available())
    build_s = time.perf_counter() - t0
    est = estimate(model, step)
    data = [_batch(model.config.vocab_size, batch)]
    times = []
    for i in range(warmup + reps):
        t = time.perf_counter()
        step.step(data, i + 1, LR)
        times.append(time.perf_counter() - t)
    # after the timed steps: one more, step by step
    profile = runpy.run_path(str(Path(__file__).with_name("profile_step.py")))["profile"]
    _, kinds = profile(step.program.executable)
    lora = _lora_bench()
    return {"build_s": build_s, "step_times": times[warmup:], "first_step_s": times[0],
            "estimate_gb": est.total / 1e9, "compute": step.compute,
            "compute_why": step.compute_why, "checkpointed": step.checkpointed,
            "split_s": {k: round(v, 3) for k, v in kinds.most_common()},
            "gemms": lora["step_gemms"](step), "attention_gemms": lora["attention_gemms"](step)}


def _lora_bench():
    """lora_bench.py's functions: the step's GEMMs and the clean-process floor."""
    return runpy.run_path(str(Path(__file__).with_name("lora_bench.py")))


def peer_model(layers):
    """The peer's ``LlamaForCausalLM`` of the 8B shape with ``layers`` layers, bfloat16,
    random (std about 0.02, like the quantized side), without an adapter."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    s = SHAPE
    cfg = LlamaConfig(hidden_size=s["dim"], num_hidden_layers=layers,
                      num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"],
                      head_dim=s["head_dim"], intermediate_size=s["ffn"],
                      vocab_size=s["vocab"], rope_theta=s["rope_base"], rms_norm_eps=s["eps"],
                      max_position_embeddings=8192, tie_word_embeddings=False,
                      torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.uniform_(-0.035, 0.035)  # std 0.02, like the quantized side
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)  # to_empty left its buffer empty
    return model


def run_peer(layers, warmup, reps, batch=1, checkpoint=False):
    import torch
    from peft import LoraConfig, get_peft_model

    s = SHAPE
    t0 = time.perf_counter()
    model = peer_model(layers)
    lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids = torch.tensor(_batch(s["vocab"], batch)[0])
    build_s = time.perf_counter() - t0
    times = []
    for _ in range(warmup + reps):
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return {"build_s": build_s, "step_times": times[warmup:], "first_step_s": times[0],
            "torch_threads": torch.get_num_threads()}


def worker(side, layers, warmup, reps, backend, compute, batch, peer_checkpoint):
    if side == "gradtape":
        res = run_gradtape(model_file(layers, log=lambda *a: None), warmup, reps, backend,
                           compute, batch)
    else:
        res = run_peer(layers, warmup, reps, batch, peer_checkpoint)
    res["peak_mb"] = _peak_mb()
    print(json.dumps(res), flush=True)


def _side(side, layers, warmup, reps, backend, compute, timeout, batch, peer_checkpoint):
    cmd = [sys.executable, __file__, "--worker", side, "--layers", str(layers), "--warmup",
           str(warmup), "--reps", str(reps), "--backend", backend, "--compute", compute,
           "--batch", str(batch), "--seq-len", str(T)]
    if peer_checkpoint:
        cmd.append("--peer-checkpoint")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode == -signal.SIGKILL:  # its stderr holds warnings only
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return {"error": f"killed (SIGKILL): out of memory, most likely (this machine has "
                         f"{total:.1f} GiB)"}
    if res.returncode != 0:
        return {"error": res.stderr.strip()[-1500:] or f"exit status {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def cpu_info():
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "isa": os.environ.get("GRADTAPE_ISA") or "native"}


def main(argv=None):
    global T  # read by the functions above; each side's process gets --seq-len
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object per workload")
    ap.add_argument("--workloads", default=WORKLOAD,
                    help=f"comma-separated among {', '.join(WORKLOADS)} (default: %(default)s;"
                         " -2k: T=2048, the peer with gradient checkpointing)")
    ap.add_argument("--layers", type=int, default=32,
                    help="decoder layers (32: the 8B shape; fewer to check the benchmark)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed steps per side (default: 3; 1 for -2k)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backend", default="cpu", help="gradtape backend (default: cpu)")
    ap.add_argument("--compute", default="auto,float32,bf16",
                    help="gradtape GEMM precisions, comma-separated (a row each: "
                         "gradtape_default_s for auto, finetune's default; gradtape_s for "
                         "float32, gradtape_bf16_s, gradtape_int8_s ...; bf16 runs float32 "
                         "where the CPU has no fast bf16, and gradtape_bf16_compute says what "
                         "ran)")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences per step, both sides (default: 1; the issue's second "
                         "shape is 4)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="rows of a sequence (default: the workload's, 256 or 2048)")
    ap.add_argument("--peer-checkpoint", action="store_true",
                    help="the peer with transformers' gradient checkpointing (what fits "
                         "its T=2048 step in 24 GB; -2k's default)")
    ap.add_argument("--sides", default="gradtape,peer", help="gradtape, peer or both")
    ap.add_argument("--no-floor", action="store_true",
                    help="leave out the float32 GEMM floor (each gradtape row's vs_floor: "
                         "every GEMM of its step, the fused attention's tiles too, timed "
                         "alone through NumPy's BLAS in a clean process, as "
                         "bench/lora_bench.py's floor_s; about a minute for the 8B)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per side")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        T = args.seq_len
        worker(args.worker, args.layers, args.warmup, args.reps, args.backend, args.compute,
               args.batch, args.peer_checkpoint)
        return 0
    names = args.workloads.split(",")
    for w in names:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; this script runs "
                             f"{', '.join(WORKLOADS)}")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    path = model_file(args.layers, log)
    for w in names:
        seq_len, peer_checkpoint, reps = WORKLOADS[w]
        T = args.seq_len or seq_len
        bench_workload(w, args, path, args.peer_checkpoint or peer_checkpoint,
                       args.reps if args.reps is not None else reps, log)
    return 0


def floor_for(row, label, step_s, gemms, attention, log):
    """The step's float32 GEMM floor into ``row`` (``floor_s``, ``floor_attention_s``: the
    fused attention's part; once per distinct list of GEMMs) and ``{label}_vs_floor``."""
    key = json.dumps([gemms, attention])
    if row.get("_floor_key") != key:
        log(f"[{row['workload']}] GEMM floor: the step's GEMMs alone in a clean "
            "subprocess ...")
        f = _lora_bench()["clean_floor"](gemms, attention)
        row.update({"_floor_key": key, "floor_s": f["floor_s"],
                    "floor_attention_s": f["floor_attention_s"],
                    "floor_sgemm_gflops": f["sgemm_gflops"], "floor_blas": f["blas"]})
    row[f"{label}_vs_floor"] = step_s / row["floor_s"]
    log(f"[{row['workload']}] {label}: floor {row['floor_s']:.2f} s (attention "
        f"{row['floor_attention_s']:.2f} s): {row[f'{label}_vs_floor']:.2f}x")


def bench_workload(name, args, path, peer_checkpoint, reps, log):
    """One workload's row: each side (and gradtape per --compute) in its subprocess."""
    row = {"workload": name, "layers": args.layers, "T": T, "batch": args.batch,
           "rank": RANK, "peer_checkpoint": peer_checkpoint,
           "targets": 7, "file_gib": path.stat().st_size / 2**30, "backend": args.backend,
           **cpu_info()}
    try:
        from threadpoolctl import threadpool_info
        row["blas"] = [f"{i['internal_api']} {i['version']} ({i['architecture']}, "
                       f"{i['num_threads']} threads)" for i in threadpool_info()
                       if i["user_api"] == "blas"]
    except ImportError:
        pass
    runs = []  # (row label, side, compute)
    for side in args.sides.split(","):
        if side == "gradtape":
            label = {"float32": "gradtape", "auto": "gradtape_default"}
            runs += [(label.get(c, f"gradtape_{c}"), side, c) for c in args.compute.split(",")]
        else:
            runs.append((side, side, "float32"))
    for label, side, compute in runs:
        log(f"[{name}] {label}: {args.warmup} warm-up + {reps} timed steps, alone "
            "in a subprocess ...")
        r = _side(side, args.layers, args.warmup, reps, args.backend, compute,
                  args.timeout, args.batch, peer_checkpoint)
        if "error" in r:
            log(f"[{name}] {label} failed: {r['error']}")
            row[f"{label}_error"] = r["error"]
            continue
        med = statistics.median(r["step_times"])
        if "gemms" in r and not args.no_floor:
            floor_for(row, label, med, r.pop("gemms"), r.pop("attention_gemms"), log)
        row.update({f"{label}_s": med, f"{label}_tokens_per_s": args.batch * T / med,
                    f"{label}_peak_mb": r["peak_mb"], f"{label}_build_s": r["build_s"],
                    f"{label}_first_step_s": r["first_step_s"]})
        if "estimate_gb" in r:
            for key in ("estimate_gb", "compute", "compute_why", "checkpointed", "split_s"):
                row[f"{label}_{key}"] = r[key]
        log(f"[{name}] {label}: step {med:.2f} s ({args.batch * T / med:.1f} tokens/s), "
            f"peak RSS "
            f"{r['peak_mb'] / 1024:.2f} GiB")
    for label, side, _ in runs:
        if side == "gradtape" and f"{label}_s" in row and "peer_s" in row:
            row["ratio" + label[len("gradtape"):]] = row["peer_s"] / row[f"{label}_s"]
    row.pop("_floor_key", None)
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        def fmt(label):
            if f"{label}_s" not in row:
                return f"{label}: {'failed' if f'{label}_error' in row else 'not run'}"
            ratio = row.get("ratio" + label[len("gradtape"):]) if label != "peer" else None
            return (f"{label} {row[f'{label}_s']:.2f} s/step "
                    f"({row[f'{label}_tokens_per_s']:.1f} tok/s), peak RSS "
                    f"{row[f'{label}_peak_mb'] / 1024:.2f} GiB"
                    + (f", {ratio:.2f}x the peer" if ratio else "")
                    + (f", {row[f'{label}_vs_floor']:.2f}x its GEMM floor "
                       f"{row['floor_s']:.2f} s" if f"{label}_vs_floor" in row else ""))
        print(f"{name} (T={T}, {args.layers} layers, {row['file_gib']:.2f} GiB file, CPU "
              f"{row['cpu']}, AMX {row['amx_bf16']}): "
              + "; ".join(fmt(label) for label, _, _ in runs)
              + " (peer: transformers + PEFT, bf16"
              + (", gradient checkpointing" if peer_checkpoint else "") + ")", flush=True)


if __name__ == "__main__":
    sys.exit(main())
