"""DoRA's pieces that need no PEFT (PEFT itself: ``test_dora.py``): the rank-r column norm
against the dense one, a base kept in ggml blocks against its dequantized twin, the cpu
backend against NumPy, the adapter files (DoRA and rsLoRA round trips, bad files),
``merge`` folding DoRA in, and ``export-gguf-lora`` refusing it.

Tolerances: float64 1e-12 where only the summation order differs (the expanded norm
against the dense one, qmatmul against matmul, C against NumPy); float32 1e-5 for logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops
from gradtape.blocks import random_blocks
from gradtape.cli import main
from gradtape.errors import FileFormatError, GradtapeError
from gradtape.models import dora, export
from gradtape.models.lora import load_adapter
from support.adapters import random_dora_adapter
from support.compare import rel_err
from support.tinymodel import lora_loss_outputs, tiny_model, write_hf_folder


def test_rank_r_norm_equals_the_dense_norm():
    r = np.random.default_rng(0)
    w0, a, b = r.standard_normal((12, 7)), r.standard_normal((12, 3)), r.standard_normal((3, 7))
    dense = np.linalg.norm(w0 + 0.7 * a @ b, axis=0)
    assert rel_err(dora.column_norms(w0, a, b, 0.7), dense) <= 1e-12
    tp = gt.Tape()
    n = nn.dora_norm(tp, tp.const(w0), tp.param(a), tp.param(b),
                     tp.const(dora.column_norms_sq(w0)), 0.7)
    assert not n.requires_grad  # detached, as PEFT's
    assert rel_err(n.value, dense) <= 1e-12


def test_block_weight_norm_and_layer_equal_the_dequantized_weight():
    """A weight kept in its blocks (``[out, in]``): ``||w0_j||^2`` read row by row, the
    cross term through ``qmatmul``; values and gradients equal the dense layer's."""
    r = np.random.default_rng(1)
    bm = random_blocks("Q8_0", 600, 64, r, std=0.5)  # [out, in]: more rows than a chunk
    w = bm.dequantize().astype(np.float64).T  # [in, out]
    assert rel_err(dora.column_norms_sq(bm), (w * w).sum(0)) <= 1e-12
    x, a = r.standard_normal((5, 64)), r.standard_normal((64, 3))
    b, m = 0.1 * r.standard_normal((3, 600)), 1 + r.uniform(size=600)
    assert rel_err(dora.column_norms(bm, a, b, 2.0), dora.column_norms(w, a, b, 2.0)) <= 1e-12
    outs = []
    for w0 in (bm, w):
        tp = gt.Tape()
        leaves = [tp.param(v) for v in (x, a, b, m)]
        y = nn.dora_linear(tp, leaves[0], tp.const(w0), *leaves[1:],
                           tp.const(dora.column_norms_sq(w0)), 2.0)
        loss = ops.reduce_sum(ops.mul(y, y))
        g = tp.backward(loss)
        outs.append([y.value] + [g[v].value for v in leaves])
    for got, ref in zip(*outs):
        assert rel_err(got, ref) <= 1e-12


def _block_twins(seed=0):
    """A tiny model whose linears are Q8_0 blocks, and its dequantized float twin."""
    m = tiny_model(seed, dim=64, ffn_dim=64)
    r = np.random.default_rng(seed + 5)
    blocks, dense = dict(m.weights), dict(m.weights)
    for name, w in m.weights.items():
        if name.startswith("layers.") and w.ndim == 2:
            bm = random_blocks("Q8_0", w.shape[1], w.shape[0], r, std=0.2)
            blocks[name], dense[name] = bm, np.ascontiguousarray(bm.dequantize().T)
    return m.config, blocks, dense


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_quantized_base_dora_step_equals_the_dense_one(backend):
    cfg, blocks, dense = _block_twins()
    ad = random_dora_adapter(cfg, dense, rank=2)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 9)
    runs = []
    for weights in (blocks, dense):
        tp = gt.Tape(np.float64, eager=False)
        outs, _ = lora_loss_outputs(tp, cfg, weights, ad, ids)
        runs.append(tp.compile(outs, backend=backend).run())
    assert len(runs[0]) == 1 + 3 * len(ad.weights)
    assert max(rel_err(g, r) for g, r in zip(*runs)) <= 1e-10


