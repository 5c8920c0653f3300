"""Greedy decode speed of each family's small test model (``tests/models/families.py``,
hidden size 64, float32) through the C step (``decoder="blocks"``) against the graph
(``decoder="graph"``): tokens/s after the first, the median of 3 runs of 48 tokens, and
whether both give the same 16 greedy tokens.  At this size the figures measure per-token
overhead, not GEMM speed.

    python bench/family_decode.py
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "models"), str(ROOT / "tests")]  # the test models

from families import C_DECODE_FAMILIES, C_DECODE_KW, make_folder  # noqa: E402

from gradtape import llama  # noqa: E402


def rate(model, prompt, n, decoder, reps=3):
    """Median tokens/s after the first of ``reps`` greedy runs of ``n`` tokens."""
    model.generate(prompt, 4, decoder=decoder, stop_ids=())  # builds what it needs
    rates = []
    for _ in range(reps):
        t = []
        model.generate(prompt, n, decoder=decoder, stop_ids=(),
                       stream=lambda _: t.append(time.perf_counter()))
        rates.append((len(t) - 1) / (t[-1] - t[0]))
    return float(np.median(rates))


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    root = Path(tempfile.mkdtemp())
    prompt = list(range(3, 19))
    for fam in C_DECODE_FAMILIES:
        m = llama.load(str(make_folder(fam, root / fam, kw_override=C_DECODE_KW)))
        c, g = rate(m, prompt, 48, "blocks"), rate(m, prompt, 48, "graph")
        same = (m.generate(prompt, 16, decoder="blocks", stop_ids=())
                == m.generate(prompt, 16, decoder="graph", stop_ids=()))
        print(f"{fam:8s} C {c:7.0f} tok/s  graph {g:6.0f} tok/s  {c / g:5.1f}x  "
              f"same greedy tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
