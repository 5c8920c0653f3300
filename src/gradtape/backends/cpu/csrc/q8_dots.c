/* Integer dot products for the decode step: the activation row quantized to 8 bits once
   per matrix-vector product (and shared by the products that read the same row), the
   weights' blocks read as stored.  This is llama.cpp's CPU matvec scheme; ggml_vec.c's
   dots keep the activations in float32 instead.  Nothing here runs a prefill GEMM.

   The row x [k] is quantized in the form(s) its weights need (gq_need):
     Q8_0 (blocks of 32), for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL weights:
       a = max_j |x_j|, d = f16(a / 127), q_j = round_half_even(x_j * (127 / a)) (0 where
       a = 0), and s = f16(a / 127 * sum_j q_j) for Q4_1 / Q5_1's min term: llama.cpp's
       x86 quantize_row_q8_0 / quantize_row_q8_1, rounding for rounding;
     Q8_K (blocks of 256), for Q2_K to Q6_K and IQ2 to IQ4_XS weights: m = the first x_j
       of largest |x_j|, q_j = min(127, round_half_even(x_j * (-127 / m))), d = 1 / (-127 / m)
       (float32), and the sums of q over each 16: quantize_row_q8_K_ref.
   A weight block then adds (d_w d_x) * (an integer dot) and its min term:
     Q4_0  w = d (n - 8):    d d_x sum (n - 8) q       Q5_0  as Q4_0, 5-bit n, n - 16
     Q4_1  w = d n + m:      d d_x sum n q + m s       Q5_1  as Q4_1, 5-bit n
       (AVX2's Q5_0: sum n q - z, z = 16 times each 4 quants' sum kept with the row;
        its Q4_0 likewise with 8 times the sums, two blocks a vector: gq_q8_0_pairs)
     Q8_0  w = d n:          d d_x sum n q       IQ4_NL  w = d v: d d_x sum v q (v: IQ4_XS's)
     Q4_K  w = d sc_s n - dmin mn_s (sub-blocks s of 32):
           d d_x sum_s sc_s (sum n q)_s - dmin d_x sum_s mn_s (bsum_2s + bsum_2s+1)
     Q5_K  as Q4_K, 5-bit n;   Q6_K  w = d sc_s (n - 32), sub-blocks of 16:
           d d_x (sum_s sc_s (sum n q)_s - 32 sum_s sc_s bsum_s)
     Q3_K  as Q6_K, 3-bit n, n - 4;   Q2_K  w = d sc_s n - dmin mn_s, 2-bit n, sub-blocks
           of 16: d d_x sum_s sc_s (sum n q)_s - dmin d_x sum_s mn_s bsum_s
     IQ4_XS  w = d (ls_s - 32) v, v = the format's table at a 4-bit index, sub-blocks of
           32: d d_x sum_s (ls_s - 32) (sum v q)_s
     IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S  w = d / div m_s g (+-1), g a grid value, m_s
           odd, sub-blocks of 16: (d d_x / div) sum_s m_s (sum (+-g) q)_s (q8_dots.h)
   The integer sums are exact (no 16-bit step can saturate at these ranges: |q| <= 127,
   n <= 63, |v| <= 127, g <= 43); only the float sums' order differs from a scalar loop.
   Paths: AVX2 (maddubs / madd; with AVX512-VNNI or AVX-VNNI a dpbusd where the ISA class
   has it), with AVX-512 two 32-element blocks a step, and plain C.  F16 / BF16 weights
   keep ggml_vec.c's float dots. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gt_prelude.h"
#include "ggml_blocks.h"
#include "q8_dots.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(GV_EMULATE)
#include <immintrin.h>
#define GQ_AVX2 1
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__))
#define GQ_PAIRS 1  /* Q4_0, Q4_1, IQ4_NL's dots take two blocks a vector (gq_q8_0_pairs) */
#endif
#endif

/* the block dots are inlined into their types' row loops (GQ_ROWS): one call per
   product instead of per row, its constants set up once */
#define GQ_INLINE static inline __attribute__((always_inline))

/* the float an f16 store of v reads back as (round to nearest even) */
static inline float gq_f16(float v) {
#ifdef __F16C__
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
    return (float)(_Float16)v;
#endif
}

int gq_need(int64_t type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL:
        return GQ_Q80;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS:
        return GQ_Q8K;
#ifdef GB_IQ_TABLES
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ3_XXS: case T_IQ3_S: return GQ_Q8K;
#endif
    }
    return 0;
}

/* --- the quantizers ------------------------------------------------------------------ */

/* q[32] = round_half_even(x * id) for |x * id| <= 127.5, and their sum */
static inline int gq_round32(const float *x, float id, int8_t *q) {
#ifdef GQ_AVX2
    const __m256 m = _mm256_set1_ps(id);
    __m256i v[4];
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), m),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* 32 -> 16 -> 8 bits (saturating: the values fit), then the 64-bit lanes the packs
       interleaved back in order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                         _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                            b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return _mm_cvtsi128_si32(s4);
#else
    int s = 0;
    for (int j = 0; j < 32; j++) {
        const int v = (int)nearbyintf(x[j] * id);
        q[j] = (int8_t)v;
        s += v;
    }
    return s;
#endif
}

static inline float gq_absmax(const float *x, int64_t n) {
#ifdef GQ_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int64_t j = 8; j < n; j += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
#else
    float a = 0.0f;
    for (int64_t j = 0; j < n; j++) a = fabsf(x[j]) > a ? fabsf(x[j]) : a;
    return a;
#endif
}

/* Q8_0 (with Q8_1's sums) of x [k], k a multiple of 32: q [k], d [k/32], s [k/32], and
   z [k/4] = 16 times the sum of each 4 quants (the int32 lanes of the AVX2 dots, so Q5_0's
   sum (n - 16) q is the unsigned sum n q less z, Q4_0's sum (n - 8) q less z / 2: the same
   integers) */
void gq_q8_0(const float *x, int64_t k, int8_t *q, float *d, float *s, int32_t *z) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float a = gq_absmax(x + 32 * b, 32), dd = a / 127.0f;
        const int sum = gq_round32(x + 32 * b, a != 0.0f ? 127.0f / a : 0.0f, q + 32 * b);
        d[b] = gq_f16(dd);
        s[b] = gq_f16(dd * (float)sum);
        for (int l = 0; l < 8; l++)
            z[8 * b + l] = 16 * (q[32 * b + 4 * l] + q[32 * b + 4 * l + 1]
                                 + q[32 * b + 4 * l + 2] + q[32 * b + 4 * l + 3]);
    }
}