def test_dora_step_on_the_cpu_backend_equals_numpy():
    m = tiny_model()
    ad = random_dora_adapter(m.config, m.weights, rank=3, rslora=True)
    ids = np.random.default_rng(3).integers(0, m.config.vocab_size, 11)
    tp = gt.Tape(np.float64, eager=False)
    outs, _ = lora_loss_outputs(tp, m.config, m.weights, ad, ids)
    ref = tp.compile(outs, backend="numpy").run()
    got = tp.compile(outs, backend="cpu").run()
    assert max(rel_err(g, r) for g, r in zip(got, ref)) <= 1e-12


def test_dora_and_rslora_files_round_trip(tmp_path):
    m = tiny_model()
    ad = random_dora_adapter(m.config, m.weights, rank=2, alpha=3.0, rslora=True)
    ad.save(tmp_path / "a")
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert conf["use_dora"] is True and conf["use_rslora"] is True
    back = load_adapter(tmp_path / "a")
    assert back.dora and back.scale == pytest.approx(3.0 / np.sqrt(2))
    assert set(back.magnitudes) == set(ad.magnitudes)
    for k, v in ad.magnitudes.items():
        assert np.array_equal(back.magnitudes[k], v)


def _edit_adapter(folder, conf=None, drop=None):
    from safetensors.numpy import load_file, save_file
    path = folder / "adapter_model.safetensors"
    if drop:
        t = load_file(str(path))
        del t[next(k for k in sorted(t) if k.endswith(drop))]
        save_file(t, str(path))
    if conf:
        c = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**c, **conf}))


@pytest.mark.parametrize("conf, drop, match", [
    ({"use_dora": False}, None, "is a DoRA magnitude, but adapter_config.json does not say"),
    (None, "lora_magnitude_vector", "lacks lora_magnitude_vector"),
])
def test_bad_dora_files_are_one_clear_error(tmp_path, conf, drop, match):
    m = tiny_model()
    random_dora_adapter(m.config, m.weights, rank=2).save(tmp_path / "a")
    _edit_adapter(tmp_path / "a", conf, drop)
    with pytest.raises(FileFormatError, match=match):
        load_adapter(tmp_path / "a")


def test_generation_with_dora_equals_the_merged_model():
    """``logits`` with a DoRA adapter (the column factor fixed) equal the merged model's:
    ``merge`` folds ``m / ||w0 + s A B||`` into each column."""
    m = tiny_model()
    ad = random_dora_adapter(m.config, m.weights, rank=2, b_scale=0.3)
    from types import SimpleNamespace

    from gradtape.infer.runner import Runner
    ids = list(np.random.default_rng(4).integers(0, 256, 10))
    ours = Runner(m).logits(ids, adapter=ad)
    merged = Runner(SimpleNamespace(**{**vars(m), "weights": export.merge(m.weights, ad)}))
    merged = merged.logits(ids)
    assert rel_err(ours, Runner(m).logits(ids)) > 1e-3
    assert rel_err(ours, merged) <= 1e-5


