"""Benchmarks side by side with the peers, reported as ratios: one LoRA training step
on SmolLM2 (T=256) and on a tiny 2-layer LLaMA (T=32) against Hugging Face transformers
+ PEFT, plus the peak memory of each (``bench/lora_bench.py``); and generation on
SmolLM2 Q4_1 against llama.cpp on the same file (``smollm2-generate``,
``bench/generate_bench.py``).  Needs a source checkout (the peer code lives in bench/,
not in the package); the training workloads need the test extras (torch, transformers,
peft), the generation peer needs llama-cpp-python (skipped with a note without it).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ..errors import GradtapeError

BENCH = Path(__file__).resolve().parents[3] / "bench"
SCRIPT = BENCH / "lora_bench.py"
GENERATE_SCRIPT = BENCH / "generate_bench.py"
GENERATE_WORKLOADS = ("smollm2-generate",)


def add_arguments(parser):
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per workload and peer, one per line")
    parser.add_argument("--with-compile", action="store_true",
                        help="also compare with the peer under torch.compile (takes minutes)")
    parser.add_argument("--workloads", default="smollm2-lora,tiny-lora,smollm2-generate",
                        help="comma-separated (default: %(default)s)")
    parser.add_argument("--backend", default="cpu", help="gradtape backend (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=0, help="timed steps per side")


def _run_script(script, argv):
    if not script.is_file():
        raise GradtapeError(f"{script} not found: gradtape bench runs from a source checkout")
    sys.argv = [str(script)] + argv
    return runpy.run_path(str(script))["main"](argv)


def run(args) -> int:
    names = [w for w in args.workloads.split(",") if w]
    gen = [w for w in names if w in GENERATE_WORKLOADS]
    train = [w for w in names if w not in GENERATE_WORKLOADS]
    rc = 0
    if train:
        for mod in ("torch", "transformers", "peft", "threadpoolctl"):
            try:
                __import__(mod)
            except ImportError:
                raise GradtapeError(f"gradtape bench needs {mod} (pip install -e '.[test]')") from None
        argv = ["--workloads", ",".join(train), "--backend", args.backend, "--reps",
                str(args.reps)]
        argv += ["--json"] * args.json + ["--with-compile"] * args.with_compile
        rc = _run_script(SCRIPT, argv) or rc
    if gen:
        argv = ["--workloads", ",".join(gen)] + ["--json"] * args.json
        argv += ["--reps", str(args.reps)] if args.reps else []
        rc = _run_script(GENERATE_SCRIPT, argv) or rc
    return rc
