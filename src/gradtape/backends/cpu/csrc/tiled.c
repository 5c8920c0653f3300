/* The tiled primitives' per-block elementwise work (../../../tiled.py: NumpyTiles is the
   reference of every function here): one loop over a block's rows each, the rows split
   over the threads (OpenMP), masked entries exactly 0.  float32 and float64 variants
   from one macro.  Row sums: the head's in double (rows of up to the vocabulary); an
   attention tile's in the tile's dtype (rows of at most a key tile, a few hundred terms
   summed 8 lanes at a time: within float32 rounding of the reference's pairwise sum, and
   faster than widening every term).  This file knows nothing of Python;
   ../tiled.py loads it.

   Each row is walked in passes that vectorize (`omp simd`, branch-free bodies): the
   scores and their max, then exp and the sum.  The soft-cap (tanh, a libm call) and a
   mask each add their own pass, so the plain causal tiles, most of the work, run the
   two short ones; a bitwise select, not a branch, zeroes the masked entries.  The
   causal and window limits of a tile's rows come as column ranges, not a mask: only
   the visible part of a row is computed, the rest zeroed. */
#ifndef GT_TILED_C  /* flash.c includes this file */
#define GT_TILED_C
#include "gt_prelude.h"

#define DEFINE(T, SUF, EXP, TANH, ACC)                                                  \
/* max of row[j] (mk says visible) over [0, ncol): max(x) * iscale = max(x * iscale)   \
   exactly for iscale > 0 (rounding is monotone), so the raw row is scanned */          \
static inline T rowmax_##SUF(const T *row, const uint8_t *mk, long ncol) {             \
    T mx = -INFINITY;                                                                   \
    if (mk) {                                                                           \
        _Pragma("omp simd reduction(max:mx)")                                           \
        for (long j = 0; j < ncol; j++) {                                               \
            T x = mk[j] ? row[j] : (T)-INFINITY;                                        \
            mx = x > mx ? x : mx;                                                       \
        }                                                                               \
    } else {                                                                            \
        _Pragma("omp simd reduction(max:mx)")                                           \
        for (long j = 0; j < ncol; j++) mx = row[j] > mx ? row[j] : mx;                 \
    }                                                                                   \
    return mx;                                                                          \
}                                                                                       \
/* cap(x * iscale) in place over a row, -inf where the mask row says hidden; its max */  \
static inline T scores_##SUF(T *row, const uint8_t *mk, long ncol, T iscale, T cap) {  \
    if (cap) {                                                                          \
        T ic = (T)1 / cap;                                                              \
        for (long j = 0; j < ncol; j++) row[j] = cap * TANH(row[j] * iscale * ic);      \
    } else if (iscale != (T)1) {                                                        \
        _Pragma("omp simd")                                                             \
        for (long j = 0; j < ncol; j++) row[j] *= iscale;                               \
    }                                                                                   \
    if (mk) {                                                                           \
        _Pragma("omp simd")                                                             \
        for (long j = 0; j < ncol; j++) row[j] = mk[j] ? row[j] : (T)-INFINITY;         \
    }                                                                                   \
    return rowmax_##SUF(row, 0, ncol);                                                  \
}                                                                                       \
/* row[j] = exp(row[j] - sub); the row's sum, in double (a head row is long) */         \
static inline double exps_##SUF(T *row, long ncol, T sub) {                             \
    double sum = 0.0;                                                                   \
    _Pragma("omp simd reduction(+:sum)")                                                \
    for (long j = 0; j < ncol; j++) {                                                   \
        T p = EXP(row[j] - sub);                                                        \
        row[j] = p;                                                                     \
        sum += p;                                                                       \
    }                                                                                   \
    return sum;                                                                         \
}                                                                                       \
/* head_fwd: z [rows, ncol] (row stride ld) raw logits of vocabulary rows v0..          \
   -> cap; picked; running max m, sum s rescaled by exp(m_old - m_new) */              \
