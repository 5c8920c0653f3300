"""The decode step's integer dots (``csrc/q8_dots.c``) against a NumPy reference of the
same quantized scheme: the activation row's Q8_0 / Q8_K blocks bit for bit (llama.cpp's
rounding), the integer block sums exactly (with power-of-two scales every float step is
exact, so the product must equal the reference bit for bit), and on random blocks the
product within float32 rounding of the reference summed in float64.  At every
instruction-set class this CPU runs, and the plain C path (the 16-lane emulation build).
The prefill's GEMM on AMX tiles (``csrc/q8_amx.c``) is held to the same reference, many
rows at once, where the CPU has AMX-INT8."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL, dequantize

from gradtape.backends.cpu import ggml_vec

from support import hardware
from support.hardware import kernel_isa  # noqa: F401  (a fixture)
from support.lanes import sixteen_lanes  # noqa: F401  (a fixture)

Q8 = sorted(ggml_vec.Q8_TYPES)
f16 = np.float16
IQ_DIV = {"IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8, "IQ3_XXS": 4, "IQ3_S": 1}


# --- the reference: the scheme in NumPy -------------------------------------------------

def ref_q8_0(x):
    """(q, d, s) as llama.cpp's x86 quantize_row_q8_1: a = max |x|, d = f16(a / 127),
    q = rint(x * (127 / a)) (half to even), s = f16(a / 127 * sum q)."""
    xb = x.reshape(-1, 32)
    a = np.abs(xb).max(1)
    d = a / np.float32(127)
    inv = np.divide(np.float32(127), a, out=np.zeros_like(a), where=a != 0)
    q = np.rint(xb * inv[:, None]).astype(np.int32)
    s = (d * q.sum(1).astype(np.float32)).astype(f16).astype(np.float32)
    return q.astype(np.int8).ravel(), d.astype(f16).astype(np.float32), s


def ref_q8_k(x):
    """(q, d, bsums) as quantize_row_q8_K_ref: m = the first x of largest |x|,
    q = min(127, rint(x * (-127 / m))), d = 1 / (-127 / m)."""
    xb = x.reshape(-1, 256)
    m = xb[np.arange(len(xb)), np.abs(xb).argmax(1)]
    zero = m == 0
    iscale = np.float32(-127) / np.where(zero, np.float32(1), m)
    q = np.minimum(127, np.rint(xb * iscale[:, None])).astype(np.int32)
    q[zero] = 0
    d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    return q.astype(np.int8).ravel(), d, q.reshape(-1, 16).sum(1).astype(np.int16)


def _h(b, off):  # the f16 at byte off of each block, as float64
    return b[:, off:off + 2].copy().view(f16)[:, 0].astype(np.float64)


def _nibs32(qs):  # [nb, 16] bytes -> [nb, 32]: low nibbles, then high
    return np.concatenate([qs & 15, qs >> 4], 1).astype(np.int64)


def _bits32(qh):  # [nb, 4] bytes -> [nb, 32] bit j of the little-endian u32
    h = qh.copy().view(np.uint32)[:, 0].astype(np.int64)
    return (h[:, None] >> np.arange(32)) & 1


def _scale_min(s):  # [nb, 12] -> sc [nb, 8], mn [nb, 8] (ggml's 6-bit packing)
    s = s.astype(np.int64)
    sc, mn = np.empty((len(s), 8), np.int64), np.empty((len(s), 8), np.int64)
    sc[:, :4], mn[:, :4] = s[:, :4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:] & 15) | ((s[:, :4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def ref_row(qtype, row, x):
    """One row's product in float64 from its integer block sums, and the sum of the
    absolute terms (the scale of its float32 rounding)."""
    _, qk, bs = ggml_vec.QTYPES[qtype]
    b = row.reshape(-1, bs)
    terms = []
    if ggml_vec.Q8_TYPES[qtype] == "Q8_0":
        q, dx, sx = ref_q8_0(x)
        y = q.reshape(-1, 32).astype(np.int64)
        d = _h(b, 0)
        if qtype == "Q8_0":
            n = b[:, 2:].copy().view(np.int8).astype(np.int64)
        elif qtype == "IQ4_NL":
            n = np.array(IQ4_NL.kvalues, np.int64)[_nibs32(b[:, 2:18])]
        else:
            qs = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]
            n = _nibs32(b[:, qs:qs + 16])
            if qtype in ("Q5_0", "Q5_1"):
                n |= _bits32(b[:, qs - 4:qs]) << 4
            n -= {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
        terms.append(d * dx * (n * y).sum(1))
        if qtype in ("Q4_1", "Q5_1"):
            terms.append(_h(b, 2) * sx)
    else:
        q, dx, bsum = ref_q8_k(x)
        y = q.reshape(-1, 256).astype(np.int64)
        bsum = bsum.reshape(-1, 16).astype(np.int64)
        if qtype == "Q2_K":  # w = d sc n - dmin mn, n 2 bits laid out as Q3_K's low ones
            bb = b.astype(np.int64)
            e = np.arange(256)
            n = (bb[:, 16 + 32 * (e // 128) + e % 32] >> (2 * (e % 128 // 32))) & 3
            isum = ((bb[:, e // 16] & 15) * n * y).sum(1)
            terms += [_h(b, 80) * dx * isum, -_h(b, 82) * dx * ((bb[:, :16] >> 4) * bsum).sum(1)]
        elif qtype == "Q3_K":  # n = the 2 low bits - 4 where the hmask bit is clear
            bb = b.astype(np.int64)
            sc = np.empty((len(b), 16), np.int64)
            for s in range(16):
                sc[:, s] = (((bb[:, 96 + s % 8] >> (4 * (s // 8))) & 15)
                            | ((bb[:, 104 + s % 4] >> (2 * (s // 4))) & 3) << 4) - 32
            e = np.arange(256)
            h, j, m = e // 128, e % 128 // 32, e % 32
            hbit = (bb[:, m] >> (4 * h + j)) & 1
            n = ((bb[:, 32 + 32 * h + m] >> (2 * j)) & 3) - 4 * (1 - hbit)
            terms.append(_h(b, 108) * dx * (sc[:, e // 16] * n * y).sum(1))
        elif qtype in IQ_DIV:  # w = d / div (m g sign): gguf's values at d = 1, times div
            one = b.copy()
            one[:, :2] = scale_bytes(np.ones(len(b)))
            n = dequantize(one.ravel(), GGMLQuantizationType[qtype]).reshape(-1, 256)
            n = n.astype(np.float64) * IQ_DIV[qtype]
            assert np.array_equal(n, np.rint(n))
            terms.append(_h(b, 0) * dx * (n.astype(np.int64) * y).sum(1) / IQ_DIV[qtype])
        elif qtype == "IQ4_XS":
            kv = np.array(IQ4_NL.kvalues, np.int64)
            sh = b[:, 2].astype(np.int64) | b[:, 3].astype(np.int64) << 8
            isum = np.zeros(len(b), np.int64)  # sum_s (ls_s - 32) (v . q)_s
            for s in range(8):
                ls = ((b[:, 4 + s // 2] >> (4 * (s % 2))) & 15) | ((sh >> (2 * s)) & 3) << 4
                v = kv[_nibs32(b[:, 8 + 16 * s:24 + 16 * s])]
                isum += (ls - 32) * (v * y[:, 32 * s:32 * s + 32]).sum(1)
            terms.append(_h(b, 0) * dx * isum)
        elif qtype == "Q6_K":
            d = _h(b, 208)
            sc = b[:, 192:208].copy().view(np.int8).astype(np.int64)
            isum = np.zeros(len(b), np.int64)  # sum_s sc_s (n . q)_s, n = 0 .. 63
            for h in range(2):
                for g in range(4):
                    ql = b[:, 64 * h + 32 * (g & 1):][:, :32].astype(np.int64)
                    qh = b[:, 128 + 32 * h:][:, :32].astype(np.int64)
                    n = ((ql >> (4 * (g >> 1))) & 15) | (((qh >> (2 * g)) & 3) << 4)
                    prod = n * y[:, 128 * h + 32 * g:][:, :32]
                    s = 8 * h + 2 * g
                    isum += sc[:, s] * prod[:, :16].sum(1) + sc[:, s + 1] * prod[:, 16:].sum(1)
            off = 32 * (sc * bsum).sum(1)  # the offset's part: sum_s sc_s 32 bsum_s
            terms += [d * dx * isum, -d * dx * off]
        else:
            five = qtype == "Q5_K"
            d, dmin = _h(b, 0), _h(b, 2)
            sc, mn = _scale_min(b[:, 4:16])
            qs = b[:, 48 if five else 16:].astype(np.int64)
            isum = np.zeros(len(b), np.int64)
            for s in range(8):
                n = (qs[:, 32 * (s // 2):][:, :32] >> (4 * (s & 1))) & 15
                if five:
                    n |= ((b[:, 16:48].astype(np.int64) >> s) & 1) << 4
                isum += sc[:, s] * (n * y[:, 32 * s:32 * s + 32]).sum(1)
            mins = (mn * (bsum[:, 0::2] + bsum[:, 1::2])).sum(1)
            terms += [d * dx * isum, -dmin * dx * mins]
    t = np.concatenate(terms)
    return t.sum(), np.abs(t).sum()


# --- inputs -----------------------------------------------------------------------------

def scale_bytes(v):
    return np.asarray(v, f16).view(np.uint8).reshape(*np.shape(v), 2)


def weight_rows(qtype, rows, k, seed, exact=False):
    """Random blocks ``[rows, row_bytes]``.  exact: every scale 2^-8, no min term, small
    K-quant scales, so that every float step of the product is exact."""
    rng = np.random.default_rng(seed)
    _, qk, bs = ggml_vec.QTYPES[qtype]
    b = rng.integers(0, 256, (rows, k // qk, bs), dtype=np.uint8)
    shape = b.shape[:2]

    def scale():
        if exact:
            return np.full(shape, 2.0 ** -8)
        return rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape) * 0.01

    if qtype == "Q6_K":
        b[:, :, 208:210] = scale_bytes(scale())
        if exact:
            b[:, :, 192:208] = rng.integers(-3, 4, (*shape, 16)).astype(np.int8).view(np.uint8)
    elif qtype == "Q2_K":
        b[:, :, 80:82] = scale_bytes(scale())
        b[:, :, 82:84] = scale_bytes(np.zeros(shape) if exact else scale())
    elif qtype == "Q3_K":
        b[:, :, 108:110] = scale_bytes(scale())
        if exact:  # scales 32 + 0 .. 3 (the high bits 2, the low 0 .. 3), less 32
            b[:, :, 96:104] = rng.integers(0, 4, (*shape, 8)) * 17
            b[:, :, 104:108] = 0xAA
    else:
        b[:, :, 0:2] = scale_bytes(scale())
        if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            b[:, :, 2:4] = scale_bytes(np.zeros(shape) if exact else scale())
        if exact and qtype in ("Q4_K", "Q5_K"):
            b[:, :, 4:16] = rng.integers(0, 4, (*shape, 12))  # sc, mn <= 63 still
        if exact and qtype == "IQ4_XS":  # scales 32 + 0 .. 3: the sums below 2^24
            b[:, :, 2:4] = 0xAA
            b[:, :, 4:8] = rng.integers(0, 4, (*shape, 4)) * 17
        if exact and qtype in IQ_SCALES:  # 4-bit scales 0 .. 1: the sums below 2^24
            at, mask = IQ_SCALES[qtype]
            b[:, :, at] &= mask
    return b.reshape(rows, -1)


# the bytes holding the IQ types' 4-bit scales and the mask that keeps them at 0 .. 1:
# IQ2_XS, IQ2_S, IQ3_S two a byte; IQ2_XXS, IQ3_XXS the top nibble of a u32 per 32 values
IQ_SCALES = {"IQ2_XS": (slice(66, 74), 0x11), "IQ2_S": (slice(74, 82), 0x11),
             "IQ3_S": (slice(106, 110), 0x11), "IQ2_XXS": (slice(9, 66, 8), 0x1F),
             "IQ3_XXS": (slice(69, 98, 4), 0x1F)}


def activations(k, seed, exact=False, block=32):
    """x [k]; exact: each block's largest |x| is 127 * 2^-6, so its scale is 2^-6."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * 0.5).astype(np.float32)
    if exact:
        x = np.clip(x, -1.9, 1.9)
        top = rng.integers(0, block, k // block) + np.arange(0, k, block)
        x[top] = np.float32(127 * 2.0 ** -6) * rng.choice([-1, 1], k // block)
    return x


# --- the tests --------------------------------------------------------------------------

@pytest.fixture(params=["simd", "plain"])
def quantizer(request):
    """The quantizers as built for this CPU, and their plain C (the emulation build)."""
    if request.param == "plain":
        request.getfixturevalue("sixteen_lanes")
        assert ggml_vec.lib().gq_path() == 0


@pytest.mark.usefixtures("kernel_isa", "quantizer")
@pytest.mark.parametrize("k", [32, 256, 1536])
def test_q8_0_rounds_as_llama_cpp(k):
    for seed in range(3):
        x = activations(k, seed)
        x[:3] = [0.5 * 127 / 64, -1.5 * 127 / 64, 2.5 * 127 / 64]  # halves: to even
        if seed == 2:
            x[:32] = 0  # an all-zero block: d = 0, q = 0
        (q, d, s), (wq, wd, ws) = ggml_vec.quantize_q8_0(x), ref_q8_0(x)
        np.testing.assert_array_equal(q, wq)
        np.testing.assert_array_equal(d.view(np.uint32), wd.view(np.uint32))
        np.testing.assert_array_equal(s.view(np.uint32), ws.view(np.uint32))


@pytest.mark.usefixtures("kernel_isa", "quantizer")
@pytest.mark.parametrize("k", [256, 1536])
def test_q8_k_rounds_as_llama_cpp(k):
    for seed in range(3):
        x = activations(k, seed)
        x[5], x[9] = 4.0, -4.0  # ties in |x|: the first is the reference
        if seed == 2:
            x[:256] = 0
        q, d, bs = ggml_vec.quantize_q8_k(x)
        wq, wd, wbs = ref_q8_k(x)
        np.testing.assert_array_equal(q, wq)
        np.testing.assert_array_equal(d.view(np.uint32), wd.view(np.uint32))
        np.testing.assert_array_equal(bs, wbs)


def _check_products(qtype, exact, rows=37, nthreads=2):
    for seed in range(2):
        # an odd number of 32-element blocks too (the AVX-512 path takes them in pairs)
        k = 512 if ggml_vec.QTYPES[qtype][1] == 256 else (576, 608)[seed]
        W = weight_rows(qtype, rows, k, seed, exact)
        x = activations(k, seed + 10, exact, ggml_vec.QTYPES[qtype][1] if exact else 32)
        got = ggml_vec.matvec_q8(qtype, W, x, nthreads=nthreads)
        for r in range(rows):
            want, scale = ref_row(qtype, W[r], x)
            if exact:  # integer sums * 2^-e with |partial sums| < 2^24: exact in float32
                assert got[r] == np.float32(want), (qtype, r, got[r], want)
            else:  # float32 sums of ~k/32 terms, each rounded once or twice
                assert abs(got[r] - want) <= 1e-6 * scale + 1e-30, (qtype, r, got[r], want)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("qtype", Q8)
@pytest.mark.parametrize("exact", [True, False], ids=["integer-exact", "random"])
def test_integer_dots_equal_the_scheme(qtype, exact):
    _check_products(qtype, exact)


@pytest.mark.parametrize("qtype", Q8)
def test_plain_c_dots_equal_the_scheme(sixteen_lanes, qtype):
    assert ggml_vec.lib().gq_path() == 0  # the emulation build has no AVX2 intrinsics
    _check_products(qtype, exact=True, nthreads=1)
    _check_products(qtype, exact=False, nthreads=1)


def test_matvec_q8_names_what_it_lacks():
    W = weight_rows("Q4_1", 4, 64, 0)
    with pytest.raises(ValueError, match="F16 has no integer dots"):
        ggml_vec.matvec_q8("F16", np.zeros((4, 64), np.uint8), np.zeros(32, np.float32))
    with pytest.raises(ValueError, match=r"x\[32\] against W\[4, 64\]"):
        ggml_vec.matvec_q8("Q4_1", W, np.zeros(32, np.float32))


# --- the prefill's integer GEMMs (csrc/q8_amx.c on AMX tiles, csrc/q8_gemm.c with AVX2) ---

GEMM = list(ggml_vec.GEMM_TYPES)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("qtype", GEMM)
@pytest.mark.parametrize("exact", [True, False], ids=["integer-exact", "random"])
def test_int8_gemm_equals_the_scheme(qtype, exact):
    """Many rows at once (37 rows of x: two tiles of 16 and 5 past them; 37 weight rows:
    a panel of 5 past two of 16, an odd last row), each product the scheme's, as
    ``matvec_q8`` holds it, at every class the CPU runs (AVX2's GEMM below AMX)."""
    hardware.int8_gemm(qtype)
    rows, T = 37, 37
    block = ggml_vec.QTYPES[qtype][1]
    for seed in range(2):
        # 18 and 19 blocks of 32: groups of 4 tiles and the rest; K-quants: 6 and 3 blocks
        # (24 and 12 units of 32, 96 and 48 of Q6_K's 16)
        k = (576, 608)[seed] if block == 32 else (1536, 768)[seed]
        W = weight_rows(qtype, rows, k, seed, exact)
        X = np.stack([activations(k, seed + 10 + t, exact, block if exact else 32)
                      for t in range(T)])
        got = ggml_vec.matmul_q8(qtype, W, X)
        for t in range(0, T, 4):
            for r in range(rows):
                want, scale = ref_row(qtype, W[r], X[t])
                if exact:  # integer sums * 2^-e, partial sums < 2^24: exact in float32
                    assert got[t, r] == np.float32(want), (qtype, t, r, got[t, r], want)
                else:
                    assert abs(got[t, r] - want) <= 1e-6 * scale + 1e-30, (qtype, t, r)
        assert np.array_equal(got[1:T:4], ggml_vec.matmul_q8(qtype, W, X[1:T:4]))


@pytest.mark.parametrize("qtype", hardware.AVX2_GEMM)
def test_int8_gemm_splits_rows_over_threads_alike(qtype):
    """One thread and two give the same products, bit for bit: each weight row's sums
    are one thread's, in one order."""
    hardware.int8_gemm(qtype)
    W = weight_rows(qtype, 53, 512, 5)
    X = np.stack([activations(512, 40 + t, False, 32) for t in range(21)])
    one = ggml_vec.matmul_q8(qtype, W, X, nthreads=1)
    assert np.array_equal(one, ggml_vec.matmul_q8(qtype, W, X, nthreads=2))


def test_matmul_q8_names_what_it_lacks():
    with pytest.raises(ValueError, match="F16 has no integer GEMM"):
        ggml_vec.matmul_q8("F16", np.zeros((4, 512), np.uint8),
                           np.zeros((2, 256), np.float32))
    hardware.int8_gemm("Q4_K")
    W = weight_rows("Q4_K", 4, 512, 0)
    with pytest.raises(ValueError, match=r"x\[2, 256\] against W\[4, 512\]"):
        ggml_vec.matmul_q8("Q4_K", W, np.zeros((2, 256), np.float32))