/* The forms the AVX2 dots of Q4_0, Q4_1 and IQ4_NL read, from the row's quants q0
   (blocks b0 .. b1): they take two blocks a vector, element i of each in the low half of
   the first and element 16 + i in the second.
     qp [k + 32]: each pair of blocks' quants in that order, 0 .. 15 of both, then 16 .. 31;
     zp [k/8]: 8 times those vectors' int32 lane sums (4 + 4 quants a lane): Q4_0's
       sum (n - 8) q is the unsigned sum n q less them;
     ap [k + 32]: |qp| (at most 127), IQ4_NL's unsigned operand.
   Each block writes its own bytes alone: the team's threads quantize a row in parts. */
void gq_q8_0_pairs(gq_row *r, int64_t b0, int64_t b1) {
#ifdef GQ_PAIRS
    for (int64_t b = b0; b < b1; b++) {
        const int8_t *q = r->q0 + 32 * b;
        int8_t *p = r->qp + 64 * (b / 2) + 16 * (b % 2);
        memcpy(p, q, 16);
        memcpy(p + 32, q + 16, 16);
        uint8_t *a = r->ap + (p - r->qp);
        for (int l = 0; l < 16; l++) {
            a[l] = (uint8_t)(q[l] < 0 ? -q[l] : q[l]);
            a[32 + l] = (uint8_t)(q[16 + l] < 0 ? -q[16 + l] : q[16 + l]);
        }
        for (int l = 0; l < 4; l++) {
            int t = 0;
            for (int e = 0; e < 4; e++) t += q[4 * l + e] + q[16 + 4 * l + e];
            r->zp[4 * b + l] = 8 * t;
        }
    }
#else
    (void)r, (void)b0, (void)b1;
#endif
}

/* Q8_K of x [k], k a multiple of 256: q [k], d [k/256], bs [k/16] */
void gq_q8_k(const float *x, int64_t k, int8_t *q, float *d, int16_t *bs) {
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t *qb = q + 256 * b;
        const float a = gq_absmax(xb, 256);
        if (a == 0.0f) {
            d[b] = 0.0f;
            memset(qb, 0, 256);
            memset(bs + 16 * b, 0, 16 * sizeof(int16_t));
            continue;
        }
        int64_t j = 0;
        while (fabsf(xb[j]) != a) j++;  /* the first of largest magnitude */
        const float is = -127.0f / xb[j];
        /* |x_j * is| <= 127 up to one rounding: the ref's min(127, .) changes nothing */
        for (int64_t i = 0; i < 8; i++) gq_round32(xb + 32 * i, is, qb + 32 * i);
        for (int64_t g = 0; g < 16; g++) {
            int t = 0;
            for (int l = 0; l < 16; l++) t += qb[16 * g + l];
            bs[16 * b + g] = (int16_t)t;
        }
        d[b] = 1.0f / is;
    }
}

static int64_t gq_up(int64_t n) { return (n + 63) / 64 * 64; }

int64_t gq_bytes(int64_t kmax) {
    return 2 * gq_up(kmax) + 2 * gq_up(kmax + 32) + 2 * gq_up(4 * (kmax / 32))
           + gq_up(4 * (kmax / 256 + 1)) + gq_up(2 * (kmax / 16)) + gq_up(kmax)
           + gq_up(kmax / 2) + 64;
}

void gq_init(gq_row *r, void *buf, int64_t kmax) {
    uint8_t *p = (uint8_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    r->q0 = (int8_t *)p; p += gq_up(kmax);
    r->qk = (int8_t *)p; p += gq_up(kmax);
    r->qp = (int8_t *)p; p += gq_up(kmax + 32);
    r->ap = (uint8_t *)p; p += gq_up(kmax + 32);
    r->d0 = (float *)p; p += gq_up(4 * (kmax / 32));
    r->s0 = (float *)p; p += gq_up(4 * (kmax / 32));
    r->dk = (float *)p; p += gq_up(4 * (kmax / 256 + 1));
    r->bk = (int16_t *)p; p += gq_up(2 * (kmax / 16));
    r->z0 = (int32_t *)p; p += gq_up(kmax);
    r->zp = (int32_t *)p;
    r->k = 0;
    r->have = 0;
}

int gq_forms(int64_t k, int need) {
    return ((need & GQ_Q80) && k % 32 == 0 ? GQ_Q80 : 0)
           | ((need & GQ_Q8K) && k % 256 == 0 ? GQ_Q8K : 0);
}

void gq_quantize_span(gq_row *r, const float *x, int64_t k, int need, int64_t e0,
                      int64_t e1) {
    const int have = gq_forms(k, need);
    if (have & GQ_Q80) {
        gq_q8_0(x + e0, e1 - e0, r->q0 + e0, r->d0 + e0 / 32, r->s0 + e0 / 32, r->z0 + e0 / 4);
        gq_q8_0_pairs(r, e0 / 32, e1 / 32);
    }
    if (have & GQ_Q8K)
        gq_q8_k(x + e0, e1 - e0, r->qk + e0, r->dk + e0 / 256, r->bk + e0 / 16);
}

void gq_quantize(gq_row *r, const float *x, int64_t k, int need) {
    r->k = k;
    r->have = gq_forms(k, need);
    gq_quantize_span(r, x, k, need, 0, k);
}

/* --- the block dots ------------------------------------------------------------------ */

/* how far ahead of the bytes being read the weights are prefetched: a decode step streams
   every weight from memory once, and the hardware's prefetcher alone leaves the dots
   waiting on it.  The SIMD dots prefetch the lines GQ_AHEAD past each group of blocks as
   they read it: spread out, not a row's worth of lines at once, which overflows the
   core's queue of misses and stalls the reads behind it */
#ifndef GQ_AHEAD
#define GQ_AHEAD 4096
#endif
static inline void gq_ahead(const uint8_t *p, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + GQ_AHEAD + l);
}

#ifdef GQ_AVX2
/* 8 int32 lanes, each the sum of 4 products u * s (u unsigned, s signed bytes) */
static inline __m256i gq_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* the same for signed w: |w| times s with w's sign */
static inline __m256i gq_ss(__m256i w, __m256i s) {
    return gq_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}
static inline float gq_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256i gq_y(const int8_t *q) { return _mm256_loadu_si256((const __m256i *)q); }

/* the 32-element types' weight bytes in element order: signed (SGN 1: Q4_0, Q5_0, Q8_0,
   the offset taken off) or unsigned (Q4_1, Q5_1: the min term is added apart) */
