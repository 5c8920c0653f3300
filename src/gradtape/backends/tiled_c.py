"""The cpu backend's kernels for the tiled primitives' elementwise work (``tiled.py``):
the same methods as ``tiled.NumpyTiles``, one C loop over a block's rows each (OpenMP
over the rows), so a block of scores is read and written once per step instead of once
per NumPy call.  The GEMMs and the walk over the blocks are ``tiled.py``'s own.

Math as in ``NumpyTiles``, in the block's dtype, row sums in double; float32 ``exp`` is
``_cgen``'s vectorizable ``gt_expf``; masked entries are exactly 0.  Without a C compiler
the cpu backend runs on NumPy anyway (``CpuBackend.unavailable``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _cgen

_BODY = r"""
#define ISMASKED(mk, j) ((mk) && !(mk)[j])

#define DEFINE(T, SUF, EXP, TANH)                                                        \
/* head_fwd: z [rows, ncol] (row stride ld) raw logits of vocabulary rows v0..          \
   -> cap; picked; running max m, sum s rescaled by exp(m_old - m_new) */              \
void gt_head_fwd_##SUF(T *z, long ld, T *m, T *s, T *picked, const int64_t *ids,       \
                       long rows, long ncol, long v0, double cap) {                    \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = z + r * ld, mx = -INFINITY;                                            \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = row[j];                                                               \
            if (cap) x = (T)cap * TANH(x * (T)(1.0 / cap));                             \
            row[j] = x;                                                                 \
            mx = x > mx ? x : mx;                                                       \
        }                                                                               \
        long c = ids[r] - v0;                                                           \
        if (c >= 0 && c < ncol) picked[r] = row[c];                                     \
        T mn = m[r] > mx ? m[r] : mx;                                                   \
        double sum = 0.0;                                                               \
        for (long j = 0; j < ncol; j++) sum += EXP(row[j] - mn);                        \
        s[r] = (m[r] == -INFINITY ? (T)0 : s[r] * EXP(m[r] - mn)) + (T)sum;             \
        m[r] = mn;                                                                      \
    }                                                                                   \
}                                                                                       \
/* head_dz: z raw logits -> a * softmax(cap(z)) - b * onehot, times 1 - tanh^2 */       \
void gt_head_dz_##SUF(T *z, long ld, const T *lse, const T *a, const T *b,             \
                      const int64_t *ids, long rows, long ncol, long v0, double cap) { \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = z + r * ld;                                                            \
        long c = ids[r] - v0;                                                           \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = row[j], th = 0;                                                       \
            if (cap) { th = TANH(x * (T)(1.0 / cap)); x = (T)cap * th; }                \
            T p = EXP(x - lse[r]) * a[r];                                               \
            if (j == c) p -= b[r];                                                      \
            if (cap) p *= (T)1 - th * th;                                               \
            row[j] = p;                                                                 \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
/* attn_fwd: s [rows, ncol] raw scores (row r reads mask row r mod n)    \
   -> p = exp(cap(s * iscale) - m_new), 0 where masked; m, l, acc [rows, hd] updated */ \
void gt_attn_fwd_##SUF(T *s, T *m, T *l, T *acc, const uint8_t *mask, long rows,       \
                       long ncol, long n, long hd, double iscale, double cap) {        \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = s + r * ncol, mx = -INFINITY;                                          \
        const uint8_t *mk = mask ? mask + (r % n) * ncol : 0;                           \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = row[j] * (T)iscale;                                                   \
            if (cap) x = (T)cap * TANH(x * (T)(1.0 / cap));                             \
            if (ISMASKED(mk, j)) x = -INFINITY;                                         \
            row[j] = x;                                                                 \
            mx = x > mx ? x : mx;                                                       \
        }                                                                               \
        T mn = m[r] > mx ? m[r] : mx;                                                   \
        T safe = mn == -INFINITY ? (T)0 : mn;                                           \
        T alpha = m[r] == -INFINITY ? (T)0 : EXP(m[r] - safe);                          \
        double sum = 0.0;                                                               \
        for (long j = 0; j < ncol; j++) {                                               \
            T p = ISMASKED(mk, j) ? (T)0 : EXP(row[j] - safe);                          \
            row[j] = p;                                                                 \
            sum += p;                                                                   \
        }                                                                               \
        l[r] = l[r] * alpha + (T)sum;                                                   \
        T *ar = acc + r * hd;                                                           \
        for (long d = 0; d < hd; d++) ar[d] *= alpha;                                   \
        m[r] = mn;                                                                      \
    }                                                                                   \
}                                                                                       \
/* attn_p: s raw scores -> exp(cap(s * iscale) - lse), 0 where masked; t = 1 - tanh^2 */\
void gt_attn_p_##SUF(T *s, T *t, const T *lse, const uint8_t *mask, long rows,         \
                     long ncol, long n, double iscale, double cap) {                   \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = s + r * ncol;                                                          \
        const uint8_t *mk = mask ? mask + (r % n) * ncol : 0;                           \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = row[j] * (T)iscale;                                                   \
            if (cap) {                                                                  \
                T th = TANH(x * (T)(1.0 / cap));                                        \
                t[r * ncol + j] = (T)1 - th * th;                                       \
                x = (T)cap * th;                                                        \
            }                                                                           \
            row[j] = ISMASKED(mk, j) ? (T)0 : EXP(x - lse[r]);                          \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
/* attn_ds: dp -> p * (dp - D), times t under a cap, times iscale */                    \
void gt_attn_ds_##SUF(T *dp, const T *p, const T *t, const T *D, long rows, long ncol, \
                      double iscale, double cap) {                                     \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = dp + r * ncol;                                                         \
        const T *pr = p + r * ncol;                                                     \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = pr[j] * (row[j] - D[r]);                                              \
            if (cap) x *= t[r * ncol + j];                                              \
            row[j] = x * (T)iscale;                                                     \
        }                                                                               \
    }                                                                                   \
}

