/* What every C source of gradtape shares: the generated kernels (_cgen.py) get this text
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
/* float32 -> bf16 bits, round to nearest even (the carry of 0x7FFF plus the lowest kept
   bit); NaN stays a quiet NaN instead of rounding into infinity. */
static inline uint16_t gt_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? ((u >> 16) | 0x40u) : r);
}
typedef void (*gt_kernel)(void **);
#endif
