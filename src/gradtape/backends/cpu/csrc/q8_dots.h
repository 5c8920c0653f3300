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
    int32_t *z0;          /* [k/4] 16 times each 4 Q8_0 quants' sum: Q5_0's offsets */
    int8_t *qp;           /* [k + 32] q0 as the AVX2 dots of Q4_0, Q4_1, IQ4_NL read it, */
    int32_t *zp;          /* [k/8] Q4_0's offsets for them, */
    uint8_t *ap;          /* [k + 32] and |qp| for IQ4_NL's (gq_q8_0_pairs) */
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
void gq_q8_0_pairs(gq_row *r, int64_t b0, int64_t b1);
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

/* q8_gemm.c: the prefill's integer GEMM in force (AMX, else AVX2; AVX2 for IQ types): the
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

static inline uint32_t gq_u32(const uint8_t *p) {
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

/* whether t is an IQ2 / IQ3 type read below (their tables in this unit); its block bytes */
static inline int gq_iq_type(int64_t t) {
#ifdef GB_IQ_TABLES
    return t == T_IQ2_XXS || t == T_IQ2_XS || t == T_IQ2_S || t == T_IQ3_XXS || t == T_IQ3_S;
#else
    (void)t;
    return 0;
#endif
}
static inline int gq_iq_bytes(int64_t t) {
    return t == T_IQ2_XXS ? 66 : t == T_IQ2_XS ? 74 : t == T_IQ2_S ? 82 : t == T_IQ3_XXS ? 98
           : 110;
}

#ifdef GB_IQ_TABLES
/* The IQ2 / IQ3 types as the integer scheme reads them, chunk c (values 32 c .. 32 c + 31)
   of a block p at a time: w = d / div (mult g) sign, g an unsigned grid value, mult = 1 +
   2 s odd per 16 values, div 8 (IQ2), 4 (IQ3_XXS), 1 (IQ3_S).  A chunk is 4 grid rows of
   8 values (IQ2) or 8 of 4 (IQ3); bit e of its sign word: value 32 c + e is negative. */
static inline int gq_iq_div(int64_t t) { return t == T_IQ3_S ? 1 : t == T_IQ3_XXS ? 4 : 8; }
static inline int gq_iq_width(int64_t t) { return t == T_IQ3_XXS || t == T_IQ3_S ? 4 : 8; }
/* grid row j of chunk c */
static inline const uint8_t *gq_iq_row(int64_t t, const uint8_t *p, int c, int j) {
    switch (t) {
    case T_IQ2_XXS: return gb_grid_iq2_xxs[p[2 + 8 * c + j]];
    case T_IQ2_XS: return gb_grid_iq2_xs[(p[2 + 8 * c + 2 * j] | p[3 + 8 * c + 2 * j] << 8) & 511];
    case T_IQ2_S: return gb_grid_iq2_s[p[2 + 4 * c + j] | ((p[66 + c] >> 2 * j) & 3) << 8];
    case T_IQ3_XXS: return gb_grid_iq3_xxs[p[2 + 8 * c + j]];
    default: return gb_grid_iq3_s[p[2 + 8 * c + j] | ((p[66 + c] >> j) & 1) << 8];
    }
}
/* chunk c's sign word: sign bytes, or 7-bit indices into gb_ksigns */
static inline uint32_t gq_iq_signs(int64_t t, const uint8_t *p, int c) {
    uint32_t a;
    switch (t) {
    case T_IQ2_S: return gq_u32(p + 34 + 4 * c);
    case T_IQ3_S: return gq_u32(p + 74 + 4 * c);
    case T_IQ2_XS: {
        uint32_t r = 0;
        for (int j = 0; j < 4; j++) r |= (uint32_t)gb_ksigns[p[3 + 8 * c + 2 * j] >> 1] << 8 * j;
        return r;
    }
    default: a = gq_u32(p + (t == T_IQ2_XXS ? 6 + 8 * c : 66 + 4 * c));
    }
    return gb_ksigns[a & 127] | gb_ksigns[a >> 7 & 127] << 8 | gb_ksigns[a >> 14 & 127] << 16
           | (uint32_t)gb_ksigns[a >> 21 & 127] << 24;
}
/* the block's 16 multipliers, one per 16 values in order */
static inline void gq_iq_mults(int64_t t, const uint8_t *p, uint8_t m[16]) {
    for (int i = 0; i < 16; i++) {
        const int c = i / 2;
        int s;
        switch (t) {
        case T_IQ2_XS: s = p[66 + c] >> 4 * (i % 2) & 15; break;
        case T_IQ2_S: s = p[74 + c] >> 4 * (i % 2) & 15; break;
        case T_IQ3_S: s = p[106 + c / 2] >> 4 * (c % 2) & 15; break;
        default: s = (int)(gq_u32(p + (t == T_IQ2_XXS ? 6 + 8 * c : 66 + 4 * c)) >> 28);
        }
        m[i] = (uint8_t)(1 + 2 * s);
    }
}
#endif

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
/* a Q3_K block p's 16 scales (6 bits, less 32) in bytes: scale s is the nibble s / 8 of
   sc[s % 8] with bits 2 (s / 4) of sc[8 + s % 4] above it (sc at byte 96).  In vector
   operations, as a scalar unpacking stored and read back as one vector stalls the dot
   on the store; the 16 bytes read end at the block's last */
