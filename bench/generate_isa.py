"""Generation against llama.cpp at one instruction-set class: both sides built for it.

Workloads ``smollm2-generate-avx2`` and ``smollm2-generate-native``: SmolLM2-135M-Instruct
as Q4_1 (the embedded GGUF) and as Q4_K_M (made from that file by llama.cpp's own
quantizer, ``llama_model_quantize`` with ``allow_requantize``: tensors of 576 columns fall
back from Q4_K / Q6_K to Q5_0 / Q8_0 as llama-quantize does, ffn_down stays Q4_K / Q6_K;
cached in ``$GRADTAPE_CACHE/bench``), 2 threads,
fresh prompts (a different 256-token window of one text each rep), 128 greedy tokens.
``--gguf FILE`` runs one file of your own instead (its blocks kept as stored): for instance
the 8B-shaped Q4_K_M file of quant_bench.py (Q4_K / Q6_K rows), with ``--prompt-tokens 64
--new-tokens 24``; ``--gguf-type Q3_K`` runs an 8B-shaped file of 8 layers whose every
matrix is that type (random blocks, written once by quant_bench.py).

* gradtape runs in a subprocess with ``GRADTAPE_ISA=<class>`` (every kernel built and chosen
  as on a CPU of that class); timed as in generate_bench.py (``ours_once``).
* llama.cpp is the llama-cpp-python build of ``make llama-cpp-avx2`` / ``make
  llama-cpp-native`` (``.venv/llama-cpp-<class>``: ``--llama-cpp`` names another folder),
  imported in a subprocess of its own; timed by its own counters (``peer_once``).  A class
  without its build gets our figures and a note.
* The sides alternate, ``--reps`` times each, on the same prompt ids; medians; ratios
  ``gradtape / llama.cpp``.  Each row names the CPU, the class, llama.cpp's CMake flags and
  what its ggml reports (``llama_print_system_info``).

    python bench/generate_isa.py [--workloads smollm2-generate-avx2] [--json] [--reps 3]
        [--prompt-tokens 256] [--new-tokens 128] [--gguf FILE | --gguf-type QTYPE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_bench as G  # noqa: E402  (its prompt text, sides and CPU report)

WORKLOADS = ("smollm2-generate-avx2", "smollm2-generate-native")
BLOCK_TYPE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                    "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                    "IQ3_S")
Q4KM_NAME = "smollm2-135m-instruct-q4_k_m-from-q4_1.gguf"
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15  # llama.h's enum llama_ftype


def cache_dir() -> Path:
    d = os.environ.get("GRADTAPE_CACHE")
    return (Path(d).expanduser() if d else Path.home() / ".cache" / "gradtape") / "bench"


def peer_dir(isa: str, given: str | None) -> Path:
    return Path(given) if given else Path(sys.prefix) / f"llama-cpp-{isa}"


# --- the workers: one process per side, answering one JSON line per request -------------

def _protocol_out():
    """A file on the original stdout for the protocol; fd 1 then goes to stderr, so that
    nothing a library prints reaches the driver as an answer."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def worker_ours(model_path: str, keep: bool):
    out = _protocol_out()
    os.environ.setdefault("GRADTAPE_THREADS", str(G.THREADS))
    from gradtape import llama
    from gradtape.backends.cpu import toolchain

    model = llama.load(model_path, keep_quantized=keep)
    out.write(json.dumps({"ready": True, "isa": toolchain.isa()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        prefill, decode, toks = G.ours_once(model, req["ids"], n=req["n"])
        out.write(json.dumps({"prefill": prefill, "decode": decode,
                              "tokens": [int(t) for t in toks]}) + "\n")


def _import_peer(folder: str):
    llama_cpp, why = G.load_llama_cpp()
    if llama_cpp is None:
        raise SystemExit(f"generate_isa: {why}")
    where = Path(llama_cpp.__file__).resolve()
    if Path(folder).resolve() not in where.parents:
        raise SystemExit(f"generate_isa: imported llama_cpp from {where}, not from {folder}")
    return llama_cpp


def worker_peer(model_path: str, folder: str, n_ctx: int):
    out = _protocol_out()
    llama_cpp = _import_peer(folder)
    llm = llama_cpp.Llama(model_path, n_threads=G.THREADS, n_threads_batch=G.THREADS,
                          n_ctx=n_ctx, logits_all=False, verbose=False)
    system = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    out.write(json.dumps({"ready": True, "version": llama_cpp.__version__,
                          "system_info": system}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        prefill, decode, _wall, n, text = G.peer_once(llama_cpp, llm, req["ids"], n=req["n"])
        out.write(json.dumps({"prefill": prefill, "decode": decode, "completion_tokens": n,
                              "text": text}) + "\n")


def worker_quantize(src: str, dst: str, folder: str):
    """``dst``: ``src`` requantized to Q4_K_M by llama.cpp's own quantizer."""
    _protocol_out()
    llama_cpp = _import_peer(folder)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    params.nthread = G.THREADS
    tmp = dst + ".part"
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
    if rc != 0:
        raise SystemExit(f"generate_isa: llama_model_quantize({src}) returned {rc}")
    os.replace(tmp, dst)


# --- the driver -------------------------------------------------------------------------

class Side:
    """A worker process: ``ask`` sends one request and returns its answer."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready = self._answer()

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise SystemExit(f"generate_isa: the {self.proc.args[3]} worker ended (exit {rc}); "
                             "its messages are above")
        return json.loads(line)

    def ask(self, ids, n):
        self.proc.stdin.write(json.dumps({"ids": list(map(int, ids)), "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def side_env(isa=None, peer=None):
    env = dict(os.environ)
    env.setdefault("GRADTAPE_THREADS", str(G.THREADS))
    if isa:
        env["GRADTAPE_ISA"] = isa
    if peer:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(peer), env.get("PYTHONPATH")]))
    return env


def q4km_file(src: Path, peers, log):
    """The cached Q4_K_M SmolLM2, made on first use with the first llama.cpp build found;
    (path, None) or (None, why)."""
    dst = cache_dir() / Q4KM_NAME
    if dst.is_file():
        return dst, None
    folder = next((p for p in peers if (p / ".built").is_file()), None)
    if folder is None:
        return None, "no llama.cpp build to quantize with (make llama-cpp-avx2)"
    dst.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {dst} (Q4_K_M from {src.name}, llama.cpp's quantizer in {folder})")
    rc = subprocess.call([sys.executable, __file__, "--worker", "quantize", "--model", str(src),
                          "--out", str(dst), "--llama-cpp", str(folder)],
                         env=side_env(peer=folder))
    return (dst, None) if rc == 0 and dst.is_file() else (None, f"quantizing failed ({rc})")


def prompts(tok, reps, length):
    """A different window of the text for each rep (one more for the warm-up)."""
    base = tok.encode(G.TEXT)
    stream = base * (2 + (length + 8 * (reps + 1)) // len(base))
    return [stream[8 * r: 8 * r + length] for r in range(reps + 1)]


def row_for(isa, path, quant, folder, reps, n_prompt, n_new, tok, log, keep=False):
    row = {"workload": f"{'gguf' if keep else 'smollm2'}-generate-{isa}", "model": path.name,
           "quant": quant, "isa": isa, "prompt_tokens": n_prompt, "new_tokens": n_new,
           "threads": G.THREADS}
    ours = Side(["--worker", "ours", "--model", str(path)] + (["--keep"] if keep else []),
                side_env(isa=isa))
    row["gradtape_isa"] = ours.ready["isa"]
    peer = None
    if (folder / ".built").is_file():
        n_ctx = max(1024, n_prompt + n_new)
        peer = Side(["--worker", "peer", "--model", str(path), "--llama-cpp", str(folder),
                     "--n-ctx", str(n_ctx)], side_env(peer=folder))
        flags = (folder / "flags.txt")
        row.update(peer="llama.cpp " + peer.ready["version"],
                   peer_system_info=peer.ready["system_info"],
                   peer_cmake_flags=flags.read_text().strip() if flags.is_file() else None)
    else:
        row["peer_note"] = (f"no llama.cpp build in {folder} (make llama-cpp-{isa})")
    ids = prompts(tok, reps, n_prompt)
    ours.ask(ids[0], 4)  # warm-up: build the kernels, map the blocks
    if peer:
        peer.ask(ids[0], 4)
    mine, theirs = [], []
    for r in range(reps):
        mine.append(ours.ask(ids[r + 1], n_new))
        if peer:
            theirs.append(peer.ask(ids[r + 1], n_new))
        log(f"{isa} {quant} rep {r + 1}/{reps}: ours prefill {mine[-1]['prefill']:.0f} "
            f"decode {mine[-1]['decode']:.1f} tok/s"
            + (f"; llama.cpp prefill {theirs[-1]['prefill']:.0f} decode "
               f"{theirs[-1]['decode']:.1f}" if theirs else ""))
    ours.close()
    med = statistics.median
    row.update(gradtape_prefill_tok_s=med(m["prefill"] for m in mine),
               gradtape_decode_tok_s=med(m["decode"] for m in mine))
    if peer:
        peer.close()
        row.update(peer_prefill_tok_s=med(p["prefill"] for p in theirs),
                   peer_decode_tok_s=med(p["decode"] for p in theirs),
                   peer_completion_tokens=theirs[0]["completion_tokens"])
        row["prefill_ratio"] = row["gradtape_prefill_tok_s"] / row["peer_prefill_tok_s"]
        row["decode_ratio"] = row["gradtape_decode_tok_s"] / row["peer_decode_tok_s"]
        # how long the two greedy continuations agree (information, not a check: llama.cpp
        # quantizes activations to 8 bits)
        peer_ids = tok.encode(theirs[0]["text"])
        row["equal_greedy_tokens"] = next(
            (j for j, (a, b) in enumerate(zip(mine[0]["tokens"], peer_ids)) if a != b),
            min(len(mine[0]["tokens"]), len(peer_ids)))
    return row


def bench(isa, args, log):
    from gradtape import llama
    from gradtape.backends.cpu import toolchain
    from gradtape.models import default_model_path

    if isa not in toolchain.isa_classes():
        raise SystemExit(f"generate_isa: this CPU cannot run the {isa} class "
                         f"(it runs {', '.join(toolchain.isa_classes())})")
    folder = peer_dir(isa, args.llama_cpp)
    if args.gguf_type:
        import quant_bench
        args.gguf = str(quant_bench.model_file(8, log, qtype=args.gguf_type))
    if args.gguf:
        path = Path(args.gguf).expanduser()
        if not path.is_file():
            raise SystemExit(f"generate_isa: --gguf {path}: no such file")
        tok = llama.load(str(path), keep_quantized=True).tokenizer
        return [row_for(isa, path, "as stored", folder, args.reps, args.prompt_tokens,
                        args.new_tokens, tok, log, keep=True)]
    src = default_model_path()
    tok = llama.load(str(src)).tokenizer
    others = [peer_dir(c, None) for c in ("avx2", "native")]
    q4km, why = q4km_file(src, [folder, *others], log)
    rows = [row_for(isa, src, "Q4_1", folder, args.reps, args.prompt_tokens, args.new_tokens,
                    tok, log)]
    if q4km is not None:
        rows.append(row_for(isa, q4km, "Q4_K_M (llama.cpp, requantized from Q4_1)", folder,
                            args.reps, args.prompt_tokens, args.new_tokens, tok, log))
    else:
        rows.append({"workload": f"smollm2-generate-{isa}", "quant": "Q4_K_M",
                     "isa": isa, "skipped": why})
    return rows


def show(row):
    if "skipped" in row:
        return f"{row['workload']} {row['quant']}: skipped ({row['skipped']})"
    text = (f"{row['workload']} {row['quant']} [{row['cpu']}; ISA {row['isa']}]: gradtape "
            f"prefill {row['gradtape_prefill_tok_s']:.0f} tok/s, decode "
            f"{row['gradtape_decode_tok_s']:.1f} tok/s")
    if "peer_prefill_tok_s" in row:
        text += (f"\n  {row['peer']} ({row['peer_system_info']}): prefill "
                 f"{row['peer_prefill_tok_s']:.0f} tok/s, decode "
                 f"{row['peer_decode_tok_s']:.1f} tok/s -> ratios prefill "
                 f"{row['prefill_ratio']:.2f}x, decode {row['decode_ratio']:.2f}x")
    else:
        text += f"\n  llama.cpp skipped: {row['peer_note']}"
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object per line")
    ap.add_argument("--reps", type=int, default=0, help="timed runs per side (default 3)")
    ap.add_argument("--workloads", default=WORKLOADS[0])
    ap.add_argument("--backend", default="cpu", help=argparse.SUPPRESS)  # (the C engine's own)
    ap.add_argument("--prompt-tokens", type=int, default=G.PROMPT_TOKENS,
                    help="prompt length (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=G.NEW_TOKENS,
                    help="greedy tokens after the prompt (default %(default)s)")
    ap.add_argument("--llama-cpp", default=None,
                    help="the llama.cpp build's folder (default: .venv/llama-cpp-<class>)")
    ap.add_argument("--gguf", default=None,
                    help="a GGUF file to run instead of SmolLM2's two (kept as stored)")
    ap.add_argument("--gguf-type", default=None, choices=BLOCK_TYPE_NAMES,
                    help="an 8B-shaped file of 8 layers, every matrix of this block type")
    ap.add_argument("--worker", choices=("ours", "peer", "quantize"), help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=1024, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "ours":
        return worker_ours(args.model, args.keep)
    if args.worker == "peer":
        return worker_peer(args.model, args.llama_cpp, args.n_ctx)
    if args.worker == "quantize":
        return worker_quantize(args.model, args.out, args.llama_cpp)
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.reps < 0:
        raise SystemExit("generate_isa: --prompt-tokens >= 1, --new-tokens >= 2, --reps >= 0")
    args.reps = args.reps or 3
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    info = G.cpu_info()
    info.pop("isa")  # each row says its own class
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise SystemExit(f"generate_isa: unknown workload {w!r} (have {WORKLOADS})")
        for row in bench(w.rsplit("-", 1)[1], args, log):
            row = {**row, **info}
            print(json.dumps(row) if args.json else show(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
