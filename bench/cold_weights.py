"""How much slower a float32 training step's big GEMMs run inside the step than alone:
the SmolLM2 LoRA step (T=256, float32) is built and run, then its ``KINDS`` costliest
kinds of product (calls times hot time: the FFN's projections, the tied LM head) are
timed three ways in one process:

* ``hot``: one program step called again and again (its weight stays in cache, as in
  the GEMM floor of ``lora_bench.py``, which times each product alone, call after call);
* ``in step``: each call of that kind right after the program steps before it, as a
  replay runs it (every layer's own weight, read from memory);
* ``flushed``: one call after 600 MB were written (nothing of it in cache).

    GRADTAPE_ISA=avx2 python bench/cold_weights.py [--json]

The ratios say how far a step that streams its weights can come to a floor timed hot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import llama
from gradtape.backends.cpu.measure import cpu_summary
from gradtape.models.lora import init_adapter
from gradtape.train.step import TrainStep

KINDS = 4  # the costliest kinds of product timed
BEFORE = 3  # program steps run before each "in step" call


def _ms(xs):
    return round(statistics.median(xs) * 1e3, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per way (default 7)")
    args = ap.parse_args()
    model = llama.load("smollm2")
    step = TrainStep(model, init_adapter(model.config, 8, 16.0, seed=0), 1, 256,
                     backend="cpu", compute="float32")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 256))
    batch = [(ids, np.roll(ids, -1, 1))]
    for i in range(3):
        step.step(batch, i + 1, 1e-4)
    ex = step.program.executable
    steps = ex._steps
    at = {}  # label -> indices of its calls
    for i, q in enumerate(steps):
        label = getattr(q, "label", "")
        if label.startswith("matmul") and i >= BEFORE:
            at.setdefault(label, []).append(i)
    flush = np.zeros(600 * 2 ** 20 // 4, np.float32)
    rows = []
    with ex.replay_context():
        costly = sorted(at, key=lambda k: -len(at[k]) * _hot(steps[at[k][0]], 3))[:KINDS]
        for label in costly:
            calls = at[label]
            hot = [_timed(steps[calls[0]]) for _ in range(args.reps)]
            in_step = []
            for i in calls[:max(args.reps, 30)]:
                for q in steps[i - BEFORE:i]:
                    q()
                in_step.append(_timed(steps[i]))
            flushed = []
            for _ in range(args.reps):
                flush += 1.0
                flushed.append(_timed(steps[calls[0]]))
            rows.append({"product": label, "calls": len(calls), "hot_ms": _ms(hot),
                         "in_step_ms": _ms(in_step), "flushed_ms": _ms(flushed),
                         "in_step_vs_hot": round(_ms(in_step) / _ms(hot), 3),
                         "flushed_vs_hot": round(_ms(flushed) / _ms(hot), 3)})
    out = {"cpu": cpu_summary(), "products": rows}
    if args.json:
        print(json.dumps(out))
        return
    print(out["cpu"])
    for r in rows:
        print(f"{r['product']} x{r['calls']}: hot {r['hot_ms']} ms, in step {r['in_step_ms']} "
              f"ms ({r['in_step_vs_hot']}x), flushed {r['flushed_ms']} ms "
              f"({r['flushed_vs_hot']}x)")


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _hot(fn, n):
    return min(_timed(fn) for _ in range(n))


if __name__ == "__main__":
    main()