static inline __m256i gq_w_q4_0(const uint8_t *p) {
    return _mm256_sub_epi8(gq_nibs(p + 2), _mm256_set1_epi8(8));
}
/* n - 16 as a signed byte: the nibble with 0xF0 or'd in where the fifth bit is clear */
static inline __m256i gq_w_q5_0(const uint8_t *p) {
    return _mm256_or_si256(gq_nibs(p + 6), _mm256_andnot_si256(gq_bits(p + 2),
                                                                _mm256_set1_epi8((char)0xF0)));
}
static inline __m256i gq_w_q8_0(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)(p + 2));
}
static inline __m256i gq_w_iq4_nl(const uint8_t *p) { return gq_iq4_values(p + 2); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
/* two blocks a 512-bit step: 16 int32 lanes, the first 8 block b's, the others b + 1's */
static inline __m512i gq_us2(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
/* signed w: |w| times s negated where w < 0 (AVX-512 has no byte sign instruction) */
static inline __m512i gq_ss2(__m512i w, __m512i s) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return gq_us2(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
}
/* two blocks' weight bytes: W's of each, or for Q5_0 / Q5_1 (qh: the fifth bits' byte
   offset) the nibbles with 16 added where a byte mask from both blocks' bits says */
static inline __m512i gq_w2(__m256i w, __m256i w1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(w), w1, 1);
}
static inline __m512i gq_w2_q5(const uint8_t *p, const uint8_t *p1, int qs, int qh, int off) {
    uint32_t h, h1;
    memcpy(&h, p + qh, 4);
    memcpy(&h1, p1 + qh, 4);
    const __m512i n = gq_w2(gq_nibs(p + qs), gq_nibs(p1 + qs));
    const __m512i v = _mm512_mask_add_epi8(n, (__mmask64)h | (__mmask64)h1 << 32, n,
                                           _mm512_set1_epi8(16));
    return off ? _mm512_sub_epi8(v, _mm512_set1_epi8((char)off)) : v;
}
static inline __m512i gq_w_q4_0_2(const uint8_t *p, const uint8_t *p1) { return gq_w2(gq_w_q4_0(p), gq_w_q4_0(p1)); }
static inline __m512i gq_w_q4_1_2(const uint8_t *p, const uint8_t *p1) { return gq_w2(gq_w_q4_1(p), gq_w_q4_1(p1)); }
static inline __m512i gq_w_q5_0_2(const uint8_t *p, const uint8_t *p1) { return gq_w2_q5(p, p1, 6, 2, 16); }
static inline __m512i gq_w_q5_1_2(const uint8_t *p, const uint8_t *p1) { return gq_w2_q5(p, p1, 8, 4, 0); }
static inline __m512i gq_w_q8_0_2(const uint8_t *p, const uint8_t *p1) { return gq_w2(gq_w_q8_0(p), gq_w_q8_0(p1)); }
static inline __m512i gq_w_iq4_nl_2(const uint8_t *p, const uint8_t *p1) {
    return gq_w2(gq_w_iq4_nl(p), gq_w_iq4_nl(p1));
}
#define GQ_W5 gq_w_q5_0
#define GQ_W5_2 gq_w_q5_0_2
#define GQ_S5 1
#define GQ_W4 gq_w_q4_0
#define GQ_W4_2 gq_w_q4_0_2
#define GQ_S4 1
#define GQ_PAIR(W, SGN, p, p1, y) (SGN ? gq_ss2(W##_2(p, p1), y) : gq_us2(W##_2(p, p1), y))
/* 16 blocks' scales at a time: their first 4 bytes gathered (d, and Q4_1 / Q5_1's m:
   two f16), d_w d_x and m_w s_x in lanes; each pair's d_w d_x then moved into place by a
   permute.  The rest (under 16 blocks) a pair at a time with scalar scales. */
#define GQ_DOT32(NAME, BS, W, SGN, MIN)                                                  \
GQ_INLINE float NAME(const uint8_t *row, int64_t nb, const gq_row *x) {                  \
    __m512 a = _mm512_setzero_ps(), mv = _mm512_setzero_ps();                            \
    __m256 t = _mm256_setzero_ps();                                                      \
    float m = 0.0f;                                                                      \
    const __m512i at = _mm512_mullo_epi32(                                               \
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),         \
        _mm512_set1_epi32(BS));                                                          \
    int64_t b = 0;                                                                       \
    for (; b + 16 <= nb; b += 16) {                                                      \
        const uint8_t *p = row + BS * b;                                                 \
        gq_ahead(p, 16 * BS);                                                            \
        const __m512i g = _mm512_i32gather_epi32(at, (const void *)p, 1);                \
        const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)),        \
                                       _mm512_loadu_ps(x->d0 + b));                      \
        if (MIN)                                                                         \
            mv = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(                  \
                                     _mm512_srli_epi32(g, 16))),                         \
                                 _mm512_loadu_ps(x->s0 + b), mv);                        \
        __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);  \
        for (int j = 0; j < 16; j += 2) {                                                \
            const uint8_t *pj = p + BS * j;                                              \
            const __m512i i = GQ_PAIR(W, SGN, pj, pj + BS,                               \
                                      _mm512_loadu_si512(x->q0 + 32 * (b + j)));         \
            a = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, d), _mm512_cvtepi32_ps(i), a); \
            pick = _mm512_add_epi32(pick, _mm512_set1_epi32(2));                         \
        }                                                                                \
    }                                                                                    \
    for (; b + 1 < nb; b += 2) {                                                         \
        const uint8_t *p = row + BS * b, *p1 = p + BS;                                   \
        const __m512i i = GQ_PAIR(W, SGN, p, p1, _mm512_loadu_si512(x->q0 + 32 * b));    \
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(gb_h2f(p) * x->d0[b]),        \
                                            _mm256_set1_ps(gb_h2f(p1) * x->d0[b + 1]), 1); \
        a = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(i), a);                                \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b] + gb_h2f(p1 + 2) * x->s0[b + 1];          \
    }                                                                                    \
    if (b < nb) {                                                                        \
        const uint8_t *p = row + BS * b;                                                 \
        const __m256i y = gq_y(x->q0 + 32 * b);                                          \
        t = _mm256_mul_ps(_mm256_set1_ps(gb_h2f(p) * x->d0[b]),                          \
                          _mm256_cvtepi32_ps(SGN ? gq_ss(W(p), y) : gq_us(W(p), y)));    \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b];                                          \
    }                                                                                    \
    if (MIN) a = _mm512_add_ps(a, mv);  /* (its lanes summed with the rest) */           \
    return gq_hsum(_mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(a),                \
                                               _mm512_extractf32x8_ps(a, 1)), t)) + m;   \
}
#else
/* the f16 at byte offset off of each of 8 blocks BS bytes apart */
static inline __m128i gq_h8(const uint8_t *p, int64_t BS, int off) {
    int16_t h[8];
    for (int j = 0; j < 8; j++) memcpy(h + j, p + BS * j + off, 2);
    return _mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
}
/* 8 blocks a step: each block's d_w d_x a scalar product, broadcast (a gather of the
   8 scales costs more than 8 loads: it is microcoded on AMD Zen); Q4_1 / Q5_1's m_w s_x
   in lanes, the 8 blocks' m_w as one vector.  The rest (under 8 blocks) one at a time,
   its min term a scalar sum.  Two accumulators, alternately. */
