"""The ggml matrix-vector kernels against ``gguf.quants.dequantize`` on random blocks of
every supported type: dequantized rows bit for bit, products within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

import gguf
from gradtape.backends.cpu import ggml_vec

from support.hardware import kernel_isa  # noqa: F401  (a fixture)

assert ggml_vec.available(), "the C kernels do not build: gradtape needs a C compiler (cc)"

# byte ranges of the f16 scales inside one block (the rest are quant bits: any value)
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
          "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0],
          "IQ3_XXS": [0], "IQ3_S": [0]}


def random_blocks(qtype, rows, k, seed=0):
    """``[rows, row_bytes]`` uint8: random quant bits, finite f16 scales of either sign."""
    rng = np.random.default_rng(seed)
    _, qk, bs = ggml_vec.QTYPES[qtype]
    if qk == 1:  # plain float rows
        vals = rng.standard_normal((rows, k)).astype(np.float32)
        if qtype == "F32":
            return vals.view(np.uint8)
        if qtype == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return gguf.quants.quantize(vals, gguf.GGMLQuantizationType.BF16)
    nb = k // qk
    data = rng.integers(0, 256, (rows, nb, bs), dtype=np.uint8)
    for off in HALVES[qtype]:
        h = (rng.uniform(0.5, 2.0, (rows, nb)) * rng.choice([-1, 1], (rows, nb)) * 0.01)
        data[:, :, off:off + 2] = h.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return data.reshape(rows, nb * bs)


def deq(qtype, data):
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", sorted(ggml_vec.QTYPES))
def test_take_rows_is_dequantize(qtype):
    k = 512
    data = random_blocks(qtype, 37, k, seed=1)
    ids = [0, 36, 5, 5, 17]
    got = ggml_vec.take_rows(qtype, data, ids)
    want = deq(qtype, data)[ids]
    assert got.shape == (5, k)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", sorted(ggml_vec.QTYPES))
@pytest.mark.parametrize("T", [1, 3, 4])
def test_matvec_against_dequantize(qtype, T):
    rows, k = 67, 768  # rows not a multiple of the 16-row chunks or of the threads
    # (the K-quants: three super-blocks, through the vector dots at T = 1 too)
    if ggml_vec.QTYPES[qtype][1] <= 32:
        k += 32  # an odd number of 32-blocks: the vector dots' (T = 1) last single block
    data = random_blocks(qtype, rows, k, seed=T)
    x = np.random.default_rng(9).standard_normal((T, k)).astype(np.float32)
    w = deq(qtype, data).astype(np.float64)  # the exact weights
    got = ggml_vec.matvec(qtype, data, x)
    ref = x.astype(np.float64) @ w.T
    # float32 sums: each of 16 lanes adds k/16 products, then 4 levels of lane sums;
    # error <= (k/16 + 5) * 2^-24 * sum |w x| (first-order bound)
    bound = (k / 16 + 5) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert got.shape == (T, rows) and got.dtype == np.float32
    assert np.all(np.abs(got - ref) <= bound)
    for nt in (1, 3):  # any number of threads gives the same bits (rows are independent)
        np.testing.assert_array_equal(ggml_vec.matvec(qtype, data, x, nthreads=nt), got)


def test_bad_shapes_are_refused():
    data = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match=r"x\[1, 32\] against W\[4, 64\]"):
        ggml_vec.matvec("Q4_1", data, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="T <= 4"):
        ggml_vec.matvec("Q4_1", data, np.zeros((5, 64), np.float32))
    with pytest.raises(ValueError, match="Q4_1 blocks must be uint8"):
        ggml_vec.matvec("Q4_1", data[:, :30], np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="IQ1_S is not supported"):
        ggml_vec.matvec("IQ1_S", data, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="out of range"):
        ggml_vec.take_rows("Q4_1", data, [4])


@pytest.mark.usefixtures("kernel_isa")  # at every class this CPU runs
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "BF16", "F16", "F32"])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("k", [512, 4352])
def test_matmul_against_dequantize(qtype, T, k):
    """70 rows: a panel of 6 past four of 16; T past a multiple of AVX2's 6 rows; k = 4352:
    two chunks of AVX2's 2048 columns and a part."""
    rows = 70
    data = random_blocks(qtype, rows, k, seed=T + 5)
    x = np.random.default_rng(T).standard_normal((T, k)).astype(np.float32)
    w = deq(qtype, data).astype(np.float64)
    got = ggml_vec.matmul(qtype, data, x)
    ref = x.astype(np.float64) @ w.T
    # k/8 + 5 roundings of the absolute terms: the dot form's lanes each add k/8 products;
    # AVX2's packed kernel adds them in one chain per 2048 columns, well within it here
    bound = (k / 8 + 5) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert got.shape == (T, rows) and np.all(np.abs(got - ref) <= bound)
    np.testing.assert_array_equal(ggml_vec.matmul(qtype, data, x, nthreads=3), got)


@pytest.mark.parametrize("qtype", sorted(q for q in ggml_vec.QTYPES if q != "F32"))
@pytest.mark.parametrize("T", [1, 4])
def test_cpu_backend_qmatmul_of_few_rows_uses_the_matvec(qtype, T, monkeypatch):
    """The cpu backend lowers a float32 qmatmul of <= 4 rows to this kernel; its result is
    the NumPy reference's up to float32 summation order (2e-6 of the largest value, as
    the tiled GEMM's tests allow)."""
    import gradtape as gt
    from gradtape import ops
    from gradtape.backends.cpu import qgemm
    from gradtape.blocks import random_blocks

    calls = []
    real = ggml_vec.matvec_call
    monkeypatch.setattr(ggml_vec, "matvec_call", lambda *a: calls.append(a) or real(*a))
    bm = random_blocks(qtype, 70, 512, np.random.default_rng(T))
    tp = gt.Tape(np.float32)
    x = tp.const(np.random.default_rng(1).standard_normal((T, 512)).astype(np.float32))
    y = ops.qmatmul(x, tp.const(bm))
    ref = tp.compile([y], backend="numpy").run()[0]
    got = tp.compile([y], backend="cpu").run()[0]
    assert len(calls) == 1 and qgemm.ggml_vec is ggml_vec
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
