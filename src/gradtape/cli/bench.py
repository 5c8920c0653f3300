"""Benchmarks side by side with the peers, reported as ratios: one LoRA training step
on SmolLM2 (T=256; on request T=2048 and 8192, ``smollm2-lora-2k`` / ``-8k``) and on a tiny 2-layer LLaMA (T=32) in each --compute precision against
Hugging Face transformers + PEFT (eager float32 and under bf16 autocast), with the step's
GEMM floor (measured in a clean process), the peak memory of each, the CPU and the GEMM
paths (``bench/lora_bench.py``); generation on SmolLM2 Q4_1 against llama.cpp on the
same file (``smollm2-generate``, bench/generate_bench.py), and at an instruction-set
class against llama.cpp built for it, Q4_1 and Q4_K_M (``smollm2-generate-avx2``,
``smollm2-generate-native``, bench/generate_isa.py); on request an 8B-shaped Q4_K_M
model kept quantized (``llama8b-q4km-lora``, at T=2048 ``llama8b-q4km-lora-2k``,
bench/quant_bench.py); a DPO step on SmolLM2 and on that 8B-shaped file against TRL's
``DPOTrainer`` + PEFT, with the reference pass against an epoch (``smollm2-dpo``,
``llama8b-q4km-dpo``, bench/dpo_bench.py); full fine-tuning of every weight of SmolLM2 at
T=256 against transformers with AdamW, eager and under bf16 autocast (``smollm2-full``,
bench/full_bench.py).  Needs a source checkout (the peer code lives in bench/, not in the
package); the training workloads need the test extras (torch, transformers, peft; the DPO
workloads trl and datasets too), the generation peer needs llama-cpp-python (skipped with a
note without it).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from .. import checks
from ..backends import BACKENDS
from ..plan import COMPUTE_CHOICES
from ..errors import GradtapeError
from .options import option

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "lora_bench.py"
# workloads with a script of their own (the rest go to lora_bench.py)
SCRIPTS = {"llama8b-q4km-lora": SCRIPT.with_name("quant_bench.py"),
           "llama8b-q4km-lora-2k": SCRIPT.with_name("quant_bench.py"),
           "smollm2-generate": SCRIPT.with_name("generate_bench.py"),
           **{w: SCRIPT.with_name("generate_isa.py")
              for w in ("smollm2-generate-avx2", "smollm2-generate-native")},
           "smollm2-full": SCRIPT.with_name("full_bench.py"),
           "tiny-full": SCRIPT.with_name("full_bench.py"),
           **{w: SCRIPT.with_name("dpo_bench.py")
              for w in ("smollm2-dpo", "llama8b-q4km-dpo", "tiny-dpo")}}
# the peers' packages each script needs
PEER = ("torch", "transformers", "peft", "threadpoolctl")
NEEDS = {SCRIPT: PEER, SCRIPTS["llama8b-q4km-lora"]: PEER, SCRIPTS["smollm2-full"]: PEER,
         SCRIPTS["smollm2-dpo"]: PEER + ("trl", "datasets")}
COMPUTE_DEFAULT = "auto,float32,bf16"


def add_arguments(parser):
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per workload and peer, one per line")
    parser.add_argument("--with-compile", action="store_true",
                        help="also compare with the peer under torch.compile (takes minutes)")
    parser.add_argument("--workloads", default="smollm2-lora,tiny-lora,smollm2-generate",
                        help="comma-separated (default: %(default)s); smollm2-lora-2k, "
                             "smollm2-lora-8k: SmolLM2 LoRA at T=2048 / 8192 (the peer under "
                             "autocast only at 8k); smollm2-generate: "
                             "prefill and decode vs llama.cpp on the same Q4_1 file; "
                             "smollm2-generate-avx2, smollm2-generate-native: the same on "
                             "Q4_1 and a Q4_K_M made from it, ours with GRADTAPE_ISA at that "
                             "class against llama.cpp built for it (make llama-cpp-avx2, "
                             "make llama-cpp-native; bench/generate_isa.py); "
                             "llama8b-q4km-lora: "
                             "LoRA on an 8B-shaped Q4_K_M GGUF kept quantized vs "
                             "transformers + PEFT in bf16 (bench/quant_bench.py; writes a "
                             "4.2 GiB file once, needs about 20 GB of memory for the peer); "
                             "llama8b-q4km-lora-2k: the same at T=2048, the peer with "
                             "gradient checkpointing (about 10 minutes); smollm2-dpo, "
                             "llama8b-q4km-dpo: one DPO pair a step (T=256 each row) vs "
                             "TRL's DPOTrainer + PEFT under bf16 autocast and in float32 "
                             "(the 8B: bf16 weights), step time and peak memory as ours / "
                             "TRL, and our reference pass against an epoch over the same "
                             "pairs (bench/dpo_bench.py); tiny-dpo: the same on a tiny "
                             "random model, in seconds; smollm2-full: "
                             "every weight of SmolLM2 trained at T=256 vs transformers "
                             "with AdamW, eager and under bf16 autocast, step time and "
                             "peak memory as ratios (bench/full_bench.py; tiny-full: the "
                             "same on a tiny model, seconds)")
    option(parser, "--backend", checks.one_of(*BACKENDS), default="cpu",
           help="gradtape backend (default: %(default)s)")
    option(parser, "--reps", checks.count(0), type=int, default=0,
           help="timed steps per side (0: the workload's default)")
    parser.add_argument("--compute", default=COMPUTE_DEFAULT,
                        help="gradtape GEMM precisions to time, comma-separated among auto (what "
                             "finetune runs with no options: the rows marked default), "
                             "float32, bf16, int8 (default: %(default)s; each runs once: bf16 "
                             "runs float32 where the CPU has no fast bf16, and the rows say "
                             "so); the DPO workloads time auto only unless this is given")
    parser.add_argument("--no-autocast", action="store_true",
                        help="leave out the peer under torch.autocast(cpu, bfloat16) (the DPO "
                             "workloads: TRL's bf16=True on float32 weights)")


def run(args) -> int:
    if not SCRIPT.is_file():
        raise GradtapeError(f"{SCRIPT} not found: gradtape bench runs from a source checkout")
    # lora_bench.py defines its workloads and imports only numpy at the top
    known = tuple(runpy.run_path(str(SCRIPT))["WORKLOADS"]) + tuple(SCRIPTS)
    names = [w for w in args.workloads.split(",") if w]
    for w in names or [""]:
        if w not in known:
            raise GradtapeError(f"--workloads: unknown workload {w!r}; known: {', '.join(known)}")
    for c in args.compute.split(","):
        checks.one_of(*COMPUTE_CHOICES)("--compute", c)
    return _benchmark(names, args)


def _benchmark(names, args):
    """Run each workload's script with the peers it needs (importing torch takes seconds)."""
    scripts = list(dict.fromkeys(SCRIPTS.get(w, SCRIPT) for w in names))
    for mod in dict.fromkeys(m for s in scripts for m in NEEDS.get(s, ())):
        try:
            __import__(mod)
        except ImportError:
            raise GradtapeError(f"gradtape bench needs {mod} (pip install -e '.[test]')") from None
    rc = 0
    for script in scripts:
        mine = [w for w in names if SCRIPTS.get(w, SCRIPT) == script]
        argv = ["--workloads", ",".join(mine), "--backend", args.backend]
        argv += ["--reps", str(args.reps)] if args.reps else []
        argv += ["--json"] * args.json
        if script in (SCRIPT, SCRIPTS["llama8b-q4km-lora"]):
            argv += ["--compute", args.compute]
        if script == SCRIPTS["smollm2-dpo"] and args.compute != COMPUTE_DEFAULT:
            argv += ["--compute", args.compute]
        if script in (SCRIPT, SCRIPTS["smollm2-dpo"]):
            argv += ["--no-autocast"] * args.no_autocast
        if script == SCRIPT:
            argv += ["--with-compile"] * args.with_compile
        if script == SCRIPTS["smollm2-full"]:
            argv += ["--no-autocast"] * args.no_autocast
        if not script.is_file():
            raise GradtapeError(f"{script} not found: gradtape bench runs from a source "
                                "checkout")
        sys.argv = [str(script)] + argv
        rc = rc or runpy.run_path(str(script))["main"](argv)
    return rc
