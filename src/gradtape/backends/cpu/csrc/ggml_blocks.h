/* ggml's block layouts, dequantized: shared by ggml_vec.c (decoding) and qgemm.c (the
   training GEMMs' tiles), as static functions of each file that includes this header.  One block becomes float32 exactly as gguf.quants.dequantize
   computes it (the same float32 operations in the same order; built with
   -ffp-contract=off, so d * q + m is two roundings here as there): the weights are
   bit-identical to the NumPy reference.

   Block layouts (ggml, little-endian, f16 = IEEE half):
     Q4_0  18 B / 32: f16 d, u8 qs[16]           w = d * (nib - 8)
     Q4_1  20 B / 32: f16 d, f16 m, u8 qs[16]    w = d * nib + m
     Q5_0  22 B / 32: f16 d, u32 qh, u8 qs[16]   w = d * ((nib | hbit << 4) - 16)
     Q5_1  24 B / 32: f16 d, f16 m, u32 qh, qs   w = d * (nib | hbit << 4) + m
     Q8_0  34 B / 32: f16 d, i8 qs[32]           w = q * d
     (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble; hbit of
      element j is bit j of qh)
     Q4_K 144 B / 256: f16 d, f16 dmin, u8 scales[12] (8 x (6-bit sc, 6-bit m)), qs[128]
                       w = (d * sc) * nib - (dmin * m), 8 sub-blocks of 32
     Q5_K 176 B / 256: as Q4_K plus qh[32] (bit s of qh[l]: 5th bit of sub-block s, l)
     Q6_K 210 B / 256: ql[128], qh[64], i8 scales[16], f16 d
                       w = (d * scale) * ((4 low | 2 high bits) - 32), 16 sub-blocks of 16
     Q2_K  84 B / 256: u8 scales[16] (4-bit scale, 4-bit min), qs[64], f16 d, f16 dmin
                       w = (d * sc) * q2 - (dmin * m), 16 sub-blocks of 16
     Q3_K 110 B / 256: hmask[32], qs[64], 16 x 6-bit scales in 12 bytes, f16 d
                       w = (d * (sc - 32)) * (q2 - (hmask bit clear ? 4 : 0))
     IQ4_NL 18 B / 32: f16 d, qs[16]           w = d * kvalues[nib]
     IQ4_XS 136 B / 256: f16 d, u16 scales_h, u8 scales_l[4], qs[128]
                       w = (d * (sc - 32)) * kvalues[nib], 8 sub-blocks of 32
     IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: rows of a value grid with signs, where a
     unit's source defines GB_IQ_TABLES (see deq_iq2_xxs)
     F16 / BF16 / F32: plain values.
   Type ids are ggml's (GGMLQuantizationType). */
#ifndef GT_GGML_BLOCKS_H
#define GT_GGML_BLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AVX2__
/* the 8 x 8 32-bit lanes of r transposed in place (lane j of row i -> lane i of row j):
   the packed GEMMs' panels (ggml_vec.c's dequantized columns, q8_gemm.c's groups of 4
   quants) */
static inline void gb_t8x8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            r[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
            r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
        }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
        t[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ2_XXS = 16,
       T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22,
       T_IQ4_XS = 23, T_BF16 = 30 };

