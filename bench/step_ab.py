"""One training step under two or more environment settings, side by side in one process:
a TrainStep built (and run once) under each setting, then their steps replayed in turn,
round after round, so that the machine's drift falls on every setting alike; the best
and the median of each.  For settings read when a step is built, such as
``GRADTAPE_BF16_TILE`` and ``GRADTAPE_BF16_LAYOUT`` (``backends/cpu/measure.py: fastest``).

    python bench/step_ab.py --model ~/.cache/gradtape/bench/llama8b-q4km-lora-32l.gguf \\
        --keep-quantized --rank 16 --rounds 5 GRADTAPE_BF16_TILE=16M -

Each positional argument is one setting: ``NAME=VALUE[,NAME=VALUE...]``, or ``-`` for the
environment as it is.  ``--fine-tune-types lora,dora`` builds each setting's step once per
adapter type (DoRA's step against LoRA's of the same rank, in the same rounds):

    python bench/step_ab.py --model smollm2 --keep-quantized --fine-tune-types lora,dora -
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gradtape  # noqa: E402,F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np  # noqa: E402

from gradtape import llama  # noqa: E402
from gradtape.backends.cpu.measure import cpu_summary  # noqa: E402
from gradtape.models.lora import init_adapter  # noqa: E402
from gradtape.train.step import TrainStep  # noqa: E402


def parse_setting(text):
    """``{name: value}`` of ``NAME=VALUE[,NAME=VALUE...]`` (``-``: none)."""
    if text == "-":
        return {}
    pairs = [p.split("=", 1) for p in text.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"step_ab: a setting is NAME=VALUE[,NAME=VALUE...] or -, "
                         f"got {text!r}")
    return dict(pairs)


def build(model, setting, args, data, kind="lora"):
    """A TrainStep of a ``kind`` adapter (lora, dora) built and run once with ``setting``
    in the environment (put back after)."""
    saved = {k: os.environ.get(k) for k in setting}
    os.environ.update(setting)
    try:
        ad = init_adapter(model.config, args.rank, 2 * args.rank, seed=0,
                          fine_tune_type=kind, weights=model.weights if kind == "dora" else None)
        st = TrainStep(model, ad, args.batch, args.seq_len, backend="cpu", clip=0.0,
                       compute=args.compute)
        st.step(data, 1, 1e-4)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return st


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="+", help="NAME=VALUE[,NAME=VALUE...] or -")
    ap.add_argument("--model", default="smollm2", help="model path or name")
    ap.add_argument("--keep-quantized", action="store_true",
                    help="keep the GGUF's blocks (the block-weight GEMMs)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fine-tune-types", default="lora",
                    help="adapter types to build each setting's step for, among lora,dora")
    args = ap.parse_args(argv)
    kinds = args.fine_tune_types.split(",")
    if not set(kinds) <= {"lora", "dora"}:
        raise SystemExit(f"step_ab: --fine-tune-types takes lora and dora, got {kinds}")
    settings = [(text, parse_setting(text)) for text in args.settings]
    cpu = cpu_summary()
    print(f"CPU: {cpu['cpu']} ({' '.join(cpu['flags'])})")
    model = llama.load(args.model, keep_quantized=args.keep_quantized)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size,
                                            (args.batch, args.seq_len))
    data = [(ids, np.roll(ids, -1, 1))]
    steps = [(text if kinds == ["lora"] else f"{text} {kind}", build(model, s, args, data, kind))
             for text, s in settings for kind in kinds]
    times = {text: [] for text, _ in steps}
    for r in range(args.rounds):
        for text, st in steps:
            t = time.perf_counter()
            st.step(data, r + 2, 1e-4)
            times[text].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{t}: {v[-1]:.3f} s" for t, v in times.items()),
              flush=True)
    for text, v in times.items():
        print(f"{text}: best {min(v):.3f} s, median {statistics.median(v):.3f} s")


if __name__ == "__main__":
    main()
