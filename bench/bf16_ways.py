"""The ways of one bf16 block-weight product (``qgemm_bf16``: dequantize and multiply),
oneDNN's and MKL's side by side, timed in turn as ``measure.fastest`` times them when a
model's first step binds it: an 8B model's forward ``x @ W^T`` and backward ``g @ W`` on
random blocks of its shapes (T rows).  Milliseconds per product, the median over rounds
of each way's call relative to its round (``measure.seconds_in_turn``), NumPy's BLAS on
one thread as in a bf16 replay.  Shared hosts are noisy: read the ratios.

    python bench/bf16_ways.py [--qtype Q4_K] [--T 256] [--rounds 5] [--shapes 14336x4096,4096x14336]
"""

import argparse

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

import gradtape as gt
from gradtape import ops
from gradtape.backends.cpu import measure, mkl, onednn
from gradtape.backends.cpu.blas import one_blas_thread
from gradtape.backends.cpu.qgemm_bf16 import Bf16Scratch, lower_bf16
from gradtape.blocks import random_blocks

SHAPES = "14336x4096,4096x14336,4096x4096,1024x4096"  # W [rows, k]: gate/up, down, q/o, k/v


def ways(v, ins, out, scratch, provider):
    """``{name: callable}``: the ways ``lower_bf16`` offers for ``v`` with ``provider``
    running its plain GEMMs (None: oneDNN)."""
    got = {}

    def record(what, shape, runs):
        got.update(runs)
        return next(iter(runs))
    lower_bf16(v, out, ins, onednn.dnnl(), scratch, record, plain_gemms=provider)
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated W rows x k")
    args = ap.parse_args()
    s = measure.cpu_summary()
    ok, why = mkl.available()
    print(f"CPU: {s['cpu']} ({', '.join(s['flags'])}; isa {s['isa']}); "
          f"{onednn.describe()}; MKL: {mkl.mkl().version if ok else why}")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        rows, k = map(int, shape.split("x"))
        bm = random_blocks(args.qtype, rows, k, rng)
        tp = gt.Tape(np.float32)
        x = tp.param(rng.standard_normal((args.T, k), dtype=np.float32))
        g = tp.param(rng.standard_normal((args.T, rows), dtype=np.float32))
        w = tp.const(bm)
        for v, a in ((ops.qmatmul(x, w), x), (ops.qmatmul_t(g, w), g)):
            out = np.zeros(v.shape, np.float32)
            scratch = Bf16Scratch.allocate([v])
            ins = (a.value, bm.data)
            runs = ways(v, ins, out, scratch, None)
            if ok:
                runs.update({n: r for n, r in ways(v, ins, out, scratch, mkl.mkl()).items()
                             if n.endswith(" mkl")})
            names = list(runs)
            with one_blas_thread():
                secs = measure.seconds_in_turn([runs[n] for n in names], args.rounds)
            flops = 2 * args.T * rows * k
            best = min(secs)
            said = [f"{n} {1e3 * t:.0f} ms ({flops / t / 1e9:.0f} GFLOP/s"
                    f"{', best' if t == best else ''})" for n, t in zip(names, secs)]
            print(f"{v.op} {args.qtype} W [{rows}, {k}] T={args.T}: " + ", ".join(said))


if __name__ == "__main__":
    main()