/* IEEE half -> float, exact, NaN payloads kept as they are (numpy's conversion) */
static inline float gb_h2f_bits(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-08f;  /* m * 2^-24: exact */
        memcpy(&b, &f, 4);
        b |= s;
    } else if (e == 31) {
        b = s | 0x7f800000u | (m << 13);
    } else {
        b = s | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* the same for block scales, one instruction where the CPU has F16C (it quiets a
   signalling NaN, which the scale's multiplication would quiet anyway) */
static inline float gb_h2f(const uint8_t *p) {
#ifdef __F16C__
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#else
    return gb_h2f_bits(p);
#endif
}

/* --- one block -> float32 (bit-identical to gguf.quants.dequantize) ------------------- */

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 (without AVX-512): a 4- or 5-bit block's 32 values, 8 bytes of q widened at a
   time (where five: bit j of qh or'd in as bit 4 of value j), then the same float
   operations as the loops below, d * (n - off) (+ m where add; the sum is left out, not
   0 added, so that a -0.0 product stays -0.0).  GCC's own vectorization of those loops
   extracts the bytes one by one at this width. */
static inline void gb_q45_avx2(const uint8_t *q, uint32_t qh, int five, float d, float m,
                               int off, int add, float *o) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m256i ov = _mm256_set1_epi32(off), m4 = _mm256_set1_epi32(15);
    const __m256i one = _mm256_set1_epi32(1), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2; h++) {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)));
        __m256i nl = _mm256_and_si256(x, m4), nh = _mm256_srli_epi32(x, 4);
        if (five) {  /* bits 8 h + lane and 16 + 8 h + lane of qh, as bit 4 */
            const __m256i b = _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> 8 * h)), lane);
            nl = _mm256_or_si256(nl, _mm256_slli_epi32(_mm256_and_si256(b, one), 4));
            nh = _mm256_or_si256(nh, _mm256_slli_epi32(
                _mm256_and_si256(_mm256_srli_epi32(b, 16), one), 4));
        }
        __m256 lo = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(nl, ov)));
        __m256 hi = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(nh, ov)));
        if (add) lo = _mm256_add_ps(lo, mv), hi = _mm256_add_ps(hi, mv);
        _mm256_storeu_ps(o + 8 * h, lo);
        _mm256_storeu_ps(o + 16 + 8 * h, hi);
    }
}
#endif
#ifdef __AVX512F__
/* AVX-512: a 5-bit block's 32 values, 16 at a time, as gb_q45_avx2 */
static inline void gb_q5_avx512(const uint8_t *q, uint32_t qh, float d, float m, int off,
                                int add, float *o) {
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    const __m512i ov = _mm512_set1_epi32(off), m4 = _mm512_set1_epi32(15);
    const __m512i one = _mm512_set1_epi32(1), lane = _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i b = _mm512_srlv_epi32(_mm512_set1_epi32((int)qh), lane);
    const __m512i nl = _mm512_or_si512(_mm512_and_si512(x, m4),
                                       _mm512_slli_epi32(_mm512_and_si512(b, one), 4));
    const __m512i nh = _mm512_or_si512(_mm512_srli_epi32(x, 4), _mm512_slli_epi32(
        _mm512_and_si512(_mm512_srli_epi32(b, 16), one), 4));
    __m512 lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_sub_epi32(nl, ov)));
    __m512 hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_sub_epi32(nh, ov)));
    if (add) lo = _mm512_add_ps(lo, mv), hi = _mm512_add_ps(hi, mv);
    _mm512_storeu_ps(o, lo);
    _mm512_storeu_ps(o + 16, hi);
}
#endif