static inline __m128i gq_q3_scales(const uint8_t *p) {
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(p + 94)), 2);
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, m4),
                                          _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    /* sc[8..11] in every 32-bit lane, lane g shifted so bits 2g, 2g + 1 land at 4, 5 */
    const __m128i w = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11,
                                                        8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i hi = _mm_and_si128(
        _mm_slli_epi32(_mm_srlv_epi32(w, _mm_setr_epi32(0, 2, 4, 6)), 4), _mm_set1_epi8(0x30));
    return _mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32));
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
/* an IQ4_XS block's 8 scales (less 32) as int16 lanes 0..7 of both halves; the 32 signed
   values (gb_iq4nl at the nibbles) of 16 bytes qs (IQ4_NL's block), of IQ4_XS's
   sub-block s */
static inline __m256i gq_iq4_xs_scales(const uint8_t *p) {
    uint16_t h;
    uint32_t l;
    __builtin_memcpy(&h, p + 2, 2);
    __builtin_memcpy(&l, p + 4, 4);
    /* in 32-bit lanes s: scales_l's nibble s (bits 4 s), scales_h's bits 2 s, 2 s + 1 */
    const __m256i lo = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32((int)l),
                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                        _mm256_set1_epi32(32));
    /* packed: lanes 0-3 twice in the low half, 4-7 twice in the high; one per half */
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(ls, ls), 0x88);
}
static inline __m256i gq_iq4_values(const uint8_t *qs) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gb_iq4nl));
    return _mm256_shuffle_epi8(tab, gq_nibs(qs));
}
static inline __m256i gq_iq4_xs_values(const uint8_t *p, int s) {
    return gq_iq4_values(p + 8 + 16 * s);
}
/* byte e = bit e of w where it lies in its byte (2^(e % 8) where set, else 0) */
static inline __m256i gq_bits_at(uint32_t w) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    return _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)w), pick),
                            _mm256_set1_epi64x(0x8040201008040201LL));
}
/* byte e = 0xFF where bit e of w is set, else 0 (Q5_0 / Q5_1's fifth bits) */
static inline __m256i gq_bits32(uint32_t w) {
    return _mm256_cmpeq_epi8(gq_bits_at(w), _mm256_set1_epi64x(0x8040201008040201LL));
}
/* byte j = 0xFF where bit j of the u32 at qh is set, else 0 */
static inline __m256i gq_bits(const uint8_t *qh) { return gq_bits32(gq_u32(qh)); }
/* byte j = 16 where bit j is set, else 0 */
static inline __m256i gq_bit4(const uint8_t *qh) {
    return _mm256_and_si256(gq_bits(qh), _mm256_set1_epi8(16));
}
/* the unsigned values of a 32-element block in element order (the dots' and the AVX2
   GEMM's): Q4_1's nibbles; Q5_0's and Q5_1's with their fifth bits (Q5_0's - 16 apart) */