/* block zb's int32 lanes: SGN 0 unsigned w, 1 signed, 2 unsigned less the row's z0
   (Q5_0's offset of 16: cheaper than the signed product) */
#define GQ_I(W, SGN, p, y, zb)                                                           \
    (SGN == 2 ? _mm256_sub_epi32(gq_us(W(p), y),                                         \
                                 _mm256_loadu_si256((const __m256i *)(x->z0 + 8 * (zb)))) \
     : SGN ? gq_ss(W(p), y) : gq_us(W(p), y))
#define GQ_W5 gq_w_q5_0u
#define GQ_S5 2
#define GQ_DOT32(NAME, BS, W, SGN, MIN)                                                  \
GQ_INLINE float NAME(const uint8_t *row, int64_t nb, const gq_row *x) {                  \
    /* two named accumulators: an array indexed by b & 1 would be kept on the stack */   \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, mv = a0;                                   \
    float m = 0.0f;                                                                      \
    int64_t b = 0;                                                                       \
    for (; b + 8 <= nb; b += 8) {                                                        \
        const uint8_t *p = row + BS * b;                                                 \
        gq_ahead(p, 8 * BS);                                                             \
        if (MIN)                                                                         \
            mv = _mm256_fmadd_ps(_mm256_cvtph_ps(gq_h8(p, BS, 2)),                       \
                                 _mm256_loadu_ps(x->s0 + b), mv);                        \
        for (int j = 0; j < 8; j++) {                                                    \
            const uint8_t *pj = p + BS * j;                                              \
            const __m256i y = gq_y(x->q0 + 32 * (b + j));                                \
            const __m256i i = GQ_I(W, SGN, pj, y, b + j);                                \
            const __m256 dj = _mm256_set1_ps(gb_h2f(pj) * x->d0[b + j]);                 \
            if (j & 1) a1 = _mm256_fmadd_ps(dj, _mm256_cvtepi32_ps(i), a1);              \
            else a0 = _mm256_fmadd_ps(dj, _mm256_cvtepi32_ps(i), a0);                    \
        }                                                                                \
    }                                                                                    \
    for (; b < nb; b++) {                                                                \
        const uint8_t *p = row + BS * b;                                                 \
        const __m256i y = gq_y(x->q0 + 32 * b);                                          \
        const __m256i i = GQ_I(W, SGN, p, y, b);                                         \
        const __m256 db = _mm256_set1_ps(gb_h2f(p) * x->d0[b]);                          \
        if (b & 1) a1 = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(i), a1);                  \
        else a0 = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(i), a0);                        \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b];                                          \
    }                                                                                    \
    return gq_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), mv)) + m;                        \
}
/* Q4_0 / Q4_1: two blocks a vector, whose unsigned quants (at most 15) let the two
   halves' byte products add in int16 before one widening: half the widening multiplies,
   conversions and FMAs of a block at a time (Q5_0 / Q5_1 stay a block at a time: a
   pair's fifth bits cost as much to unpack as the pair saves).  Blocks b and b + 1 (b
   even) at p: element i of both in the low half of one vector, 16 + i in the other, as
   the row's qp holds them; 8 int32 lanes, the first 4 block b's, each the sum of 8
   products, less Q4_0's offset terms where off > 0.  off < 0: IQ4_NL, the nibbles
   indices into its table of signed values v, each product |q| by v with q's sign (no
   sign step on v), each half widened alone (two pair sums of 127 * 127 overflow int16) */
GQ_INLINE __m256i gq_pair_i(const uint8_t *p, int64_t BS, const gq_row *x, int64_t b,
                            int qs, int off) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + qs))),
        _mm_loadu_si128((const __m128i *)(p + BS + qs)), 1);
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    const int8_t *y = x->qp + 32 * b;
    if (off < 0) {
        const __m256i tab = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)gb_iq4nl));
        const uint8_t *a = x->ap + 32 * b;
        return _mm256_add_epi32(
            gq_us(_mm256_loadu_si256((const __m256i *)a),
                  _mm256_sign_epi8(_mm256_shuffle_epi8(tab, lo), gq_y(y))),
            gq_us(_mm256_loadu_si256((const __m256i *)(a + 32)),
                  _mm256_sign_epi8(_mm256_shuffle_epi8(tab, hi), gq_y(y + 32))));
    }
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    __m256i i = gq_us(lo, gq_y(y));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    i = _mm256_dpbusd_epi32(i, hi, gq_y(y + 32));
#else
    i = _mm256_dpbusd_avx_epi32(i, hi, gq_y(y + 32));
#endif
#else
    __m256i i = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, gq_y(y)),
                                                   _mm256_maddubs_epi16(hi, gq_y(y + 32))),
                                  _mm256_set1_epi16(1));
#endif
    if (off > 0) i = _mm256_sub_epi32(i, _mm256_loadu_si256((const __m256i *)(x->zp + 4 * b)));
    return i;
}
/* 8 blocks a step (4 pairs, each pair's d_w d_x moved into its halves by a permute);
   Q4_1's m_w s_x in lanes, the 8 blocks' m_w as one vector.  Then pairs, and a last odd
   block alone (from q0, signed where an offset or IQ4_NL's table applies). */