static inline void deq_q4_0(const uint8_t *b, float *o) {
    const float d = gb_h2f(b); const uint8_t *q = b + 2;
#if defined(__AVX2__) && !defined(__AVX512F__)
    gb_q45_avx2(q, 0, 0, d, 0.0f, 8, 0, o);
#else
    for (int l = 0; l < 16; l++) {
        o[l] = d * (float)((int)(q[l] & 15) - 8);
        o[l + 16] = d * (float)((int)(q[l] >> 4) - 8);
    }
#endif
}
static inline void deq_q4_1(const uint8_t *b, float *o) {
    const float d = gb_h2f(b), m = gb_h2f(b + 2); const uint8_t *q = b + 4;
#if defined(__AVX2__) && !defined(__AVX512F__)
    gb_q45_avx2(q, 0, 0, d, m, 0, 1, o);
#else
    for (int l = 0; l < 16; l++) {
        o[l] = d * (float)(q[l] & 15) + m;
        o[l + 16] = d * (float)(q[l] >> 4) + m;
    }
#endif
}
static inline void deq_q5_0(const uint8_t *b, float *o) {
    const float d = gb_h2f(b); uint32_t qh; memcpy(&qh, b + 2, 4); const uint8_t *q = b + 6;
#if defined(__AVX2__) && !defined(__AVX512F__)
    gb_q45_avx2(q, qh, 1, d, 0.0f, 16, 0, o);
#elif defined(__AVX512F__)
    gb_q5_avx512(q, qh, d, 0.0f, 16, 0, o);
#else
    for (int l = 0; l < 16; l++) {
        o[l] = d * (float)((int)((q[l] & 15) | (((qh >> l) & 1) << 4)) - 16);
        o[l + 16] = d * (float)((int)((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
    }
#endif
}
static inline void deq_q5_1(const uint8_t *b, float *o) {
    const float d = gb_h2f(b), m = gb_h2f(b + 2); uint32_t qh; memcpy(&qh, b + 4, 4);
    const uint8_t *q = b + 8;
#if defined(__AVX2__) && !defined(__AVX512F__)
    gb_q45_avx2(q, qh, 1, d, m, 0, 1, o);
#elif defined(__AVX512F__)
    gb_q5_avx512(q, qh, d, m, 0, 1, o);
#else
    for (int l = 0; l < 16; l++) {
        o[l] = d * (float)((q[l] & 15) | (((qh >> l) & 1) << 4)) + m;
        o[l + 16] = d * (float)((q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) + m;
    }
#endif
}
static inline void deq_q8_0(const uint8_t *b, float *o) {
    const float d = gb_h2f(b); const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) o[l] = (float)q[l] * d;
}
/* the 8 (scale, min) pairs of a Q4_K / Q5_K block, 6 bits each, packed in 12 bytes s,
   as bytes: out[0..8) the scales, out[8..16) the mins.  For j < 4: scale j is s[j] & 63
   and min j is s[j + 4] & 63; scale j + 4 is the low nibble of s[j + 8] with the top two
   bits of s[j] above it, min j + 4 the high nibble of s[j + 8] with those of s[j + 4]:
   four bytes at a time in 32-bit words (k_scale_min_words: those 16 bytes as 4 words). */
static inline void k_scale_min_words(const uint8_t *s, uint32_t r[4]) {
    uint32_t w[3];
    memcpy(w, s, 12);
    const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, two = 0x03030303u;
    r[0] = w[0] & six;
    r[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);
    r[2] = w[1] & six;
    r[3] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);
}
static inline void k_scale_min_bytes(const uint8_t *s, uint8_t out[16]) {
    uint32_t r[4];
    k_scale_min_words(s, r);
    memcpy(out, r, 16);
}
static inline void k_scale_min(const uint8_t *s, int *sc, int *mn) {
    uint8_t b[16];
    k_scale_min_bytes(s, b);
    for (int j = 0; j < 8; j++) sc[j] = b[j], mn[j] = b[8 + j];
}
/* Q4_K / Q5_K: sub-block s is nibble s & 1 of bytes 32 * (s / 2) .. (Q5_K: high bit s of
   qh[j]); loops of 32 independent values each (they vectorize) */
static inline void deq_q4_k(const uint8_t *b, float *o) {
    const float d = gb_h2f(b), dmin = gb_h2f(b + 2);
    int sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int s = 0; s < 8; s++) {
        const float D = d * (float)sc[s], M = dmin * (float)mn[s];
        const uint8_t *q = b + 16 + 32 * (s >> 1);
        const int sh = 4 * (s & 1);
        for (int j = 0; j < 32; j++) o[32 * s + j] = D * (float)((q[j] >> sh) & 0xF) - M;
    }
}
static inline void deq_q5_k(const uint8_t *b, float *o) {
    const float d = gb_h2f(b), dmin = gb_h2f(b + 2);
    int sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16;
    for (int s = 0; s < 8; s++) {
        const float D = d * (float)sc[s], M = dmin * (float)mn[s];
        const uint8_t *q = b + 48 + 32 * (s >> 1);
        const int sh = 4 * (s & 1);
        for (int j = 0; j < 32; j++)
            o[32 * s + j] = D * (float)(((q[j] >> sh) & 0xF) | (((qh[j] >> s) & 1) << 4)) - M;
    }
}
/* Q6_K: two halves of 128 values (ql bytes 64h.., qh bytes 32h..); value r of a half has
   its low 4 bits in ql[r % 64] >> 4 (r / 64), its high 2 bits in qh[r % 32] >> 2 (r / 32),
   its scale r / 16 */
static inline void deq_q6_k(const uint8_t *b, float *o) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = gb_h2f(b + 208);
    float D[16];
    for (int s = 0; s < 16; s++) D[s] = d * (float)sc[s];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const float *Dh = D + 8 * h;
        float *oh = o + 128 * h;
        for (int is = 0; is < 2; is++) {  /* 16 values per scale */
            const float d0 = Dh[is], d1 = Dh[is + 2], d2 = Dh[is + 4], d3 = Dh[is + 6];
            for (int l = 16 * is; l < 16 * is + 16; l++) {
                const int a = ql[l], c = ql[l + 32], hb = qh[l];
                oh[l] = d0 * (float)(((a & 0xF) | ((hb & 3) << 4)) - 32);
                oh[l + 32] = d1 * (float)(((c & 0xF) | (((hb >> 2) & 3) << 4)) - 32);
                oh[l + 64] = d2 * (float)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                oh[l + 96] = d3 * (float)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

/* Q2_K and Q3_K: 16 sub-blocks of 16 values, whose 2-bit quants lie in qs[64]: value j
   of sub-block s is bits 2 (s % 8 / 2) of byte 32 (s / 8) + 16 (s % 2) + j.  So the four
   sub-blocks 8 H + P + 2 i (i < 4) read the same 16 bytes, each with its own shift; with
   AVX-512 they are made together, one 128-bit lane each (gb_k2_lanes), then widened;
   with AVX2 one after the other as 16 bytes (gb_k2_bytes), widened 8 at a time. */
#ifdef __AVX512BW__
/* the 16 bytes at p in each 128-bit lane i, shifted right by sh + step i (within each
   byte: the 16-bit shifts' spill is masked off by the caller) */
static inline __m512i gb_k2_lanes(const uint8_t *p, int sh, int step) {
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512i n = _mm512_add_epi16(_mm512_set1_epi16((short)sh), _mm512_set_epi64(
        3 * step * 0x0001000100010001LL, 3 * step * 0x0001000100010001LL,
        2 * step * 0x0001000100010001LL, 2 * step * 0x0001000100010001LL,
        step * 0x0001000100010001LL, step * 0x0001000100010001LL, 0, 0));
    return _mm512_srlv_epi16(v, n);
}
/* lane i of the int8 values v as 16 floats */
#define GB_LANE_F32(v, i) \
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, i)))
#elif defined(__AVX2__)
/* the 16 bytes at p shifted right by sh (within each byte: the caller masks the spill) */
static inline __m128i gb_k2_bytes(const uint8_t *p, int sh) {
    return _mm_srli_epi16(_mm_loadu_si128((const __m128i *)p), sh);
}
/* o[0, 16) = D * v, minus M where sub, of the 16 int8 values v, 8 lanes at a time (the
   scalar path's operations) */
