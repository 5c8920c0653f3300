/* q8_dots.c's functions that the decode step (llama_decode.c) calls: an activation row
   quantized to 8 bits (gq_row) and the integer block dots against it; q8_amx.c's and
   q8_gemm.c's, the prefill's integer GEMMs over many such rows; and AVX2 helpers that
   unpack blocks for both. */
#ifndef GT_Q8_DOTS_H
#define GT_Q8_DOTS_H
#include <stdint.h>
#include "ggml_blocks.h"

enum { GQ_Q80 = 1, GQ_Q8K = 2 };  /* the forms of a quantized row: blocks of 32, of 256 */

typedef struct {
    int64_t k, have;      /* the row's length; the forms computed (GQ_Q80 | GQ_Q8K) */
    int8_t *q0, *qk;      /* [k] the quants of either form */
    float *d0, *s0, *dk;  /* [k/32] Q8_0 scales and Q8_1 sums (f16 values), [k/256] Q8_K's */
    int16_t *bk;          /* [k/16] Q8_K's sums of 16 quants */
    int32_t *z0;          /* [k/4] 16 times each 4 Q8_0 quants' sum: Q5_0's offset term */
} gq_row;

int gq_need(int64_t type);  /* the form a weight type's dots read (0: no integer dots) */
int64_t gq_bytes(int64_t kmax);  /* the buffer gq_init carves a row of <= kmax from */
void gq_init(gq_row *r, void *buf, int64_t kmax);
void gq_quantize(gq_row *r, const float *x, int64_t k, int need);
/* the forms gq_quantize makes of a row of k for need (GQ_Q80 | GQ_Q8K), and its blocks
   of elements [e0, e1) alone (multiples of the forms' block sizes; r->k, r->have untouched:
   the team's threads quantize a row in parts, one sets those) */
int gq_forms(int64_t k, int need);
void gq_quantize_span(gq_row *r, const float *x, int64_t k, int need, int64_t e0,
                      int64_t e1);
/* one form's parts */
void gq_q8_0(const float *x, int64_t k, int8_t *q, float *d, float *s, int32_t *z);
int gq_ready(const gq_row *x, int64_t type, int64_t k);  /* x holds what type's dots read */
void gq_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k, int64_t r0,
             int64_t r1, const gq_row *x, float *y, int accumulate);

/* q8_amx.c: Q8_0 / Q8_K rows t0 .. t1 of X [T, k] (Q8_K with the sums of each `per`
   quants); whether the AMX GEMM runs (build and Linux); the row form a weight type's AMX
   GEMM reads; its per-thread scratch; that GEMM over weight rows r0 .. r1 */
void gq_q8_0_rows(const float *X, int64_t t0, int64_t t1, int64_t k, int8_t *q, float *d,
                  float *s);
void gq_q8_k(const float *x, int64_t k, int8_t *q, float *d, int16_t *bs);  /* q8_dots.c */
void gq_q8_k_rows(const float *X, int64_t t0, int64_t t1, int64_t k, int8_t *q, float *d,
                  int16_t *sums, int per);
int gq_amx_ready(void);
int gq_amx_type(int64_t type);
int64_t gq_amx_scratch_bytes(int64_t k);
void gq_amx_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                      int64_t r0, int64_t r1, const int8_t *q, const float *d, const float *s,
                      int64_t T, float *Y, int64_t ldy, int accumulate, void *scratch);

/* q8_gemm.c: the prefill's integer GEMM in force (AMX, else AVX2 for the K-quants): the
   row form it reads against a weight type (0: none), the values a Q8_K row's sums cover
   for it, its per-thread scratch, the GEMM over weight rows r0 .. r1 */
int gq_gemm_type(int64_t type);
int gq_gemm_sums(void);
int64_t gq_gemm_scratch_bytes(int64_t k);
void gq_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k, int64_t r0,
                  int64_t r1, const int8_t *q, const float *d, const float *s, int64_t T,
                  float *Y, int64_t ldy, int accumulate, void *scratch);

