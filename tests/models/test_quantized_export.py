"""Merge and export on a base kept in its stored type: each tensor is dequantized (and
merged) on its own while writing, to float32 or float16, and the result equals merging
into the float32-loaded base."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix
from gradtape.models import export
from gradtape.models.lora import init_adapter

from support.filebuilders import write_tiny_gguf
from support.tinymodel import tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("qexp")
    path = write_tiny_gguf(tiny_model(seed=5, dim=64, ffn_dim=128, vocab=258),
                           root / "tiny-q8.gguf", qtype="Q8_0")
    ad = init_adapter(llama.load(path).config, 4, 8.0, seed=2)
    r = np.random.default_rng(0)
    for a, b in ad.weights.values():
        b[...] = r.standard_normal(b.shape).astype(np.float32) * 0.05
    ad.save(root / "adapter")
    return root, path


@pytest.mark.parametrize("fmt,dtype", [("hf", "float32"), ("gguf", "float16")])
def test_merge_cli_on_a_quantized_base(base, tmp_path, fmt, dtype):
    root, path = base
    out = tmp_path / ("merged.gguf" if fmt == "gguf" else "merged")
    res = subprocess.run([sys.executable, "-m", "gradtape.cli", "merge", "--model", str(path),
                          "--adapter", str(root / "adapter"), "--out", str(out), "--dtype",
                          dtype], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"the base's Q8_0 weights are written dequantized to {dtype}" in res.stdout
    got = llama.load(out)
    # the reference: the float32-loaded base merged in memory (the same float64 sum,
    # rounded to float32, then to the file's dtype)
    ref = export.merge(llama.load(path).weights, llama.load_adapter(root / "adapter"))
    for name, w in ref.items():
        want = w.astype(np.float16).astype(np.float32) if dtype == "float16" and w.ndim == 2 \
            else w
        np.testing.assert_array_equal(got.weights[name], want, err_msg=name)


def test_merge_and_writers_accept_block_weights(base, tmp_path):
    root, path = base
    q = llama.load(path, keep_quantized=True)
    f = llama.load(path)
    assert isinstance(q.weights["layers.1.down"], BlockMatrix)
    ad = llama.load_adapter(root / "adapter")
    mq, mf = export.merge(q.weights, ad), export.merge(f.weights, ad)
    for name in mf:
        np.testing.assert_array_equal(export.dense(mq, name), mf[name], err_msg=name)
    # an unmerged quantized base written as float32 equals the float32 base
    folder = export.save_hf_folder(q, tmp_path / "hf")
    back = llama.load(folder)
    for name, w in f.weights.items():
        np.testing.assert_array_equal(back.weights[name], w, err_msg=name)