static inline void gb_k2_store(__m128i v, float D, float M, int sub, float *o) {
    for (int e = 0; e < 2; e++) {
        const __m256 x = _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(e ? _mm_srli_si128(v, 8) : v)));
        _mm256_storeu_ps(o + 8 * e, sub ? _mm256_sub_ps(x, _mm256_set1_ps(M)) : x);
    }
}
#endif
/* Q2_K: scale and min 4 bits each in scales[s], w = (d sc) q - (dmin m) */
static inline void deq_q2_k(const uint8_t *b, float *o) {
    const float d = gb_h2f(b + 80), dmin = gb_h2f(b + 82);
    float D[16], M[16];
    for (int s = 0; s < 16; s++) {
        D[s] = d * (float)(b[s] & 0xF);
        M[s] = dmin * (float)(b[s] >> 4);
    }
    for (int hp = 0; hp < 4; hp++) {  /* the sub-blocks 8 H + P + 2 i: hp = 2 H + P */
        const int s0 = 8 * (hp / 2) + hp % 2;
        const uint8_t *q = b + 16 + 16 * hp;
#ifdef __AVX512BW__
        const __m512i v = _mm512_and_si512(gb_k2_lanes(q, 0, 2), _mm512_set1_epi8(3));
        for (int i = 0; i < 4; i++) {
            const int s = s0 + 2 * i;
            _mm512_storeu_ps(o + 16 * s, _mm512_sub_ps(
                _mm512_mul_ps(_mm512_set1_ps(D[s]), GB_LANE_F32(v, i)), _mm512_set1_ps(M[s])));
        }
#elif defined(__AVX2__)
        for (int i = 0; i < 4; i++) {
            const int s = s0 + 2 * i;
            gb_k2_store(_mm_and_si128(gb_k2_bytes(q, 2 * i), _mm_set1_epi8(3)), D[s], M[s],
                        1, o + 16 * s);
        }
#else
        for (int i = 0; i < 4; i++) {
            const int s = s0 + 2 * i;
            for (int l = 0; l < 16; l++)
                o[16 * s + l] = D[s] * (float)((q[l] >> 2 * i) & 3) - M[s];
        }
#endif
    }
}
/* Q3_K: hmask[32], qs[64], 16 6-bit scales in 12 bytes, d; 4 is taken off value j of
   sub-block s where bit s / 2 of hmask[16 (s % 2) + j] is clear; scale s is the nibble
   s / 8 of byte s % 8 with bits 2 (s / 4) of byte 8 + s % 4 above it, less 32;
   w = (d scale) q */
