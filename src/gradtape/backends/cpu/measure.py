"""The precision of the big frozen-weight GEMMs (``--compute``), and what this CPU offers.

``float32`` keeps every GEMM in float32.  ``bf16`` asks for the frozen-weight matmuls (``x @
W0``, ``dY @ W0^T``, the LM head and its transpose) to take bf16 inputs and accumulate in
float32; LoRA A/B, their gradients, norms, softmax, the loss and AdamW stay float32 either
way.  The GEMMs run in oneDNN (``onednn.py``; the ``onednn-cpu-gomp`` wheel, a
dependency on Linux x86-64).  ``auto``, the default, picks bf16 only where it is faster:
where the CPU has AMX or AVX512-BF16, both precisions are timed at the model's own GEMM
shape, once per CPU model and library versions (the result is cached in
``~/.cache/gradtape/compute-decisions.json``): whether bf16 wins depends on the CPU
(``docs/benchmarks.md``).  Asking for bf16 where it is not fast, or without oneDNN, says
so once (a RuntimeWarning) and runs float32.

``int8`` is bf16, except that the GEMMs against weights kept in their ggml blocks (a
quantized GGUF) take int8 inputs: each activation row and each weight row (forward) or
column (backward) rounded to 255 levels of its own scale, the products summed exactly in
int32 (W8A8, ``qgemm_int8.lower_int8``).  Faster than bf16 where the CPU has int8 dot
products (AVX512-VNNI, AMX-INT8; timed like bf16), at the price of each product's
quantization error (``bench/bf16_cosine.py --int8`` measures what it does to the
gradients: short of bf16's exactness, so ``auto`` never picks it).  Asked for where it
is not faster, it says so once and runs bf16.

More decisions of the kind, timed the same way: ``fastest``, whether the tiles of
a bf16 or int8 block-weight product go into oneDNN's blocked weight layout or plain rows,
and how large they are; ``packed_weights``, whether a dense weight is packed into it once;
``f32_onednn``, whether a float32 step's GEMMs run in oneDNN (one thread pool with our
kernels) or NumPy's BLAS; ``narrow_way``, whether a float32 product with a narrow side
(LoRA's rank-r ones) runs in oneDNN or our own loops (``narrow.py``); ``bf16_provider``, whether MKL's bf16 GEMM (``mkl.py``, where
installed) is timed beside oneDNN's.  This module runs nothing but those measurements.
``cpu_summary()`` is what ``gradtape bench`` prints beside its figures.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from ... import settings
from . import blas, mkl, narrow, onednn, split, toolchain
from .blas import one_blas_thread, park_blas_threads
from .toolchain import cpu_info  # this module's name for it: tests replace it here

# the GEMM shape measured when the caller names none: SmolLM2's FFN at T=256
DEFAULT_SHAPE = (256, 576, 1536)
MEASURED_ROWS = 512  # rows past this run at about the same rate: not worth the seconds


def measured_shape(shape):
    """The GEMM shape ``(m, k, n)`` a rate is measured at: the rows rounded up to a power
    of two, at most MEASURED_ROWS, so that a model's row counts (a prompt's, a batch's)
    take a few timings, not one each (and a handful of rows, whose timings are noise,
    is not timed alone)."""
    m = min(1 << max(int(shape[0]) - 1, 0).bit_length(), MEASURED_ROWS)
    return (m, *(int(d) for d in shape[1:]))


_WARNED = set()


def cpu_summary() -> dict:
    """The CPU model, the flags that decide the GEMM paths and the instruction-set class
    the kernels run at (``$GRADTAPE_ISA``)."""
    info = cpu_info()
    wanted = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
    return {"cpu": info["model"], "flags": [f for f in wanted if f in info["flags"]],
            "isa": toolchain.isa()}


def bf16_fast(shape=DEFAULT_SHAPE) -> tuple:
    """``(True, why)`` where bf16 GEMMs (oneDNN) beat float32 on this CPU at ``shape``
    (``(m, k, n)``: the model's rows, width and FFN width), else ``(False, why)``.  No
    AMX and no AVX512-BF16: no, without measuring.  Otherwise both are measured at that
    shape once per CPU model and library versions (``rates``; CPUs that split 512-bit
    instructions can run bf16 slower than float32)."""
    flags = cpu_info()["flags"]
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False, "this CPU has no bf16 matrix instructions: no AMX, no AVX512-BF16" + _cap()
    ok, why = onednn.available()
    if not ok:
        return False, why
    shape = measured_shape(shape)
    (f32, bf16), cached = rates("bf16", shape, measured_rates)
    said = (f"bf16 {bf16 / 1e9:.0f} vs float32 {f32 / 1e9:.0f} GFLOP/s at "
            f"{'x'.join(map(str, shape))}, measured{' before' if cached else ''} on this CPU")
    if bf16 > 1.1 * f32:
        return True, f"{onednn.describe(shape)}: {said}"
    return False, f"bf16 GEMMs are not faster here ({said})"


def int8_fast(shape=DEFAULT_SHAPE) -> tuple:
    """``(True, why)`` where int8 GEMMs (oneDNN) beat bf16 ones on this CPU at
    ``shape``, else ``(False, why)``; call it where ``bf16_fast`` said yes.  No int8 dot
    products (AVX512-VNNI, AMX-INT8): no, without measuring."""
    dots, why = int8_dots()
    if not dots:
        return False, why
    shape = measured_shape(shape)
    (bf16, int8), cached = rates("int8", shape, measured_int8_rates)
    said = (f"int8 {int8 / 1e9:.0f} vs bf16 {bf16 / 1e9:.0f} GFLOP/s at "
            f"{'x'.join(map(str, shape))}, measured{' before' if cached else ''} on this CPU")
    if int8 > 1.1 * bf16:
        return True, said
    return False, f"int8 GEMMs are not faster here ({said})"


def int8_dots() -> tuple:
    """``(True, "")`` where this CPU (under the cap) has int8 dot products (AVX512-VNNI,
    AMX-INT8), else ``(False, why)``: without them oneDNN's int8 GEMM adds pairs of u8 x
    s8 products in saturating int16 (``vpmaddubsw``), which int8 compute's activations,
    spread over all 255 levels, overflow."""
    flags = cpu_info()["flags"]
    if "avx512_vnni" in flags or "amx_int8" in flags:
        return True, ""
    return False, "this CPU has no int8 dot products: no AMX-INT8, no AVX512-VNNI" + _cap()


def _cap():
    """Under a cap, the words that say so after what the CPU lacks (the cap may hide
    it); else nothing."""
    cap = toolchain.isa()
    return "" if cap == "native" else f" (capped at {cap} by $GRADTAPE_ISA)"


def _cache_file():
    """The file of the measured decisions: ``$GRADTAPE_DECISIONS``, else
    ``compute-decisions.json`` in the cache folder."""
    chosen = settings.get("GRADTAPE_DECISIONS")
    return Path(chosen) if chosen else toolchain.cache_dir() / "compute-decisions.json"


_TABLES = {}  # cache file -> ((mtime, size), its table): parsed again only when changed


def _read_table(path):
    """The decisions in cache file ``path`` ({} where there is none yet, or it does not
    parse: measured and written anew).  A big model's first step looks up hundreds of
    them: the file is parsed again only when it changed."""
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        if path in _TABLES and _TABLES[path][0] == stamp:
            return _TABLES[path][1]
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    table = table if isinstance(table, dict) else {}
    _TABLES[path] = (stamp, table)
    return table


# the way the timings are made, in every cache key: a decision timed before a fix to the
# timing is timed again (2: OpenBLAS's spinning workers parked before OpenMP work is
# timed, each pair of rates timed twice in turn)
TIMING = 2


def rates(kind, shape, measure, n=2, kernels=False):
    """``((rate, ...), cached)``: the ``n`` figures ``measure(*shape)`` gives on this CPU,
    read from the cache file (keyed by ``kind``, CPU model, flags, the instruction-set
    class in force (``$GRADTAPE_ISA``: a capped run never reuses another class's
    timings), NumPy's BLAS, oneDNN's version, ``TIMING``, the shape and, where
    ``kernels`` (the measure times our C kernels: a faster dequantization can change
    which tiles win), their version), else measured (about a second) and written there
    atomically.  The libraries' own GEMM rates are
    not timed again when only our kernels change: each new timing is another chance
    for a noisy host to decide wrong.  A timing taken while other processes used the
    cores (``BUSY_CORES``) serves this process only: the next one times it again."""
    key = "|".join([kind, cpu_info()["model"], " ".join(sorted(cpu_info()["flags"])),
                    f"isa {toolchain.isa()}",
                    _blas_name(), onednn.library().version, f"timing {TIMING}",
                    *([f"kernels {toolchain.csrc_version()}"] if kernels else []),
                    "x".join(map(str, shape))])
    path = _cache_file()
    hit = _BUSY_TIMINGS.get((path, key)) or _read_table(path).get(key)
    if isinstance(hit, list) and len(hit) == n:
        return tuple(float(r) for r in hit), True
    before, start = others_core_seconds(), time.perf_counter()
    got = tuple(float(r) for r in measure(*shape))
    after = others_core_seconds()
    busy = (None if before is None or after is None
            else (after - before) / max(time.perf_counter() - start, 0.2))  # 10 ms ticks
    table = dict(_read_table(path))  # as it is now: another process may have added to it
    if busy is not None and busy > BUSY_CORES:
        # timed while other processes took the cores: this run uses it, the next times it
        # again (a busy spell's timing, cached, would decide every later run)
        _BUSY_TIMINGS[path, key] = list(got)
        table[key] = {"rates": list(got), "cores used by other processes": round(busy, 2)}
    else:
        table[key] = list(got)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: measured again next time
        pass
    return got, False


# a timing during which other processes used more than this many cores on average is
# marked in the cache file as taken under load, and timed again by the next run
BUSY_CORES = 0.25
_BUSY_TIMINGS = {}  # (file, key) -> rates timed under load, for the rest of this process


def others_core_seconds():
    """The CPU seconds (summed over cores) that every other process on the machine has
    used since boot: ``/proc/stat``'s busy time less this process's own (and its
    finished children's); None where
    there is no ``/proc/stat`` (then every timing is taken as quiet)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        busy = sum(ticks[:8]) - sum(ticks[3:5])  # user .. steal, less idle and iowait
        own = os.times()
        mine = own.user + own.system + own.children_user + own.children_system
        return busy / os.sysconf("SC_CLK_TCK") - mine
    except (OSError, ValueError, IndexError):
        return None


def _blas_name():
    """NumPy's BLAS library, version and kernels (its speed is half of the decision; an
    OpenBLAS loaded before the instruction-set cap runs the CPU's own kernels)."""
    core = blas.core()
    core = f" ({core})" if core else ""
    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{info.get('name')} {info.get('version')}{core}"
    except Exception:  # older NumPy: no dict form
        return "numpy " + np.__version__ + core


def call_seconds(fn, reps):
    """The seconds each of ``reps`` calls of ``fn`` took, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def seconds_in_turn(fns, rounds=3):
    """The seconds a call of each of ``fns`` takes, the calls made in turn, one of each a
    round, after a warm-up call of each: a slow (or fast) spell of the machine falls on
    all of them alike.  Each figure is the median, over the rounds, of the call's time
    relative to its round's mean, times the mean of those means.  So a spell covering a
    round cancels out, and no single call caught in a burst, slower or faster, decides
    between two paths a few percent apart (the best call of each could: one plain call
    caught in a fast spell beat a blocked layout that was faster on every other)."""
    for fn in fns:
        fn()
    times = [[0.0] * rounds for _ in fns]
    for r in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i][r] = time.perf_counter() - t
    means = [sum(t[r] for t in times) / len(fns) for r in range(rounds)]
    scale = sum(means) / rounds
    return [statistics.median(t[r] / means[r] for r in range(rounds)) * scale
            for t in times]


def _operands(m, k, n, reps):
    """Random float32 ``a [m, k]``, ``w [k, n]``, ``out [m, n]`` for a timed GEMM, and
    ``best(fn)``: its FLOP/s, the best of ``reps`` calls (the best resists other
    processes' noise); at most 3 for a GEMM of over 10 GFLOP (an 8B model's FFN), so
    that it takes seconds."""
    if 2 * m * k * n > 1e10:
        reps = min(reps, 3)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)

    def best(fn):
        return 2 * m * k * n / min(call_seconds(fn, reps))
    return a, w, np.empty((m, n), np.float32), best


def _best_in_turn(timings, rounds=2):
    """The largest of ``rounds`` figures of each of ``timings`` (callables returning a
    rate, each the best of its own calls), taken in turn: a slow spell of a shared host
    that spans one's calls would have to span its next ones too, while the others ran
    at full speed, to decide between them."""
    got = [[timing() for timing in timings] for _ in range(rounds)]
    return tuple(max(figures) for figures in zip(*got))


def _replay_rate(best, gemm):
    """A timing for ``_best_in_turn``: ``best(gemm)`` with NumPy's BLAS on one thread and
    its idle workers parked, as in a bf16 replay (``blas.one_blas_thread``)."""

    def rate():
        with one_blas_thread():
            return best(gemm)
    return rate


def measured_rates(m=256, k=576, n=1536, reps=7):
    """(float32 NumPy matmul, bf16 oneDNN matmul) FLOP/s at ``x [m, k] @ W [k, n]``, in
    turn (``_best_in_turn``); bf16 with NumPy's BLAS on one thread, its idle workers
    parked, as in a bf16 replay (``blas.one_blas_thread``)."""
    a, w, out, best = _operands(m, k, n, reps)
    gemm16 = onednn.dnnl().bind(out, onednn.to_bf16(a), onednn.to_bf16(w), False)
    return _best_in_turn([lambda: best(lambda: np.matmul(a, w, out=out)),
                          _replay_rate(best, gemm16)])


def measured_int8_rates(m=256, k=576, n=1536, reps=7):
    """(bf16, int8) oneDNN matmul OP/s at ``x [m, k] @ W [k, n]`` (int8: int32 sums), in
    turn (``_best_in_turn``)."""
    a, w, out, best = _operands(m, k, n, reps)
    dnnl = onednn.dnnl()
    gemm16 = dnnl.bind(out, onednn.to_bf16(a), onednn.to_bf16(w), False)
    a8, w8 = np.ones((m, k), np.int8), np.ones((k, n), np.int8)
    sums = out.view(np.int32)
    gemm8 = dnnl.bind_ptrs(onednn.Gemm(m, k, n, s8=True), a8.ctypes.data, w8.ctypes.data,
                           sums.ctypes.data)
    return _best_in_turn([_replay_rate(best, gemm16), _replay_rate(best, gemm8)])


def bf16_provider(shape) -> tuple:
    """``("mkl", why)`` where MKL's bf16 GEMM (``mkl.py``: installed, on an AMX CPU, no
    ``$GRADTAPE_ISA`` cap) runs the plain bf16 GEMMs of the model's FFN at ``shape``
    (``(m, k, n)``: forward ``x @ W^T`` and backward ``dy @ W`` of a W stored ``[n, k]``)
    faster than oneDNN: then each block product times MKL's plain ways beside oneDNN's
    ways (``qgemm_bf16.lower_bf16``); else ``("onednn", why)``, and MKL costs no first-step
    timings.  Timed once per CPU model and library versions, like ``bf16_fast``."""
    ok, why = mkl.available()
    if not ok:
        return "onednn", ""
    shape = measured_shape(shape)
    (dnnl, blas), cached = rates(f"bf16 provider {mkl.mkl().version}", shape,
                                 measured_provider_rates)
    said = (f"MKL {blas / 1e9:.0f} vs oneDNN {dnnl / 1e9:.0f} GFLOP/s at "
            f"{'x'.join(map(str, shape))} forward and backward, measured"
            f"{' before' if cached else ''} on this CPU")
    if blas > 1.05 * dnnl:
        return "mkl", f"MKL's plain GEMMs timed beside oneDNN's ways ({said})"
    return "onednn", f"oneDNN's ways alone ({said})"


def measured_provider_rates(m=256, k=576, n=1536, reps=7):
    """(oneDNN, MKL) bf16 FLOP/s of the two plain GEMMs of a W stored ``[n, k]``, the
    forward ``[m, k] @ W^T`` and the backward ``[m, n] @ W``, in turn
    (``_best_in_turn``), NumPy's BLAS on one thread as in a bf16 replay."""
    rng = np.random.default_rng(0)
    x = onednn.to_bf16(rng.standard_normal((m, max(k, n)), dtype=np.float32))
    w = onednn.to_bf16(rng.standard_normal((n, k), dtype=np.float32))
    out = np.empty((m, max(k, n)), np.float32)
    reps = min(reps, 3) if 2 * m * k * n > 1e10 else reps
    flops = 4 * m * k * n

    def timing(lib):
        fwd = lib.bind_ptrs(onednn.Gemm(m, k, n, True), x.ctypes.data, w.ctypes.data,
                            out.ctypes.data)
        bwd = lib.bind_ptrs(onednn.Gemm(m, n, k), x.ctypes.data, w.ctypes.data,
                            out.ctypes.data)

        def both():
            fwd()
            bwd()
        return _replay_rate(lambda fn: flops / min(call_seconds(fn, reps)), both)
    return _best_in_turn([timing(onednn.dnnl()), timing(mkl.mkl())])


# What one thread pool saves a float32 step: with the GEMMs in NumPy's BLAS, the C
# kernels' OpenMP threads meet OpenBLAS's still spinning ones and take several times as
# long; with the GEMMs in oneDNN they share one pool (docs/benchmarks.md)
F32_POOL_GAIN = 1.25


def f32_onednn(shape) -> tuple:
    """``(True, why)`` where a float32 step's GEMMs should run in oneDNN (on OpenMP's
    threads, as our kernels and oneDNN's bf16 GEMMs do), ``(False, why)`` where in
    NumPy's BLAS.  Both are timed alone at ``shape`` (``(m, k, n)``, rows capped as in
    ``bf16_fast``) once per CPU model and library versions; oneDNN runs them unless
    NumPy's BLAS is more than ``F32_POOL_GAIN`` times faster alone, for what one thread
    pool saves in a step."""
    try:
        onednn.library()
    except onednn.DnnlError as e:
        return False, str(e)
    shape = measured_shape(shape)
    (dnnl, blas), cached = rates("f32", shape, measured_f32_rates)
    said = (f"oneDNN {dnnl / 1e9:.0f} vs NumPy's BLAS {blas / 1e9:.0f} GFLOP/s at "
            f"{'x'.join(map(str, shape))} alone, measured{' before' if cached else ''} on "
            f"this CPU")
    if F32_POOL_GAIN * dnnl >= blas:
        return True, f"float32 GEMMs in oneDNN, one thread pool ({said})"
    return False, f"float32 GEMMs in NumPy's BLAS ({said})"


def measured_f32_rates(m=256, k=576, n=1536, reps=7):
    """(oneDNN, NumPy's BLAS) float32 FLOP/s at ``x [m, k] @ W [k, n]``, in turn
    (``_best_in_turn``); oneDNN with OpenBLAS's idle threads (up to ~0.1 s of spinning
    after a call) parked, so that none spins on a core it uses."""
    a, w, out, best = _operands(m, k, n, reps)
    gemm = onednn.library().bind_f32(out, a, w)

    def dnnl():
        park_blas_threads()
        return 0.0 if gemm is None else best(gemm)
    return _best_in_turn([dnnl, lambda: best(lambda: np.matmul(a, w, out=out))])


def fastest(what, shape, runs, only=((), "")) -> str:
    """The name of the fastest of ``runs`` (name -> a callable running one way of the
    GEMM ``what`` of ``shape``), all timed in turn once per CPU model and library versions,
    the result cached like ``rates`` (timed on a model's first step only).  The ways of a
    block-weight product: its tiles in oneDNN's blocked weight layout or in plain rows,
    of ``qgemm_bf16.bf16_tile_sizes()`` values; the names say which ("blocked 16M";
    "swapped": a forward product as ``y^T = W x^T``; "fused": one call dequantizing and
    multiplying with our own GEMM; "amx", "amx-rows": the same on AMX tiles; "direct": a
    BF16 W read in place, see ``qgemm_bf16``).  ``only``: the execution plan's
    ``(product_ways, product_tile)``, the ways and tile size it leaves (none named: all);
    one way left is taken untimed."""
    names = list(runs)
    ways, tile = only
    for want, var in ((ways[0] if ways else "", "GRADTAPE_BF16_LAYOUT"),
                      (tile, "GRADTAPE_BF16_TILE")):
        kept = [n for n in names if want in n.split()]
        # (only a forward block product has a swapped way, only a backward one amx-rows:
        # the others are timed, unsaid)
        forward = what.startswith("qmatmul ")
        if want and not kept and (want, forward) not in (("swapped", False), ("amx-rows", True)):
            warn_once(f"${var}={want} names none of the ways of {what} ({', '.join(names)}): "
                      "timing them")
        names = kept or names
    if len(names) == 1:
        return names[0]

    def measure(*_):
        with one_blas_thread():  # as in a bf16 replay
            return seconds_in_turn([runs[n] for n in names])
    seconds, _ = rates(f"bf16-tiles {what} [{', '.join(names)}]", shape, measure, len(names),
                       kernels=True)
    return names[seconds.index(min(seconds))]


NARROW_REPS = 20


def _repeated(fn):
    def run():
        for _ in range(NARROW_REPS):
            fn()
    return run


def narrow_way(a, b) -> str:
    """How the float32 product ``a @ b`` with a narrow side (``narrow.form``) runs
    fastest on this CPU: "onednn" (oneDNN's GEMM), "narrow" (``csrc/narrow_gemm.c``'s
    loops on the OpenMP threads) or "narrow 1 thread" (the same on the calling thread:
    no parallel region for a few microseconds' work); timed once per shape and
    transposition on random operands of ``a``'s and ``b``'s layouts (``fastest``), and
    kept for the process (a step binds hundreds of such products, of a dozen shapes)."""
    lay = "".join("T" if not x.flags.c_contiguous and x.T.flags.c_contiguous else "N"
                  for x in (a, b))
    key = (toolchain.isa(), lay, a.shape, b.shape)
    if key not in _F32_WAYS:
        _F32_WAYS[key] = _time_narrow(lay, a.shape, b.shape)
    return _F32_WAYS[key]


_F32_WAYS = {}  # (class, [way,] layouts, shapes) -> narrow_way or split_way, for this process


def split_way(a, b) -> str:
    """How the float32 product ``a @ b`` of a float32 replay whose GEMMs run in oneDNN
    runs fastest on this CPU: "onednn" or "split" (NumPy's BLAS split over the OpenMP
    threads, ``split.py``); timed once per shape and transposition on random operands of
    ``a``'s and ``b``'s layouts (``fastest``, NumPy's BLAS on one thread as in the
    replay), kept for the process."""
    lay = "".join("T" if not x.flags.c_contiguous and x.T.flags.c_contiguous else "N"
                  for x in (a, b))
    key = (toolchain.isa(), "split", lay, a.shape, b.shape)
    if key not in _F32_WAYS:
        rng = np.random.default_rng(0)
        a_, b_ = (_like(x.shape, t, rng) for x, t in zip((a, b), lay))
        out = np.empty((a.shape[0], b.shape[1]), np.float32)
        runs = {"onednn": onednn.library().bind_f32(out, a_, b_),
                "split": split.bind(out, a_, b_)}
        runs = {k: v for k, v in runs.items() if v is not None}
        _F32_WAYS[key] = (fastest(f"f32 split {lay}", (*a.shape, b.shape[1]), runs)
                             if len(runs) == 2 else next(iter(runs), "onednn"))
    return _F32_WAYS[key]


def _like(shape, t, rng):
    """Random float32 values of ``shape`` in a layout: C order ("N"), or a transposed
    view ("T")."""
    if t == "N":
        return rng.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape[::-1], dtype=np.float32).T