void gt_head_fwd_##SUF(T *z, long ld, T *m, T *s, T *picked, const int64_t *ids,       \
                       long rows, long ncol, long v0, double cap) {                    \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = z + r * ld;                                                            \
        T mx = scores_##SUF(row, 0, ncol, (T)1, (T)cap);                                \
        long c = ids[r] - v0;                                                           \
        if (c >= 0 && c < ncol) picked[r] = row[c];                                     \
        T mn = m[r] > mx ? m[r] : mx;                                                   \
        double sum = exps_##SUF(row, ncol, mn);                                         \
        s[r] = (m[r] == -INFINITY ? (T)0 : s[r] * EXP(m[r] - mn)) + (T)sum;             \
        m[r] = mn;                                                                      \
    }                                                                                   \
}                                                                                       \
/* head_dz: z raw logits -> a * softmax(cap(z)) - b * onehot, times 1 - tanh^2 */       \
void gt_head_dz_##SUF(T *z, long ld, const T *lse, const T *a, const T *b,             \
                      const int64_t *ids, long rows, long ncol, long v0, double cap) { \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = z + r * ld, l = lse[r], ar = a[r];                                     \
        long c = ids[r] - v0;                                                           \
        if (cap) {                                                                      \
            T cp = (T)cap, ic = (T)(1.0 / cap);                                         \
            for (long j = 0; j < ncol; j++) {                                           \
                T th = TANH(row[j] * ic);                                               \
                T p = EXP(cp * th - l) * ar;                                            \
                if (j == c) p -= b[r];                                                  \
                row[j] = p * ((T)1 - th * th);                                          \
            }                                                                           \
            continue;                                                                   \
        }                                                                               \
        _Pragma("omp simd")                                                             \
        for (long j = 0; j < ncol; j++) row[j] = EXP(row[j] - l) * ar;                  \
        if (c >= 0 && c < ncol) row[c] -= b[r];                                         \
    }                                                                                   \
}                                                                                       \
/* The visible columns of row r of an attention tile (query row i = r mod n):           \
   [lo[i], hi[i]) (causal and window limits; all when lo is null), and among them       \
   mask row i where a mask is given (segments). */                                      \
static inline void vis_##SUF(const int64_t *lo, const int64_t *hi, const uint8_t *mask,\
                             long r, long n, long ncol, long *a, long *b,               \
                             const uint8_t **mk) {                                      \
    long i = r % n;                                                                     \
    *a = lo ? lo[i] : 0;                                                                \
    *b = lo ? hi[i] : ncol;                                                             \
    *mk = mask ? mask + i * ncol : 0;                                                   \
}                                                                                       \
/* row[j] = exp(row[j] * iscale - sub), 0 where mk says hidden; the row's sum */        \
static inline ACC pexp_##SUF(T *row, const uint8_t *mk, long ncol, T iscale, T sub) {  \
    ACC sum = 0;                                                                        \
    if (mk) {                                                                           \
        _Pragma("omp simd reduction(+:sum)")                                            \
        for (long j = 0; j < ncol; j++) {                                               \
            T p = mk[j] ? EXP(row[j] * iscale - sub) : (T)0;                            \
            row[j] = p;                                                                 \
            sum += p;                                                                   \
        }                                                                               \
    } else {                                                                            \
        _Pragma("omp simd reduction(+:sum)")                                            \
        for (long j = 0; j < ncol; j++) {                                               \
            T p = EXP(row[j] * iscale - sub);                                           \
            row[j] = p;                                                                 \
            sum += p;                                                                   \
        }                                                                               \
    }                                                                                   \
    return sum;                                                                         \
}                                                                                       \
/* attn_fwd: s [rows, ncol] raw scores -> p = exp(cap(s * iscale) - m_new), 0 where     \
   hidden; m, l, acc [rows, hd] updated (rescaled by exp(m_old - m_new)).  Only the    \
   visible range [a, b) is computed; the rest of the row is zeroed. */                  \