static inline __m256i gq_w_q4_1(const uint8_t *p) { return gq_nibs(p + 4); }
static inline __m256i gq_w_q5_0u(const uint8_t *p) {
    return _mm256_or_si256(gq_nibs(p + 6), gq_bit4(p + 2));
}
static inline __m256i gq_w_q5_1(const uint8_t *p) {
    return _mm256_or_si256(gq_nibs(p + 8), gq_bit4(p + 4));
}
#ifdef GB_IQ_TABLES
/* bytes f | parity(f) << 7 of 7-bit bytes f: gb_ksigns[f] in every byte at once */
static inline __m256i gq_ksigns(__m256i f) {
    __m256i x = _mm256_xor_si256(f, _mm256_srli_epi32(f, 4));  /* bit 0: the byte's parity */
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 2));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 1));
    return _mm256_or_si256(f, _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi8(1)), 7));
}
/* 8 u32 words holding four 7-bit sign indices each (bits 0, 7, 14, 21): their sign
   bytes, one word a chunk */
static inline __m256i gq_ksigns4(__m256i v) {
    const __m256i m = _mm256_set1_epi32(0x7F);
    __m256i f = _mm256_and_si256(v, m);
    for (int l = 1; l < 4; l++)
        f = _mm256_or_si256(f, _mm256_and_si256(_mm256_slli_epi32(v, l),
                                                _mm256_slli_epi32(m, 8 * l)));
    return gq_ksigns(f);
}
/* 8 chunk scales s (int32 lanes, chunk order) as multipliers 1 + 2 s laid out as IQ4_XS's
   scales: int16 lanes 0..7 of both halves */
static inline __m256i gq_iq_m8(__m256i s) {
    s = _mm256_add_epi32(_mm256_add_epi32(s, s), _mm256_set1_epi32(1));
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(s, s), 0x88);
}
/* 16 nibbles (8 bytes at p, the low nibble first) as multipliers 1 + 2 s of 16-value
   groups, gq_scales_eo's even / odd halves */
static inline __m256i gq_iq_m16(const uint8_t *p) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p), m4 = _mm_set1_epi8(15);
    const __m128i e = _mm_unpacklo_epi64(_mm_and_si128(v, m4),
                                         _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    return _mm256_cvtepi8_epi16(_mm_add_epi8(_mm_add_epi8(e, e), _mm_set1_epi8(1)));
}
/* the odd (o = 1) or even u32 words of the 16 at p, in order */
static inline __m256i gq_u32s(const uint8_t *p, int o) {
    const __m256 a = _mm256_loadu_ps((const float *)(const void *)p);
    const __m256 b = _mm256_loadu_ps((const float *)(const void *)(p + 32));
    return _mm256_permute4x64_epi64(_mm256_castps_si256(
        _mm256_shuffle_ps(a, b, o ? 0xDD : 0x88)), 0xD8);
}

/* a block's grid row indices (idx) and sign words (sg, one a chunk), read once for its 8
   chunks */
typedef struct {
    uint16_t idx[64];
    uint32_t sg[8];
} gq_iqp;