static inline void deq_q3_k(const uint8_t *b, float *o) {
    const uint8_t *sc = b + 96;
    const float d = gb_h2f(b + 108);
    float D[16];
    for (int s = 0; s < 16; s++) {
        const int lo = (sc[s % 8] >> (4 * (s / 8))) & 0xF;
        const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        D[s] = d * (float)((int8_t)(lo | hi << 4) - 32);
    }
    for (int hp = 0; hp < 4; hp++) {  /* the sub-blocks 8 H + P + 2 i: hp = 2 H + P */
        const int s0 = 8 * (hp / 2) + hp % 2;
        const uint8_t *q = b + 32 + 16 * hp, *h = b + 16 * (hp % 2);
#ifdef __AVX512BW__
        const __m512i q2 = _mm512_and_si512(gb_k2_lanes(q, 0, 2), _mm512_set1_epi8(3));
        const __m512i clear = _mm512_andnot_si512(gb_k2_lanes(h, 4 * (hp / 2), 1),
                                                  _mm512_set1_epi8(1));
        const __m512i v = _mm512_sub_epi8(q2, _mm512_slli_epi16(clear, 2));
        for (int i = 0; i < 4; i++) {
            const int s = s0 + 2 * i;
            _mm512_storeu_ps(o + 16 * s,
                             _mm512_mul_ps(_mm512_set1_ps(D[s]), GB_LANE_F32(v, i)));
        }
#elif defined(__AVX2__)
        for (int i = 0; i < 4; i++) {  /* bit s / 2 = 4 H + i of h: clear takes 4 off */
            const int s = s0 + 2 * i;
            const __m128i q2 = _mm_and_si128(gb_k2_bytes(q, 2 * i), _mm_set1_epi8(3));
            const __m128i clear = _mm_andnot_si128(gb_k2_bytes(h, 4 * (hp / 2) + i),
                                                   _mm_set1_epi8(1));
            gb_k2_store(_mm_sub_epi8(q2, _mm_slli_epi16(clear, 2)), D[s], 0.0f, 0,
                        o + 16 * s);
        }
#else
        for (int i = 0; i < 4; i++) {
            const int s = s0 + 2 * i;
            for (int l = 0; l < 16; l++)
                o[16 * s + l] = D[s] * (float)((int)((q[l] >> 2 * i) & 3) -
                                               ((h[l] >> (s / 2)) & 1 ? 0 : 4));
        }
#endif
    }
}
/* IQ4_NL / IQ4_XS: 4-bit indices into a table of 16 non-linear values (the format's,
   gguf.quants.IQ4_NL.kvalues); in 32 values, j < 16 is the low nibble of qs[j], j + 16
   its high one */
static const int8_t gb_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                    1, 13, 25, 38, 53, 69, 89, 113};
static inline void gb_iq4_32(float D, const uint8_t *qs, float *o) {
#if defined(__AVX512F__) || defined(__AVX2__)
    /* the 16 lookups of each nibble row by one byte shuffle of the table */
    const __m128i tab = _mm_loadu_si128((const __m128i *)gb_iq4nl);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0xF);
    const __m128i v[2] = {_mm_shuffle_epi8(tab, _mm_and_si128(q, m4)),
                          _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(q, 4), m4))};
    for (int h = 0; h < 2; h++) {
#ifdef __AVX512F__
        _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(
            _mm512_set1_ps(D), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v[h]))));
#else
        for (int e = 0; e < 2; e++)
            _mm256_storeu_ps(o + 16 * h + 8 * e, _mm256_mul_ps(
                _mm256_set1_ps(D), _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(e ? _mm_srli_si128(v[h], 8) : v[h]))));
#endif
    }
#else
    for (int l = 0; l < 16; l++) {
        o[l] = D * (float)gb_iq4nl[qs[l] & 0xF];
        o[l + 16] = D * (float)gb_iq4nl[qs[l] >> 4];
    }
#endif
}
static inline void deq_iq4_nl(const uint8_t *b, float *o) { gb_iq4_32(gb_h2f(b), b + 2, o); }
/* IQ4_XS: 8 sub-blocks of 32, scale s 6 bits: the nibble s % 2 of scales_l[s / 2] with
   bits 2 s of the 16-bit scales_h above it, less 32; w = (d scale) value */