#define GQ_DOT32P(NAME, BS, QS, OFF, MIN)                                                \
GQ_INLINE float NAME(const uint8_t *row, int64_t nb, const gq_row *x) {                  \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, mv = a0;                                   \
    float m = 0.0f;                                                                      \
    const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                      \
    int64_t b = 0;                                                                       \
    for (; b + 8 <= nb; b += 8) {                                                        \
        const uint8_t *p = row + BS * b;                                                 \
        gq_ahead(p, 8 * BS);                                                             \
        const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(gq_h8(p, BS, 0)),                \
                                        _mm256_loadu_ps(x->d0 + b));                     \
        if (MIN)                                                                         \
            mv = _mm256_fmadd_ps(_mm256_cvtph_ps(gq_h8(p, BS, 2)),                       \
                                 _mm256_loadu_ps(x->s0 + b), mv);                        \
        for (int j = 0; j < 4; j++) {                                                    \
            const __m256 dj = _mm256_permutevar8x32_ps(                                  \
                dd, _mm256_add_epi32(pick, _mm256_set1_epi32(2 * j)));                   \
            const __m256 i = _mm256_cvtepi32_ps(                                         \
                gq_pair_i(p + 2 * BS * j, BS, x, b + 2 * j, QS, OFF));                   \
            if (j & 1) a1 = _mm256_fmadd_ps(dj, i, a1);                                  \
            else a0 = _mm256_fmadd_ps(dj, i, a0);                                        \
        }                                                                                \
    }                                                                                    \
    for (; b + 2 <= nb; b += 2) {                                                        \
        const uint8_t *p = row + BS * b;                                                 \
        const __m256 d = _mm256_set_m128(_mm_set1_ps(gb_h2f(p + BS) * x->d0[b + 1]),     \
                                         _mm_set1_ps(gb_h2f(p) * x->d0[b]));             \
        a0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(gq_pair_i(p, BS, x, b, QS, OFF)),      \
                             a0);                                                        \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b] + gb_h2f(p + BS + 2) * x->s0[b + 1];      \
    }                                                                                    \
    if (b < nb) {                                                                        \
        const uint8_t *p = row + BS * b;                                                 \
        const __m256i w = gq_nibs(p + QS);                                               \
        const __m256i y = gq_y(x->q0 + 32 * b);                                          \
        const __m256i i = OFF < 0 ? gq_ss(gq_iq4_values(p + QS), y)                      \
            : OFF ? gq_ss(_mm256_sub_epi8(w, _mm256_set1_epi8((char)OFF)), y) : gq_us(w, y); \
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(gb_h2f(p) * x->d0[b]), _mm256_cvtepi32_ps(i), \
                             a1);                                                        \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b];                                          \
    }                                                                                    \
    return gq_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), mv)) + m;                        \
}
#endif
#ifdef GQ_PAIRS
GQ_DOT32P(gq_dot_q4_0, 18, 2, 8, 0)
GQ_DOT32P(gq_dot_q4_1, 20, 4, 0, 1)
GQ_DOT32P(gq_dot_iq4_nl, 18, 2, -1, 0)
#else
GQ_DOT32(gq_dot_q4_0, 18, GQ_W4, GQ_S4, 0)
GQ_DOT32(gq_dot_q4_1, 20, gq_w_q4_1, 0, 1)
#endif
GQ_DOT32(gq_dot_q5_0, 22, GQ_W5, GQ_S5, 0)
GQ_DOT32(gq_dot_q5_1, 24, gq_w_q5_1, 0, 1)
GQ_DOT32(gq_dot_q8_0, 34, gq_w_q8_0, 1, 0)
#ifndef GQ_PAIRS
GQ_DOT32(gq_dot_iq4_nl, 18, gq_w_iq4_nl, 1, 0)
#endif

/* the sum of 8 int32 lanes */
static inline int gq_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
/* acc + (d d_x) is - (dmin d_x) im, is and im a block's integer sums in int32 lanes, d and
   dmin the two f16 at p */
static inline __m256 gq_d_dmin(__m256 acc, const uint8_t *p, float dx, __m256i is, __m256i im) {
    uint32_t h;
    memcpy(&h, p, 4);
    const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)h)), _mm_set1_ps(dx));
    acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(is), acc);
    return _mm256_fnmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(im),
                            acc);
}
/* a K-quant's 12 packed bytes at s as k_scale_min_words' 4 words (the 8 scales, then the
   8 mins), in vector operations: r0 = w0 & 0x3F.., r2 = w1 & 0x3F..,
   r1 = (w2 & 0x0F..) | ((w0 >> 6) & 3..) << 4, r3 = ((w2 >> 4) & 0x0F..) | ((w1 >> 6) & 3..) << 4
   (16 bytes read: the block goes on past them) */
static inline __m128i gq_k_scale_min(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m128i r02 = _mm_and_si128(v, _mm_set1_epi8(0x3F));
    const __m128i w2 = _mm_shuffle_epi32(v, 0xAA);
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(w2, _mm_setr_epi32(0, 4, 0, 4)),
                                     _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(v, 6), _mm_set1_epi8(3)), 4);
    return _mm_unpacklo_epi32(r02, _mm_or_si128(lo, hi));
}

/* Q4_K / Q5_K: the 8 sub-blocks' n . q, each times its 6-bit scale, in int32 lanes
   (maddubs's pair sums <= 2 * 31 * 127, times sc <= 63 in madd: no overflow); the
   scales and mins unpacked in vectors; the min term's integer sums in one madd over Q8_K's
   16 sums, taken off the float32 lanes block by block */
GQ_INLINE float gq_k45(const uint8_t *row, int64_t nb, const gq_row *x, int five) {
    __m256 acc = _mm256_setzero_ps();
    const int64_t BS = five ? 176 : 144;
    const __m128i pair = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + BS * b, *qs = p + (five ? 48 : 16);
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, (int)BS);
        const __m128i sm = gq_k_scale_min(p + 4);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  /* 8 x int16 */
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        __m256i is = _mm256_setzero_si256();
        for (int pr = 0; pr < 4; pr++) {  /* sub-blocks 2 pr (low nibbles), 2 pr + 1 (high) */
            __m256i lo, hi;
            gq_k45_quants(qs, qh, five, pr, &lo, &hi);
            const __m256i p0 = _mm256_maddubs_epi16(lo, gq_y(y + 64 * pr));
            const __m256i p1 = _mm256_maddubs_epi16(hi, gq_y(y + 64 * pr + 32));
            is = _mm256_add_epi32(is, _mm256_add_epi32(
                     _mm256_madd_epi16(p0, gq_pick16(sc, 2 * pr)),
                     _mm256_madd_epi16(p1, gq_pick16(sc, 2 * pr + 1))));
        }
        /* sum_s mn_s (bs_2s + bs_2s+1): each min twice as int16 against the 16 sums */
        const __m256i im = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, pair)),
                                             _mm256_loadu_si256((const __m256i *)(x->bk + 16 * b)));
        acc = gq_d_dmin(acc, p, x->dk[b], is, im);
    }
    return gq_hsum(acc);
}
GQ_INLINE float gq_dot_q4_k(const uint8_t *row, int64_t nb, const gq_row *x) { return gq_k45(row, nb, x, 0); }
GQ_INLINE float gq_dot_q5_k(const uint8_t *row, int64_t nb, const gq_row *x) { return gq_k45(row, nb, x, 1); }

/* Q6_K: n (0..63) . q per 16 in maddubs, times the signed scale in madd; the offset 32
   taken off in int32 lanes through the sums of q (one madd), before the one conversion */
GQ_INLINE float gq_dot_q6_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 210 * b;
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, 210);
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
        const __m256i seo = gq_scales_eo(s8);
        __m256i is = _mm256_slli_epi32(_mm256_madd_epi16(          /* - 32 sum_s sc_s bs_s */
            _mm256_cvtepi8_epi16(s8), _mm256_loadu_si256((const __m256i *)(x->bk + 16 * b))), 5);
        is = _mm256_sub_epi32(_mm256_setzero_si256(), is);
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (g & 1)));
                const __m256i n = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (g >> 1)), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m2), 4));
                is = _mm256_add_epi32(is, _mm256_madd_epi16(
                         _mm256_maddubs_epi16(n, gq_y(y + 128 * h + 32 * g)),
                         gq_pick16(seo, 4 * h + g)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(gb_h2f(p + 208) * x->dk[b]), _mm256_cvtepi32_ps(is), acc);
    }
    return gq_hsum(acc);
}

