"""Frozen weights in their stored type on the tape: the ggml type table, ``BlockMatrix``,
``Tape.const_blocks`` and the block primitives' shape rules, NumPy forwards (the
reference: ``gguf.quants.dequantize``, then the matmul, bit for bit), gradients and
errors.  Finite differences w.r.t. x are in test_primitives_fd.py; the cpu kernels in
tests/backends/test_qgemm.py."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import nn, ops
from gradtape.blocks import BLOCK_TYPES, BlockMatrix, ggml_type, random_blocks, row_bytes


def test_type_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    for name, t in BLOCK_TYPES.items():
        q = GGMLQuantizationType[name]
        assert int(q) == t.id
        assert GGML_QUANT_SIZES[q] == (t.block, t.nbytes), name
    assert ggml_type(19).name == "IQ1_S"  # a type we do not run still has a layout
    assert ggml_type(9999) is None


def test_block_matrix_checks_its_bytes():
    ok = np.zeros((3, row_bytes("Q4_0", 64)), np.uint8)
    BlockMatrix("Q4_0", (3, 64), ok)
    with pytest.raises(ValueError, match="not one we run"):
        BlockMatrix("IQ1_S", (3, 256), np.zeros((3, 50), np.uint8))
    with pytest.raises(ValueError, match=r"data must be uint8 \[3, 36\]"):
        BlockMatrix("Q4_0", (3, 64), ok[:, :30])
    with pytest.raises(ValueError, match="whole number of 32-element blocks"):
        BlockMatrix("Q4_0", (3, 48), ok)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_numpy_forwards_are_dequantize_then_matmul(qtype, dtype):
    r = np.random.default_rng(sorted(BLOCK_TYPES).index(qtype))
    bm = random_blocks(qtype, 6, 512, r)
    deq = bm.dequantize()
    from gguf import GGMLQuantizationType, quants
    np.testing.assert_array_equal(
        deq, quants.dequantize(bm.data, GGMLQuantizationType[qtype]).astype(np.float32))
    tp = gt.Tape(dtype)
    w = tp.const(bm)
    assert w.dtype == np.uint8 and w.shape == bm.data.shape and w.value is bm.data
    x = tp.const(r.standard_normal((4, 512)))
    g = tp.const(r.standard_normal((4, 6)))
    ids = tp.const(np.array([5, 0, 5]))
    y, z, e = ops.qmatmul(x, w), ops.qmatmul_t(g, w), ops.qtake_rows(w, ids)
    assert (y.shape, z.shape, e.shape) == ((4, 6), (4, 512), (3, 512))
    d = deq.astype(dtype)
    np.testing.assert_array_equal(y.value, x.value @ d.T)
    np.testing.assert_array_equal(z.value, g.value @ d)
    np.testing.assert_array_equal(e.value, d[[5, 0, 5]])
    # replay is the same forward
    out = tp.compile([y, z, e]).run()
    for a, b in zip(out, (y, z, e)):
        np.testing.assert_array_equal(a, b.value)


def test_gradients_flow_to_x_never_to_w():
    r = np.random.default_rng(0)
    bm = random_blocks("Q8_0", 5, 64, r)
    tp = gt.Tape()
    x = tp.param(r.standard_normal((3, 64)))
    w = tp.const(bm)
    emb = tp.param(r.standard_normal((2, 64)))
    h = ops.add(ops.qtake_rows(w, tp.const(np.array([1, 4]))), emb)  # [2, 64]
    y = ops.qmatmul(ops.concat([x, h], 0), w)  # [5, 5]
    g = tp.backward(ops.reduce_sum(ops.mul(y, y)))
    assert set(g) == {x, emb}
    d = bm.dequantize().astype(np.float64)
    xs = np.concatenate([x.value, h.value])
    full = 2 * (xs @ d.T) @ d  # d/dxs of sum((xs d^T)^2)
    np.testing.assert_allclose(g[x].value, full[:3], rtol=1e-12)
    np.testing.assert_allclose(g[emb].value, full[3:], rtol=1e-12)


def test_nn_layers_dispatch_on_block_weights():
    r = np.random.default_rng(1)
    bm = random_blocks("Q4_K", 8, 256, r)  # [out=8, in=256]
    tp = gt.Tape()
    x = tp.const(r.standard_normal((3, 256)))
    w = tp.const(bm)
    wf = tp.const(bm.dequantize().astype(np.float64).T)  # [in, out] float
    a, b = tp.const(r.standard_normal((256, 2))), tp.const(r.standard_normal((2, 8)))
    assert nn.linear(tp, x, w).op == "qmatmul"
    np.testing.assert_allclose(nn.linear(tp, x, w).value, nn.linear(tp, x, wf).value,
                               rtol=1e-12)
    np.testing.assert_allclose(nn.lora_linear(tp, x, w, a, b, 0.5).value,
                               nn.lora_linear(tp, x, wf, a, b, 0.5).value, rtol=1e-12)
    tab = random_blocks("Q6_K", 10, 256, r)  # a [V, D] table
    ids = tp.const(np.array([9, 2]))
    tf = tp.const(tab.dequantize().astype(np.float64))
    np.testing.assert_array_equal(nn.embedding(tp, tp.const(tab), ids).value,
                                  nn.embedding(tp, tf, ids).value)
    np.testing.assert_allclose(nn.linear_rows(tp, x, tp.const(tab)).value,
                               nn.linear_rows(tp, x, tf).value, rtol=1e-12)


def test_shape_and_type_errors_name_the_op_and_shapes():
    r = np.random.default_rng(2)
    bm = random_blocks("Q4_0", 8, 64, r)
    tp = gt.Tape()
    w = tp.const(bm)
    x = tp.const(np.ones((3, 32)))
    with pytest.raises(ValueError, match=r"qmatmul\(\[3, 32\], \[8, 36\].*x\[3, 32\] @ "
                                         r"W\[8, 64\]\^T \(Q4_0\): x must be \[T, 64\]"):
        ops.qmatmul(x, w)
    with pytest.raises(ValueError, match=r"qmatmul_t.*g must be \[T, 8\]"):
        ops.qmatmul_t(tp.const(np.ones((3, 7))), w)
    with pytest.raises(ValueError, match="qtake_rows.*expects 1-d ids"):
        ops.qtake_rows(w, tp.const(np.zeros((2, 2), np.int64)))
    # a uint8 block const is read by the block primitives only
    with pytest.raises(TypeError, match=r"matmul.*input 1 is a block matrix \(Q4_0 \[8, 64\]\)"):
        ops.matmul(tp.const(np.ones((3, 36))), w)
    with pytest.raises(TypeError, match=r"add.*input 0 is a block matrix"):
        ops.add(w, w)
    with pytest.raises(TypeError, match="qmatmul: the weight must be a block matrix"):
        ops.qmatmul(x, tp.const(np.ones((8, 32))))
    with pytest.raises(TypeError, match="const_blocks: needs a BlockMatrix"):
        tp.const_blocks(np.zeros((2, 2), np.uint8))
    # a hand-made record with inconsistent attrs is refused at record time
    with pytest.raises(ValueError, match=r"blocks \[8, 36\] do not hold a Q4_0 \[8, 128\]"):
        tp.record("qmatmul", (tp.const(np.ones((3, 128))), w), qtype="Q4_0", rows=8, k=128)


def test_cuda_backend_refuses_block_ops_clearly():
    from gradtape.backends.cuda.backend import CudaBackend
    from gradtape.compile import build_graph, lower
    r = np.random.default_rng(3)
    tp = gt.Tape(np.float32, eager=False)
    y = ops.qmatmul(tp.const(np.ones((2, 64))), tp.const(random_blocks("Q8_0", 4, 64, r)))
    with pytest.raises(ValueError, match=r"backend 'cuda': no kernel for qmatmul #\d+ "
                                         r"\(a weight kept as Q8_0 blocks\)"):
        lower(build_graph(tp, [y], None), CudaBackend, device=object())


def _mapped_kb(path):
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    kb, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb


def test_release_drops_mapped_pages_and_keeps_values(tmp_path):
    rb = row_bytes("Q8_0", 256)
    rows = 2048  # 557 KiB of blocks
    data = random_blocks("Q8_0", rows, 256, np.random.default_rng(0)).data
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"\0" * 100 + data.tobytes())  # not page-aligned: whole pages only
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    w = BlockMatrix("Q8_0", (rows, 256), mm[100:100 + rows * rb].reshape(rows, rb))
    before = w.dequantize()
    assert _mapped_kb(path) >= 500
    w.release()
    assert _mapped_kb(path) <= 8  # at most the two partial pages at its ends
    np.testing.assert_array_equal(w.dequantize(), before)  # read again from the file
    BlockMatrix("Q8_0", (rows, 256), np.array(data)).release()  # a copy: nothing to do
