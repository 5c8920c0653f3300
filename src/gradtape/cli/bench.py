"""Benchmarks side by side with the peers (Hugging Face transformers + PEFT), reported as
ratios: one LoRA training step on SmolLM2 (T=256) and on a tiny 2-layer LLaMA (T=32),
plus the peak memory of each.  Needs the test extras (torch, transformers, peft) and a
source checkout (the peer code lives in bench/, not in the package).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from .. import checks
from ..backends import BACKENDS
from ..errors import GradtapeError
from .options import option

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "lora_bench.py"


def add_arguments(parser):
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per workload and peer, one per line")
    parser.add_argument("--with-compile", action="store_true",
                        help="also compare with the peer under torch.compile (takes minutes)")
    parser.add_argument("--workloads", default="smollm2-lora,tiny-lora",
                        help="comma-separated (default: %(default)s)")
    option(parser, "--backend", checks.one_of(*BACKENDS), default="cpu",
           help="gradtape backend (default: %(default)s)")
    option(parser, "--reps", checks.count(0), type=int, default=0,
           help="timed steps per side (0: the workload's default)")


def run(args) -> int:
    if not SCRIPT.is_file():
        raise GradtapeError(f"{SCRIPT} not found: gradtape bench runs from a source checkout")
    script = runpy.run_path(str(SCRIPT))  # defines the workloads; imports only numpy
    known = script["WORKLOADS"]
    for w in args.workloads.split(","):
        if w not in known:
            raise GradtapeError(f"--workloads: unknown workload {w!r}; known: {', '.join(known)}")
    argv = ["--workloads", args.workloads, "--backend", args.backend, "--reps", str(args.reps)]
    argv += ["--json"] * args.json + ["--with-compile"] * args.with_compile
    return _benchmark(script, argv)


def _benchmark(script, argv):
    """The benchmark itself, with the peers it needs (importing torch takes seconds)."""
    for mod in ("torch", "transformers", "peft", "threadpoolctl"):
        try:
            __import__(mod)
        except ImportError:
            raise GradtapeError(f"gradtape bench needs {mod} (pip install -e '.[test]')") from None
    sys.argv = [str(SCRIPT)] + argv
    return script["main"](argv)
