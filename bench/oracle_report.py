"""Print the worst relative errors the exactness tests measure (for the closing note).

    .venv/bin/python bench/oracle_report.py

Reuses the test suites' cases and helpers (tests/support/fd.py, tests/core/test_*_fd.py,
tests/core/test_nn_oracle.py, tests/core/test_block_oracle.py): the LoRA LLaMA block vs torch
float64 (loss and 14 adapter gradients, every configuration), each nn layer vs torch
float64, and the finite-difference dot-product checks (first and second order) of every
primitive and layer.  Needs torch (a test-only dependency).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "core")]

from support import fd  # noqa: E402
import test_block_oracle as block  # noqa: E402
import test_nn_fd as nn_fd  # noqa: E402
import test_nn_oracle as nn_oracle  # noqa: E402
import test_primitives_fd as prim_fd  # noqa: E402


def worst(pairs):
    err, where = max(pairs, key=lambda p: p[0])
    return err, where, len(pairs)


def line(title, res, tol):
    err, where, n = res
    status = "ok" if err <= tol else "FAIL"
    print(f"{title:<44} {err:10.3e}  (tol {tol:.0e}, {n} checks, worst: {where}) {status}")


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    t0 = time.perf_counter()
    blk = []
    for c in block.CONFIGS:
        for k, e in block.block_errors(c).items():
            blk.append((e, f"T{c.T} nh{c.nh}/nkv{c.nkv} hd{c.hd} r{c.rank}: {k}"))
    line("block oracle (loss + 14 adapter grads)", worst(blk), block.ORACLE_TOL)
    lay = [(nn_oracle.compare(b, f, i), cid) for cid, b, f, i in nn_oracle.CASES]
    line("per-layer oracle (forward + grads)", worst(lay), nn_oracle.ORACLE_TOL)
    for order in (1, 2):
        pr = [(fd.check_fd(b, i, order=order), f"{n}-{c}") for n, c, b, i in prim_fd.CASES]
        line(f"FD order {order}, primitives", worst(pr), fd.FD_TOL[order])
        cases = nn_fd.CASES if order == 1 else [
            c for c in nn_fd.CASES if c[0] in nn_fd.SECOND_ORDER]
        ly = [(fd.check_fd(b, i, order=order), cid) for cid, b, i in cases]
        line(f"FD order {order}, nn layers", worst(ly), fd.FD_TOL[order])
    print(f"({time.perf_counter() - t0:.1f} s; relative error = max|ours - ref| / max|ref| for "
          "the oracles, |<g, v> - FD| / sum|g||v| for the dot-product tests)")


if __name__ == "__main__":
    main()