/* P from block p; returns the multipliers as int16 lanes for gq_pick16 */
static inline __m256i gq_iq_prep(int64_t t, const uint8_t *p, gq_iqp *P) {
    __m256i *I = (__m256i *)(void *)P->idx, *S = (__m256i *)(void *)P->sg;
    if (t == T_IQ2_XXS) {  /* per 32 values: 4 row bytes, then signs and scale */
        const __m256i a = gq_u32s(p + 2, 1), r = gq_u32s(p + 2, 0);
        _mm256_storeu_si256(I, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(r)));
        _mm256_storeu_si256(I + 1, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(r, 1)));
        _mm256_storeu_si256(S, gq_ksigns4(a));
        return gq_iq_m8(_mm256_srli_epi32(a, 28));
    }
    if (t == T_IQ3_XXS) {  /* 64 row bytes; per 32 values a word of signs and scale */
        const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 66));
        for (int g = 0; g < 4; g++)
            _mm256_storeu_si256(I + g, _mm256_cvtepu8_epi16(
                                           _mm_loadu_si128((const __m128i *)(p + 2 + 16 * g))));
        _mm256_storeu_si256(S, gq_ksigns4(a));
        return gq_iq_m8(_mm256_srli_epi32(a, 28));
    }
    if (t == T_IQ2_XS) {  /* 32 u16: a 9-bit row, a 7-bit sign index */
        __m256i k[2];
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 2 + 32 * h));
            _mm256_storeu_si256(I + h, _mm256_and_si256(v, _mm256_set1_epi16(511)));
            k[h] = _mm256_srli_epi16(v, 9);
        }
        _mm256_storeu_si256(S, _mm256_permute4x64_epi64(
                                   gq_ksigns(_mm256_packus_epi16(k[0], k[1])), 0xD8));
        return gq_iq_m16(p + 66);
    }
    if (t == T_IQ2_S) {  /* 32 row bytes, their 2 high bits (4 a byte), sign bytes */
        const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        for (int g = 0; g < 2; g++) {
            __m256i r[2];
            for (int e = 0; e < 2; e++) {  /* rows 16 g + 8 e .. + 7 */
                const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(
                    _mm256_set1_epi32((int)gq_u32(p + 66 + 4 * g)), _mm256_add_epi32(
                        sh, _mm256_set1_epi32(16 * e))), _mm256_set1_epi32(3));
                r[e] = _mm256_or_si256(_mm256_slli_epi32(h, 8), _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(p + 2 + 16 * g + 8 * e))));
            }
            _mm256_storeu_si256(I + g, _mm256_permute4x64_epi64(
                                           _mm256_packus_epi32(r[0], r[1]), 0xD8));
        }
        _mm256_storeu_si256(S, _mm256_loadu_si256((const __m256i *)(p + 34)));
        return gq_iq_m16(p + 74);
    }
    /* IQ3_S: 64 row bytes, their high bits (one a row), sign bits */
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                          4096, 8192, 16384, (short)0x8000);
    for (int g = 0; g < 4; g++) {
        const __m256i h = _mm256_and_si256(_mm256_set1_epi16((short)(p[66 + 2 * g]
                                                                     | p[67 + 2 * g] << 8)), bit);
        _mm256_storeu_si256(I + g, _mm256_or_si256(
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 2 + 16 * g))),
            _mm256_and_si256(_mm256_cmpeq_epi16(h, bit), _mm256_set1_epi16(256))));
    }
    _mm256_storeu_si256(S, _mm256_loadu_si256((const __m256i *)(p + 74)));
    const __m128i v = _mm_cvtsi32_si128((int)gq_u32(p + 106)), m4 = _mm_set1_epi8(15);
    return gq_iq_m8(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(
        _mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4))));
}
/* chunk c's 32 grid values (unsigned bytes) from its rows' indices */
static inline __m256i gq_iq_grid(int64_t t, const gq_iqp *P, int c) {
    const uint16_t *i = P->idx + (gq_iq_width(t) == 8 ? 4 : 8) * c;
    switch (t) {
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: {
        const uint8_t(*g)[8] = t == T_IQ2_XXS ? gb_grid_iq2_xxs : t == T_IQ2_XS ? gb_grid_iq2_xs
                               : gb_grid_iq2_s;
        long long r[4];
        for (int j = 0; j < 4; j++) __builtin_memcpy(&r[j], g[i[j]], 8);
        return _mm256_set_epi64x(r[3], r[2], r[1], r[0]);
    }
    default: {
        const uint8_t(*g)[4] = t == T_IQ3_XXS ? gb_grid_iq3_xxs : gb_grid_iq3_s;
        int r[8];
        for (int j = 0; j < 8; j++) __builtin_memcpy(&r[j], g[i[j]], 4);
        return _mm256_set_epi32(r[7], r[6], r[5], r[4], r[3], r[2], r[1], r[0]);
    }
    }
}
/* v with chunk c's signs (P->sg): -v where its value is negative.  Each byte's bit of the
   sign word, 0 or 2^e, plus 127 with unsigned saturation: 127 (v kept) or a byte with its
   top bit set (v negated), one operation where a compare and an or take two */
static inline __m256i gq_iq_sign(const gq_iqp *P, int c, __m256i v) {
    return _mm256_sign_epi8(v, _mm256_adds_epu8(gq_bits_at(P->sg[c]), _mm256_set1_epi8(0x7F)));
}
#endif
/* int16 lane pair j of each 128-bit half broadcast over the half (the byte shuffle's
   mask: bytes 2j, 2j + 1 repeated) */
static inline __m256i gq_pick16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}
#endif
#endif
