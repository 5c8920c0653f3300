/* Small float32 GEMMs on one thread, for the fused attention (flash.c): C[m, n] (=|+=)
   A[m, k] B[k, n] with m and n about a hundred and k from 64 to a few hundred, the
   shapes NumPy's OpenBLAS runs worst, far below the cores' FMA peak.

   A register block of MR = 6 rows of C by NR = two vectors of columns (6 x 16 floats
   with AVX2, 6 x 32 with AVX-512): every k adds one broadcast A[i, k] times two vectors
   of B's row k into 12 accumulators.  A is read in place with any strides (A^T is A with
   its strides swapped); B is first packed into panels of NR columns, [k][NR] each,
   contiguous, zero-padded past n: the rows of a strided B alias in L1, a panel never
   does.  Each C element is one float32 sum over k in order: only the order of the
   additions differs from BLAS.  The vectors are gv_simd.h's; without them the block
   is plain C. */
#ifndef GT_TILE_GEMM_H
#define GT_TILE_GEMM_H
#include "gt_prelude.h"
#include "gv_simd.h"
#if defined(__AVX512BF16__) && !defined(GV_EMULATE)
#include <immintrin.h>
#endif

#define TG_MR 6  /* rows of C per register block */
#ifdef GV_W
#define TG_VL GV_W
#else
#define TG_VL 8  /* the panel width of the plain-C block */
#endif
#define TG_NR (2 * TG_VL)  /* columns of C per register block */

/* floats of the packed panels of a [k, n] B */
static inline long tg_packed_size(long k, long n) { return (n + TG_NR - 1) / TG_NR * TG_NR * k; }

/* B [k, n], element (p, j) at B[p * rs + j * cs], into panels pb (tg_packed_size):
   panel c holds columns [c * NR, c * NR + NR) as [k][NR] at pb + c * k * NR.  B's
   rows (cs == 1) or columns (rs == 1) are read in order, whichever is contiguous. */
static void tg_pack(const float *B, long rs, long cs, long k, long n, float *pb) {
    for (long j0 = 0; j0 < n; j0 += TG_NR) {
        const long nc = n - j0 < TG_NR ? n - j0 : TG_NR;
        float *dst = pb + j0 * k;
        if (nc < TG_NR)
            for (long p = 0; p < k; p++) memset(dst + p * TG_NR, 0, TG_NR * sizeof(float));
        if (cs == 1)
            for (long p = 0; p < k; p++)
                memcpy(dst + p * TG_NR, B + p * rs + j0, nc * sizeof(float));
        else
            for (long j = 0; j < nc; j++) {
                const float *src = B + (j0 + j) * cs;
                for (long p = 0; p < k; p++) dst[p * TG_NR + j] = src[p * rs];
            }
    }
}

/* The last, partial panel of columns (nc < NR) goes through a local block `part`: C's
   values copied in (zeros past nc, or everywhere when not accumulating), and out again. */
static inline void tg_edge_in(long mr, long nc, const float *C, long ldc, float *part,
                              float **c, long *ld, int *acc) {
    for (long r = 0; r < mr; r++)
        for (long j = 0; j < TG_NR; j++)
            part[r * TG_NR + j] = *acc && j < nc ? C[r * ldc + j] : 0.0f;
    *c = part;
    *ld = TG_NR;
    *acc = 1;
}
static inline void tg_edge_out(long mr, long nc, const float *part, float *C, long ldc) {
    for (long r = 0; r < mr; r++) memcpy(C + r * ldc, part + r * TG_NR, nc * sizeof(float));
}

/* C[0:mr, 0:nc] (+)= A[0:mr, 0:k] b[0:k, 0:NR] (b one packed panel): mr <= MR rows,
   nc <= NR columns; rows past mr read row mr - 1 (computed, dropped) and a partial
   panel goes through a local block, so one unrolled body serves every edge. */
