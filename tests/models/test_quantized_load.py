"""Loading with matrices kept in their stored type, on bad input: a ggml type we do not
run is one error naming the tensor and the type (never a silent float32 expansion), and
block data is size-checked against the file before anything is mapped."""

from __future__ import annotations

import numpy as np
import pytest

from gradtape import llama
from gradtape.blocks import BlockMatrix
from gradtape.errors import FileFormatError

from support.filebuilders import write_tiny_gguf
from support.tinymodel import tiny_model


def test_a_type_we_do_not_run_is_named(tmp_path):
    m = tiny_model(seed=1, dim=256, ffn_dim=256, vocab=258)
    write_tiny_gguf(m, tmp_path / "tq.gguf", qtype="TQ2_0")
    with pytest.raises(FileFormatError, match=r"tq.gguf: tensor \S+ has ggml type TQ2_0, "
                                              r"which gradtape cannot keep quantized"):
        llama.load(tmp_path / "tq.gguf", keep_quantized=True)
    # dequantized to float32 on request, as before
    assert not isinstance(llama.load(tmp_path / "tq.gguf").weights["layers.0.q"], BlockMatrix)


def test_truncated_blocks_are_refused_before_mapping(tmp_path):
    path = write_tiny_gguf(tiny_model(seed=2, dim=64, ffn_dim=128, vocab=258),
                           tmp_path / "q8.gguf", qtype="Q8_0")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 100])
    with pytest.raises(FileFormatError, match=r"cut.gguf: tensor \S+ \(Q8_0 .* runs past the "
                                              r"end of the file"):
        llama.load(tmp_path / "cut.gguf", keep_quantized=True)
    q = llama.load(path, keep_quantized=True)  # the intact file
    mats = [w for w in q.weights.values() if isinstance(w, BlockMatrix)]
    assert len(mats) == 2 * 7 + 2  # 2 layers x 7 linears, the embedding, the untied head
    assert all(w.qtype == "Q8_0" for w in mats)
    assert all(isinstance(w, np.ndarray) and w.ndim == 1 for w in q.weights.values()
               if not isinstance(w, BlockMatrix))