static inline int gb_iq4_xs_scale(const uint8_t *b, int s) {
    const unsigned sh = (unsigned)(b[2] | b[3] << 8);
    return (int)(((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((sh >> (2 * s)) & 3) << 4) - 32;
}
static inline void deq_iq4_xs(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    for (int s = 0; s < 8; s++)
        gb_iq4_32(d * (float)gb_iq4_xs_scale(b, s), b + 8 + 16 * s, o + 32 * s);
}

#ifdef GB_IQ_TABLES
/* IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: rows of a value grid (gb_grid_*: 8 values a
   row, IQ3's 4), each value times its group's factor db and a sign, w = (db * grid) *
   sign.  The tables are gguf's own (toolchain.iq_tables writes them before the units that
   include this header); a 7-bit sign index picks a byte of 8 signs in gb_ksigns.
   Sixteen values at a time, g their grid values, bit k of sg value k's sign: */
static inline void gb_grid16(float db, const uint8_t g[16], unsigned sg, float *o) {
#ifdef __AVX512F__
    /* widened, times db, times +-1 picked by the sign bits */
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(db), _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)g))));
    _mm512_storeu_ps(o, _mm512_mul_ps(v, _mm512_mask_blend_ps(
        (__mmask16)sg, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f))));
#elif defined(__AVX2__)
    /* the same, 8 values at a time: lane k's sign bit tested by a compare */
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int e = 0; e < 2; e++) {
        const __m256 v = _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + 8 * e)))));
        const __m256i neg = _mm256_cmpeq_epi32(
            _mm256_and_si256(_mm256_set1_epi32((int)(sg >> 8 * e)), bit), bit);
        _mm256_storeu_ps(o + 8 * e, _mm256_mul_ps(v, _mm256_blendv_ps(
            _mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), _mm256_castsi256_ps(neg))));
    }
#else
    for (int k = 0; k < 16; k++) {
        /* +-1 as bits, multiplied as gguf multiplies: a select of -x would flip a NaN's
           sign, which the multiplication keeps */
        const uint32_t u = 0x3F800000u | ((sg >> k) & 1u) << 31;
        float sign;
        memcpy(&sign, &u, 4);
        o[k] = db * (float)g[k] * sign;
    }
#endif
}
/* two grid rows of 8 values, or four of 4, as 16 */
static inline void gb_rows8(const uint8_t *r0, const uint8_t *r1, uint8_t g[16]) {
    memcpy(g, r0, 8);
    memcpy(g + 8, r1, 8);
}
static inline void gb_rows4(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2,
                            const uint8_t *r3, uint8_t g[16]) {
    memcpy(g, r0, 4);
    memcpy(g + 4, r1, 4);
    memcpy(g + 8, r2, 4);
    memcpy(g + 12, r3, 4);
}
/* IQ2_XXS  66 B / 256: f16 d; per 32 values two u32: four grid rows (the bytes of the
   first), four sign indices (bits 7 l of the second) and the scale s (its bits 28-31);
   db = (d (0.5 + s)) 0.25 */
static inline void deq_iq2_xxs(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    uint8_t g[16];
    for (int ib = 0; ib < 8; ib++) {
        uint32_t a[2];
        memcpy(a, b + 2 + 8 * ib, 8);
        const float db = d * (0.5f + (float)(a[1] >> 28)) * 0.25f;
        for (int l = 0; l < 4; l += 2) {
            gb_rows8(gb_grid_iq2_xxs[(a[0] >> 8 * l) & 255],
                     gb_grid_iq2_xxs[(a[0] >> 8 * (l + 1)) & 255], g);
            gb_grid16(db, g, gb_ksigns[(a[1] >> 7 * l) & 127] |
                             gb_ksigns[(a[1] >> 7 * (l + 1)) & 127] << 8, o + 32 * ib + 8 * l);
        }
    }
}
/* IQ2_XS  74 B / 256: f16 d, 32 u16 (a 9-bit grid row, a 7-bit sign index, 8 values
   each), 16 4-bit scales (one per 16 values) */
