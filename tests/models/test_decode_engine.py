"""The one-call C decode step (``block_decoder``) against the float32 graph: logits per
token, greedy output, an unmerged adapter; the GGUF blocks are read as stored.

Greedy tokens of two decoders are compared where the graph's top-2 margin exceeds their
rounding (``support.greedy``): the C step's logits are the graph's within 2e-4 of the
largest on SmolLM2 (30 layers of float32 sums in another order), 1e-4 on the families'
two-layer models.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gradtape import plan
from gradtape.backends.cpu import measure as compute
from gradtape.errors import GradtapeError
from gradtape.infer import block_decoder as E
from gradtape.infer import prompt_choice as P
from gradtape.infer import runner as R
from gradtape.infer.inputs import lora_arrays
from gradtape.infer.kv_cache import KVCache, forward_cached
from gradtape.infer.prompt_step import PromptStep
from gradtape.llama import Llama
from gradtape.models.lora import model_targets, target_dims
from support import hardware
from support.greedy import assert_argmax_equal, assert_greedy_equal
from support.hardware import kernel_isa  # noqa: F401 (a fixture)
from support.lanes import sixteen_lanes  # noqa: F401 (a fixture)
from support.tinymodel import tiny_model
from support.compare import rel_err
from families import C_DECODE_FAMILIES

SMOLLM2_ROUNDING = 2e-4  # the C step against the graph on SmolLM2 (see the docstring)
FAMILY_ROUNDING = 1e-4  # and on the families' models

assert E.ggml_vec.available(), "the C kernels do not build: gradtape needs a C compiler (cc)"


def random_lora(cfg, rank=4, seed=0):
    """Random A and B on every linear the model adapts (Phi-3: its fused ones)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(cfg.n_layers):
        for t in model_targets(cfg):
            fin, fout = target_dims(cfg, t)
            out[(i, t)] = (rng.normal(0, 0.05, (fin, rank)).astype(np.float32),
                           rng.normal(0, 0.05, (rank, fout)).astype(np.float32))
    return out


_BLOCKS = {}


def blocks_of(model):
    """``E.block_weights`` once per model object (it maps the file and checks rows)."""
    if id(model) not in _BLOCKS:
        _BLOCKS[id(model)] = (model, E.block_weights(model))
    return _BLOCKS[id(model)][1]


def steps_vs_graph(model, prompt, tokens, lora=None, scale=1.0, cap=64):
    """Logits of each of ``tokens`` after ``prompt``: (C step, float32 graph)."""
    W = model.weights
    cache = KVCache.empty(model.config)
    forward_cached(model.config, W, prompt, cache, lora, scale)
    dec = E.BlockDecoder(model, blocks_of(model), lora, scale, cap=cap)
    dec.load(cache)
    ours = np.stack([dec.step(t).copy() for t in tokens])
    ref = forward_cached(model.config, W, tokens, cache, lora, scale)
    return ours, ref


def graph_logits(model, prompt, out, lora=None, scale=1.0):
    """The float32 graph's logits after ``prompt + out[:i]`` for every i, from one batched
    pass (teacher forcing): the reference for ``out``, a greedy continuation."""
    ids = list(prompt) + list(out[:-1])
    z = forward_cached(model.config, model.weights, ids, KVCache.empty(model.config),
                         lora, scale)
    return z[len(prompt) - 1:]


def forget_cached_rows(model):
    """The next ``generate`` prefills its prompt instead of keeping the decoder's rows."""
    if model._runner.block_dec:
        model._runner.block_dec[1].ids = []


def assert_graphs_greedy(model, prompt, out, lora=None, scale=1.0,
                         rounding=SMOLLM2_ROUNDING):
    """``out`` is the float32 graph's greedy continuation of ``prompt``, up to ties."""
    ref = graph_logits(model, prompt, out, lora, scale)
    assert_greedy_equal(ref, out, ref.argmax(1), rounding)


@pytest.mark.slow
def test_smollm2_blocks_are_the_mapped_file(smollm2):
    blocks = blocks_of(smollm2)
    qtype, data = blocks["layers.3.gate"]
    assert qtype == "Q4_1" and data.shape == (1536, 360) and not data.flags.owndata
    assert blocks["tok_embd"][0] == "Q8_0"
    import gguf
    for name in ("layers.3.gate", "layers.0.q", "layers.2.k", "tok_embd"):
        qtype, data = blocks[name]
        w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
        ours = smollm2.weights[name]
        # the very weights the graph uses (q / k rows in our half-split order)
        np.testing.assert_array_equal(w, ours if name == "tok_embd" else ours.T)


