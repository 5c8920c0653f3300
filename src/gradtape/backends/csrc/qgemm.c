/* Frozen weights in their stored ggml type: dequantization and tiled GEMMs.

   Dequantization follows llama.cpp's layouts and gguf.quants.dequantize's float32
   arithmetic operation by operation (built with -ffp-contract=off: d * q + m is two
   roundings there as here), so a dequantized row is bit for bit the NumPy reference.

   The GEMMs never hold the whole float matrix: a tile of W (rows r0.., block-aligned
   columns c0..) is dequantized into a caller-owned scratch buffer and multiplied by
   BLAS (NumPy's OpenBLAS, whose cblas_[sd]gemm the caller passes as a pointer):
     qgemm    y[T, rows]  = x[T, k] @ W^T   (y[:, r] += x[:, c] @ tile^T over column tiles)
     qgemm_t  z[T, k]     = g[T, rows] @ W  (z[:, c] += g[:, r] @ tile over row tiles)
   Tiles are dequantized with their rows split over the threads (OpenMP).  Type ids are
   ggml's.  Compiled after _cgen's prelude (gt_bf16).  This file knows nothing of Python;
   ../qgemm.py loads it. */
#include <stdlib.h>

#define QK 256

static inline float h2f(const uint8_t *p) {  /* IEEE half -> float, exact */
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-08f;  /* m * 2^-24: exact */
        memcpy(&b, &f, 4);
        b |= s;
    } else if (e == 31) {
        b = s | 0x7f800000u | (m << 13);
    } else {
        b = s | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &b, 4);
    return f;
}

typedef void (*deq_fn)(const uint8_t *b, float *restrict y, long nb);

static void deq_f16(const uint8_t *b, float *restrict y, long n) {
    for (long i = 0; i < n; i++) y[i] = h2f(b + 2 * i);
}

static void deq_bf16(const uint8_t *b, float *restrict y, long n) {
    for (long i = 0; i < n; i++) {
        uint32_t u = (uint32_t)(b[2 * i] | (b[2 * i + 1] << 8)) << 16;
        memcpy(y + i, &u, 4);
    }
}

static void deq_q4_0(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 18, y += 32) {
        const float d = h2f(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((q[j] & 0xF) - 8);
            y[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

static void deq_q4_1(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 20, y += 32) {
        const float d = h2f(b), m = h2f(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(q[j] & 0xF) + m;
            y[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}

static void deq_q5_0(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 22, y += 32) {
        const float d = h2f(b);
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const uint8_t *q = b + 6;
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) & 1u) << 4, h1 = ((qh >> (j + 16)) & 1u) << 4;
            y[j] = d * (float)(((q[j] & 0xF) | h0) - 16);
            y[j + 16] = d * (float)(((q[j] >> 4) | h1) - 16);
        }
    }
}

static void deq_q5_1(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 24, y += 32) {
        const float d = h2f(b), m = h2f(b + 2);
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        const uint8_t *q = b + 8;
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) & 1u) << 4, h1 = ((qh >> (j + 16)) & 1u) << 4;
            y[j] = d * (float)((q[j] & 0xF) | h0) + m;
            y[j + 16] = d * (float)((q[j] >> 4) | h1) + m;
        }
    }
}

static void deq_q8_0(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 34, y += 32) {
        const float d = h2f(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
    }
}

/* the 8 (scale, min) pairs of a Q4_K / Q5_K block, 6 bits each, packed in 12 bytes */
static inline void scale_min_k4(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

static void deq_q4_k(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 144, y += QK) {
        const float d = h2f(b), dmin = h2f(b + 2);
        int sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *q = b + 16;
        for (int s = 0; s < 8; s++) {  /* sub-block s: nibble s & 1 of bytes 32 * (s / 2).. */
            const float D = d * (float)sc[s], M = dmin * (float)mn[s];
            const uint8_t *qq = q + 32 * (s >> 1);
            const int sh = 4 * (s & 1);
            for (int j = 0; j < 32; j++) y[32 * s + j] = D * (float)((qq[j] >> sh) & 0xF) - M;
        }
    }
}

static void deq_q5_k(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 176, y += QK) {
        const float d = h2f(b), dmin = h2f(b + 2);
        int sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *q = b + 48;
        for (int s = 0; s < 8; s++) {  /* high bit: bit s of qh[j] */
            const float D = d * (float)sc[s], M = dmin * (float)mn[s];
            const uint8_t *qq = q + 32 * (s >> 1);
            const int sh = 4 * (s & 1);
            for (int j = 0; j < 32; j++)
                y[32 * s + j] = D * (float)(((qq[j] >> sh) & 0xF) | (((qh[j] >> s) & 1) << 4)) - M;
        }
    }
}