def _time_narrow(lay, sa, sb):
    rng = np.random.default_rng(0)

    def like(shape, t):  # random values in a layout: C order, or a transposed view
        if t == "N":
            return rng.standard_normal(shape, dtype=np.float32)
        return rng.standard_normal(shape[::-1], dtype=np.float32).T
    a, b = like(sa, lay[0]), like(sb, lay[1])
    out = np.empty((sa[0], sb[1]), np.float32)
    runs = {"onednn": onednn.library().bind_f32(out, a, b),
            "narrow": narrow.bind(out, a, b),
            "narrow 1 thread": narrow.bind(out, a, b, threaded=False)}
    # each timed call runs the product NARROW_REPS times: one call of a few microseconds
    # is mostly the timer's and the machine's noise
    runs = {k: _repeated(v) for k, v in runs.items() if v is not None}
    if len(runs) < 2:
        return next(iter(runs), "onednn")
    return fastest(f"f32 narrow {lay}", (sa[0], sa[1], sb[1]), runs)


def blocked_faster(what, shape, blocked, plain, only=((), "")) -> bool:
    """Whether the bf16 or int8 GEMM ``blocked()``, its weights in a blocked layout of
    oneDNN's kernel (the tiles of an int8 block-weight product quantized into it, or a
    weight packed once: ``packed_weights``), beats ``plain()``, the same GEMM reading
    plain rows (``fastest`` of the two)."""
    return fastest(what, shape, {"blocked": blocked, "plain": plain}, only) == "blocked"


