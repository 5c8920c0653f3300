"""Side-by-side generation benchmark: gradtape vs llama.cpp on the same GGUF file.

Workload ``smollm2-generate``: SmolLM2-135M-Instruct Q4_1 (the embedded GGUF), 2 threads,
a 256-token prompt then 128 greedy tokens.  Both sides get the same token ids.

* gradtape: ``Llama.generate`` (prefill through the batched float32 graph, then one C
  call per token from the Q4_1 / Q8_0 blocks as stored).  Prefill time = from the call
  to the first new token; decode rate = the 127 tokens after it (wall clock, including
  sampling in Python).
* llama.cpp (llama-cpp-python, ``n_threads=2, n_ctx=512, logits_all=False``):
  ``create_completion(ids, max_tokens=128, temperature=0)`` after ``reset()``; prefill
  and decode rates from llama.cpp's own counters (``llama_perf_context``: its compute
  time only, which favours it slightly).  Skipped with a note when it is not installed.
* Sides alternate, ``--reps`` times each; medians; ratios ``gradtape / llama.cpp``.
* Adapter cost: decode with a rank-8 LoRA on all seven targets, unmerged, against the
  base, both ours (ratio ``adapter_s / base_s``; target <= 1.15).
* Agreement: our greedy tokens against our float32 graph reference (``decoder="graph"``)
  for the first 32 tokens; where they first differ, the reference's top-2 logit margin
  at that step and how far our logits are from the reference's there (a near-tie that
  float32 summation order flips, or a real error).  llama.cpp's agreement with the same
  reference is reported too (it quantizes activations to 8 bits, so it differs sooner).

    python bench/generate_bench.py [--json] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import gradtape  # noqa: F401  (first: it caps OpenBLAS at the ISA class before NumPy loads)
import numpy as np

WORKLOADS = ("smollm2-generate",)
PROMPT_TOKENS, NEW_TOKENS, AGREE_TOKENS, THREADS = 256, 128, 32, 2
TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships "
        "home at night. Over the centuries, keepers built towers of stone, then of iron, "
        "and placed lamps and lenses at the top so that sailors could see the light from "
        "far out at sea. Each lighthouse had its own pattern of flashes, written in the "
        "charts, so that a captain could tell which coast he was passing. Life for the "
        "keepers was quiet and often lonely: they trimmed the wicks, polished the glass, "
        "wound the clockwork that turned the lens, and wrote the weather in a log every "
        "few hours. Storms could cut them off from the mainland for weeks. ")


def cpu_info() -> dict:
    model = platform.processor() or platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    feats = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
             if f" {f}" in flags]
    # the instruction-set class gradtape's kernels run at ($GRADTAPE_ISA; not llama.cpp's)
    return {"cpu": model, "cpu_features": feats, "cores": os.cpu_count(),
            "isa": os.environ.get("GRADTAPE_ISA") or "native"}


def blas_info() -> list:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["threadpoolctl not installed"]
    return [f"{i['internal_api']} {i.get('version')} ({i.get('architecture')}, "
            f"{i['num_threads']} threads)" for i in threadpool_info()
            if i["user_api"] == "blas"]


def prompt_ids(tok):
    ids = []
    while len(ids) < PROMPT_TOKENS:
        ids += tok.encode(TEXT)
    return ids[:PROMPT_TOKENS]


# --- the sides ----------------------------------------------------------------------------

def ours_once(model, ids, adapter=None, n=NEW_TOKENS, decoder="auto"):
    """(prefill tok/s, decode tok/s, tokens)."""
    stamps = []
    t0 = time.perf_counter()
    out = model.generate(ids, n, adapter=adapter, stop_ids=(), decoder=decoder,
                         stream=lambda t: stamps.append(time.perf_counter()))
    prefill = len(ids) / (stamps[0] - t0)
    decode = (len(out) - 1) / (stamps[-1] - stamps[0])
    return prefill, decode, out


def load_llama_cpp():
    """llama_cpp, or None and the reason."""
    try:
        import llama_cpp
    except ModuleNotFoundError as e:
        if e.name != "diskcache":
            return None, (f"llama-cpp-python is not installed ({e}); build it from its "
                          "source package (pip install --no-binary :all: llama-cpp-python)")
        # llama_cpp imports diskcache only for its optional on-disk prompt cache, which
        # this benchmark does not use; a placeholder lets the rest import
        import types
        sys.modules["diskcache"] = types.SimpleNamespace(Cache=object)
        try:
            import llama_cpp
        except Exception as e2:  # noqa: BLE001 - any failure means: no peer
            return None, f"llama-cpp-python does not import: {type(e2).__name__}: {e2}"
    except Exception as e:  # noqa: BLE001
        return None, f"llama-cpp-python does not import: {type(e).__name__}: {e}"
    return llama_cpp, None


def peer_once(llama_cpp, llm, ids, n=NEW_TOKENS):
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    t0 = time.perf_counter()
    res = llm.create_completion(ids, max_tokens=n, temperature=0.0, stop=[])
    wall = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)
    prefill = perf.n_p_eval / (perf.t_p_eval_ms / 1e3)
    decode = perf.n_eval / (perf.t_eval_ms / 1e3) if perf.n_eval else float("nan")
    text = res["choices"][0]["text"]
    return prefill, decode, wall, res["usage"]["completion_tokens"], text


def first_difference(model, ids, ours, ref):
    """Where two greedy runs first differ, and why: the reference's top-2 margin there
    and the largest difference between our logits and the reference's."""
    from gradtape.infer import block_decoder as E
    from gradtape.infer import kv_cache as M

    i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return {"equal_tokens": min(len(ours), len(ref), AGREE_TOKENS)}
    prefix = list(ids) + list(ref[:i])
    cache = M.KVCache.empty(model.config)
    M.forward_cached(model.config, model.weights, prefix[:-1], cache)
    z_ref = M.forward_cached(model.config, model.weights, prefix[-1:], cache)[-1]
    cache = M.KVCache.empty(model.config)
    M.forward_cached(model.config, model.weights, prefix[:-1], cache)
    dec = E.BlockDecoder(model, E.block_weights(model), cap=len(prefix) + 1)
    dec.load(cache)
    z = dec.step(prefix[-1])
    top = np.sort(z_ref)[-2:]
    return {"equal_tokens": i, "ours_token": int(ours[i]), "reference_token": int(ref[i]),
            "reference_top2_margin": float(top[1] - top[0]),
            "max_logit_difference": float(np.abs(z - z_ref).max())}