/* Q2_K: n = 2 bits (the layout of Q3_K's low bits), w = d sc_s n - dmin mn_s over 16
   sub-blocks of 16 (4-bit scale and min in one byte each); the scale pairs in one pick
   as Q6_K's, the mins' integer sum in one madd over Q8_K's 16 sums */
GQ_INLINE float gq_dot_q2_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 84 * b;
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, 84);
        const __m128i sm = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0xF);
        const __m256i seo = gq_scales_eo(_mm_and_si128(sm, m4));
        const __m256i im = _mm256_madd_epi16(
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), m4)),
            _mm256_loadu_si256((const __m256i *)(x->bk + 16 * b)));
        __m256i is = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * h));
            for (int j = 0; j < 4; j++)
                is = _mm256_add_epi32(is, _mm256_madd_epi16(
                         _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j),
                                                               _mm256_set1_epi8(3)),
                                              gq_y(y + 128 * h + 32 * j)),
                         gq_pick16(seo, 4 * h + j)));
        }
        acc = gq_d_dmin(acc, p + 80, x->dk[b], is, im);
    }
    return gq_hsum(acc);
}

/* Q3_K: n = u - 4, u = the 2 low bits | the hmask bit << 2 (0..7), unsigned in maddubs;
   each 32 values two sub-blocks of 16 (their scales in one pick, as Q6_K's); the offset
   4 sum_s sc_s bs_s taken off in int32 lanes.  Chunk j's u is taken 2^sh[j] times, its
   bits masked where they lie (fewer shifts: sh = 0, 2, 4, 4, the pair sums at most
   2 * 112 * 127) and its scales 16 / 2^sh[j] times: every sum 16 times, undone in d */
GQ_INLINE float gq_dot_q3_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 110 * b;
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, 110);
        const __m128i s8 = gq_q3_scales(p);
        const __m256i seo = gq_scales_eo(s8);
        const __m256i sj[4] = {_mm256_slli_epi16(seo, 4), _mm256_slli_epi16(seo, 2), seo, seo};
        __m256i is = _mm256_slli_epi32(_mm256_madd_epi16(      /* - 16 * 4 sum_s sc_s bs_s */
            _mm256_cvtepi8_epi16(s8), _mm256_loadu_si256((const __m256i *)(x->bk + 16 * b))), 6);
        is = _mm256_sub_epi32(_mm256_setzero_si256(), is);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)p);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
            for (int j = 0; j < 4; j++) {
                /* the low bits' mask and where hmask's bit 4 h + j goes (bit 2 + sh[j]) */
                static const int low[4] = {0x03, 0x0C, 0x30, 0x30}, top[4] = {2, 4, 6, 6};
                const int from = 4 * h + j, t = top[j];
                const __m256i l = _mm256_and_si256(j == 3 ? _mm256_srli_epi16(q, 2) : q,
                                                   _mm256_set1_epi8((char)low[j]));
                const __m256i hs = t > from ? _mm256_slli_epi16(hm, t - from)
                                 : t < from ? _mm256_srli_epi16(hm, from - t) : hm;
                const __m256i u = _mm256_or_si256(
                    l, _mm256_and_si256(hs, _mm256_set1_epi8((char)(1 << t))));
                is = _mm256_add_epi32(is, _mm256_madd_epi16(
                         _mm256_maddubs_epi16(u, gq_y(y + 128 * h + 32 * j)),
                         gq_pick16(sj[j], 4 * h + j)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(gb_h2f(p + 108) * x->dk[b] * 0.0625f),
                              _mm256_cvtepi32_ps(is), acc);
    }
    return gq_hsum(acc);
}

/* IQ4_XS: a sub-block's 32 table values by one byte shuffle of gb_iq4nl, their products
   with q signed by signed (|v| and q with v's sign in maddubs), times the scale
   ls - 32 in madd */
GQ_INLINE float gq_dot_iq4_xs(const uint8_t *row, int64_t nb, const gq_row *x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 136 * b;
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, 136);
        const __m256i sc = gq_iq4_xs_scales(p);
        __m256i is = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i v = gq_iq4_xs_values(p, s);
            const __m256i q = gq_y(y + 32 * s);
            is = _mm256_add_epi32(is, _mm256_madd_epi16(
                     _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(q, v)),
                     gq_pick16(sc, s)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(gb_h2f(p) * x->dk[b]), _mm256_cvtepi32_ps(is), acc);
    }
    return gq_hsum(acc);
}

#ifdef GB_IQ_TABLES
/* IQ2 / IQ3 (q8_dots.h: gq_iq_*): a chunk's grid values, unsigned, by q with the chunk's
   signs in maddubs, times the multipliers in madd; d / div in float.  The next block's
   rows and signs are read before this block's sums: the chains of its reads then run
   beside the sums, not before them */
GQ_INLINE float gq_dot_iq(const uint8_t *row, int64_t nb, const gq_row *x, int64_t t) {
    __m256 acc = _mm256_setzero_ps();
    const int64_t bytes = gq_iq_bytes(t);
    const float inv = 1.0f / (float)gq_iq_div(t);
    gq_iqp P[2];
    __m256i sc = nb > 0 ? gq_iq_prep(t, row, &P[0]) : _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + bytes * b;
        const int8_t *y = x->qk + 256 * b;
        gq_ahead(p, (int)bytes);
        const gq_iqp *Q = &P[b & 1];
        const __m256i sn = b + 1 < nb ? gq_iq_prep(t, p + bytes, &P[(b + 1) & 1]) : sc;
        __m256i is = _mm256_setzero_si256();
#pragma GCC unroll 8  /* the scale picks' masks then constants, not built a chunk at a time */
        for (int c = 0; c < 8; c++) {
            const __m256i q = gq_iq_sign(Q, c, gq_y(y + 32 * c));
            is = _mm256_add_epi32(is, _mm256_madd_epi16(
                     _mm256_maddubs_epi16(gq_iq_grid(t, Q, c), q), gq_pick16(sc, c)));
        }
        sc = sn;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(gb_h2f(p) * x->dk[b] * inv),
                              _mm256_cvtepi32_ps(is), acc);
    }
    return gq_hsum(acc);
}
#endif

#else  /* plain C: the same integer sums, one block at a time */
/* not vectorized: GCC 12 turns the signed byte products below into AVX-VNNI's
   unsigned-by-signed dpbusd where the target has it (the 16-lane emulation build on such
   a CPU), giving wrong sums; a CPU on this path has no such instructions anyway */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")
#endif

/* the integer dot of a 32-element block at p (its quants at byte qs, the fifth bits' u32
   at byte qh where qh > 0, minus off) with the row's quants y */