def packed_weights(m, k, n, tb, only=((), "")) -> bool:
    """Whether the bf16 GEMM ``[m, k] @ W [k, n]`` (W stored ``[n, k]`` where ``tb``) of
    a dense weight should read W packed once into the layout oneDNN's kernel keeps
    (``onednn.pack``) rather than in place, reordered by each call (``blocked_faster``
    on random operands of that shape): which wins depends on the CPU's kernels."""
    d = onednn.dnnl()
    if not d.packs(m, k, n, tb):  # the kernel reads W in place: nothing to pack
        return False
    made = {}

    def operands():
        """(a, w, out, pack) addresses, made on the first timed call only: a decision
        read from the cache costs no random operands (seconds for a big model's
        weights)"""
        if not made:
            rng = np.random.default_rng(0)
            a = onednn.to_bf16(rng.standard_normal((m, k), dtype=np.float32))
            w = onednn.to_bf16(rng.standard_normal((n, k) if tb else (k, n),
                                                   dtype=np.float32))
            out = np.empty((m, n), np.float32)
            pack, _ = d.pack(m, k, n, tb, w)
            made.update(keep=(a, w, out, pack), ptrs=(a.ctypes.data, w.ctypes.data,
                                                      out.ctypes.data, pack.ctypes.data))
        return made["ptrs"]

    def packed():
        a, _, out, pack = operands()
        d.gemm(onednn.Gemm(m, k, n, tb, packed=True), a, pack, out)

    def plain():
        d.gemm(onednn.Gemm(m, k, n, tb), *operands()[:3])
    try:
        return blocked_faster(f"pack {'W^T' if tb else 'W'}", (m, k, n), packed, plain, only)
    except onednn.DnnlError:  # no reorder into that layout: the plain copy
        return False


def warn_once(said):
    """A RuntimeWarning, once per process for each text."""
    if said not in _WARNED:
        _WARNED.add(said)
        warnings.warn(f"gradtape: {said}", RuntimeWarning, stacklevel=4)