static inline void deq_iq2_xs(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    uint8_t g[16];
    for (int i = 0; i < 16; i++) {  /* 16 values a scale */
        const int s = (b[66 + i / 2] >> (4 * (i % 2))) & 0xF;
        const unsigned q0 = (unsigned)(b[2 + 4 * i] | b[3 + 4 * i] << 8);
        const unsigned q1 = (unsigned)(b[4 + 4 * i] | b[5 + 4 * i] << 8);
        gb_rows8(gb_grid_iq2_xs[q0 & 511], gb_grid_iq2_xs[q1 & 511], g);
        gb_grid16(d * (0.5f + (float)s) * 0.25f, g,
                  gb_ksigns[q0 >> 9] | gb_ksigns[q1 >> 9] << 8, o + 16 * i);
    }
}
/* IQ2_S  82 B / 256: f16 d, 32 grid row bytes, 32 sign bytes, 2 high bits of each row
   (8 bytes), 16 4-bit scales */
static inline void deq_iq2_s(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    uint8_t g[16];
    for (int i = 0; i < 16; i++) {  /* 16 values a scale: rows 2 i, 2 i + 1 */
        const int s = (b[74 + i / 2] >> (4 * (i % 2))) & 0xF, h = b[66 + i / 2] >> 4 * (i % 2);
        gb_rows8(gb_grid_iq2_s[b[2 + 2 * i] | (h & 3) << 8],
                 gb_grid_iq2_s[b[3 + 2 * i] | (h >> 2 & 3) << 8], g);
        gb_grid16(d * (0.5f + (float)s) * 0.25f, g, b[34 + 2 * i] | b[35 + 2 * i] << 8,
                  o + 16 * i);
    }
}
/* IQ3_XXS  98 B / 256: f16 d, 64 grid row bytes (4 values each), per 32 values a u32 of
   four sign indices and the scale s (bits 28-31); db = (d (0.5 + s)) 0.5 */
static inline void deq_iq3_xxs(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    uint8_t g[16];
    for (int ib = 0; ib < 8; ib++) {
        uint32_t a;
        memcpy(&a, b + 66 + 4 * ib, 4);
        const float db = d * (0.5f + (float)(a >> 28)) * 0.5f;
        for (int l = 0; l < 4; l += 2) {
            const uint8_t *r = b + 2 + 8 * ib + 2 * l;
            gb_rows4(gb_grid_iq3_xxs[r[0]], gb_grid_iq3_xxs[r[1]], gb_grid_iq3_xxs[r[2]],
                     gb_grid_iq3_xxs[r[3]], g);
            gb_grid16(db, g, gb_ksigns[(a >> 7 * l) & 127] |
                             gb_ksigns[(a >> 7 * (l + 1)) & 127] << 8, o + 32 * ib + 8 * l);
        }
    }
}
/* IQ3_S  110 B / 256: f16 d, 64 grid row bytes, their high bits (8 bytes), 256 sign
   bits, 8 4-bit scales (one per 32 values); db = d (1 + 2 s) */
static inline void deq_iq3_s(const uint8_t *b, float *o) {
    const float d = gb_h2f(b);
    uint8_t g[16];
    for (int i = 0; i < 16; i++) {  /* 16 values: rows 4 i .. 4 i + 3 */
        const int s = (b[106 + i / 4] >> (4 * (i / 2 % 2))) & 0xF;
        const uint8_t *r = b + 2 + 4 * i;
        const int h = b[66 + i / 2] >> 4 * (i % 2);
        gb_rows4(gb_grid_iq3_s[r[0] | (h & 1) << 8], gb_grid_iq3_s[r[1] | (h >> 1 & 1) << 8],
                 gb_grid_iq3_s[r[2] | (h >> 2 & 1) << 8],
                 gb_grid_iq3_s[r[3] | (h >> 3 & 1) << 8], g);
        gb_grid16(d * (float)(1 + 2 * s), g, b[74 + 2 * i] | b[75 + 2 * i] << 8, o + 16 * i);
    }
}
#endif

/* --- whole rows: nb blocks (F16 / BF16 / F32: nb values) -> float32 ------------------- */

typedef void (*gb_deq_fn)(const uint8_t *b, float *restrict y, long nb);

