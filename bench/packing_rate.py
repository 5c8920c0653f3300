"""Training target tokens per second on the demo's data (examples/records, SmolLM2), one
example a row padded (the demo's old 4 x 88 rows) against examples packed into longer
rows (``train.data.pack_rows``): each setting's step replayed in turn, wall and process CPU
time per step (CPU time is the steadier figure on a shared machine).

    python bench/packing_rate.py [--reps 3] [--backend cpu] [--packed 4x352 1x352]
"""

import argparse
import os
import time
from pathlib import Path

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

from gradtape import models
from gradtape.models.lora import init_adapter
from gradtape.train import data as data_mod
from gradtape.train.step import TrainStep

DATA = Path(__file__).resolve().parents[1] / "examples" / "records" / "train.jsonl"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--packed", nargs="*", default=["4x352", "1x352"],
                    help="packed settings, BATCHxSEQ_LEN")
    args = ap.parse_args()
    model = models.load("smollm2")
    data = data_mod.read_data(DATA)
    examples, _ = data_mod.tokenize_examples(data, model.tokenizer, 352)
    setups = {"padded 4x88": (4, 88, data_mod.pad_rows)}
    for s in args.packed:
        b, t = map(int, s.split("x"))
        setups[f"packed {s}"] = (b, t, data_mod.pack_rows)
    runs = {}
    for name, (b, t, make) in setups.items():
        rows = make([(i[:t], m[:t]) for i, m in examples], t, model.tokenizer.eos_id)
        st = TrainStep(model, init_adapter(model.config, 8, 16.0, "all", 0), b, t,
                       backend=args.backend)
        st.step([rows.batch(np.arange(b))], 1, 1e-3)  # the first run binds the fed leaves
        runs[name] = (st, rows, b)
        print(f"{name}: {len(examples)} examples in {len(rows)} rows", flush=True)
    got = {name: [] for name in runs}
    for rep in range(args.reps):  # alternating, so that drift hits every setting alike
        for name, (st, rows, b) in runs.items():
            batch = rows.batch(data_mod.batch_indices(len(rows), b, rep, 0))
            wall, cpu = time.perf_counter(), time.process_time()
            st.step([batch], rep + 2, 1e-3)
            got[name].append((int((batch[1] != data_mod.IGNORE).sum()),
                              time.perf_counter() - wall, time.process_time() - cpu))
    print(f"load average {os.getloadavg()[0]:.1f}")
    base = None
    for name, xs in got.items():
        tokens, wall, cpu = (sum(x[i] for x in xs) for i in range(3))
        base = base or (tokens / wall, tokens / cpu)
        print(f"{name}: {tokens / len(xs):.0f} target tokens a step, {wall / len(xs):.2f} s wall "
              f"({cpu / len(xs):.2f} s CPU); target tokens/s {tokens / wall:.1f} wall "
              f"({tokens / wall / base[0]:.2f}x), {tokens / cpu:.1f} per CPU-s "
              f"({tokens / cpu / base[1]:.2f}x)")


if __name__ == "__main__":
    main()
