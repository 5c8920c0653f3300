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

``--grad-checkpoints auto,fit`` does the same for activation checkpointing's choices, each
with the memory available as the limit, as ``gradtape finetune`` gives it (the demo's step):

    python bench/step_ab.py --batch 4 --seq-len 352 --rounds 6 --grad-checkpoints auto,fit -
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
from gradtape.models.memory import mem_available  # noqa: E402
from gradtape.train.step import GRAD_CHECKPOINT, TrainStep  # noqa: E402


def parse_setting(text):
    """``{name: value}`` of ``NAME=VALUE[,NAME=VALUE...]`` (``-``: none)."""
    if text == "-":
        return {}
    pairs = [p.split("=", 1) for p in text.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"step_ab: a setting is NAME=VALUE[,NAME=VALUE...] or -, "
                         f"got {text!r}")
    return dict(pairs)


def build(model, setting, args, data, kind="lora", checkpoint="off"):
    """A TrainStep of a ``kind`` adapter (lora, dora) with ``checkpoint`` as its
    ``grad_checkpoint``, built and run once with ``setting`` in the environment (put back
    after)."""
    saved = {k: os.environ.get(k) for k in setting}
    os.environ.update(setting)
    try:
        ad = init_adapter(model.config, args.rank, 2 * args.rank, seed=0,
                          fine_tune_type=kind, weights=model.weights if kind == "dora" else None)
        st = TrainStep(model, ad, args.batch, args.seq_len, backend="cpu", clip=0.0,
                       compute=args.compute, grad_checkpoint=checkpoint,
                       memory_limit=None if checkpoint in ("off", "on") else mem_available())
        if checkpoint != "off":
            print(f"{checkpoint}: {st.plan.checkpoint.why}", flush=True)
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
    ap.add_argument("--grad-checkpoints", default="off",
                    help="activation checkpointing choices to build each setting's step "
                         f"with, among {','.join(GRAD_CHECKPOINT)}")
    args = ap.parse_args(argv)
    kinds, checkpoints = args.fine_tune_types.split(","), args.grad_checkpoints.split(",")
    if not set(kinds) <= {"lora", "dora"}:
        raise SystemExit(f"step_ab: --fine-tune-types takes lora and dora, got {kinds}")
    if not set(checkpoints) <= set(GRAD_CHECKPOINT):
        raise SystemExit(f"step_ab: --grad-checkpoints takes {','.join(GRAD_CHECKPOINT)}, "
                         f"got {checkpoints}")
    settings = [(text, parse_setting(text)) for text in args.settings]
    cpu = cpu_summary()
    print(f"CPU: {cpu['cpu']} ({' '.join(cpu['flags'])})")
    model = llama.load(args.model, keep_quantized=args.keep_quantized)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size,
                                            (args.batch, args.seq_len))
    data = [(ids, np.roll(ids, -1, 1))]
    steps = [(" ".join([text] + [kind] * (len(kinds) > 1) + [gc] * (len(checkpoints) > 1)),
              build(model, s, args, data, kind, gc))
             for text, s in settings for kind in kinds for gc in checkpoints]
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