static inline void tg_block(long mr, long nc, long k, const float *A, long rsa, long csa,
                            const float *b, float *C, long ldc, int acc) {
    float part[TG_MR * TG_NR];
    float *c = C;
    long ld = ldc;
    if (nc < TG_NR) tg_edge_in(mr, nc, C, ldc, part, &c, &ld, &acc);
    const float *a[TG_MR];
    for (int r = 0; r < TG_MR; r++) a[r] = A + (r < mr ? r : mr - 1) * rsa;
#ifdef GV_W
    gv_f s[TG_MR][2];
    _Pragma("GCC unroll 6")
    for (int r = 0; r < TG_MR; r++) {
        s[r][0] = acc && r < mr ? gv_load(c + r * ld) : gv_zero();
        s[r][1] = acc && r < mr ? gv_load(c + r * ld + TG_VL) : gv_zero();
    }
    for (long p = 0; p < k; p++) {
        const gv_f b0 = gv_load(b + p * TG_NR), b1 = gv_load(b + p * TG_NR + TG_VL);
        _Pragma("GCC unroll 6")
        for (int r = 0; r < TG_MR; r++) {
            const gv_f x = gv_set1(a[r][p * csa]);
            s[r][0] = gv_fma(x, b0, s[r][0]);
            s[r][1] = gv_fma(x, b1, s[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        gv_store(c + r * ld, s[r][0]);
        gv_store(c + r * ld + TG_VL, s[r][1]);
    }
#else
    for (long r = 0; r < mr; r++) {
        float s[TG_NR];
        for (long j = 0; j < TG_NR; j++) s[j] = acc ? c[r * ld + j] : 0.0f;
        for (long p = 0; p < k; p++) {
            const float x = a[r][p * csa];
            for (long j = 0; j < TG_NR; j++) s[j] += x * b[p * TG_NR + j];
        }
        memcpy(c + r * ld, s, sizeof s);
    }
#endif
    if (c == part) tg_edge_out(mr, nc, part, C, ldc);
}

/* C[m, n] (=|+=) A[m, k] B[k, n]: A element (i, p) at A[i * rsa + p * csa], B packed as
   by tg_pack but with panels ps floats apart (k * NR when packed for this k; larger when
   B is the first k rows of a taller packed matrix), C rows ldc apart (accumulate: added
   to C). */
static void tg_gemm(long m, long n, long k, const float *A, long rsa, long csa,
                    const float *pb, long ps, float *C, long ldc, int accumulate) {
    for (long j = 0; j < n; j += TG_NR)
        for (long i = 0; i < m; i += TG_MR)
            tg_block(m - i < TG_MR ? m - i : TG_MR, n - j < TG_NR ? n - j : TG_NR, k,
                     A + i * rsa, rsa, csa, pb + j / TG_NR * ps, C + i * ldc + j, ldc,
                     accumulate);
}
/* --- bf16 inputs, float32 sums (the fused attention under --compute bf16) ------------

   The same register block over bf16 values: each pair of k (2p, 2p + 1) adds
   A[i, 2p] B[2p, j] + A[i, 2p + 1] B[2p + 1, j] to a float32 sum, one AVX512-BF16
   vdpbf16ps per row and vector (twice an FMA's products per instruction).  A panel of B
   holds [kp][NR][2] values (kp = ceil(k / 2) pairs, a pair's two values adjacent, zeros
   past k and past n); A holds its pairs adjacent too, pair p of row i at A + i * rsa +
   p * csa (in bf16 values): a row-major copy (tg_rows16: csa = 2) or a transposed one
   (tg_cols16: rsa = 2).  Values are rounded to nearest even once, on the way in
   (gt_bf16).  Without AVX512-BF16 (or under GV_EMULATE) the block is plain C over the
   same products: equal to the instruction within float32 rounding. */
typedef uint16_t tg_bf16;

static inline long tg_pairs(long k) { return (k + 1) / 2; }
/* bf16 values of the packed panels of a [k, n] B */
static inline long tg_packed16_size(long k, long n) {
    return (n + TG_NR - 1) / TG_NR * TG_NR * 2 * tg_pairs(k);
}
static inline uint32_t tg_pair(float lo, float hi) {
    return (uint32_t)gt_bf16(lo) | (uint32_t)gt_bf16(hi) << 16;
}
static inline float tg_f32(tg_bf16 h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* B [k, n], element (p, j) at B[p * rs + j * cs], into bf16 panels pb (tg_packed16_size):
   panel c at pb + c * NR * 2 * kp */
static void tg_pack16(const float *B, long rs, long cs, long k, long n, tg_bf16 *pb) {
    const long kp = tg_pairs(k);
    for (long j0 = 0; j0 < n; j0 += TG_NR) {
        const long nc = n - j0 < TG_NR ? n - j0 : TG_NR;
        uint32_t *dst = (uint32_t *)(pb + j0 * 2 * kp);
        for (long p = 0; p < kp; p++) {
            const float *r0 = B + 2 * p * rs + j0 * cs, *r1 = r0 + rs;
            uint32_t *d = dst + p * TG_NR;
            if (2 * p + 1 < k)
                for (long j = 0; j < nc; j++) d[j] = tg_pair(r0[j * cs], r1[j * cs]);
            else
                for (long j = 0; j < nc; j++) d[j] = tg_pair(r0[j * cs], 0.0f);
            for (long j = nc; j < TG_NR; j++) d[j] = 0;
        }
    }
}

/* a [m, k] (rows lda apart) as bf16 pairs along its rows: row i at dst + i * ldd
   (ldd >= 2 * kp), a zero after an odd k (the pairs of a row are its values in order) */
static void tg_rows16(const float *a, long lda, long m, long k, tg_bf16 *dst, long ldd) {
    for (long i = 0; i < m; i++) {
        const float *r = a + i * lda;
        gt_bf16_n(r, dst + i * ldd, k - k % 2);
        if (k % 2) ((uint32_t *)(dst + i * ldd))[k / 2] = tg_pair(r[k - 1], 0.0f);
    }
}

/* a [m, k] (rows lda apart) transposed, as bf16 pairs along its columns: row j of a^T,
   pair p = (a[2p, j], a[2p + 1, j]) at dst + p * 2 * ldt + 2 * j (ldt >= k), a zero row
   after an odd m */
static void tg_cols16(const float *a, long lda, long m, long k, tg_bf16 *dst, long ldt) {
#if GT_CVT16
    /* words 2i and 2i + 1 of a pair vector: word i of the first row's 16, of the next */
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                         18, 2, 17, 1, 16, 0);
#endif
    for (long p = 0; p < m / 2; p++) {
        const float *r0 = a + 2 * p * lda, *r1 = r0 + lda;
        uint32_t *d = (uint32_t *)dst + p * ldt;
        long j = 0;
#if GT_CVT16
        /* AVX512-BF16's conversion of 16 values of each row, then interleaved; where
           they hold a denormal, tg_pair's (as gt_bf16_n) */
        for (; j + 16 <= k; j += 16) {
            const __m512 a0 = _mm512_loadu_ps(r0 + j), a1 = _mm512_loadu_ps(r1 + j);
            if (_mm512_fpclass_ps_mask(a0, 0x20) | _mm512_fpclass_ps_mask(a1, 0x20))
                for (long q = j; q < j + 16; q++) d[q] = tg_pair(r0[q], r1[q]);
            else
                _mm512_storeu_si512(d + j, _mm512_permutexvar_epi16(
                    zip, (__m512i)_mm512_cvtne2ps_pbh(a1, a0)));
        }
#endif
        _Pragma("omp simd")
        for (long q = j; q < k; q++) d[q] = tg_pair(r0[q], r1[q]);
    }
    if (m % 2) {
        const float *r0 = a + (m - 1) * lda;
        uint32_t *d = (uint32_t *)dst + m / 2 * ldt;
        for (long j = 0; j < k; j++) d[j] = tg_pair(r0[j], 0.0f);
    }
}

#if defined(__AVX512BF16__) && !defined(GV_EMULATE) && TG_NR == 32
#define TG_WIDE16 1
/* C[0:mr, 0:16 nv] (+)= A[0:mr, 0:2kp] B over nv / 2 whole panels of B (at b, b + ps):
   AVX512-BF16's register block, 6 rows by nv vectors of sums.  nv = 4 (tg_gemm16's
   blocks of two panels) keeps 24 sums in registers, so each loaded A pair feeds four
   vdpbf16ps and a block's work is twice its fixed cost (the sums' loads and stores,
   the first products' latency), which counts at the attention's short k (a head's 64 or
   128 values).  Each sum takes the pairs in order whatever nv is. */
static inline void tg_block16_vec(int nv, long mr, long kp, const tg_bf16 *A, long rsa,
                                  long csa, const tg_bf16 *b, long ps, float *C, long ldc,
                                  int acc) {
    const tg_bf16 *a[TG_MR];
    for (int r = 0; r < TG_MR; r++) a[r] = A + (r < mr ? r : mr - 1) * rsa;
    __m512 s[TG_MR][4];
    _Pragma("GCC unroll 6")
    for (int r = 0; r < TG_MR; r++)
        for (int v = 0; v < nv; v++)
            s[r][v] = acc && r < mr ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
    for (long p = 0; p < kp; p++) {
        __m512bh bv[4];
        for (int v = 0; v < nv; v++)  /* vector v: panel v / 2, its half v % 2 */
            bv[v] = (__m512bh)_mm512_loadu_si512(b + v / 2 * ps + p * 2 * TG_NR + v % 2 * TG_NR);
        _Pragma("GCC unroll 6")
        for (int r = 0; r < TG_MR; r++) {
            uint32_t x;
            memcpy(&x, a[r] + p * csa, 4);
            const __m512bh xa = (__m512bh)_mm512_set1_epi32((int)x);
            for (int v = 0; v < nv; v++) s[r][v] = _mm512_dpbf16_ps(s[r][v], xa, bv[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(C + r * ldc + 16 * v, s[r][v]);
}
#else
#define TG_WIDE16 0
#endif

/* C[0:mr, 0:nc] (+)= A[0:mr, 0:2kp] b[0:2kp, 0:NR] over bf16 pairs, edges as tg_block */
static inline void tg_block16(long mr, long nc, long kp, const tg_bf16 *A, long rsa,
                              long csa, const tg_bf16 *b, float *C, long ldc, int acc) {
    float part[TG_MR * TG_NR];
    float *c = C;
    long ld = ldc;
    if (nc < TG_NR) tg_edge_in(mr, nc, C, ldc, part, &c, &ld, &acc);
#if TG_WIDE16
    tg_block16_vec(2, mr, kp, A, rsa, csa, b, 0, c, ld, acc);
#else
    const tg_bf16 *a[TG_MR];
    for (int r = 0; r < TG_MR; r++) a[r] = A + (r < mr ? r : mr - 1) * rsa;
    for (long r = 0; r < mr; r++) {
        float s[TG_NR];
        for (long j = 0; j < TG_NR; j++) s[j] = acc ? c[r * ld + j] : 0.0f;
        for (long p = 0; p < kp; p++) {
            const float x0 = tg_f32(a[r][p * csa]), x1 = tg_f32(a[r][p * csa + 1]);
            const tg_bf16 *bp = b + p * 2 * TG_NR;
            for (long j = 0; j < TG_NR; j++)
                s[j] += x0 * tg_f32(bp[2 * j]) + x1 * tg_f32(bp[2 * j + 1]);
        }
        memcpy(c + r * ld, s, sizeof s);
    }
#endif
    if (c == part) tg_edge_out(mr, nc, part, C, ldc);
}

/* tg_gemm over bf16: C[m, n] (=|+=) A[m, k] B[k, n], A as pairs (rsa, csa in bf16
   values), B in bf16 panels ps values apart; two whole panels at a time where
   tg_block16_vec runs, the rest one panel at a time.  Each C element is the same sum
   in the same order either way. */
static void tg_gemm16(long m, long n, long k, const tg_bf16 *A, long rsa, long csa,
                      const tg_bf16 *pb, long ps, float *C, long ldc, int accumulate) {
    const long kp = tg_pairs(k);
    long j = 0;
#if TG_WIDE16
    for (; j + 2 * TG_NR <= n; j += 2 * TG_NR)
        for (long i = 0; i < m; i += TG_MR)
            tg_block16_vec(4, m - i < TG_MR ? m - i : TG_MR, kp, A + i * rsa, rsa, csa,
                           pb + j / TG_NR * ps, ps, C + i * ldc + j, ldc, accumulate);
#endif
    for (; j < n; j += TG_NR)
        for (long i = 0; i < m; i += TG_MR)
            tg_block16(m - i < TG_MR ? m - i : TG_MR, n - j < TG_NR ? n - j : TG_NR, kp,
                       A + i * rsa, rsa, csa, pb + j / TG_NR * ps, C + i * ldc + j, ldc,
                       accumulate);
}
#endif
