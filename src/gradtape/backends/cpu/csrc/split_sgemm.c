/* A float32 GEMM as NumPy's BLAS computes it, split over the OpenMP threads: each thread
   one single-threaded cblas_sgemm on its share of C's columns (of its rows where C has
   fewer than SG_ROWS_BELOW columns), so a replay's threads stay OpenMP's (oneDNN, our
   kernels) while OpenBLAS's kernels do the work.  The caller keeps NumPy's BLAS on one
   thread meanwhile (blas.one_blas_thread).  Each C element is one BLAS dot over k,
   whichever thread computes it: the same split gives the same bits every call. */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SG_ROWS_BELOW 64  /* columns below which the rows are split instead */

typedef void (*sg_sgemm64)(int, int, int, int64_t, int64_t, int64_t, float, const float *,
                           int64_t, const float *, int64_t, float, float *, int64_t);
typedef void (*sg_sgemm32)(int, int, int, int, int, int, float, const float *, int,
                           const float *, int, float, float *, int);

/* C [m, n] (row-major, rows ldc apart) = op(A) op(B): A [m, k] stored as rows lda apart,
   or (ta) as its transpose [k, m]; B [k, n] likewise (tb: stored [n, k]).  fn: the
   library's cblas_sgemm, with 64-bit integers where ilp64. */
void gt_split_sgemm(const void *fn, int ilp64, int ta, int tb, long m, long n, long k,
                    const float *a, long lda, const float *b, long ldb, float *c, long ldc) {
    const int by_rows = n < SG_ROWS_BELOW;
    _Pragma("omp parallel")
    {
#ifdef _OPENMP
        const long nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const long nt = 1, id = 0;
#endif
        const long total = by_rows ? m : n, unit = by_rows ? 8 : 16;
        const long per = ((total + nt - 1) / nt + unit - 1) / unit * unit;
        const long p0 = id * per, p1 = p0 + per < total ? p0 + per : total;
        if (p1 > p0) {
            long mm = m, nn = n;
            const float *aa = a, *bb = b;
            float *cc = c;
            if (by_rows) {  /* rows p0..p1 of op(A) and of C */
                mm = p1 - p0;
                aa = ta ? a + p0 : a + p0 * lda;
                cc = c + p0 * ldc;
            } else {  /* columns p0..p1 of op(B) and of C */
                nn = p1 - p0;
                bb = tb ? b + p0 * ldb : b + p0;
                cc = c + p0;
            }
            const int ota = ta ? 112 : 111, otb = tb ? 112 : 111;  /* CblasTrans, NoTrans */
            if (ilp64)
                ((sg_sgemm64)fn)(101, ota, otb, mm, nn, k, 1.0f, aa, lda, bb, ldb, 0.0f, cc,
                                 ldc);
            else
                ((sg_sgemm32)fn)(101, ota, otb, (int)mm, (int)nn, (int)k, 1.0f, aa, (int)lda,
                                 bb, (int)ldb, 0.0f, cc, (int)ldc);
        }
    }
}