#define GB_BLOCKS(NAME, QK, BS)                                                        \
static void NAME##_blocks(const uint8_t *b, float *restrict y, long nb) {            \
    for (long i = 0; i < nb; i++) NAME(b + i * (BS), y + i * (QK));                   \
}
GB_BLOCKS(deq_q4_0, 32, 18)
GB_BLOCKS(deq_q4_1, 32, 20)
GB_BLOCKS(deq_q5_0, 32, 22)
GB_BLOCKS(deq_q5_1, 32, 24)
GB_BLOCKS(deq_q8_0, 32, 34)
GB_BLOCKS(deq_q4_k, 256, 144)
GB_BLOCKS(deq_q5_k, 256, 176)
GB_BLOCKS(deq_q6_k, 256, 210)
GB_BLOCKS(deq_q2_k, 256, 84)
GB_BLOCKS(deq_q3_k, 256, 110)
GB_BLOCKS(deq_iq4_nl, 32, 18)
GB_BLOCKS(deq_iq4_xs, 256, 136)
#ifdef GB_IQ_TABLES
GB_BLOCKS(deq_iq2_xxs, 256, 66)
GB_BLOCKS(deq_iq2_xs, 256, 74)
GB_BLOCKS(deq_iq2_s, 256, 82)
GB_BLOCKS(deq_iq3_xxs, 256, 98)
GB_BLOCKS(deq_iq3_s, 256, 110)
#endif

/* Plain values: eight halves at a time by F16C's conversion (exact), except where one of
   the eight is a NaN, whose payload the instruction would change (it quiets a signalling
   one): those eight take gb_h2f_bits.  bf16 is the high half of its float32. */
static void gb_f16_values(const uint8_t *b, float *restrict y, long n) {
    long i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(b + 2 * i));
        const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)),
                                            _mm_set1_epi16(0x7C00));
        if (_mm_testz_si128(nan, nan))
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
        else
            for (long j = i; j < i + 8; j++) y[j] = gb_h2f_bits(b + 2 * j);
    }
#endif
    for (; i < n; i++) y[i] = gb_h2f_bits(b + 2 * i);
}
static void gb_bf16_values(const uint8_t *b, float *restrict y, long n) {
    for (long i = 0; i < n; i++) {
        uint32_t u = (uint32_t)(b[2 * i] | (b[2 * i + 1] << 8)) << 16;
        memcpy(y + i, &u, 4);
    }
}
static void gb_f32_values(const uint8_t *b, float *restrict y, long n) { memcpy(y, b, 4 * n); }

/* the row kernel of type t, its block size in values and in bytes; -1: not a type we run */
static int gb_layout(int64_t t, gb_deq_fn *f, int *block, int *bytes) {
    switch (t) {
    case T_F32:  *f = gb_f32_values;  *block = 1;   *bytes = 4;   return 0;
    case T_F16:  *f = gb_f16_values;  *block = 1;   *bytes = 2;   return 0;
    case T_BF16: *f = gb_bf16_values; *block = 1;   *bytes = 2;   return 0;
    case T_Q4_0: *f = deq_q4_0_blocks; *block = 32;  *bytes = 18;  return 0;
    case T_Q4_1: *f = deq_q4_1_blocks; *block = 32;  *bytes = 20;  return 0;
    case T_Q5_0: *f = deq_q5_0_blocks; *block = 32;  *bytes = 22;  return 0;
    case T_Q5_1: *f = deq_q5_1_blocks; *block = 32;  *bytes = 24;  return 0;
    case T_Q8_0: *f = deq_q8_0_blocks; *block = 32;  *bytes = 34;  return 0;
    case T_Q4_K: *f = deq_q4_k_blocks; *block = 256; *bytes = 144; return 0;
    case T_Q5_K: *f = deq_q5_k_blocks; *block = 256; *bytes = 176; return 0;
    case T_Q6_K: *f = deq_q6_k_blocks; *block = 256; *bytes = 210; return 0;
    case T_Q2_K: *f = deq_q2_k_blocks; *block = 256; *bytes = 84;  return 0;
    case T_Q3_K: *f = deq_q3_k_blocks; *block = 256; *bytes = 110; return 0;
    case T_IQ4_NL: *f = deq_iq4_nl_blocks; *block = 32; *bytes = 18; return 0;
    case T_IQ4_XS: *f = deq_iq4_xs_blocks; *block = 256; *bytes = 136; return 0;
#ifdef GB_IQ_TABLES
    case T_IQ2_XXS: *f = deq_iq2_xxs_blocks; *block = 256; *bytes = 66; return 0;
    case T_IQ2_XS: *f = deq_iq2_xs_blocks; *block = 256; *bytes = 74; return 0;
    case T_IQ2_S: *f = deq_iq2_s_blocks; *block = 256; *bytes = 82; return 0;
    case T_IQ3_XXS: *f = deq_iq3_xxs_blocks; *block = 256; *bytes = 98; return 0;
    case T_IQ3_S: *f = deq_iq3_s_blocks; *block = 256; *bytes = 110; return 0;
#endif
    }
    return -1;
}
#endif
