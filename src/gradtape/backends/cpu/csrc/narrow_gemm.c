/* float32 GEMMs with one narrow side (at most NARROW = 32): LoRA's rank-r products
   `x @ A`, `u @ B`, their gradients `dY @ B^T`, `U^T dY`, `X^T dU`.  `out [m, n] = a [m, k]
   @ b [k, n]`, out C order, a any element strides (a transposed view is read in place), b
   with contiguous rows (else copied so first).  A library's GEMM packs and blocks for big
   sides and is slow when one is 8 (oneDNN's jit kernels below AVX-512 most); here every
   tile of out, 8 rows by 16 (or 8) columns, is summed over all of k in registers, 8
   lanes a vector (FMA), the tiles split over the OpenMP threads or all on one; without
   FMA, plain loops.  Sums run in another order than a library's: equal within float32 rounding,
   never bitwise.  ../narrow.py binds it; ../measure.py times it against oneDNN per shape.
   This file knows nothing of Python. */
#include "gt_prelude.h"
#if defined(__FMA__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#define NARROW 32
#define TR 8   /* rows of a tile */
#define TC 16  /* columns of a full tile */

#if defined(__FMA__) && defined(__AVX2__)
/* 4 rows by 16 columns: 8 accumulators, so the FMAs' latency is hidden */
static inline void tile4x16(float *out, long ldo, const float *const ar[4], long nr, long sak,
                            const float *b, long ldb, long k) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00,
           c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    for (long p = 0; p < k; p++) {
        const float *bp = b + p * ldb;
        __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
        __m256 x = _mm256_broadcast_ss(ar[0] + p * sak);
        c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(ar[1] + p * sak);
        c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(ar[2] + p * sak);
        c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(ar[3] + p * sak);
        c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    __m256 c[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (long r = 0; r < nr; r++) {
        _mm256_storeu_ps(out + r * ldo, c[r][0]);
        _mm256_storeu_ps(out + r * ldo + 8, c[r][1]);
    }
}

/* 8 rows by 8 columns: 8 accumulators */
static inline void tile8x8(float *out, long ldo, const float *const ar[8], long nr, long sak,
                           const float *b, long ldb, long k) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
           c7 = c0;
    for (long p = 0; p < k; p++) {
        __m256 b0 = _mm256_loadu_ps(b + p * ldb);
        long o = p * sak;
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[0] + o), b0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[1] + o), b0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[2] + o), b0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[3] + o), b0, c3);
        c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[4] + o), b0, c4);
        c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[5] + o), b0, c5);
        c6 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[6] + o), b0, c6);
        c7 = _mm256_fmadd_ps(_mm256_broadcast_ss(ar[7] + o), b0, c7);
    }
    __m256 c[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    for (long r = 0; r < nr; r++) _mm256_storeu_ps(out + r * ldo, c[r]);
}
#endif

/* out[i0 + r, j0:j0+w) for the TR rows ar[] (pointers to a's rows, stride sak along k;
   rows past nr repeat row 0 and are not stored) */
static inline void tile(float *out, long ldo, const float *const ar[TR], long nr, long sak,
                        const float *b, long ldb, long k, long j0, long w) {
#if defined(__FMA__) && defined(__AVX2__)
    if (w == 16) {
        tile4x16(out + j0, ldo, ar, nr < 4 ? nr : 4, sak, b + j0, ldb, k);
        if (nr > 4)
            tile4x16(out + 4 * ldo + j0, ldo, ar + 4, nr - 4, sak, b + j0, ldb, k);
        return;
    }
    if (w == 8) {
        tile8x8(out + j0, ldo, ar, nr, sak, b + j0, ldb, k);
        return;
    }
#endif
    for (long r = 0; r < nr; r++)
        for (long j = j0; j < j0 + w; j++) {
            float s = 0.0f;
            for (long p = 0; p < k; p++) s += ar[r][p * sak] * b[p * ldb + j];
            out[r * ldo + j] = s;
        }
}

/* bp: scratch of k * n floats, used where b's rows are not contiguous (sbn != 1);
   threaded: the tiles split over the OpenMP threads, else all on the calling thread (no
   parallel region to wake and join: a product of a few microseconds' work can cost less
   so, more where the cores are shared with other processes) */
void gt_narrow(float *out, const float *a, long sam, long sak, const float *b, long sbk,
               long sbn, long m, long k, long n, float *bp, int threaded) {
    if (sbn != 1) {
        for (long p = 0; p < k; p++)
            for (long j = 0; j < n; j++) bp[p * n + j] = b[p * sbk + j * sbn];
        b = bp;
        sbk = n;
    }
#if defined(__FMA__) && defined(__AVX2__)
    long full = n / TC, half = (n % TC) >= 8, cols = full + half + (n % 8 != 0);
#else
    long full = 0, half = 0, cols = 1;
#endif
    long rows = (m + TR - 1) / TR;
    #pragma omp parallel for schedule(static) if (threaded)
    for (long t = 0; t < rows * cols; t++) {
        long rb = t / cols, cb = t % cols, i0 = rb * TR, nr = m - i0 < TR ? m - i0 : TR;
        const float *ar[TR];
        for (long r = 0; r < TR; r++) ar[r] = a + (i0 + (r < nr ? r : 0)) * sam;
        long j0, w;
        if (cb < full) { j0 = cb * TC; w = TC; }
        else if (cb == full && half) { j0 = full * TC; w = 8; }
        else { j0 = full * TC + half * 8; w = n - j0; }
        tile(out + i0 * n, n, ar, nr, sak, b, sbk, k, j0, w);
    }
}
