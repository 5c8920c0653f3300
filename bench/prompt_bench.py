"""How long ``generate`` takes over a prompt, by ``--compute``: float32 (row by row in the
decoder's C prefill; a float32 program from ``PROMPT_F32_ROWS`` rows on) against auto
(one compiled bf16 program where it pays, ``infer.prompt_step.PromptStep``).  Each prompt length runs one token after the prompt in each
precision, the precisions alternating, ``--reps`` times after a warm-up each (the
warm-up builds the program and measures its GEMM layouts the first time a size runs
on this CPU); medians, and auto's ratio to float32.  ``--history N``: a chat turn
instead, a prompt of N rows and its 8-token answer followed by 24 new rows, with the
decoder's cached rows kept against forgotten (``BlockDecoder.kept``).  Default model:
the 8B Q4_K_M file that ``bench/quant_bench.py`` writes (4.2 GB; that bench makes it).

    python bench/prompt_bench.py [--model PATH] [--rows 16,64,256] [--reps 3]
    python bench/prompt_bench.py --history 500
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import llama
from gradtape.backends.cpu import measure as compute
from gradtape.infer.prompt_choice import prompt_compute

COMPUTES = ("float32", "auto")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or folder (default: the "
                    "8B Q4_K_M of bench/quant_bench.py)")
    ap.add_argument("--rows", default="16,64,256", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--history", type=int, default=0, help="time a chat turn after a "
                    "history of this many rows instead")
    args = ap.parse_args()
    path = args.model
    if path is None:
        qb = runpy.run_path(str(Path(__file__).with_name("quant_bench.py")))
        path = str(qb["model_file"](32))
    summary = compute.cpu_summary()
    print(f"CPU: {summary['cpu']} ({', '.join(summary['flags'])}); {path}")
    model = llama.load(path, keep_quantized=True)
    rng = np.random.default_rng(0)
    if args.history:
        return chat_turn(model, args.history, args.reps, rng)
    for rows in map(int, args.rows.split(",")):
        ids = rng.integers(0, model.config.vocab_size, rows)
        took = {c: [] for c in COMPUTES}
        for c in COMPUTES:  # warm-up
            model.generate(ids, 1, compute=c, stop_ids=())
        for _ in range(args.reps):
            for c in COMPUTES:
                forget(model)  # else the prompt is the cached rows, and nothing is run
                t = time.perf_counter()
                model.generate(ids, 1, compute=c, stop_ids=())
                took[c].append(time.perf_counter() - t)
        med = {c: statistics.median(v) for c, v in took.items()}
        ran = prompt_compute(model.config, "auto", rows, np.float32) or "float32"
        print(f"{rows:5d} rows: float32 {med['float32']:6.2f} s, auto ({ran}) "
              f"{med['auto']:6.2f} s: {med['float32'] / med['auto']:.2f}x", flush=True)


def forget(model):
    """The decoder's cached rows forgotten (``BlockDecoder.kept`` finds none)."""
    if model._runner.block_dec is not None:
        model._runner.block_dec[1].ids = []


def chat_turn(model, history, reps, rng):
    """The seconds of a turn: 24 new rows after ``history`` rows and their 8-token
    answer, with the cached rows kept and forgotten, in turn."""
    p1 = list(rng.integers(0, model.config.vocab_size, history))
    took = {"kept": [], "afresh": []}
    for _ in range(reps):
        for how in took:
            answer = model.generate(p1, 8, stop_ids=())  # the cache: p1 and its answer
            p2 = p1 + answer + list(rng.integers(0, model.config.vocab_size, 24))
            if how == "afresh":
                forget(model)
            t = time.perf_counter()
            model.generate(p2, 1, stop_ids=())
            took[how].append(time.perf_counter() - t)
    med = {h: statistics.median(v) for h, v in took.items()}
    print(f"a turn of 24 rows after {history} + 8: kept {med['kept']:.2f} s, afresh "
          f"{med['afresh']:.2f} s: {med['afresh'] / med['kept']:.2f}x")


if __name__ == "__main__":
    main()
