/* The float32 vector the decode fast paths (ggml_vec.c, llama_decode.c) are written
   against, so that one kernel text serves both instruction sets -march=native may give:
     AVX-512:    GV_W = 16 lanes, gv_f = __m512
     AVX2 + FMA (+ F16C): GV_W = 8 lanes, gv_f = __m256 (AMD Zen 1-3, Intel Haswell ..)
   Neither: GV_W stays undefined and the callers keep their plain C loops.  gv_fma(a, b, c)
   is a * b + c with one rounding (the flags forbid the compiler to contract, so every
   fused multiply-add is one of these); gv_sum adds the lanes in a fixed order. */
#ifndef GT_GV_SIMD_H
#define GT_GV_SIMD_H
#include <stdint.h>

/* the arithmetic, whose intrinsics have the same names under either prefix P (_mm512,
   _mm256) */
#define GV_ARITH(P)                                                                     \
static inline gv_f gv_zero(void) { return P##_setzero_ps(); }                            \
static inline gv_f gv_set1(float v) { return P##_set1_ps(v); }                           \
static inline gv_f gv_load(const float *p) { return P##_loadu_ps(p); }                   \
static inline void gv_store(float *p, gv_f v) { P##_storeu_ps(p, v); }                   \
static inline gv_f gv_add(gv_f a, gv_f b) { return P##_add_ps(a, b); }                  \
static inline gv_f gv_mul(gv_f a, gv_f b) { return P##_mul_ps(a, b); }                  \
static inline gv_f gv_fma(gv_f a, gv_f b, gv_f c) { return P##_fmadd_ps(a, b, c); }

#if defined(GV_EMULATE)
/* for the tests: GV_EMULATE lanes (16: the AVX-512 paths) as GCC's generic vectors,
   on any CPU; gv_fma rounds twice here (the flags forbid contraction) */
#include <string.h>
#define GV_W GV_EMULATE
typedef float gv_f __attribute__((vector_size(4 * GV_W)));
static inline gv_f gv_zero(void) { gv_f v = {0}; return v; }
static inline gv_f gv_set1(float x) { return gv_zero() + x; }
static inline gv_f gv_load(const float *p) { gv_f v; memcpy(&v, p, sizeof v); return v; }
static inline void gv_store(float *p, gv_f v) { memcpy(p, &v, sizeof v); }
static inline gv_f gv_add(gv_f a, gv_f b) { return a + b; }
static inline gv_f gv_mul(gv_f a, gv_f b) { return a * b; }
static inline gv_f gv_fma(gv_f a, gv_f b, gv_f c) { return a * b + c; }
static inline float gv_sum(gv_f v) {
    float s = 0.0f;
    for (int l = 0; l < GV_W; l++) s += v[l];
    return s;
}
static inline void gv_nibs(const uint8_t *qs, int h, gv_f *lo, gv_f *hi) {
    for (int l = 0; l < GV_W; l++) {
        (*lo)[l] = (float)(qs[GV_W * h + l] & 15);
        (*hi)[l] = (float)(qs[GV_W * h + l] >> 4);
    }
}
static inline gv_f gv_i8(const uint8_t *p) {
    gv_f v;
    for (int l = 0; l < GV_W; l++) v[l] = (float)(int8_t)p[l];
    return v;
}
/* lanes of Q6_K quants from GV_W bytes each of ql and qh, the offset 32 subtracted:
   (((ql >> shl) & 15) | ((qh >> shh) & 3) << 4) - 32 */
static inline gv_f gv_q6(const uint8_t *ql, const uint8_t *qh, int shl, int shh) {
    gv_f v;
    for (int l = 0; l < GV_W; l++)
        v[l] = (float)((((ql[l] >> shl) & 15) | (((qh[l] >> shh) & 3) << 4)) - 32);
    return v;
}
/* lanes of Q5_K quants from GV_W bytes each of ql and qh: ((ql >> shl) & 15) |
   ((qh >> shh) & 1) << 4 */
static inline gv_f gv_q5(const uint8_t *ql, const uint8_t *qh, int shl, int shh) {
    gv_f v;
    for (int l = 0; l < GV_W; l++)
        v[l] = (float)(((ql[l] >> shl) & 15) | (((qh[l] >> shh) & 1) << 4));
    return v;
}
static inline gv_f gv_f16(const uint8_t *p) {
    gv_f v;
    for (int l = 0; l < GV_W; l++) {
        _Float16 h;
        memcpy(&h, p + 2 * l, 2);
        v[l] = (float)h;
    }
    return v;
}

#elif defined(__AVX512F__)
#include <immintrin.h>
#define GV_W 16
typedef __m512 gv_f;
GV_ARITH(_mm512)
static inline float gv_sum(gv_f v) { return _mm512_reduce_add_ps(v); }
/* lanes from the low and the high nibbles of bytes GV_W h .. GV_W h + GV_W - 1 of qs
   (h < 16 / GV_W: 0 here) */
static inline void gv_nibs(const uint8_t *qs, int h, gv_f *lo, gv_f *hi) {
    (void)h;
    const __m128i m4 = _mm_set1_epi8(15), q = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
}
/* GV_W bytes at p, and lanes from GV_W signed bytes (in a register / at p) */
static inline __m128i gv_bytes(const uint8_t *p) {
    return _mm_loadu_si128((const __m128i *)p);
}
static inline gv_f gv_i8v(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
static inline gv_f gv_i8(const uint8_t *p) { return gv_i8v(gv_bytes(p)); }
/* lanes from GV_W IEEE halves at p */
static inline gv_f gv_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GV_W 8
typedef __m256 gv_f;
GV_ARITH(_mm256)
/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline float gv_sum(gv_f v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* (the bytes widened to 32 bits first, then split: fewer shuffles than splitting first) */
static inline void gv_nibs(const uint8_t *qs, int h, gv_f *lo, gv_f *hi) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
}
static inline __m128i gv_bytes(const uint8_t *p) {
    return _mm_loadl_epi64((const __m128i *)p);
}
static inline gv_f gv_i8v(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
static inline gv_f gv_i8(const uint8_t *p) { return gv_i8v(gv_bytes(p)); }
static inline gv_f gv_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

#if defined(GV_W) && !defined(GV_EMULATE)
/* gv_q6 (see the emulation) for either instruction set: the GV_W quants put together and
   offset as bytes (each field shifted within its byte: the 16-bit shifts' spill into the
   neighbouring byte is masked off), then widened */
static inline gv_f gv_q6(const uint8_t *ql, const uint8_t *qh, int shl, int shh) {
    const __m128i lo = _mm_and_si128(_mm_srli_epi16(gv_bytes(ql), shl), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(gv_bytes(qh), shh), _mm_set1_epi8(3));
    return gv_i8v(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)));
}
/* gv_q5 (see the emulation) the same way: one high bit, no offset */
static inline gv_f gv_q5(const uint8_t *ql, const uint8_t *qh, int shl, int shh) {
    const __m128i lo = _mm_and_si128(_mm_srli_epi16(gv_bytes(ql), shl), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(gv_bytes(qh), shh), _mm_set1_epi8(1));
    return gv_i8v(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)));
}
#endif
#endif