def random_adapter(model, seed=0):
    from gradtape.models import lora as L
    ad = L.init_adapter(model.config, rank=8, alpha=16.0,
                        targets=("q", "k", "v", "o", "gate", "up", "down"),
                        base_model=model.name)
    rng = np.random.default_rng(seed)
    for key, (a, b) in ad.weights.items():
        b[...] = rng.normal(0, 0.02, b.shape)
    return ad


def bench(reps, log):
    os.environ.setdefault("GRADTAPE_THREADS", str(THREADS))
    from gradtape import llama
    from gradtape.models import default_model_path

    path = default_model_path()
    model = llama.load(str(path))
    ids = prompt_ids(model.tokenizer)
    llama_cpp, why = load_llama_cpp()
    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(str(path), n_threads=THREADS, n_threads_batch=THREADS,
                              n_ctx=512, logits_all=False, verbose=False)
    adapter = random_adapter(model)
    log(f"model {path.name}; prompt {len(ids)} tokens, {NEW_TOKENS} new; "
        f"{THREADS} threads; peer: {'llama.cpp ' + llama_cpp.__version__ if llm else why}")

    ours_once(model, ids, n=4)  # warm-up: build the kernels, map the blocks
    ours_once(model, ids, adapter, n=4)
    if llm is not None:
        peer_once(llama_cpp, llm, ids, n=4)
    mine, peer, with_ad = [], [], []
    for r in range(reps):
        mine.append(ours_once(model, ids))
        with_ad.append(ours_once(model, ids, adapter))
        if llm is not None:
            peer.append(peer_once(llama_cpp, llm, ids))
        log(f"rep {r + 1}/{reps}: ours prefill {mine[-1][0]:.0f} tok/s decode "
            f"{mine[-1][1]:.1f} tok/s (adapter {with_ad[-1][1]:.1f})"
            + (f"; llama.cpp prefill {peer[-1][0]:.0f} decode {peer[-1][1]:.1f}" if peer
               else ""))
    med = statistics.median
    ours_tokens = mine[0][2]
    ref = model.generate(ids, AGREE_TOKENS, stop_ids=(), decoder="graph")
    agree = first_difference(model, ids, ours_tokens[:AGREE_TOKENS], ref)
    row = {"workload": "smollm2-generate", "peer": "llama.cpp" if llm else None,
           "prompt_tokens": len(ids), "new_tokens": NEW_TOKENS, "threads": THREADS,
           "gradtape_prefill_tok_s": med(m[0] for m in mine),
           "gradtape_decode_tok_s": med(m[1] for m in mine),
           "gradtape_adapter_decode_tok_s": med(m[1] for m in with_ad),
           "agreement_vs_float32_reference": agree}
    row["adapter_cost"] = row["gradtape_decode_tok_s"] / row["gradtape_adapter_decode_tok_s"]
    if llm is not None:
        row.update(peer_prefill_tok_s=med(p[0] for p in peer),
                   peer_decode_tok_s=med(p[1] for p in peer),
                   peer_completion_tokens=peer[0][3])
        row["prefill_ratio"] = row["gradtape_prefill_tok_s"] / row["peer_prefill_tok_s"]
        row["decode_ratio"] = row["gradtape_decode_tok_s"] / row["peer_decode_tok_s"]
        peer_ids = model.tokenizer.encode(peer[0][4])[:AGREE_TOKENS]
        row["peer_equal_tokens_vs_reference"] = next(
            (j for j, (a, b) in enumerate(zip(peer_ids, ref)) if a != b),
            min(len(peer_ids), len(ref)))
    else:
        row["peer_note"] = why
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--reps", type=int, default=0, help="timed runs per side (default 3)")
    ap.add_argument("--backend", default="cpu", help=argparse.SUPPRESS)  # (the C step's own)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args(argv)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    info = {**cpu_info(), "blas": blas_info()}
    log(f"CPU: {info['cpu']} ({', '.join(info['cpu_features'])}); {info['cores']} cores; "
        f"BLAS: {'; '.join(info['blas'])}")
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise SystemExit(f"generate_bench: unknown workload {w!r} (have {WORKLOADS})")
        row = {**bench(args.reps or 3, log), **info}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{row['workload']}: gradtape prefill {row['gradtape_prefill_tok_s']:.0f} "
                  f"tok/s, decode {row['gradtape_decode_tok_s']:.1f} tok/s, with adapter "
                  f"{row['gradtape_adapter_decode_tok_s']:.1f} (cost "
                  f"{row['adapter_cost']:.2f}x); {row['cpu']}", flush=True)
            if row.get("peer"):
                print(f"  llama.cpp prefill {row['peer_prefill_tok_s']:.0f} tok/s, decode "
                      f"{row['peer_decode_tok_s']:.1f} tok/s -> ratios prefill "
                      f"{row['prefill_ratio']:.2f}x, decode {row['decode_ratio']:.2f}x",
                      flush=True)
            else:
                print(f"  llama.cpp skipped: {row['peer_note']}", flush=True)
            print(f"  greedy vs float32 reference: {row['agreement_vs_float32_reference']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