static void deq_q6_k(const uint8_t *b, float *restrict y, long nb) {
    for (long i = 0; i < nb; i++, b += 210, y += QK) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = h2f(b + 208);
        float D[16];
        for (int s = 0; s < 16; s++) D[s] = d * (float)sc[s];
        for (int h = 0; h < 2; h++) {  /* halves of 128 values: ql bytes 64h.., qh 32h.. */
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const float *Dh = D + 8 * h;
            float *yh = y + 128 * h;
            /* value r of the half: low 4 bits from ql[r % 64] >> 4 (r / 64), high 2 bits
               from qh[r % 32] >> 2 (r / 32); scale r / 16 */
            for (int is = 0; is < 2; is++) {  /* 16 values per scale */
                const float d0 = Dh[is], d1 = Dh[is + 2], d2 = Dh[is + 4], d3 = Dh[is + 6];
                for (int l = 16 * is; l < 16 * is + 16; l++) {
                    const int a = ql[l], c = ql[l + 32], h = qh[l];
                    yh[l] = d0 * (float)(((a & 0xF) | ((h & 3) << 4)) - 32);
                    yh[l + 32] = d1 * (float)(((c & 0xF) | (((h >> 2) & 3) << 4)) - 32);
                    yh[l + 64] = d2 * (float)(((a >> 4) | (((h >> 4) & 3) << 4)) - 32);
                    yh[l + 96] = d3 * (float)(((c >> 4) | (((h >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

static int layout(int t, deq_fn *f, int *block, int *bytes) {
    switch (t) {
    case 1:  *f = deq_f16;  *block = 1;  *bytes = 2;   return 0;
    case 2:  *f = deq_q4_0; *block = 32; *bytes = 18;  return 0;
    case 3:  *f = deq_q4_1; *block = 32; *bytes = 20;  return 0;
    case 6:  *f = deq_q5_0; *block = 32; *bytes = 22;  return 0;
    case 7:  *f = deq_q5_1; *block = 32; *bytes = 24;  return 0;
    case 8:  *f = deq_q8_0; *block = 32; *bytes = 34;  return 0;
    case 12: *f = deq_q4_k; *block = QK; *bytes = 144; return 0;
    case 13: *f = deq_q5_k; *block = QK; *bytes = 176; return 0;
    case 14: *f = deq_q6_k; *block = QK; *bytes = 210; return 0;
    case 30: *f = deq_bf16; *block = 1;  *bytes = 2;   return 0;
    }
    return -1;
}

int gt_q_supported(int t) {
    deq_fn f; int bl, by;
    return layout(t, &f, &bl, &by) == 0;
}

/* float32 rows ids[0..n) (all rows in order when ids is NULL) of a [*, k] matrix whose
   rows are rb bytes apart: out [n, k] */
int gt_deq_rows(int t, const uint8_t *w, long rb, const int64_t *ids, long n, long k,
                float *out) {
    deq_fn f; int bl, by;
    if (layout(t, &f, &bl, &by)) return -1;
    for (long i = 0; i < n; i++) f(w + (ids ? ids[i] : i) * rb, out + i * k, k / bl);
    return 0;
}

/* the same into float64 (each float32 value widened exactly): the row is dequantized
   into the upper half of its own output row, then widened front to back */
int gt_deq_rows_f64(int t, const uint8_t *w, long rb, const int64_t *ids, long n, long k,
                    double *out) {
    deq_fn f; int bl, by;
    if (layout(t, &f, &bl, &by)) return -1;
    for (long i = 0; i < n; i++) {
        double *o = out + i * k;
        float *tmp = (float *)o + k;
        f(w + (ids ? ids[i] : i) * rb, tmp, k / bl);
        for (long j = 0; j < k; j++) o[j] = (double)tmp[j];
    }
    return 0;
}

/* --- bf16 tiles: the operands of the bf16 GEMMs (``--compute bf16``) ------------------
   Rounded as gt_bf16 (the prelude's; nearest even, NaN kept quiet), which is how ggml
   rounds float32 to bf16.  A row is dequantized a chunk at a time into float32 kept in
   L1, then rounded (a loop that vectorizes); rows split over the threads. */
#define BF16_CHUNK 1024  /* a multiple of every block size */

static void row_bf16(deq_fn f, int bl, int by, const uint8_t *row, long c0, long nc,
                     uint16_t *restrict o) {
    float tmp[BF16_CHUNK];
    for (long j = 0; j < nc; j += BF16_CHUNK) {
        const long m = nc - j < BF16_CHUNK ? nc - j : BF16_CHUNK;
        f(row + (c0 + j) / bl * by, tmp, m / bl);
        for (long i = 0; i < m; i++) o[j + i] = gt_bf16(tmp[i]);
    }
}

/* out[i * ldo + j] = bf16 of W[row, c0 + j] for j < nc, row = ids[i] (r0 + i when ids
   is NULL), i < n; c0 and nc multiples of the block */
int gt_deq_tile_bf16(int t, const uint8_t *w, long rb, const int64_t *ids, long r0, long n,
                     long c0, long nc, uint16_t *out, long ldo) {
    deq_fn f; int bl, by;
    if (layout(t, &f, &bl, &by) || c0 % bl || nc % bl) return -1;
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++)
        row_bf16(f, bl, by, w + (ids ? ids[i] : r0 + i) * rb, c0, nc, out + i * ldo);
    return 0;
}

/* o[i] = bf16 of x[i]: the activation operand of a bf16 GEMM */
void gt_f32_bf16(const float *restrict x, uint16_t *restrict o, long n) {
    #pragma omp parallel for schedule(static) if (n >= (1L << 16))
    for (long i = 0; i < n; i++) o[i] = gt_bf16(x[i]);
}

/* --- tiled GEMMs -------------------------------------------------------------------- */

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *,
                          int64_t, const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float *,
                          int32_t, const float *, int32_t, float, float *, int32_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double, const double *,
                          int64_t, const double *, int64_t, double, double *, int64_t);
typedef void (*dgemm32_t)(int, int, int, int32_t, int32_t, int32_t, double, const double *,
                          int32_t, const double *, int32_t, double, double *, int32_t);

#define TR(t) ((t) ? TRANS : NO_TRANS)

static void gemm_f(void *fn, int ilp64, int ta, int tb, long m, long n, long k,
                   const float *a, long lda, const float *b, long ldb, float beta, float *c,
                   long ldc) {
    if (ilp64)
        ((sgemm64_t)fn)(ROW_MAJOR, TR(ta), TR(tb), m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    else
        ((sgemm32_t)fn)(ROW_MAJOR, TR(ta), TR(tb), (int32_t)m, (int32_t)n, (int32_t)k, 1.0f,
                        a, (int32_t)lda, b, (int32_t)ldb, beta, c, (int32_t)ldc);
}

static void gemm_d(void *fn, int ilp64, int ta, int tb, long m, long n, long k,
                   const double *a, long lda, const double *b, long ldb, double beta,
                   double *c, long ldc) {
    if (ilp64)
        ((dgemm64_t)fn)(ROW_MAJOR, TR(ta), TR(tb), m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc);
    else
        ((dgemm32_t)fn)(ROW_MAJOR, TR(ta), TR(tb), (int32_t)m, (int32_t)n, (int32_t)k, 1.0,
                        a, (int32_t)lda, b, (int32_t)ldb, beta, c, (int32_t)ldc);
}

/* dst[j * ldd + i] = src[i * m + j] for i < n, j < m: a [n, m] block transposed into a
   matrix with row stride ldd, in cache-sized squares */
#define TRANSPOSE(NAME, TYPE)                                                         \
static void NAME(const TYPE *restrict src, long n, long m, TYPE *restrict dst, long ldd) { \
    for (long i0 = 0; i0 < n; i0 += 32)                                              \
        for (long j0 = 0; j0 < m; j0 += 32) {                                        \
            const long i1 = i0 + 32 < n ? i0 + 32 : n, j1 = j0 + 32 < m ? j0 + 32 : m; \
            for (long j = j0; j < j1; j++)                                           \
                for (long i = i0; i < i1; i++) dst[j * ldd + i] = src[i * m + j];    \
        }                                                                            \
}
TRANSPOSE(transpose_f, float)
TRANSPOSE(transpose_d, double)

/* tile [n, nc] of W: rows r0.., columns c0.. (c0, nc multiples of the block) */
static void tile_f(deq_fn f, int bl, int by, const uint8_t *w, long rb, long r0, long n,
                   long c0, long nc, float *tile) {
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++) f(w + (r0 + i) * rb + c0 / bl * by, tile + i * nc, nc / bl);
}

static void tile_d(deq_fn f, int bl, int by, const uint8_t *w, long rb, long r0, long n,
                   long c0, long nc, double *tile) {
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++) {
        double *o = tile + i * nc;
        float *tmp = (float *)o + nc;
        f(w + (r0 + i) * rb + c0 / bl * by, tmp, nc / bl);
        for (long j = 0; j < nc; j++) o[j] = (double)tmp[j];
    }
}

/* The drivers.  y[T, rows] = x[T, k] @ W^T and z[T, k] = g[T, rows] @ W over tiles of R
   rows x C block-aligned columns of W (``tile``: R * C values of scratch).

   ``lay`` 0 writes each product straight into the output's column block (BLAS with
   ldc = the output's row length).  ``lay`` 1 computes the transposed block
   ([rows of W, T], ``tbuf``: max(R, C) * T more values of scratch) and transposes it into
   place: OpenBLAS's Haswell kernels run tile @ x^T (the long side first) up to 4x faster
   than x @ tile^T at T = 256 (measured), and the transpose costs one pass over T x R
   values per tile. */
#define DRIVERS(SUF, TYPE, TILE, GEMM, TRANSPOSE_FN)                                   \
int gt_qgemm_##SUF(int t, const uint8_t *w, long rb, long rows, long k, const TYPE *x,  \
                   long T, TYPE *y, TYPE *tile, long R, long C, void *gemm, int ilp64,  \
                   int lay, TYPE *tbuf) {                                            \
    deq_fn f; int bl, by;                                                              \
    if (layout(t, &f, &bl, &by) || C % bl) return -1;                                  \
    for (long r0 = 0; r0 < rows; r0 += R) {                                            \
        const long n = rows - r0 < R ? rows - r0 : R;                                  \
        for (long c0 = 0; c0 < k; c0 += C) {                                           \
            const long nc = k - c0 < C ? k - c0 : C;                                   \
            TILE(f, bl, by, w, rb, r0, n, c0, nc, tile);                               \
            if (lay) /* tbuf[n, T] (+)= tile @ x[:, c0..]^T */                      \
                GEMM(gemm, ilp64, 0, 1, n, T, nc, tile, nc, x + c0, k, c0 ? 1 : 0,     \
                     tbuf, T);                                                         \
            else /* y[:, r0..] (+)= x[:, c0..] @ tile^T */                             \
                GEMM(gemm, ilp64, 0, 1, T, n, nc, x + c0, k, tile, nc, c0 ? 1 : 0,     \
                     y + r0, rows);                                                    \
        }                                                                              \
        if (lay) TRANSPOSE_FN(tbuf, n, T, y + r0, rows);                            \
    }                                                                                  \
    return 0;                                                                          \
}                                                                                      \
int gt_qgemm_t_##SUF(int t, const uint8_t *w, long rb, long rows, long k, const TYPE *g, \
                     long T, TYPE *z, TYPE *tile, long R, long C, void *gemm, int ilp64, \
                     int lay, TYPE *tbuf) {                                          \
    deq_fn f; int bl, by;                                                              \
    if (layout(t, &f, &bl, &by) || C % bl) return -1;                                  \
    for (long c0 = 0; c0 < k; c0 += C) {                                               \
        const long nc = k - c0 < C ? k - c0 : C;                                       \
        for (long r0 = 0; r0 < rows; r0 += R) {                                        \
            const long n = rows - r0 < R ? rows - r0 : R;                              \
            TILE(f, bl, by, w, rb, r0, n, c0, nc, tile);                               \
            if (lay) /* tbuf[nc, T] (+)= tile^T @ g[:, r0..]^T */                   \
                GEMM(gemm, ilp64, 1, 1, nc, T, n, tile, nc, g + r0, rows, r0 ? 1 : 0,  \
                     tbuf, T);                                                         \
            else /* z[:, c0..] (+)= g[:, r0..] @ tile */                               \
                GEMM(gemm, ilp64, 0, 0, T, nc, n, g + r0, rows, tile, nc, r0 ? 1 : 0,  \
                     z + c0, k);                                                       \
        }                                                                              \
        if (lay) TRANSPOSE_FN(tbuf, nc, T, z + c0, k);                              \
    }                                                                                  \
    return 0;                                                                          \
}

DRIVERS(f32, float, tile_f, gemm_f, transpose_f)
DRIVERS(f64, double, tile_d, gemm_d, transpose_d)