def test_merge_cli_folds_dora_and_export_gguf_lora_refuses_it(tmp_path, capsys):
    m = tiny_model()
    write_hf_folder(m, tmp_path / "base")
    ad = random_dora_adapter(m.config, m.weights, rank=2, b_scale=0.3)
    ad.save(tmp_path / "adapter")
    assert main(["merge", "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    from gradtape import llama
    base = llama.load(tmp_path / "base")
    ids = list(range(5, 17))
    want = base.logits(ids, adapter=load_adapter(tmp_path / "adapter", base))
    assert rel_err(llama.load(tmp_path / "merged").logits(ids), want) <= 1e-5
    assert main(["merge", "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), "--out", str(tmp_path / "merged.gguf")]) == 0
    assert rel_err(llama.load(tmp_path / "merged.gguf").logits(ids), want) <= 1e-5
    capsys.readouterr()
    assert main(["export-gguf-lora", "--adapter", str(tmp_path / "adapter"), "--model",
                 str(tmp_path / "base"), "--out", str(tmp_path / "x.gguf")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DoRA" in err[0] and "gradtape merge" in err[0], err
    with pytest.raises(GradtapeError, match="gradtape merge"):
        export.save_gguf_lora(ad, m.config, tmp_path / "y.gguf")


def test_greedy_generation_with_dora_follows_its_logits():
    """``generate`` with a DoRA adapter (the graph decoder: the C engine applies LoRA
    only) picks the tokens its teacher-forced logits pick, as the merged model does."""
    from types import SimpleNamespace

    from gradtape.infer.runner import Runner
    from gradtape.infer.loop import Stopping
    from gradtape.infer.sampling import Sampling
    from support.greedy import assert_greedy_equal

    m = tiny_model(dim=64, ffn_dim=64, head_scale=16.0)
    ad = random_dora_adapter(m.config, m.weights, rank=2, b_scale=0.3)
    prompt = [5, 9, 200, 31, 77]
    never = Stopping(ids=())  # the tiny model has no stop tokens
    a = Runner(m).generate(prompt, 6, Sampling(), adapter=ad, stopping=never)
    merged = SimpleNamespace(**{**vars(m), "weights": export.merge(m.weights, ad)})
    b = Runner(merged).generate(prompt, 6, Sampling(), stopping=never)
    ref = Runner(m).logits(prompt + a[:-1], adapter=ad)[len(prompt) - 1:]
    assert_greedy_equal(ref, a, b, rounding=1e-5)


def c_engine_vs_graph(model, ad, prompt, tokens):
    """A DoRA adapter through the C decode engine (prefill, then a step per token) and
    through the float32 graph: ``(C rows, graph rows)``, the prompt's last and each
    token's logits."""
    from gradtape.infer import block_decoder as E
    from gradtape.infer.inputs import lora_arrays
    from gradtape.infer.kv_cache import KVCache, forward_cached

    lora, scale = lora_arrays(ad, model.config, np.float32, model.weights)
    assert all(len(v) == 3 for v in lora.values())  # DoRA: (A, B, column factor)
    dec = E.BlockDecoder(model, E.block_weights(model), lora, scale, cap=32)
    ours = [dec.prefill(prompt).copy()] + [dec.step(t).copy() for t in tokens]
    cache = KVCache.empty(model.config)
    ref = [forward_cached(model.config, model.weights, prompt, cache, lora, scale)[-1]]
    ref += list(forward_cached(model.config, model.weights, tokens, cache, lora, scale))
    return np.stack(ours), np.stack(ref)


def test_the_c_decode_engine_runs_dora():
    """The C step and prefill scale each DoRA row by its factor, the residual linears
    (o, down) through a scratch row: the graph's logits up to float32 summation order."""
    from gradtape.llama import Llama

    m = tiny_model(seed=1, dim=64, ffn_dim=96)
    model = Llama(m.config, m.weights, None, name="tiny")
    ad = random_dora_adapter(m.config, m.weights, rank=2, b_scale=0.3)
    ours, ref = c_engine_vs_graph(model, ad, [3, 1, 4, 1, 5], [9, 2, 6, 5])
    assert rel_err(ours, ref) < 1e-5
    other, _ = c_engine_vs_graph(model, random_dora_adapter(m.config, m.weights, rank=2,
                                                            b_scale=0.0), [3, 1, 4, 1, 5],
                                 [9, 2, 6, 5])
    assert rel_err(other, ref) > 1e-3  # the adapter matters
