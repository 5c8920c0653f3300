"""The fused attention (``csrc/flash.c``) of a git revision against the working tree's, in
one process, their calls alternated: on a shared machine whose speed drifts by 10-50%
between minutes, two separate runs cannot show a 5% change; alternated calls see the
same drift.

    python bench/flash_ab.py --rev HEAD~1 [--seq-len 256] [--heads 32,8,128]

Both builds take the package's flags (``-march=native``, OpenMP); each call is one
layer's forward or backward (causal, one sequence) on the same random inputs.  Printed:
the CPU, each build's largest difference from the other's results (relative to their
largest magnitude), and per precision and direction the median of each build and the
ratio tree / revision (below 1: the working tree is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import gradtape  # noqa: E402,F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np  # noqa: E402

from gradtape.backends.cpu import toolchain  # noqa: E402
from gradtape.backends.cpu.measure import cpu_summary  # noqa: E402

CSRC = "src/gradtape/backends/cpu/csrc"


def build_at(rev, tmp):
    """flash.c and the files it includes as they were at ``rev``, compiled"""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    texts = []
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        (Path(tmp) / name).write_text(text)
        texts.append(text)
    flags = (*toolchain.threads_flags(), f"-I{tmp}")
    return toolchain.build('#include "flash.c"\n', flags, "flashab", directory=tmp,
                           depends=texts)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare against "
                    "(default HEAD: the tree's uncommitted change)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", default="9,3,64",
                    help="query heads, KV heads and head dim (default SmolLM2's 9,3,64; "
                         "an 8B LLaMA's: 32,8,128)")
    ap.add_argument("--reps", type=int, default=0,
                    help="calls of each build per row (default: about 2 s of calls)")
    args = ap.parse_args()
    nh, nkv, hd = (int(x) for x in args.heads.split(","))
    t = args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.rev: ctypes.CDLL(str(build_at(args.rev, tmp))),
                "tree": ctypes.CDLL(str(toolchain.build_csrc(["flash.c"],
                                                             flags=toolchain.threads_flags(),
                                                             prefix="tiled")[0]))}
    rng = np.random.default_rng(0)
    q = rng.standard_normal((t, nh * hd), dtype=np.float32)
    k, v = (rng.standard_normal((t, nkv * hd), dtype=np.float32) for _ in range(2))
    gy = rng.standard_normal((t, nh * hd + nh), dtype=np.float32)

    def ptr(a):
        return ctypes.c_void_p(a.ctypes.data if a is not None else 0)

    dims = (ctypes.c_long(1), ctypes.c_long(t), ctypes.c_long(t), ctypes.c_long(nh),
            ctypes.c_long(nkv), ctypes.c_long(hd), ctypes.c_double(hd ** -0.5),
            ctypes.c_double(0.0), ctypes.c_long(0))

    def calls(lib, prec):
        """(forward, backward) of one build, each writing its own outputs"""
        y = np.empty((t, nh * hd + nh), np.float32)
        g = np.empty(t * nh * hd + 2 * t * nkv * hd, np.float32)
        fwd, bwd = getattr(lib, f"gt_flash_fwd_{prec}"), getattr(lib, f"gt_flash_bwd_{prec}")

        def forward():
            if fwd(ptr(y), ptr(q), ptr(k), ptr(v), ptr(None), *dims):
                raise MemoryError("flash scratch")

        def backward():
            if bwd(ptr(g), ptr(gy), ptr(q), ptr(k), ptr(v), ptr(y), ptr(None), *dims):
                raise MemoryError("flash scratch")
        forward()
        backward()
        return forward, backward, y, g

    cpu = cpu_summary()
    print(f"CPU: {cpu['cpu']} ({' '.join(cpu['flags'])}); T={t}, heads {nh},{nkv},{hd}")
    for prec in ("bf16", "f32"):
        runs = {name: calls(lib, prec) for name, lib in libs.items()}
        (_, _, y0, g0), (_, _, y1, g1) = runs.values()
        print(f"{prec}: results differ by {np.abs(y0 - y1).max() / np.abs(y0).max():.1e} "
              f"(forward), {np.abs(g0 - g1).max() / np.abs(g0).max():.1e} (backward)")
        for d, direction in enumerate(("forward", "backward")):
            one = runs["tree"][d]
            t0 = time.perf_counter()
            one()
            reps = args.reps or max(10, int(1.0 / max(time.perf_counter() - t0, 1e-6)))
            times = {name: [] for name in runs}
            for _ in range(reps):
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    run[d]()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            print(f"  {direction:8s} {args.rev} {med[args.rev]:.3f} ms, tree "
                  f"{med['tree']:.3f} ms: tree / {args.rev} {med['tree'] / med[args.rev]:.3f}"
                  f" ({reps} calls each)")


if __name__ == "__main__":
    main()
