"""Benchmarks side by side with the peers (Hugging Face transformers + PEFT, eager float32
and under bf16 autocast), reported as ratios: one LoRA training step on SmolLM2 (T=256)
and on a tiny 2-layer LLaMA (T=32) in each --compute precision, the step's GEMM floor
(measured in a clean process), the peak memory of each, the CPU and the GEMM paths.  Needs the test extras (torch, transformers, peft) and a
source checkout (the peer code lives in bench/, not in the package).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ..errors import GradtapeError

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "lora_bench.py"


def add_arguments(parser):
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per workload and peer, one per line")
    parser.add_argument("--with-compile", action="store_true",
                        help="also compare with the peer under torch.compile (takes minutes)")
    parser.add_argument("--workloads", default="smollm2-lora,tiny-lora",
                        help="comma-separated (default: %(default)s)")
    parser.add_argument("--backend", default="cpu", help="gradtape backend (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=0, help="timed steps per side")
    parser.add_argument("--compute", default="float32,bf16",
                        help="gradtape GEMM precisions to time, comma-separated among float32, "
                             "bf16, auto (default: %(default)s; bf16 runs float32 where the CPU "
                             "has no fast bf16, and the rows say so)")
    parser.add_argument("--no-autocast", action="store_true",
                        help="leave out the peer under torch.autocast(cpu, bfloat16)")


def run(args) -> int:
    if not SCRIPT.is_file():
        raise GradtapeError(f"{SCRIPT} not found: gradtape bench runs from a source checkout")
    for mod in ("torch", "transformers", "peft", "threadpoolctl"):
        try:
            __import__(mod)
        except ImportError:
            raise GradtapeError(f"gradtape bench needs {mod} (pip install -e '.[test]')") from None
    argv = ["--workloads", args.workloads, "--backend", args.backend, "--reps", str(args.reps),
            "--compute", args.compute]
    argv += (["--json"] * args.json + ["--with-compile"] * args.with_compile
             + ["--no-autocast"] * args.no_autocast)
    sys.argv = [str(SCRIPT)] + argv
    mod = runpy.run_path(str(SCRIPT))
    return mod["main"](argv)