static inline int gq_i32(const uint8_t *p, int qs, int qh, int off, const int8_t *y) {
    int i = 0;
    if (qs < 0) {  /* Q8_0: signed bytes at p + 2 */
        for (int j = 0; j < 32; j++) i += (int)(int8_t)p[2 + j] * y[j];
        return i;
    }
    uint32_t h = 0;
    if (qh > 0) memcpy(&h, p + qh, 4);
    for (int l = 0; l < 16; l++) {
        const int lo = (p[qs + l] & 15) | (int)((h >> l) & 1) << 4;
        const int hi = (p[qs + l] >> 4) | (int)((h >> (l + 16)) & 1) << 4;
        i += (lo - off) * y[l] + (hi - off) * y[l + 16];
    }
    return i;
}
#define GQ_DOT32(NAME, BS, QS, QH, OFF, MIN)                                              \
GQ_INLINE float NAME(const uint8_t *row, int64_t nb, const gq_row *x) {                  \
    float s = 0.0f, m = 0.0f;                                                            \
    for (int64_t b = 0; b < nb; b++) {                                                   \
        const uint8_t *p = row + BS * b;                                                 \
        const int i = gq_i32(p, QS, QH, OFF, x->q0 + 32 * b);                            \
        s += gb_h2f(p) * x->d0[b] * (float)i;                                            \
        if (MIN) m += gb_h2f(p + 2) * x->s0[b];                                          \
    }                                                                                    \
    return s + m;                                                                        \
}
GQ_DOT32(gq_dot_q4_0, 18, 2, 0, 8, 0)
GQ_DOT32(gq_dot_q4_1, 20, 4, 0, 0, 1)
GQ_DOT32(gq_dot_q5_0, 22, 6, 2, 16, 0)
GQ_DOT32(gq_dot_q5_1, 24, 8, 4, 0, 1)
GQ_DOT32(gq_dot_q8_0, 34, -1, 0, 0, 0)
/* the integer dot of 32 IQ4 values (16 bytes qs of indices into gb_iq4nl) with y */
static inline int gq_iq4_i32(const uint8_t *qs, const int8_t *y) {
    int t = 0;
    for (int l = 0; l < 16; l++)
        t += gb_iq4nl[qs[l] & 0xF] * y[l] + gb_iq4nl[qs[l] >> 4] * y[l + 16];
    return t;
}
GQ_INLINE float gq_dot_iq4_nl(const uint8_t *row, int64_t nb, const gq_row *x) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 18 * b;
        s += gb_h2f(p) * x->d0[b] * (float)gq_iq4_i32(p + 2, x->q0 + 32 * b);
    }
    return s;
}

GQ_INLINE float gq_k45(const uint8_t *row, int64_t nb, const gq_row *x, int five) {
    float s = 0.0f, mins = 0.0f;
    const int64_t BS = five ? 176 : 144;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + BS * b, *qs = p + (five ? 48 : 16), *qh = p + 16;
        const int8_t *y = x->qk + 256 * b;
        const int16_t *bs = x->bk + 16 * b;
        int sc[8], mn[8], is = 0, im = 0;
        k_scale_min(p + 4, sc, mn);
        for (int sb = 0; sb < 8; sb++) {
            int t = 0;
            for (int l = 0; l < 32; l++) {
                int n = (qs[32 * (sb / 2) + l] >> (4 * (sb & 1))) & 15;
                if (five) n |= ((qh[l] >> sb) & 1) << 4;
                t += n * y[32 * sb + l];
            }
            is += sc[sb] * t;
            im += mn[sb] * (bs[2 * sb] + bs[2 * sb + 1]);
        }
        s += gb_h2f(p) * x->dk[b] * (float)is;
        mins += gb_h2f(p + 2) * x->dk[b] * (float)im;
    }
    return s - mins;
}
GQ_INLINE float gq_dot_q4_k(const uint8_t *row, int64_t nb, const gq_row *x) { return gq_k45(row, nb, x, 0); }
GQ_INLINE float gq_dot_q5_k(const uint8_t *row, int64_t nb, const gq_row *x) { return gq_k45(row, nb, x, 1); }

GQ_INLINE float gq_dot_q6_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 210 * b;
        const int8_t *sc = (const int8_t *)(p + 192), *y = x->qk + 256 * b;
        int is = 0;
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    const int n = ((p[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15)
                                  | (((p[128 + 32 * h + l] >> (2 * g)) & 3) << 4);
                    is += sc[8 * h + 2 * g + l / 16] * (n - 32) * y[128 * h + 32 * g + l];
                }
        s += gb_h2f(p + 208) * x->dk[b] * (float)is;
    }
    return s;
}
GQ_INLINE float gq_dot_q2_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    float s = 0.0f, mins = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 84 * b;
        const int8_t *y = x->qk + 256 * b;
        const int16_t *bs = x->bk + 16 * b;
        int is = 0, im = 0;
        for (int e = 0; e < 256; e++) {  /* e = 128 h + 32 j + m: byte 32 h + m, shift 2 j */
            const int h = e / 128, j = (e % 128) / 32, m = e % 32;
            is += (p[e / 16] & 0xF) * ((p[16 + 32 * h + m] >> (2 * j)) & 3) * y[e];
        }
        for (int sb = 0; sb < 16; sb++) im += (p[sb] >> 4) * bs[sb];
        s += gb_h2f(p + 80) * x->dk[b] * (float)is;
        mins += gb_h2f(p + 82) * x->dk[b] * (float)im;
    }
    return s - mins;
}
GQ_INLINE float gq_dot_q3_k(const uint8_t *row, int64_t nb, const gq_row *x) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 110 * b;
        const int8_t *y = x->qk + 256 * b;
        int8_t sc[16];
        int is = 0;
        for (int sb = 0; sb < 16; sb++) {
            sc[sb] = (int8_t)((((p[96 + sb % 8] >> (4 * (sb / 8))) & 0xF)
                               | ((p[104 + sb % 4] >> (2 * (sb / 4))) & 3) << 4) - 32);
        }
        for (int e = 0; e < 256; e++) {  /* e = 128 h + 32 j + m: byte 32 h + m, shift 2 j */
            const int h = e / 128, j = (e % 128) / 32, m = e % 32;
            const int n = ((p[32 + 32 * h + m] >> (2 * j)) & 3)
                          - ((p[m] >> (4 * h + j)) & 1 ? 0 : 4);
            is += sc[e / 16] * n * y[e];
        }
        s += gb_h2f(p + 108) * x->dk[b] * (float)is;
    }
    return s;
}
GQ_INLINE float gq_dot_iq4_xs(const uint8_t *row, int64_t nb, const gq_row *x) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 136 * b;
        const int8_t *y = x->qk + 256 * b;
        int is = 0;
        for (int sb = 0; sb < 8; sb++)
            is += gb_iq4_xs_scale(p, sb) * gq_iq4_i32(p + 8 + 16 * sb, y + 32 * sb);
        s += gb_h2f(p) * x->dk[b] * (float)is;
    }
    return s;
}
#ifdef GB_IQ_TABLES
GQ_INLINE float gq_dot_iq(const uint8_t *row, int64_t nb, const gq_row *x, int64_t t) {
    float s = 0.0f;
    const int64_t bytes = gq_iq_bytes(t);
    const int w = gq_iq_width(t);
    const float inv = 1.0f / (float)gq_iq_div(t);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + bytes * b;
        const int8_t *y = x->qk + 256 * b;
        uint8_t m[16];
        gq_iq_mults(t, p, m);
        int is = 0;
        for (int c = 0; c < 8; c++) {
            const uint32_t sg = gq_iq_signs(t, p, c);
            for (int e = 0; e < 32; e++) {
                const int g = gq_iq_row(t, p, c, e / w)[e % w];
                is += m[2 * c + e / 16] * (sg >> e & 1 ? -g : g) * y[32 * c + e];
            }
        }
        s += gb_h2f(p) * x->dk[b] * inv * (float)is;
    }
    return s;
}
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif

/* each type's row loop: y[r] (+)= the dot of row r for r in [r0, r1) (the plain-C dots
   prefetch a row's bytes GQ_AHEAD past it at its start; the SIMD ones as they go) */
#ifdef GQ_AVX2
#define GQ_ROW_AHEAD(p, n)
#else
#define GQ_ROW_AHEAD(p, n) gq_ahead(p, (int)(n))
#endif
typedef void (*gq_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const gq_row *,
                      float *, int);
#define GQ_ROWS(DOT)                                                                     \
static void DOT##_rows(const uint8_t *W, int64_t row_bytes, int64_t nb, int64_t r0,      \
                       int64_t r1, const gq_row *x, float *y, int accumulate) {          \
    for (int64_t r = r0; r < r1; r++) {                                                  \
        GQ_ROW_AHEAD(W + r * row_bytes, row_bytes);                                      \
        const float v = DOT(W + r * row_bytes, nb, x);                                   \
        y[r] = accumulate ? y[r] + v : v;                                                \
    }                                                                                    \
}
GQ_ROWS(gq_dot_q4_0)
GQ_ROWS(gq_dot_q4_1)
GQ_ROWS(gq_dot_q5_0)
GQ_ROWS(gq_dot_q5_1)
GQ_ROWS(gq_dot_q8_0)
GQ_ROWS(gq_dot_iq4_nl)
GQ_ROWS(gq_dot_q4_k)
GQ_ROWS(gq_dot_q5_k)
GQ_ROWS(gq_dot_q6_k)
GQ_ROWS(gq_dot_q2_k)
GQ_ROWS(gq_dot_q3_k)
GQ_ROWS(gq_dot_iq4_xs)
#ifdef GB_IQ_TABLES
#define GQ_IQ(NAME, T)                                                                   \
    GQ_INLINE float NAME(const uint8_t *row, int64_t nb, const gq_row *x) {              \
        return gq_dot_iq(row, nb, x, T);                                                 \
    }                                                                                    \
    GQ_ROWS(NAME)
GQ_IQ(gq_dot_iq2_xxs, T_IQ2_XXS)
GQ_IQ(gq_dot_iq2_xs, T_IQ2_XS)
GQ_IQ(gq_dot_iq2_s, T_IQ2_S)
GQ_IQ(gq_dot_iq3_xxs, T_IQ3_XXS)
GQ_IQ(gq_dot_iq3_s, T_IQ3_S)
#endif

/* the row loop of a type and its block size (0: the type has none) */
static int gq_kernel(int64_t type, gq_fn *fn) {
    switch (type) {
    case T_Q4_0: *fn = gq_dot_q4_0_rows; return 32;
    case T_Q4_1: *fn = gq_dot_q4_1_rows; return 32;
    case T_Q5_0: *fn = gq_dot_q5_0_rows; return 32;
    case T_Q5_1: *fn = gq_dot_q5_1_rows; return 32;
    case T_Q8_0: *fn = gq_dot_q8_0_rows; return 32;
    case T_IQ4_NL: *fn = gq_dot_iq4_nl_rows; return 32;
    case T_Q4_K: *fn = gq_dot_q4_k_rows; return 256;
    case T_Q5_K: *fn = gq_dot_q5_k_rows; return 256;
    case T_Q6_K: *fn = gq_dot_q6_k_rows; return 256;
    case T_Q2_K: *fn = gq_dot_q2_k_rows; return 256;
    case T_Q3_K: *fn = gq_dot_q3_k_rows; return 256;
    case T_IQ4_XS: *fn = gq_dot_iq4_xs_rows; return 256;
#ifdef GB_IQ_TABLES
    case T_IQ2_XXS: *fn = gq_dot_iq2_xxs_rows; return 256;
    case T_IQ2_XS: *fn = gq_dot_iq2_xs_rows; return 256;
    case T_IQ2_S: *fn = gq_dot_iq2_s_rows; return 256;
    case T_IQ3_XXS: *fn = gq_dot_iq3_xxs_rows; return 256;
    case T_IQ3_S: *fn = gq_dot_iq3_s_rows; return 256;
#endif
    }
    *fn = 0;
    return 0;
}

int gq_ready(const gq_row *x, int64_t type, int64_t k) {
    const int need = gq_need(type);
    return x && need && x->k == k && (x->have & need) == need;
}

void gq_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k, int64_t r0,
             int64_t r1, const gq_row *x, float *y, int accumulate) {
    gq_fn fn;
    const int64_t nb = k / gq_kernel(type, &fn);
    fn(W, row_bytes, nb, r0, r1, x, y, accumulate);
}

/* y[rows] = W x through x quantized once into buf (gq_bytes(k) bytes), rows split over
   nthreads threads (the kernels' test and bench entry; the decode step calls gq_rows) */
void gq_matvec(int64_t type, const uint8_t *W, int64_t rows, int64_t k, int64_t row_bytes,
               const float *x, float *y, int64_t nthreads, void *buf) {
    gq_row r;
    gq_init(&r, buf, k);
    gq_quantize(&r, x, k, gq_need(type));
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)nthreads) if (nthreads > 1)
    {
        int64_t a, e;
        gq_share(rows, omp_get_thread_num(), omp_get_num_threads(), &a, &e);
        gq_rows(type, W, row_bytes, k, a, e, &r, y, 0);
    }
#else
    gq_rows(type, W, row_bytes, k, 0, rows, &r, y, 0);
#endif
}

/* which path the dots take: 0 plain C, 1 AVX2 (maddubs), 2 AVX2 with VNNI's dpbusd */
int64_t gq_path(void) {
#if defined(GQ_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(GQ_AVX2)
    return 1;
#else
    return 0;
#endif
}