DEFINE(float, f32, gt_expf, tanhf)
DEFINE(double, f64, exp, tanh)
"""

_LIB = []


def _lib():
    if not _LIB:
        path, _ = _cgen.build(_cgen.PRELUDE + _BODY, flags=_cgen.threads_flags(),
                              prefix="tiled")
        _LIB.append(ctypes.CDLL(str(path)))
    return _LIB[0]


def _p(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


_L, _D = ctypes.c_long, ctypes.c_double


class CTiles:
    """``tiled.NumpyTiles``' methods as C loops, for one float dtype."""

    def __init__(self, dtype):
        self.suf = "f32" if np.dtype(dtype) == np.float32 else "f64"
        lib = _lib()
        self.f = {name: getattr(lib, f"gt_{name}_{self.suf}")
                  for name in ("head_fwd", "head_dz", "attn_fwd", "attn_p", "attn_ds")}
        for fn in self.f.values():
            fn.restype = None

    def head_fwd(self, z, m, s, picked, ids, v0, cap):
        self.f["head_fwd"](_p(z), _L(z.strides[0] // z.itemsize), _p(m), _p(s), _p(picked),
                           _p(ids), _L(z.shape[0]), _L(z.shape[1]), _L(v0), _D(cap))

    def head_dz(self, z, lse, a, b, ids, v0, cap):
        self.f["head_dz"](_p(z), _L(z.strides[0] // z.itemsize), _p(lse), _p(a), _p(b),
                          _p(ids), _L(z.shape[0]), _L(z.shape[1]), _L(v0), _D(cap))

    @staticmethod
    def _mask(mask):
        return None if mask is None else np.ascontiguousarray(mask, np.uint8)

    def attn_fwd(self, s, m, l, acc, iscale, cap, mask, g):
        mk = self._mask(mask)
        nkv, gn, ncol = s.shape
        self.f["attn_fwd"](_p(s), _p(m), _p(l), _p(acc), _p(mk), _L(nkv * gn), _L(ncol),
                           _L(gn // g), _L(acc.shape[2]), _D(iscale), _D(cap))

    def attn_p(self, s, t, lse, iscale, cap, mask, g):
        mk = self._mask(mask)
        nkv, gn, ncol = s.shape
        self.f["attn_p"](_p(s), _p(t), _p(lse), _p(mk), _L(nkv * gn), _L(ncol), _L(gn // g),
                         _D(iscale), _D(cap))

    def attn_ds(self, dp, p, t, D, iscale, cap):
        nkv, gn, ncol = dp.shape
        self.f["attn_ds"](_p(dp), _p(p), _p(t), _p(np.ascontiguousarray(D)), _L(nkv * gn),
                          _L(ncol), _D(iscale), _D(cap))


TILED_OPS = ("head_nll", "head_nll_grad_x", "head_nll_grad_w", "attn", "attn_grad")
_KERNELS = {}


def kernels(dtype):
    """The CTiles of ``dtype`` (built once per process)."""
    key = np.dtype(dtype).str
    if key not in _KERNELS:
        _KERNELS[key] = CTiles(dtype)
    return _KERNELS[key]
