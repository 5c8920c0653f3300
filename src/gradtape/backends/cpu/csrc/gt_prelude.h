/* What every C source of gradtape shares: the generated kernels (codegen.py) get this text
   first; the files here include it.  float32 exp as an inlined polynomial (libm's expf
   is a call that stops vectorization), float32 -> bf16 rounding, and the kernel type. */
#ifndef GT_PRELUDE_H
#define GT_PRELUDE_H
#include <math.h>
#include <stdint.h>
#include <string.h>
/* exp for float32: exp(x) = 2^n exp(r), r = x - n ln2 (Cephes expf coefficients);
   branch-free so loops calling it vectorize; overflow gives inf, underflow 0, NaN stays. */
static inline float gt_expf(float x) {
    x = x > 89.0f ? 89.0f : x;
    x = x < -104.0f ? -104.0f : x;
    float fn = x * 1.44269504088896341f;
    fn = (fn + 12582912.0f) - 12582912.0f;   /* round to nearest integer */
    int32_t n = (int32_t)fn;
    float r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float z = r * r;
    float y = ((((( 1.9875691500E-4f * r + 1.3981999507E-3f) * r + 8.3334519073E-3f) * r
                 + 4.1665795894E-2f) * r + 1.6666665459E-1f) * r + 5.0000001201E-1f) * z
              + r + 1.0f;
    int32_t n1 = n >> 1, n2 = n - n1;        /* two factors: 2^n may not be a normal float */
    int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    return y * s1 * s2;
}
/* a * b + c for the sums of a product inside a kernel (codegen._product_sum): one fused
   instruction where the CPU has it, else a product and a sum (a libm call would stop
   vectorization) */
#if defined(__FMA__) || defined(__aarch64__)
#define GT_FMA(a, b, c) __builtin_fma(a, b, c)
#define GT_FMAF(a, b, c) __builtin_fmaf(a, b, c)
#else
#define GT_FMA(a, b, c) ((a) * (b) + (c))
#define GT_FMAF(a, b, c) ((a) * (b) + (c))
#endif
/* float32 -> bf16 bits, round to nearest even (the carry of 0x7FFF plus the lowest kept
   bit); NaN stays a quiet NaN instead of rounding into infinity. */
static inline uint16_t gt_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? ((u >> 16) | 0x40u) : r);
}
/* o[i] = gt_bf16(x[i]) over [0, n); with AVX512-BF16 32 values at a time by its own
   conversion, the same rounding (NaN made quiet alike), except that it takes denormal
   inputs as zero: 32 values holding a denormal take gt_bf16 instead, so the bits are
   gt_bf16's always */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    !defined(GV_EMULATE)
#define GT_CVT16 1  /* the conversion instruction (and the checks and permutes around it) */
#include <immintrin.h>
#else
#define GT_CVT16 0
#endif
static inline void gt_bf16_n(const float *restrict x, uint16_t *restrict o, long n) {
    long i = 0;
#if GT_CVT16
    for (; i + 32 <= n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        if (_mm512_fpclass_ps_mask(a, 0x20) | _mm512_fpclass_ps_mask(b, 0x20))
            for (long j = i; j < i + 32; j++) o[j] = gt_bf16(x[j]);
        else
            _mm512_storeu_si512(o + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
#endif
    for (; i < n; i++) o[i] = gt_bf16(x[i]);
}
/* the same over n values split among the OpenMP threads in runs of GT_BF16_RUN */
#define GT_BF16_RUN 4096L
static inline void gt_bf16_par(const float *restrict x, uint16_t *restrict o, long n) {
    #pragma omp parallel for schedule(static)
    for (long c = 0; c < n; c += GT_BF16_RUN)
        gt_bf16_n(x + c, o + c, n - c < GT_BF16_RUN ? n - c : GT_BF16_RUN);
}
typedef void (*gt_kernel)(void **);
#endif