@pytest.mark.slow
def test_smollm2_step_logits_match_the_graph(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to")
    ours, ref = steps_vs_graph(smollm2, ids[:9], ids[9:])
    # float32 both ways, same weights; only the order of sums differs (30 layers)
    assert rel_err(ours, ref) < SMOLLM2_ROUNDING
    assert_argmax_equal(ref, ours, SMOLLM2_ROUNDING)


@pytest.mark.slow
def test_smollm2_unmerged_adapter(smollm2):
    lora = random_lora(smollm2.config, rank=8)
    ids = smollm2.tokenizer.encode("Adapters change the answer of a model")
    ours, ref = steps_vs_graph(smollm2, ids[:4], ids[4:], lora, scale=2.0)
    base, _ = steps_vs_graph(smollm2, ids[:4], ids[4:])
    assert rel_err(ours, ref) < 2e-4 and rel_err(base, ref) > 1e-2  # the adapter matters


@pytest.mark.slow
def test_greedy_generation_equals_the_graph(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode("A short poem about the sea:")
    a = smollm2.generate(prompt, 12, decoder="blocks", stop_ids=())
    assert_graphs_greedy(smollm2, prompt, a)
    # reused across calls (same adapter, enough room)
    dec = smollm2._runner.block_dec[1]
    assert smollm2.generate(prompt, 12, stop_ids=()) == a and smollm2._runner.block_dec[1] is dec


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("tied", [False, True])
def test_float_model_without_gguf(tied):
    """A model without a GGUF file decodes from float32 rows (type F32)."""
    m = tiny_model(seed=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=tied)
    model = Llama(m.config, m.weights, None, name="tiny")
    lora = random_lora(m.config, rank=2, seed=3)
    ours, ref = steps_vs_graph(model, [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], lora, 0.5)
    assert rel_err(ours, ref) < 1e-5
    assert E.block_weights(model)["layers.0.q"][0] == "F32"


@pytest.mark.parametrize("tied", [False, True])
def test_float_model_decodes_on_16_lanes(sixteen_lanes, tied):
    """The same through the C step's 16-lane (AVX-512) paths, emulated on any CPU."""
    test_float_model_without_gguf(tied)


GROUPS = [(2, 2), (4, 2), (6, 2), (8, 2), (10, 2), (14, 2), (8, 1)]  # 1 to 8 queries a key head


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("n_heads,n_kv_heads", GROUPS)
def test_query_groups_of_every_size(n_heads, n_kv_heads):
    """The C step and prefill attend a key head's query heads together, at most four a
    pass (groups of 5, 7 and 8 take two): every group size gives the graph's logits."""
    m = tiny_model(seed=2, dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   ffn_dim=64)
    model = Llama(m.config, m.weights, None, name="tiny")
    prompt, tokens = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8]
    ours, ref = steps_vs_graph(model, prompt, tokens)
    assert rel_err(ours, ref) < 1e-5
    dec = E.BlockDecoder(model, blocks_of(model), cap=32)
    assert rel_err(dec.prefill(prompt + tokens), ref[-1]) < 1e-5


@pytest.mark.parametrize("n_heads,n_kv_heads", [(6, 2), (14, 2)])
def test_query_groups_on_16_lanes(sixteen_lanes, n_heads, n_kv_heads):
    """The same through the 16-lane (AVX-512) attention, emulated on any CPU."""
    test_query_groups_of_every_size(n_heads, n_kv_heads)


# a half cache's logits against the float32 cache's: max |f16 - f32| / max |f32|, measured
# 2e-4 to 6e-4 on the tiny models below (a half keeps 11 bits: each row moves by up to 2.4e-4)
HALF_CACHE = 2e-3


@pytest.mark.usefixtures("kernel_isa")
def test_the_cache_rounds_to_halves_as_numpy():
    """The cache's conversion (AVX-512, F16C or plain C) rounds to nearest even as NumPy's
    cast: random bit patterns, ties, subnormals, overflow; then 7 values a call, which
    takes the plain C for every value.  A NaN stays a NaN."""
    rng = np.random.default_rng(0)
    lib = E.ggml_vec.lib()
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-25 + 2**-40, 65520.0, 65519.99]
    bits = rng.integers(0, 2**32, 40000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([np.array(ties + [0.0, -0.0, 1e-10, 6.1e-5, 1e9, np.inf, -np.inf],
                                 np.float32), bits,
                        rng.normal(0, 1e-5, 5000).astype(np.float32),
                        rng.normal(0, 3, 5000).astype(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):  # (the overflows are the point)
        ref = x.astype(np.float16)
    nan = np.isnan(x)
    for chunk in (len(x), 7):
        out = np.zeros(len(x), np.uint16)
        for a in range(0, len(x), chunk):
            lib.gd_halves(x[a:].ctypes.data, min(chunk, len(x) - a), out[a:].ctypes.data)
        np.testing.assert_array_equal(out[~nan], ref.view(np.uint16)[~nan])
        assert np.isnan(out[nan].view(np.float16)).all()


def test_the_cache_rounds_to_halves_on_16_lanes(sixteen_lanes):
    test_the_cache_rounds_to_halves_as_numpy()


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("n_heads,n_kv_heads", GROUPS)
def test_a_half_cache_holds_the_float32_rows_rounded(n_heads, n_kv_heads):
    """With ``kv="f16"`` the first layer caches the float32-cache decoder's keys and values
    rounded to halves, bit for bit (the prefill's rows and the steps'), and every group
    size attends over them widened: logits within HALF_CACHE of the float32 cache's."""
    m = tiny_model(seed=2, dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   ffn_dim=64)
    model = Llama(m.config, m.weights, None, name="tiny")
    decs = {kv: E.BlockDecoder(model, blocks_of(model), cap=64, dots="float", kv=kv)
            for kv in ("f32", "f16")}
    z = {kv: [d.prefill([3, 1, 4, 1, 5, 9, 2] * 3).copy()]
         + [d.step(t).copy() for t in (6, 5, 3, 5, 8)] for kv, d in decs.items()}
    assert decs["f16"].kc.dtype == np.float16 and decs["f32"].kc.dtype == np.float32
    for half, full in zip(decs["f16"].rows(0), decs["f32"].rows(0)):
        np.testing.assert_array_equal(half, full.astype(np.float16).astype(np.float32))
    errs = [rel_err(a, b) for a, b in zip(z["f16"], z["f32"])]
    assert 0 < max(errs) < HALF_CACHE, errs


@pytest.mark.parametrize("n_heads,n_kv_heads", [(6, 2), (14, 2)])
def test_a_half_cache_on_16_lanes(sixteen_lanes, n_heads, n_kv_heads):
    """The same through the 16-lane (AVX-512) attention, emulated on any CPU."""
    test_a_half_cache_holds_the_float32_rows_rounded(n_heads, n_kv_heads)


def test_the_cache_type_follows_the_dots_unless_asked():
    """q8 keeps a half cache (llama.cpp's default), float a float32 one; a decoder given
    ``kv`` keeps it whatever the dots; anything else is refused.  A half cache takes over
    a graph's cache (a prompt program's) and a float32 decoder's rows rounded."""
    m = tiny_model()
    model = Llama(m.config, m.weights, None)
    cache = KVCache.empty(m.config)
    forward_cached(m.config, m.weights, [3, 1, 4, 1, 5, 9], cache)
    full = E.BlockDecoder(model, blocks_of(model), cap=8, dots="float")
    full.load(cache)
    half, grown = (E.BlockDecoder(model, blocks_of(model), cap=c, kv="f16") for c in (8, 16))
    half.load(cache)
    grown.take(full)
    for dec in (half, grown):
        for a, b in zip(dec.rows(1), full.rows(1)):
            np.testing.assert_array_equal(a, b.astype(np.float16).astype(np.float32))
    dec = E.BlockDecoder(model, blocks_of(model), cap=8, dots="q8")
    assert (dec.kv, dec.kc.dtype, dec.m.kv16) == ("f16", np.float16, 1)
    dec.set_dots("float")
    assert (dec.kv, dec.vc.dtype, dec.m.kv16) == ("f32", np.float32, 0)
    assert dec.m.kc == dec.kc.ctypes.data and dec.m.vc == dec.vc.ctypes.data
    fixed = E.BlockDecoder(model, blocks_of(model), cap=8, dots="float", kv="f16")
    fixed.set_dots("q8")
    fixed.set_dots("float")
    assert fixed.kv == "f16" and fixed.m.kv16 == 1
    with pytest.raises(ValueError, match="kv='f8', not one of f32, f16"):
        E.BlockDecoder(model, blocks_of(model), cap=8, kv="f8")


@pytest.mark.parametrize("dots", ["float", "q8"])
def test_the_thread_count_does_not_change_a_float(dots):
    """Every output of the prefill and the steps is summed by one thread in one order,
    whichever the team: the prefill deals (row, key head) pairs round-robin and the steps
    split the query heads, here at a split (9 heads, 3 key heads) that cuts a key head's
    group in two."""
    m = tiny_model(seed=4, dim=16 * 9, n_heads=9, n_kv_heads=3, ffn_dim=64)
    model = Llama(m.config, m.weights, None, name="tiny")
    blocks = blocks_of(model)
    prompt, tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 2, [6, 2, 6]
    runs = []
    for nthreads in (1, 2, 3):
        dec = E.BlockDecoder(model, blocks, cap=64, nthreads=nthreads, dots=dots)
        runs.append([dec.prefill(prompt).copy()] + [dec.step(t).copy() for t in tokens])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_full_cache_is_refused():
    m = tiny_model()
    model = Llama(m.config, m.weights, None)
    dec = E.BlockDecoder(model, E.block_weights(model), cap=2)
    dec.step(1)
    dec.step(2)
    with pytest.raises(ValueError, match="the cache is full"):
        dec.step(3)


@pytest.mark.slow
@pytest.mark.parametrize("with_lora", [False, True])
def test_prefill_in_c_matches_the_graph(smollm2, with_lora):
    """A prompt of 70 rows (two C calls of 64 + 6 rows): the last row's logits and the
    cached keys / values equal the graph's up to float32 summation order."""
    lora = random_lora(smollm2.config, rank=4, seed=2) if with_lora else None
    ids = smollm2.tokenizer.encode("Prefill puts a whole prompt through the layers " * 9)[:70]
    dec = E.BlockDecoder(smollm2, blocks_of(smollm2), lora, 2.0, cap=80)
    z = dec.prefill(ids).copy()
    cache = KVCache.empty(smollm2.config)
    ref = forward_cached(smollm2.config, smollm2.weights, ids, cache, lora, 2.0)[-1]
    assert dec.length == 70 and rel_err(z, ref) < 2e-5
    for i in (0, 29):
        keys, values = dec.rows(i)
        assert rel_err(keys, cache.k[i]) < 2e-5 and rel_err(values, cache.v[i]) < 2e-5
    # decoding continues from the C-filled cache as from the graph's
    nxt = int(np.argmax(ref))
    assert rel_err(dec.step(nxt), forward_cached(smollm2.config, smollm2.weights, [nxt], cache,
                                               lora, 2.0)[-1]) < 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("with_lora", [False, True])
def test_a_prompt_as_one_bf16_program_matches_the_graph(smollm2, with_lora):
    """PromptStep in bf16, 70 rows padded to 128: the last row's logits and every
    layer's keys / values within bf16's rounding of the float32 graph's (about 1e-2 of
    the largest value after 30 layers; padding leaking into the real rows would be far
    off), and decoding continues from its cache."""
    hardware.onednn_bf16()
    cfg = smollm2.config
    lora = random_lora(cfg, rank=4, seed=2) if with_lora else None
    ids = smollm2.tokenizer.encode("Prefill puts a whole prompt through the layers " * 9)[:70]
    step = PromptStep(cfg, smollm2.weights, lora, 2.0, 128, "bf16")
    assert step.prog.executable.compute == "bf16"
    cache = KVCache.empty(cfg)
    z = step(ids, cache)
    ref_cache = KVCache.empty(cfg)
    ref = forward_cached(cfg, smollm2.weights, ids, ref_cache, lora, 2.0)[-1]
    assert cache.length == 70 and rel_err(z, ref) < 2e-2
    for i in range(cfg.n_layers):
        assert rel_err(cache.k[i], ref_cache.k[i]) < 6e-2
        assert rel_err(cache.v[i], ref_cache.v[i]) < 6e-2
    dec = E.BlockDecoder(smollm2, blocks_of(smollm2), lora, 2.0, cap=80)
    dec.load(cache)
    nxt = int(np.argmax(ref))
    assert rel_err(dec.step(nxt), forward_cached(cfg, smollm2.weights, [nxt], ref_cache,
                                                   lora, 2.0)[-1]) < 2e-2


@pytest.mark.slow
def test_generate_runs_short_prompts_as_before(smollm2):
    """A prompt below PROMPT_BF16_FLOPS of work under compute="auto" decodes as it does in
    float32; float64 stays float64; float32 runs one program from PROMPT_F32_ROWS rows."""
    ids = smollm2.tokenizer.encode("A long prompt goes through one program. " * 20)
    assert P.prompt_compute(smollm2.config, "auto", 12, np.float32) is None
    with pytest.raises(GradtapeError, match="compute must be one of float32, bf16, int8, auto"):
        smollm2.generate(ids[:3], 1, compute="fp8")
    a = smollm2.generate(ids[:12], 5, stop_ids=())
    smollm2._runner.block_dec[1].ids = []  # the same arithmetic again, not the cached rows
    assert a == smollm2.generate(ids[:12], 5, compute="float32", stop_ids=())
    with warnings.catch_warnings():  # once per process: "bf16 asked for, running float32"
        warnings.simplefilter("ignore")
        assert P.prompt_compute(smollm2.config, "bf16", 12, np.float64) is None  # float64 stays
    # float32 from PROMPT_F32_ROWS rows on: the program's tiled attention
    assert P.prompt_compute(smollm2.config, "float32", P.PROMPT_F32_ROWS, np.float32) == "float32"
    assert P.prompt_compute(smollm2.config, "float32", P.PROMPT_F32_ROWS - 1, np.float32) is None
    assert P.prompt_compute(smollm2.config, "float32", P.PROMPT_F32_ROWS, np.float64) is None


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False], ids=["bf16-fast", "bf16-slow"])
def test_generate_runs_long_prompts_as_one_bf16_program_where_bf16_is_fast(smollm2,
                                                                           monkeypatch, fast):
    """Both answers of the measurement (``compute.bf16_fast``, forced here: which one
    this CPU gives is not this test's business).  Where bf16 is fast: from
    PROMPT_BF16_FLOPS of work on under "auto", and for any prompt past the matrix-vector
    rows under "bf16", one compiled bf16 program, reused by prompts of similar length, by
    either decoder.  Where it is not: "auto" keeps float32, "bf16" says so and runs
    float32, with float32's tokens."""
    if fast:
        hardware.onednn_bf16()
    monkeypatch.setattr(compute, "bf16_fast", lambda shape=compute.DEFAULT_SHAPE:
                        (fast, "forced by the test"))
    monkeypatch.setattr(plan, "_WARNED", set())  # each notice afresh
    cfg = smollm2.config
    ids = smollm2.tokenizer.encode("A long prompt goes through one program. " * 20)
    rows = -(-int(P.PROMPT_BF16_FLOPS) // (2 * P.linear_weights(cfg)))
    assert P.prompt_compute(smollm2.config, "auto", rows - 1, np.float32) is None
    prompt = ids[:70]
    if not fast:
        f32 = "float32" if rows >= P.PROMPT_F32_ROWS else None
        assert P.prompt_compute(smollm2.config, "auto", rows, np.float32) == f32
        with pytest.warns(RuntimeWarning, match="bf16 compute asked for, running float32: "
                                                "forced by the test"):
            assert P.prompt_compute(smollm2.config, "bf16", 70, np.float32) is None
        forget_cached_rows(smollm2)
        a = smollm2.generate(prompt, 4, compute="bf16", stop_ids=())
        forget_cached_rows(smollm2)
        assert a == smollm2.generate(prompt, 4, compute="float32", stop_ids=())
        return
    assert P.prompt_compute(smollm2.config, "auto", rows, np.float32) == "bf16"
    assert P.prompt_compute(smollm2.config, "bf16", 12, np.float32) == "bf16"
    # the shapes decided at: auto's the prompt's rows (compute.measured_shape rounds
    # them), bf16's the model's width at 256 rows, whatever the prompt's length
    shapes = []
    with monkeypatch.context() as m:
        m.setattr(plan, "decide_compute", lambda c, a, shape: shapes.append(shape) or
                  plan.Decision("bf16", "recorded"))
        lengths = (rows, rows + 1, 2 * rows - 1)
        for n in lengths:
            P.prompt_compute(smollm2.config, "auto", n, np.float32)
        P.prompt_compute(smollm2.config, "bf16", 12, np.float32)
        P.prompt_compute(smollm2.config, "bf16", 600, np.float32)
    assert [m for m, *_ in shapes] == [*lengths, 256, 256]
    a = smollm2.generate(prompt, 4, compute="bf16", stop_ids=())
    step = smollm2._runner.prompt[3]
    assert step.rows == 128
    cache = KVCache.empty(cfg)
    z = step(prompt, cache)
    assert a[0] == int(np.argmax(z))  # the same program: the same logits
    # the two decoders from the bf16 program's cache: the graph's logits along ``a`` the
    # reference, the C step within SMOLLM2_ROUNDING of them
    ref = np.vstack([z[None], forward_cached(cfg, smollm2.weights, a[:-1], cache)])
    assert_greedy_equal(ref, a, smollm2.generate(prompt, 4, compute="bf16", stop_ids=(),
                                                 decoder="graph"), SMOLLM2_ROUNDING)
    # prompts that do not start with the cached rows (those would be kept instead)
    smollm2.generate(ids[1:101], 2, compute="bf16", stop_ids=())  # also 128 rows: reused
    assert smollm2._runner.prompt[3] is step
    smollm2.generate(ids[2:132], 2, compute="bf16", stop_ids=())  # 192 rows: replaced
    assert smollm2._runner.prompt[3] is not step and smollm2._runner.prompt[3].rows == 192
    # rows from the bf16 program are kept for bf16, not where float32 is asked for
    dec = smollm2._runner.block_dec[1]
    assert dec.kept(ids[2:140]) >= 130 and not dec.exact
    smollm2.generate(ids[2:140], 1, compute="float32", stop_ids=())
    assert dec.exact and smollm2._runner.prompt[3].rows == 192


@pytest.mark.slow
def test_a_prompt_program_that_does_not_fit_prefills_row_by_row(smollm2, monkeypatch):
    """A prompt program that would hold more than PROMPT_MEM_SHARE of the memory
    available, or cannot be allocated, is not kept: one warning, and the prompt is
    prefilled row by row, with the same tokens as a prompt too short for a program (the
    same arithmetic)."""
    cfg = smollm2.config
    ids = smollm2.tokenizer.encode("A prompt too large for the memory left. " * 6)[:40]

    def generate(decoder):
        if smollm2._runner.block_dec:
            smollm2._runner.block_dec[1].ids = []  # not the cached rows: a prefill
        return smollm2.generate(ids, 3, compute="float32", stop_ids=(), decoder=decoder)

    smollm2._runner.prompt = None
    row_by_row = {decoder: generate(decoder) for decoder in ("blocks", "graph")}
    assert smollm2._runner.prompt is None
    monkeypatch.setattr(plan, "PROMPT_F32_ROWS", 16)  # float32 programs from 16 rows
    generate("blocks")
    step = smollm2._runner.prompt[3]
    # at least its outputs: the keys and values of 48 padded rows in every layer
    kv = 2 * cfg.n_layers * step.rows * cfg.n_kv_heads * cfg.head_dim * 4
    assert step.rows == 48 and step.nbytes > kv
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(int(step.nbytes / R.PROMPT_MEM_SHARE)
                                                     - 1))
    for decoder, tokens in row_by_row.items():
        smollm2._runner.prompt = None
        with pytest.warns(RuntimeWarning, match="prefilling it row by row"):
            assert generate(decoder) == tokens
        assert smollm2._runner.prompt is None

    def too_large(*args):
        raise MemoryError  # an arena larger than the kernel lets one allocation have

    monkeypatch.setattr(R, "PromptStep", too_large)
    monkeypatch.delenv("GRADTAPE_MEM_AVAILABLE")
    with pytest.warns(RuntimeWarning, match="more than it can have"):
        assert generate("blocks") == row_by_row["blocks"]


@pytest.mark.slow
def test_a_prompt_that_starts_with_the_cached_rows_prefills_only_the_rest(smollm2,
                                                                          monkeypatch):
    """A chat's next prompt starts with the last one and its answer: only the rows past
    the cached ones are prefilled, and the logits are the graph's up to float32 order.
    Rows cached with another adapter, or with this one before it changed in place, are
    not kept."""
    from gradtape.models.lora import init_adapter
    tok, cfg = smollm2.tokenizer, smollm2.config
    p1 = tok.encode("A chat's history stays in the cache between turns. " * 3)
    out = smollm2.generate(p1, 6, compute="float32", stop_ids=())
    dec = smollm2._runner.block_dec[1]
    assert dec.ids[:dec.length] == list(p1) + out[:-1]  # the last token was never fed
    rows = []
    real = E.BlockDecoder.prefill
    monkeypatch.setattr(E.BlockDecoder, "prefill",
                        lambda self, ids: rows.append(len(ids)) or real(self, ids))
    p2 = list(p1) + out + tok.encode(" Then the user asks again.")
    smollm2.generate(p2, 1, compute="float32", stop_ids=())
    assert rows == [len(p2) - len(p1) - len(out) + 1]
    ref = forward_cached(cfg, smollm2.weights, p2, KVCache.empty(cfg))[-1]
    assert rel_err(dec.logits, ref) < 2e-4
    ad = init_adapter(cfg, rank=2, targets=("q", "down"), base_model=smollm2.name)
    for _, b in ad.weights.values():
        b[...] = np.random.default_rng(0).normal(0, 0.05, b.shape)
    p3 = p2 + tok.encode(" Once more.")
    rows.clear()
    smollm2.generate(p3, 1, adapter=ad, compute="float32", stop_ids=())
    smollm2.generate(p3 + [p3[-1]], 1, adapter=ad, compute="float32", stop_ids=())
    for _, b in ad.weights.values():
        b *= 2  # trained in place
    smollm2.generate(p3 + [p3[-1]] * 2, 1, adapter=ad, compute="float32", stop_ids=())
    assert rows == [len(p3), 1, len(p3) + 2]
    # room for more rows than the decoder has: a larger one takes over the cached rows
    p4 = p3 + [p3[-1]] * 3
    smollm2.generate(p4, dec.cap + 1 - len(p4), adapter=ad, compute="float32", stop_ids=())
    assert smollm2._runner.block_dec[1].cap > dec.cap and rows[-1] == 1


@pytest.mark.slow
def test_changed_weights_do_not_decode_from_the_file(smollm2):
    """A merged model keeps the base file as its source; its adapted linears must come
    from its own weights, not the file's blocks."""
    from gradtape.models.export import merged_model
    from gradtape.models.lora import init_adapter
    ad = init_adapter(smollm2.config, rank=2, targets=("q", "down"), base_model=smollm2.name)
    rng = np.random.default_rng(0)
    for key, (a, b) in ad.weights.items():
        b[...] = rng.normal(0, 0.05, b.shape)
    merged = merged_model(smollm2, ad)
    blocks = E.block_weights(merged)
    assert blocks["layers.4.q"][0] == "F32" and blocks["layers.4.down"][0] == "F32"
    assert blocks["layers.4.k"][0] == "Q4_1" and blocks["tok_embd"][0] == "Q8_0"
    ids = smollm2.tokenizer.encode("Merged weights are new weights")
    ours, ref = steps_vs_graph(merged, ids[:3], ids[3:])
    assert rel_err(ours, ref) < 2e-4


@pytest.mark.slow
def test_kept_block_matrices_decode_as_loaded(smollm2, smollm2_gguf):
    """A model loaded with its matrices kept quantized (BlockMatrix) decodes from those
    very blocks and generates what the float32 model generates."""
    from gradtape import llama
    kept = llama.load(str(smollm2_gguf), keep_quantized=True)
    blocks = E.block_weights(kept)
    assert blocks["layers.7.up"][1] is kept.weights["layers.7.up"].data
    np.testing.assert_array_equal(blocks["layers.7.q"][1], blocks_of(smollm2)["layers.7.q"][1])
    prompt = smollm2.tokenizer.encode("The three primary colours are")
    assert kept.generate(prompt, 8) == smollm2.generate(prompt, 8)


@pytest.mark.slow
def test_adapter_changes_between_calls_are_seen(smollm2):
    """The reused decoder takes the adapter afresh each call: new B values, or another
    adapter, change the output; no adapter gives the base output again."""
    from gradtape.models.lora import init_adapter
    prompt = smollm2.tokenizer.encode("Once upon a time")
    base = smollm2.generate(prompt, 6, stop_ids=())
    ad = init_adapter(smollm2.config, rank=4, targets=("q", "v", "down"),
                      base_model=smollm2.name)
    assert smollm2.generate(prompt, 6, adapter=ad, stop_ids=()) == base  # B = 0
    rng = np.random.default_rng(1)
    for key, (a, b) in ad.weights.items():
        b[...] = rng.normal(0, 0.3, b.shape)  # in place, as a training step does
    changed = smollm2.generate(prompt, 6, adapter=ad, stop_ids=())
    assert changed != base
    lora, scale = lora_arrays(ad, smollm2.config, np.float32)
    assert_graphs_greedy(smollm2, prompt, changed, lora, scale)
    assert smollm2.generate(prompt, 6, stop_ids=()) == base


# --- every family the C step runs, on its small random transformers model -----------------

@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family -> (its HF folder with ``C_DECODE_KW``, the GGUF llama.cpp's converter makes
    of it, or of its variant without the options a GGUF cannot say (``GGUF_VARIANTS``)),
    all made on first use."""
    from families import (C_DECODE_KW, FAMILIES, GGUF_VARIANTS,
                          converter_dir, make_folder, model_job, run_converters)
    root = tmp_path_factory.mktemp("c_decode")
    folders = {f: make_folder(f, root / f, kw_override=C_DECODE_KW) for f in C_DECODE_FAMILIES}
    assert converter_dir() is not None, (
        "llama.cpp's convert_hf_to_gguf.py not found (make test extracts it into "
        ".venv/llama.cpp-convert; or set GRADTAPE_LLAMA_CPP_CONVERT)")
    src = {f: make_folder(f, root / f"{f}-variant",
                          kw_override={**C_DECODE_KW, **GGUF_VARIANTS[f]})
           if f in GGUF_VARIANTS else folders[f] for f in C_DECODE_FAMILIES}
    run_converters([model_job(src[f], root / f"{f}.gguf", FAMILIES[f][2])
                    for f in C_DECODE_FAMILIES], root)
    return {f: (folders[f], root / f"{f}.gguf") for f in C_DECODE_FAMILIES}


def _family_prompt(model, n=14):
    """``n`` ids of the harness text: longer than Mistral's window (5), so the windowed
    layers drop keys in the C prefill and in the steps after it."""
    from families import TEXT
    ids = model.tokenizer.encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def _c_vs_graph(model, prompt, tokens, lora=None, scale=1.0):
    """(C logits, graph logits) ``[1 + len(tokens), V]``: the C prefill of ``prompt`` (its
    last row), then a C step per token, against the graph over the same rows."""
    dec = E.BlockDecoder(model, E.block_weights(model), lora, scale, cap=64)
    ours = [dec.prefill(prompt).copy()] + [dec.step(t).copy() for t in tokens]
    cache = KVCache.empty(model.config)
    ref = [forward_cached(model.config, model.weights, prompt, cache, lora, scale)[-1]]
    ref += list(forward_cached(model.config, model.weights, tokens, cache, lora, scale))
    return np.stack(ours), np.stack(ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", C_DECODE_FAMILIES)
def test_family_decodes_through_the_c_step(family, family_models):
    """Biases (Qwen2), q/k norms (Qwen3, Gemma 3), windows (Mistral, Phi-3, Gemma), fused
    qkv and gate_up split by rows (Phi-3), llama3 rope factors, NoPE layers (SmolLM3),
    Gemma's (1 + w) norms, post-norms, GeGLU, embedding scale, soft-caps, query scale and
    per-layer rope bases with linear scaling (Gemma 3):
    the C prefill and steps give the graph's logits up to float32 summation order, and
    greedy generation through C picks the graph's tokens and transformers' (its full
    forward's argmax over the generated sequence), wherever the graph's top-2 margin is
    over their rounding (FAMILY_ROUNDING; transformers' float32 forward is within 1e-5,
    tests/models/test_families.py)."""
    import torch
    from gradtape import llama
    folder, _ = family_models[family]
    model = llama.load(str(folder))
    assert E.supported(model), family
    prompt = _family_prompt(model)
    ours, ref = _c_vs_graph(model, prompt, _family_prompt(model, 20)[6:])
    err = rel_err(ours, ref)
    print(f"FAMILY {family} c-step-vs-graph {err:.2e}")
    assert err < FAMILY_ROUNDING
    new = model.generate(prompt, 12, decoder="blocks", stop_ids=())
    ref = graph_logits(model, prompt, new)
    assert_greedy_equal(ref, new, model.generate(prompt, 12, decoder="graph", stop_ids=()),
                        FAMILY_ROUNDING)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        z = hf(torch.tensor([prompt + new[:-1]])).logits[0]
    assert_greedy_equal(ref, new, z[len(prompt) - 1:].argmax(-1).tolist(), FAMILY_ROUNDING)


@pytest.mark.slow
@pytest.mark.parametrize("family", C_DECODE_FAMILIES)
def test_family_prompt_as_one_program_is_the_graph(family, family_models):
    """PromptStep (compiled, float32 here: any CPU) on each family's options, 14 rows
    padded to 16, past Mistral's window of 5: its logits and every layer's keys and
    values are the eager graph's up to float32 summation order, and the C step decodes
    on from its cache as from the graph's."""
    from gradtape import llama
    folder, _ = family_models[family]
    model = llama.load(str(folder))
    cfg, prompt = model.config, _family_prompt(model)
    step = PromptStep(cfg, model.weights, None, 1.0, 16, "float32")
    cache, ref_cache = KVCache.empty(cfg), KVCache.empty(cfg)
    z = step(prompt, cache)
    ref = forward_cached(cfg, model.weights, prompt, ref_cache)[-1]
    assert cache.length == len(prompt) and rel_err(z, ref) < 1e-4
    for i in range(cfg.n_layers):
        assert rel_err(cache.k[i], ref_cache.k[i]) < 1e-4
        assert rel_err(cache.v[i], ref_cache.v[i]) < 1e-4
    dec = E.BlockDecoder(model, E.block_weights(model), cap=32)
    dec.load(cache)
    nxt = int(np.argmax(ref))
    assert rel_err(dec.step(nxt), forward_cached(cfg, model.weights, [nxt], ref_cache)[-1]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", C_DECODE_FAMILIES)
def test_family_gguf_decodes_from_the_file(family, family_models):
    """The GGUF llama.cpp's converter makes: the C step reads its blocks (q / k rows
    un-permuted only where the converter permuted them) and gives the graph's logits."""
    from gradtape import llama
    _, gguf = family_models[family]
    model = llama.load(str(gguf))
    assert E.supported(model), family
    blocks = E.block_weights(model)
    # from the mapped file (a float copy would own its data)
    assert not blocks["layers.1.v"][1].flags.owndata
    if family in ("qwen2", "qwen3", "gemma2", "gemma3"):  # q / k rows as stored, not copied
        assert not blocks["layers.1.q"][1].flags.owndata
    prompt = _family_prompt(model)
    ours, ref = _c_vs_graph(model, prompt, _family_prompt(model, 20)[6:])
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_phi3_fused_adapter_decodes_through_the_c_step(source, family_models):
    """An adapter on Phi-3's fused qkv / gate_up (and o, down): the C step adapts the
    q / k / v and gate / up parts with one A and B split by columns, at the adapter's
    scale, and gives the graph's logits; generation through C picks the graph's tokens."""
    from gradtape import llama
    from gradtape.models.lora import init_adapter
    path = family_models["phi3"][source == "gguf"]
    model = llama.load(str(path))
    lora = random_lora(model.config, rank=4, seed=5)
    assert {t for _, t in lora} == {"qkv", "o", "gate_up", "down"}
    prompt, tokens = _family_prompt(model), _family_prompt(model, 20)[6:]
    ours, ref = _c_vs_graph(model, prompt, tokens, lora, 2.0)
    base, _ = _c_vs_graph(model, prompt, tokens)
    assert rel_err(ours, ref) < FAMILY_ROUNDING and rel_err(base, ref) > 1e-2  # it matters
    ad = init_adapter(model.config, rank=4, alpha=12.0, targets=("qkv", "gate_up"), seed=1)
    rng = np.random.default_rng(2)
    for a, b in ad.weights.values():
        b[...] = rng.normal(0, 0.3, b.shape)
    new = model.generate(prompt, 10, adapter=ad, decoder="blocks", stop_ids=())
    lora, scale = lora_arrays(ad, model.config, np.float32)
    assert_greedy_equal(graph_logits(model, prompt, new, lora, scale), new,
                        model.generate(prompt, 10, adapter=ad, decoder="graph", stop_ids=()),
                        FAMILY_ROUNDING)


def test_rows_the_c_step_lacks_keep_the_graph():
    """head_dim 12 (not a multiple of the kernels' 16): "auto" decodes through the graph,
    "blocks" is one error."""
    from gradtape.errors import GradtapeError
    m = tiny_model(dim=48, n_heads=4)
    model = Llama(m.config, m.weights, None)
    assert model.config.head_dim == 12 and not E.supported(model)
    out = model.generate([3, 1, 4], 5, stop_ids=())
    assert out == model.generate([3, 1, 4], 5, decoder="graph", stop_ids=())
    with pytest.raises(GradtapeError, match="decoder 'blocks' needs"):
        model.generate([3, 1, 4], 5, decoder="blocks", stop_ids=())