/* thread t of nt's share [*a, *e) of a matrix's rows, whole groups of 16 */
static inline void gq_share(int64_t rows, int64_t t, int64_t nt, int64_t *a, int64_t *e) {
    const int64_t c = (rows + 15) / 16, a0 = c * t / nt * 16, e0 = c * (t + 1) / nt * 16;
    *a = a0 > rows ? rows : a0;
    *e = e0 > rows ? rows : e0;
}

#ifdef __AVX2__
#include <immintrin.h>
/* 16 bytes of nibbles -> 32 bytes: the low nibbles (elements 0..15), then the high (the
   dots' Q4 / Q5 quants, q8_amx.c's panels).  The bytes in both halves, the high half
   shifted by 4 in one variable shift, then one mask: two operations, not four */
static inline __m256i gq_nibs(const uint8_t *qs) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(15));
}
/* Q4_K / Q5_K's sub-blocks 2 pr (lo: the low nibbles of the 32 bytes at qs + 32 pr) and
   2 pr + 1 (hi: the high ones), 0..15, or 0..31 with Q5_K's fifth bits from qh's bits
   2 pr and 2 pr + 1 (five) */
static inline void gq_k45_quants(const uint8_t *qs, __m256i qh, int five, int pr, __m256i *lo,
                                 __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * pr));
    *lo = _mm256_and_si256(q, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (five) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(
                  _mm256_and_si256(_mm256_srli_epi16(qh, 2 * pr), one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(
                  _mm256_and_si256(_mm256_srli_epi16(qh, 2 * pr + 1), one), 4));
    }
}
/* a Q3_K block's 16 scales (6 bits) at sc, four at a time in 32-bit words: scale s is
   the nibble s / 8 of sc[s % 8] with bits 2 (s / 4) of sc[8 + s % 4] above it; the
   result less 32 */
static inline __m128i gq_q3_scales(const uint8_t *sc) {
    uint32_t w[3], r[4];
    __builtin_memcpy(w, sc, 12);
    const uint32_t four = 0x0F0F0F0Fu, two = 0x03030303u;
    r[0] = (w[0] & four) | ((w[2] & two) << 4);
    r[1] = (w[1] & four) | (((w[2] >> 2) & two) << 4);
    r[2] = ((w[0] >> 4) & four) | (((w[2] >> 4) & two) << 4);
    r[3] = ((w[1] >> 4) & four) | (((w[2] >> 6) & two) << 4);
    return _mm_sub_epi8(_mm_loadu_si128((const __m128i *)r), _mm_set1_epi8(32));
}

/* Q3_K's 32 values 128 h + 32 j .. + 31 as u = the 2 low bits (of q, the block's 32
   quant bytes of half h) | the hmask bit (of hm, its 32 mask bytes) << 2, 0..7 */
static inline __m256i gq_q3_quants(__m256i q, __m256i hm, int h, int j) {
    return _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j),
                                           _mm256_set1_epi8(1)), 2));
}
/* 16 byte scales (sub-blocks of 16) as int16, the even ones in the low half and the odd
   in the high: gq_pick16(., c) gives a 32-value chunk's two, one per half (Q2_K's
   unsigned 4-bit scales read the same as signed) */
static inline __m256i gq_scales_eo(__m128i s8) {
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
        s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}
/* an IQ4_XS block's 8 scales (less 32) as int16 lanes 0..7 of both halves, and its 32
   values of sub-block s (gb_iq4nl at the nibbles), signed */
static inline __m256i gq_iq4_xs_scales(const uint8_t *p) {
    int16_t ls[8];
    for (int s = 0; s < 8; s++) ls[s] = (int16_t)gb_iq4_xs_scale(p, s);
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ls));
}
static inline __m256i gq_iq4_xs_values(const uint8_t *p, int s) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gb_iq4nl));
    return _mm256_shuffle_epi8(tab, gq_nibs(p + 8 + 16 * s));
}
/* int16 lane pair j of each 128-bit half broadcast over the half (the byte shuffle's
   mask: bytes 2j, 2j + 1 repeated) */
static inline __m256i gq_pick16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}
#endif
#endif