void gt_attn_fwd_##SUF(T *s, T *m, T *l, T *acc, const int64_t *lo, const int64_t *hi, \
                       const uint8_t *mask, long rows, long ncol, long n, long hd,     \
                       double iscale, double cap) {                                    \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = s + r * ncol, is = (T)iscale, mx, sc = is;                             \
        long a, b;                                                                      \
        const uint8_t *mk;                                                              \
        vis_##SUF(lo, hi, mask, r, n, ncol, &a, &b, &mk);                               \
        if (b < a) b = a;                                                               \
        if (cap) {                                                                      \
            mx = scores_##SUF(row + a, mk ? mk + a : 0, b - a, is, (T)cap);             \
            sc = (T)1;                                                                  \
        } else {                                                                        \
            mx = rowmax_##SUF(row + a, mk ? mk + a : 0, b - a) * is;                    \
        }                                                                               \
        T mn = m[r] > mx ? m[r] : mx;                                                   \
        T safe = mn == -INFINITY ? (T)0 : mn;                                           \
        T alpha = m[r] == -INFINITY ? (T)0 : EXP(m[r] - safe);                          \
        ACC sum = pexp_##SUF(row + a, mk ? mk + a : 0, b - a, sc, safe);                \
        memset(row, 0, a * sizeof(T));                                                  \
        memset(row + b, 0, (ncol - b) * sizeof(T));                                     \
        l[r] = l[r] * alpha + (T)sum;                                                   \
        T *ar = acc + r * hd;                                                           \
        _Pragma("omp simd")                                                             \
        for (long d = 0; d < hd; d++) ar[d] *= alpha;                                   \
        m[r] = mn;                                                                      \
    }                                                                                   \
}                                                                                       \
/* attn_p: s raw scores -> exp(cap(s * iscale) - lse), 0 where hidden; t = 1 - tanh^2   \
   (over the whole row, hidden entries too, as the reference) */                        \
void gt_attn_p_##SUF(T *s, T *t, const T *lse, const int64_t *lo, const int64_t *hi,   \
                     const uint8_t *mask, long rows, long ncol, long n, double iscale, \
                     double cap) {                                                     \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = s + r * ncol, sc = (T)iscale;                                          \
        long a, b;                                                                      \
        const uint8_t *mk;                                                              \
        vis_##SUF(lo, hi, mask, r, n, ncol, &a, &b, &mk);                               \
        if (b < a) b = a;                                                               \
        if (cap) {                                                                      \
            T *tr = t + r * ncol, cp = (T)cap, ic = (T)(1.0 / cap);                     \
            for (long j = 0; j < ncol; j++) {                                           \
                T th = TANH(row[j] * (T)iscale * ic);                                   \
                tr[j] = (T)1 - th * th;                                                 \
                row[j] = cp * th;                                                       \
            }                                                                           \
            sc = (T)1;                                                                  \
        }                                                                               \
        pexp_##SUF(row + a, mk ? mk + a : 0, b - a, sc, lse[r]);                        \
        memset(row, 0, a * sizeof(T));                                                  \
        memset(row + b, 0, (ncol - b) * sizeof(T));                                     \
    }                                                                                   \
}                                                                                       \
/* attn_ds: dp -> p * (dp - D), times t under a cap, times iscale */                    \
void gt_attn_ds_##SUF(T *dp, const T *p, const T *t, const T *D, long rows, long ncol, \
                      double iscale, double cap) {                                     \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long r = 0; r < rows; r++) {                                                   \
        T *row = dp + r * ncol, d = D[r], is = (T)iscale;                               \
        const T *pr = p + r * ncol;                                                     \
        if (cap) {                                                                      \
            const T *tr = t + r * ncol;                                                 \
            _Pragma("omp simd")                                                         \
            for (long j = 0; j < ncol; j++) row[j] = pr[j] * (row[j] - d) * tr[j] * is; \
        } else {                                                                        \
            _Pragma("omp simd")                                                         \
            for (long j = 0; j < ncol; j++) row[j] = pr[j] * (row[j] - d) * is;         \
        }                                                                               \
    }                                                                                   \
}

DEFINE(float, f32, gt_expf, tanhf, float)
DEFINE(double, f64, exp, tanh, double)
#endif
