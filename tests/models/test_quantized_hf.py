"""A Hugging Face folder's bf16 / f16 matrices kept 2 bytes per value
(``load(..., keep_quantized=True)``): memory-mapped ``BlockMatrix`` views in torch's
``[out, in]`` that dequantize to exactly the float32-loaded weights, logits equal to the
folder loaded to float32 up to float32 rounding, and a LoRA step on the cpu backend."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix
from gradtape.models.lora import init_adapter
from gradtape.train.step import TrainStep

from support.compare import rel_err
from support.tinymodel import tiny_model, write_hf_folder


def _to_half(folder, kind):
    """Rewrite model.safetensors with every 2-d tensor as BF16 or F16 (norms F32)."""
    from gradtape.formats.safetensors_reader import read_safetensors
    path = folder / "model.safetensors"
    tensors, _ = read_safetensors(path)
    header, chunks, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        if a.ndim == 2:
            raw = (a.astype(np.float16).tobytes() if kind == "F16" else
                   (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes())
            dt = kind
        else:
            raw, dt = a.astype(np.float32).tobytes(), "F32"
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(chunks))


@pytest.mark.parametrize("kind", ["BF16", "F16"])
def test_hf_half_weights_stay_two_bytes(tmp_path, kind):
    folder = write_hf_folder(tiny_model(seed=8), tmp_path / "m")
    _to_half(folder, kind)
    q = llama.load(folder, keep_quantized=True)
    f = llama.load(folder)
    w = q.weights["layers.1.gate"]
    assert isinstance(w, BlockMatrix) and w.qtype == kind
    assert w.shape == (q.config.ffn_dim, q.config.dim) and w.data.dtype == np.uint8
    assert w.nbytes == 2 * q.config.ffn_dim * q.config.dim
    assert isinstance(q.weights["lm_head"], BlockMatrix)
    assert q.weights["norm"].dtype == np.float32
    np.testing.assert_array_equal(w.dequantize().T, f.weights["layers.1.gate"])
    ids = [5, 17, 200, 3, 99, 1]
    # the weights are the same values, but the kept ones go through the block GEMMs (C
    # tiles, then BLAS on each tile) where the float32 ones take one BLAS call: the sums
    # run in another order, so equal only up to float32 rounding (6e-7 measured on an AMX
    # Xeon; bitwise on some CPUs, which is luck of the blocking, not a promise)
    assert rel_err(q.logits(ids), f.logits(ids)) <= 1e-5
    # one LoRA step on the cpu backend: the same loss as the float32-loaded folder
    ad = init_adapter(q.config, 2, 4.0, seed=0)
    ids2 = np.arange(24).reshape(2, 12) % 250
    tg = np.roll(ids2, -1, 1)
    tg[:, -1] = -100
    la, _ = TrainStep(q, ad, 2, 12, backend="cpu", compute="float32").step([(ids2, tg)], 1, 1e-3)
    lb, _ = TrainStep(f, ad, 2, 12, backend="cpu", compute="float32").step([(ids2, tg)], 1, 1e-3)
    assert abs(la - lb) <= 1e-5 * abs(lb)
