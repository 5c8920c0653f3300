"""Where a SmolLM2 training step's time goes (LoRA, or every weight: ``--fine-tune-type
full``): each step of the compiled program timed
on its own (matmuls by shape, generated C kernel runs, NumPy ops by name); with
``--kernels N``, also each generated kernel call timed alone, the N costliest kinds.

    python bench/profile_step.py [--batch 1] [--seq-len 256] [--backend cpu] [--reps 2]
                                 [--compute float32|bf16|auto] [--model PATH]
                                 [--keep-quantized] [--rank 8] [--kernels 20]
                                 [--fine-tune-type lora|full] [--clip 1.0]
"""

import argparse
import collections
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import llama
from gradtape.models.lora import init_adapter
from gradtape.train.step import TrainStep


# the tiled primitives (tiled.py): NumPy walks with BLAS GEMMs and C kernels per tile
TILED = {"fwd_attn": "attention", "fwd_attn_grad": "attention", "fwd_head_nll": "LM head + loss",
         "fwd_head_nll_e": "LM head + loss", "fwd_head_nll_grad_x": "LM head + loss",
         "fwd_head_nll_grad_w": "LM head + loss"}


def _name(step):
    """``(name, kind)`` of one program step; kinds: matmul (NumPy's BLAS), bf16 GEMM /
    matmul f32 (oneDNN), a block-weight GEMM's label (dequantization + GEMM per tile), C
    (generated kernels), attention, LM head + loss, numpy (the rest)."""
    if hasattr(step, "label"):  # a block-weight GEMM (backends/cpu/qgemm*.py), a oneDNN matmul
        return step.label, step.label.split(" [")[0].split(" (")[0]
    f = getattr(step, "func", step)
    if f is np.matmul:
        return f"matmul {step.args[0].shape} x {step.args[1].shape}", "matmul"
    name = getattr(f, "__name__", repr(f))
    if name == "gt_run":  # a run of generated C kernels between two NumPy steps
        return f"C kernels x{step.args[2]}", "C"
    if name == "run" and "onednn" in getattr(f, "__module__", ""):
        return "bf16 GEMM (oneDNN)", "bf16 GEMM"
    return name, TILED.get(name, "numpy")


def profile(executable, reps=1):
    """Each step of a compiled program (its cpu ``executable``) timed alone over ``reps``
    replays, inside the replay's own context (denormals flushed, NumPy's BLAS on one
    thread in a bf16 replay): ``(seconds by name, seconds by kind)``, per replay.  A bf16
    or int8 block-weight GEMM (``qgemm_bf16.lower_bf16`` / ``qgemm_int8.lower_int8``) is
    split into its tiles' dequantization ("dequantize bf16" / "int8"), their GEMMs ("block
    GEMM bf16" / "int8") and the rest of it (the activation's rounding or quantization,
    moves), under its own kind."""
    per, kinds = collections.Counter(), collections.Counter()
    with executable.replay_context():
        for _ in range(reps):
            for step in executable._steps:
                name, kind = _name(step)
                precision = getattr(step, "precision", None)
                split = {"dequantize": 0.0, "GEMM": 0.0} if precision else None
                t = time.perf_counter()
                step(split) if split is not None else step()
                dt = time.perf_counter() - t
                per[name] += dt / reps
                if split is not None:
                    kinds[f"dequantize {precision}"] += split["dequantize"] / reps
                    kinds[f"block GEMM {precision}"] += split["GEMM"] / reps
                    dt -= split["dequantize"] + split["GEMM"]
                kinds[kind] += dt / reps
    return per, kinds


def profile_kernels(executable, reps=1):
    """Each generated kernel call of a bound cpu ``executable`` timed alone over ``reps``
    replays, in the replay's context: ``(seconds by label, calls by label)``, per replay."""
    per, calls = collections.Counter(), collections.Counter()
    runs = executable.kernel_calls()
    with executable.replay_context():
        for _ in range(reps):
            for _step, label, run in runs:
                t = time.perf_counter()
                run()
                per[label] += (time.perf_counter() - t) / reps
    for _step, label, _run in runs:
        calls[label] += 1
    return per, calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--compute", default="float32", help="float32, bf16, int8 or auto")
    ap.add_argument("--model", default="smollm2",
                    help="model path or name (default: smollm2)")
    ap.add_argument("--keep-quantized", action="store_true",
                    help="keep the GGUF's blocks (the block-weight GEMMs)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--fine-tune-type", default="lora", choices=("lora", "full"),
                    help="lora (an adapter of --rank) or full (every weight, as "
                         "bench/full_bench.py trains it with --clip 0)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="clip the gradient's global norm (0: no clipping)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also time each generated kernel call alone and list the N "
                         "costliest kinds (cpu backend)")
    args = ap.parse_args()
    model = llama.load(args.model, keep_quantized=args.keep_quantized)
    full = args.fine_tune_type == "full"
    adapter = None if full else init_adapter(model.config, args.rank, 2 * args.rank, seed=0)
    st = TrainStep(model, adapter, args.batch, args.seq_len, backend=args.backend,
                   compute=args.compute, clip=args.clip, fine_tune_type=args.fine_tune_type)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.seq_len))
    st.step([(ids, np.roll(ids, -1, 1))], 1, 1e-4)  # first run: binds fed leaves
    ex = st.program.executable
    steps = getattr(ex, "_steps", None)
    if not steps or not callable(steps[0]) or not hasattr(ex, "replay_context"):
        raise SystemExit(f"backend {args.backend!r} does not expose per-step callables")
    per, kinds = profile(ex, args.reps)
    total = sum(kinds.values())
    print(f"{len(steps)} program steps, {total:.3f} s per replay (compute {st.compute})")
    for kind, t in kinds.most_common():
        print(f"  {kind:15s} {t:.3f} s  {100 * t / total:4.1f}%")
    for name, t in per.most_common(args.top):
        print(f"    {t:.4f} s  {name}")
    if args.kernels and hasattr(ex, "kernel_calls"):
        per, calls = profile_kernels(ex, args.reps)
        print(f"{sum(calls.values())} generated kernel calls, each alone: "
              f"{sum(per.values()):.3f} s per replay")
        for label, t in per.most_common(args.kernels):
            print(f"    {1e3 * t:8.2f} ms  x{calls[label]:<4d} {label}")


if __name__ == "__main__":
    main()
