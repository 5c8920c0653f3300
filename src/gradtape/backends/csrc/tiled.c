/* The tiled primitives' per-block elementwise work (../../tiled.py: NumpyTiles is the
   reference of every function here): one loop over a block's rows each, the rows split
   over the threads (OpenMP), row sums in double, masked entries exactly 0.  float32 and
   float64 variants from one macro.  This file knows nothing of Python; ../tiled_c.py
   loads it. */
#include "gt_prelude.h"

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
