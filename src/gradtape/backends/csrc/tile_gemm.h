/* Small float32 GEMMs on one thread, for the fused attention (flash.c): C[m, n] (=|+=)
   A[m, k] B[k, n] with m and n about a hundred and k from 64 to a few hundred, the
   shapes NumPy's OpenBLAS runs worst (60-115 GFLOP/s on 2 Zen 3 cores, where one core's
   FMA peak is about 80).

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

/* C[0:mr, 0:nc] (+)= A[0:mr, 0:k] b[0:k, 0:NR] (b one packed panel): mr <= MR rows,
   nc <= NR columns; rows past mr read row mr - 1 (computed, dropped) and a partial
   panel goes through a local block, so one unrolled body serves every edge. */
static inline void tg_block(long mr, long nc, long k, const float *A, long rsa, long csa,
                            const float *b, float *C, long ldc, int acc) {
    float part[TG_MR * TG_NR];
    float *c = C;
    long ld = ldc;
    if (nc < TG_NR) {  /* the last columns: through `part` */
        for (long r = 0; r < mr; r++)
            for (long j = 0; j < TG_NR; j++)
                part[r * TG_NR + j] = acc && j < nc ? C[r * ldc + j] : 0.0f;
        c = part;
        ld = TG_NR;
        acc = 1;
    }
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
    if (c == part)
        for (long r = 0; r < mr; r++) memcpy(C + r * ldc, part + r * TG_NR, nc * sizeof(float));
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
#endif
