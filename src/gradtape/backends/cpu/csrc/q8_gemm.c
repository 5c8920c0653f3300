/* The prefill's integer GEMM: many activation rows quantized to 8 bits (as the decode
   step quantizes its one row) against block weights, the scheme of q8_dots.c's dots
   summed over many rows at once.  Two kernels, chosen by what the CPU has:
     AMX tiles (q8_amx.c), every type gq_amx_type names, where AMX-INT8 runs;
     AVX2 (here), the K-quants (Q2_K to Q6_K) and the IQ types (IQ2_XXS to IQ4_XS)
     against Q8_K rows, elsewhere on x86 (the IQ types on AMX hosts too); at the AVX2
     class the K-quants and the 32-element types (Q4_0 to Q8_0 and IQ4_NL, against Q8_0
     rows) take another, 8 weight rows a vector (gq_avx2_gemm_lanes, below).
   AMX hosts keep float32 rows for Q2_K and Q3_K: their sums of 16 are not the AMX GEMM's
   of 32 (the IQ types read no sums).

   The K-quant kernel unpacks a panel of 16 weight rows once per call (each super-block's
   quants as bytes in element order, its scales as int16 lanes for madd), then for each 4
   activation rows and each 2 weight rows sums, per super-block,
     isum = sum_u sc_u (n . q)_u        (maddubs / madd, exact in int32 lanes)
     imin = sum_s mn_s (bs_2s + bs_2s+1)   Q4_K / Q5_K, from Q8_K's sums of 16
     imin = sum_s mn_s bs_s                Q2_K (sub-blocks of 16)
     ioff = o sum_s sc_s bs_s              Q6_K (o = 32), Q3_K (o = 4): n unsigned, the
                                           offset apart
   (the IQ types' n are signed: IQ4_XS's table values, IQ2 / IQ3's grid values with their
   signs; |n| by q with n's sign in maddubs)
   and adds (d_w d_x) isum - (dmin_w d_x) imin, or (d_w d_x) (isum - ioff), in float32:
   the decode dots' integers and products, summed over blocks in another order. */
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

int gq_avx2_build(void) { return 1; }

/* a super-block unpacked (every field 32-byte aligned): quants n in element order (Q4_K /
   Q5_K 0..31, Q6_K 0..63, the IQ types their signed values); each 32-value chunk's scales
   as 16 int16 lanes for madd (Q4_K / Q5_K: its sub-block's in all; Q6_K: its first
   sub-block's in the low half, its second's in the high); the 16 int16 factors of Q8_K's
   sums of 16 (mins each twice; Q6_K 32 sc; the IQ types none) */
typedef struct {
    uint8_t n[256];
    int16_t sc[8][16], mn[16];
} gq_ub;

#define GQ_PANEL 16  /* weight rows unpacked at once */

/* the chunks' scale vectors from the scales as 16 int16 lanes: Q4_K / Q5_K's 8 in both
   halves, Q6_K's even ones in the low half and odd ones in the high */
static inline void gq_chunk_scales(__m256i s, gq_ub *u) {
    for (int c = 0; c < 8; c++) _mm256_store_si256((__m256i *)u->sc[c], gq_pick16(s, c));
}

static inline void gq_unpack_k45(const uint8_t *p, int five, gq_ub *u, float *d, float *dm) {
    const uint8_t *qs = p + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16))
                            : _mm256_setzero_si256();
    for (int pr = 0; pr < 4; pr++) {  /* sub-blocks 2 pr (low nibbles), 2 pr + 1 (high) */
        __m256i lo, hi;
        gq_k45_quants(qs, qh, five, pr, &lo, &hi);
        _mm256_storeu_si256((__m256i *)(u->n + 64 * pr), lo);
        _mm256_storeu_si256((__m256i *)(u->n + 64 * pr + 32), hi);
    }
    uint32_t r[4];
    k_scale_min_words(p + 4, r);
    const __m128i sm = _mm_setr_epi32((int)r[0], (int)r[1], (int)r[2], (int)r[3]);
    gq_chunk_scales(_mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm)), u);
    const __m128i pair = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, pair)));
    *d = gb_h2f(p);
    *dm = gb_h2f(p + 2);
}

static inline void gq_unpack_q6k(const uint8_t *p, gq_ub *u, float *d, float *dm) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        for (int g = 0; g < 4; g++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (g & 1)));
            _mm256_storeu_si256((__m256i *)(u->n + 128 * h + 32 * g), _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (g >> 1)), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m2), 4)));
        }
    }
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
    gq_chunk_scales(gq_scales_eo(s8), u);
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5));
    *d = gb_h2f(p + 208);
    *dm = 0.0f;
}

/* Q2_K: n (2 bits, Q3_K's layout of its low bits) in element order, the scale pairs of
   16-value sub-blocks as Q6_K's, its 16 mins against the 16 sums */
static inline void gq_unpack_q2k(const uint8_t *p, gq_ub *u, float *d, float *dm) {
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * h));
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(u->n + 128 * h + 32 * j), _mm256_and_si256(
                _mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)));
    }
    const __m128i sm = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0xF);
    gq_chunk_scales(gq_scales_eo(_mm_and_si128(sm, m4)), u);
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_cvtepu8_epi16(
                                             _mm_and_si128(_mm_srli_epi16(sm, 4), m4)));
    *d = gb_h2f(p + 80);
    *dm = gb_h2f(p + 82);
}

/* Q3_K as Q6_K: u = the 2 low bits | the hmask bit << 2 (0..7) in element order, its
   offset 4 taken off through the sums */
static inline void gq_unpack_q3k(const uint8_t *p, gq_ub *u, float *d, float *dm) {
    const __m256i hm = _mm256_loadu_si256((const __m256i *)p);
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(u->n + 128 * h + 32 * j), gq_q3_quants(q, hm, h, j));
    }
    const __m128i s8 = gq_q3_scales(p);
    gq_chunk_scales(gq_scales_eo(s8), u);
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 2));
    *d = gb_h2f(p + 108);
    *dm = 0.0f;
}

/* IQ4_XS: its signed table values, its 8 scales as Q4_K's, no mins */
static inline void gq_unpack_iq4xs(const uint8_t *p, gq_ub *u, float *d, float *dm) {
    for (int s = 0; s < 8; s++)
        _mm256_storeu_si256((__m256i *)(u->n + 32 * s), gq_iq4_xs_values(p, s));
    gq_chunk_scales(gq_iq4_xs_scales(p), u);
    memset(u->mn, 0, sizeof u->mn);
    *d = gb_h2f(p);
    *dm = 0.0f;
}

#ifdef GB_IQ_TABLES
/* IQ2 / IQ3: the grid values with their signs, the multipliers (per 16 values or 32) as
   the scales, d / div (q8_dots.h: gq_iq_*) */
static inline void gq_unpack_iq(int64_t t, const uint8_t *p, gq_ub *u, float *d, float *dm) {
    gq_iqp P;
    const __m256i sc = gq_iq_prep(t, p, &P);
    for (int c = 0; c < 8; c++)
        _mm256_storeu_si256((__m256i *)(u->n + 32 * c), gq_iq_sign(&P, c, gq_iq_grid(t, &P, c)));
    gq_chunk_scales(sc, u);
    memset(u->mn, 0, sizeof u->mn);
    *d = gb_h2f(p) / (float)gq_iq_div(t);
    *dm = 0.0f;
}
#endif

/* lanes r * 4 + t of the result: the sum of a[r * 4 + t]'s 8 lanes (unpacks and adds:
   hadd issues as several operations and runs at half their rate) */
static inline __m256i gq_sum8(const __m256i a[8]) {
    __m256i h[4], g[2];
    for (int i = 0; i < 4; i++)  /* a[2i], a[2i+1] interleaved, 4 partial sums each */
        h[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* a[4i] .. a[4i+3], 2 partial sums each per half */
        g[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(h[2 * i], h[2 * i + 1]),
                                _mm256_unpackhi_epi64(h[2 * i], h[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g[0], g[1], 0x20),
                            _mm256_permute2x128_si256(g[0], g[1], 0x31));
}

/* v in a register: loaded once, not read again from memory by each instruction using it */
#define GQ_REG(v) __asm__("" : "+x"(v))

/* how a type's sums end: minus the mins' (Q4_K, Q5_K, Q2_K), minus an offset's (Q6_K,
   Q3_K), none (the IQ types, whose n are signed) */
enum { GQ_MINS, GQ_OFFSET, GQ_SIGNED };

/* the sums of weight rows a, b (unpacked, nb blocks; scales dw, dm) with the 4 activation
   rows y[t] (Q8_K quants, sums of 16 bs[t], scales dx [nb][4]): lanes r * 4 + t; `mode`
   a constant at each call, so that each mode compiles into its own loop */
static inline __attribute__((always_inline)) __m256 gq_tile(
        const gq_ub *a, const gq_ub *b, const float *dwa, const float *dwb, const float *dma,
        const float *dmb, const int8_t *const y[4], const int16_t *const bs[4], const float *dx,
        int64_t nb, int mode) {
    __m256 S = _mm256_setzero_ps(), M = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        const gq_ub *ua = a + k, *ub = b + k;
        __m256i acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {  /* 32-value chunks */
            const __m256i sa = _mm256_loadu_si256((const __m256i *)(ua->n + 32 * c));
            const __m256i sb = _mm256_loadu_si256((const __m256i *)(ub->n + 32 * c));
            const int sg = mode == GQ_SIGNED;
            const __m256i wa = sg ? _mm256_sign_epi8(sa, sa) : sa;
            const __m256i wb = sg ? _mm256_sign_epi8(sb, sb) : sb;
            __m256i ca = _mm256_load_si256((const __m256i *)ua->sc[c]);
            __m256i cb = _mm256_load_si256((const __m256i *)ub->sc[c]);
            GQ_REG(ca);
            GQ_REG(cb);
            for (int t = 0; t < 4; t++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(y[t] + 256 * k + 32 * c));
                const __m256i qa = sg ? _mm256_sign_epi8(q, sa) : q;
                const __m256i qb = sg ? _mm256_sign_epi8(q, sb) : q;
                acc[t] = _mm256_add_epi32(acc[t],
                                          _mm256_madd_epi16(_mm256_maddubs_epi16(wa, qa), ca));
                acc[4 + t] = _mm256_add_epi32(acc[4 + t],
                                              _mm256_madd_epi16(_mm256_maddubs_epi16(wb, qb), cb));
            }
        }
        const __m256i is = gq_sum8(acc);
        const __m256 x = _mm256_broadcast_ps((const __m128 *)(dx + 4 * k));
        const __m256 dw = _mm256_set_m128(_mm_set1_ps(dwb[k]), _mm_set1_ps(dwa[k]));
        if (mode == GQ_SIGNED) {
            S = _mm256_fmadd_ps(_mm256_mul_ps(dw, x), _mm256_cvtepi32_ps(is), S);
            continue;
        }
        const __m256i ma = _mm256_loadu_si256((const __m256i *)ua->mn);
        const __m256i mb = _mm256_loadu_si256((const __m256i *)ub->mn);
        for (int t = 0; t < 4; t++) {
            const __m256i s = _mm256_loadu_si256((const __m256i *)(bs[t] + 16 * k));
            acc[t] = _mm256_madd_epi16(ma, s);
            acc[4 + t] = _mm256_madd_epi16(mb, s);
        }
        const __m256i im = gq_sum8(acc);
        if (mode == GQ_OFFSET) {
            S = _mm256_fmadd_ps(_mm256_mul_ps(dw, x), _mm256_cvtepi32_ps(_mm256_sub_epi32(is, im)),
                                S);
        } else {
            const __m256 dm = _mm256_set_m128(_mm_set1_ps(dmb[k]), _mm_set1_ps(dma[k]));
            S = _mm256_fmadd_ps(_mm256_mul_ps(dw, x), _mm256_cvtepi32_ps(is), S);
            M = _mm256_fmadd_ps(_mm256_mul_ps(dm, x), _mm256_cvtepi32_ps(im), M);
        }
    }
    return _mm256_sub_ps(S, M);
}

/* --- 8 weight rows a vector, on the AVX2 class: the 32-element types against Q8_0 rows,
   the K-quants against Q8_K rows ------------------------------------------------------
   A panel of 8 weight rows is repacked GQ_KC blocks of 32 at a time: for each 32 values,
   8 vectors, vector g holding values 4g .. 4g+3 of every row (row r in int32 lane r,
   unsigned: 0..15, the five-bit types' 0..31; Q8_0's and IQ4_NL's signed), beside the
   rows' scales.  One activation
   row's quants 4g .. 4g+3, broadcast, meet vector g in maddubs: each row's partial dot in
   its own lanes, so one int32 vector holds the 8 rows' dots of those 32 values (the form
   above, one row per vector, adds each dot across lanes).
     32-element types: each block's int32 vector scaled by one multiply-add (d_w d_x);
       Q4_0's and Q5_0's offsets (8, 16) off through each activation block's sum of
       quants, Q4_1's and Q5_1's mins through Q8_0's s; Q8_0 and IQ4_NL (signed) at about
       half the rate: a sign step per product, and int16 room for one pair sum only;
     the K-quants: a sub-block's int16 sums meet its scales in madd (each row's scale
       in its lanes), added in int32 over the super-block, then as the form above:
       (d_w d_x) isum - (dmin_w d_x) imin, imin from Q8_K's sums of 32 (Q4_K, Q5_K) or
       16 (Q2_K), a pair of them a broadcast against the rows' mins of those two
       sub-blocks; Q6_K's and Q3_K's (d_w d_x) (isum - o sum_s sc_s bs_s), o = 32, 4,
       from the sums of 16 the same way.
   Each output sums a chunk's blocks in order, the chunks in order. */
typedef struct {
    uint8_t n[8][32];
    float d[8], m[8];
} gq_p8;

typedef struct {
    uint8_t n[8][8][32];  /* [32 values][vector] */
    int16_t sc[16][16];   /* [sub-block]: row r's scale in lanes 2r, 2r + 1 (16 of 16
                             values: Q2_K, Q3_K, Q6_K) */
    int16_t mn[8][16];    /* [pair j]: row r's mins of sub-blocks 2j, 2j + 1 in lanes 2r,
                             2r + 1 (Q3_K, Q6_K: their scales, against the offset) */
    float d[8], dm[8];
} gq_pk8;

#define GQ_KC 32   /* blocks of 32 a chunk: 4 activation rows' part in L1, GQ_TB rows' in L2 */
#define GQ_TB 256  /* activation rows a pass (their chunk's sums in scratch) */

/* whether this build's AVX2 GEMM takes the 32-element types and the K-quants 8 rows a
   vector: the AVX2 class only (AVX-512 keeps its float32 GEMM for the 32-element types
   and the form above for the K-quants; neither has been measured against this one there) */
static int gq_avx2_lanes(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1;
#endif
}

/* the 32-element types: read against Q8_0 rows */
static inline int gq_q80_type(int64_t t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 ||
           t == T_IQ4_NL;
}

static inline int gq_lane_type(int64_t t) {
    return gq_avx2_lanes() && (gq_q80_type(t) || t == T_Q2_K || t == T_Q3_K || t == T_Q4_K ||
                               t == T_Q5_K || t == T_Q6_K);
}

/* rows p .. p + np (np <= 8; zero rows past them) of W, blocks b0 .. b0 + nb, into P */
static void gq_pack8(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t p, int64_t np,
                     int64_t b0, int64_t nb, gq_p8 *P) {
    gb_deq_fn f;
    int bl, by;
    gb_layout(type, &f, &bl, &by);
    const int min = type == T_Q4_1 || type == T_Q5_1;
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t *blk = W + (p + r) * row_bytes + (b0 + b) * by;
            __m256i n = _mm256_setzero_si256();
            if (r < np)
                n = type == T_Q4_0 ? gq_nibs(blk + 2) : type == T_Q4_1 ? gq_w_q4_1(blk)
                    : type == T_Q5_0 ? gq_w_q5_0u(blk) : type == T_Q5_1 ? gq_w_q5_1(blk)
                    : type == T_IQ4_NL ? gq_iq4_values(blk + 2)
                    : _mm256_loadu_si256((const __m256i *)(blk + 2));
            v[r] = _mm256_castsi256_ps(n);
            P[b].d[r] = r < np ? gb_h2f(blk) : 0.0f;
            P[b].m[r] = r < np && min ? gb_h2f(blk + 2) : 0.0f;
        }
        gb_t8x8(v);
        for (int g = 0; g < 8; g++) _mm256_store_ps((float *)(void *)P[b].n[g], v[g]);
    }
}

/* the same for the K-quants, super-blocks b0 .. b0 + nb */
static void gq_packk8(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t p,
                      int64_t np, int64_t b0, int64_t nb, gq_pk8 *P) {
    const int five = type == T_Q5_K, six = type == T_Q6_K, two = type == T_Q2_K;
    const int three = type == T_Q3_K;
    gb_deq_fn f;
    int bl, by;
    gb_layout(type, &f, &bl, &by);
    const int ns = six || two || three ? 16 : 8, nm = ns / 2;  /* scales, pairs of mins */
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[8][8];  /* [32 values][row] */
        int16_t sc[8][16], mn[8][16];  /* [row]: scales; mins (Q3_K, Q6_K: the scales) */
        for (int r = 0; r < 8; r++) {
            const uint8_t *blk = W + (p + r) * row_bytes + (b0 + b) * by;
            if (r >= np) {
                for (int u = 0; u < 8; u++) v[u][r] = _mm256_setzero_ps();
                memset(sc[r], 0, sizeof sc[r]);
                memset(mn[r], 0, sizeof mn[r]);
                P[b].d[r] = P[b].dm[r] = 0.0f;
                continue;
            }
            if (ns == 16) {  /* in element order, as the form above unpacks them */
                gq_ub u __attribute__((aligned(32)));
                float d_, dm_;
                int8_t s8[16];
                if (six) {
                    gq_unpack_q6k(blk, &u, &d_, &dm_);
                    memcpy(s8, blk + 192, 16);
                } else if (three) {  /* its scales less 32 */
                    gq_unpack_q3k(blk, &u, &d_, &dm_);
                    _mm_storeu_si128((__m128i *)(void *)s8, gq_q3_scales(blk));
                } else {
                    gq_unpack_q2k(blk, &u, &d_, &dm_);
                }
                for (int c = 0; c < 8; c++)
                    v[c][r] = _mm256_loadu_ps((const float *)(const void *)(u.n + 32 * c));
                for (int j = 0; j < 16; j++) {  /* Q2_K: 4-bit scales and mins */
                    sc[r][j] = two ? blk[j] & 15 : s8[j];
                    mn[r][j] = two ? blk[j] >> 4 : s8[j];
                }
                P[b].d[r] = d_;
                P[b].dm[r] = dm_;
                continue;
            }
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                    : _mm256_setzero_si256();
            for (int pr = 0; pr < 4; pr++) {
                __m256i lo, hi;
                gq_k45_quants(blk + (five ? 48 : 16), qh, five, pr, &lo, &hi);
                v[2 * pr][r] = _mm256_castsi256_ps(lo);
                v[2 * pr + 1][r] = _mm256_castsi256_ps(hi);
            }
            uint8_t sm[16];
            k_scale_min_bytes(blk + 4, sm);
            for (int j = 0; j < 8; j++) sc[r][j] = sm[j], mn[r][j] = sm[8 + j];
            P[b].d[r] = gb_h2f(blk);
            P[b].dm[r] = gb_h2f(blk + 2);
        }
        for (int c = 0; c < 8; c++) {
            gb_t8x8(v[c]);
            for (int g = 0; g < 8; g++) _mm256_store_ps((float *)(void *)P[b].n[c][g], v[c][g]);
        }
        for (int r = 0; r < 8; r++) {
            for (int u = 0; u < ns; u++) P[b].sc[u][2 * r] = P[b].sc[u][2 * r + 1] = sc[r][u];
            for (int j = 0; j < nm; j++) {
                P[b].mn[j][2 * r] = mn[r][2 * j];
                P[b].mn[j][2 * r + 1] = mn[r][2 * j + 1];
            }
        }
    }
}

/* s[t] += w . (activation row t's quants at x[t] + 4g, broadcast), t < 4, for vectors g <
   8 of n; at the end of each `per` vectors the int16 sums widened into i[t] by madd with
   f (ones, or the sub-block's scales; an expression of g): 8 pair sums of 15 * 127 fit
   int16, 4 of 31 * 127, 2 of 63 * 127 */
#define GQ_DOTS8(n, x, off, per, f, i)                                                   \
    do {                                                                                 \
        __m256i gq_s0 = _mm256_setzero_si256(), gq_s1 = gq_s0, gq_s2 = gq_s0, gq_s3 = gq_s0; \
        for (int g = 0; g < 8; g++) {                                                    \
            const __m256i w = _mm256_load_si256((const __m256i *)(n)[g]);                \
            int32_t y[4];                                                                \
            for (int t = 0; t < 4; t++) memcpy(y + t, x[t] + (off) + 4 * g, 4);          \
            gq_s0 = _mm256_add_epi16(gq_s0, _mm256_maddubs_epi16(w, _mm256_set1_epi32(y[0]))); \
            gq_s1 = _mm256_add_epi16(gq_s1, _mm256_maddubs_epi16(w, _mm256_set1_epi32(y[1]))); \
            gq_s2 = _mm256_add_epi16(gq_s2, _mm256_maddubs_epi16(w, _mm256_set1_epi32(y[2]))); \
            gq_s3 = _mm256_add_epi16(gq_s3, _mm256_maddubs_epi16(w, _mm256_set1_epi32(y[3]))); \
            /* the sums in registers, in order: GCC would make all 32 products first,    \
               held on the stack, then add them in a tree */                             \
            GQ_REG(gq_s0);                                                               \
            GQ_REG(gq_s1);                                                               \
            GQ_REG(gq_s2);                                                               \
            GQ_REG(gq_s3);                                                               \
            if (g % (per) == (per) - 1) {                                                \
                const __m256i gq_f = (f);                                                \
                i[0] = _mm256_add_epi32(i[0], _mm256_madd_epi16(gq_s0, gq_f));           \
                i[1] = _mm256_add_epi32(i[1], _mm256_madd_epi16(gq_s1, gq_f));           \
                i[2] = _mm256_add_epi32(i[2], _mm256_madd_epi16(gq_s2, gq_f));           \
                i[3] = _mm256_add_epi32(i[3], _mm256_madd_epi16(gq_s3, gq_f));           \
                gq_s0 = gq_s1 = gq_s2 = gq_s3 = _mm256_setzero_si256();                  \
            }                                                                            \
        }                                                                                \
    } while (0)

/* out[t] (lanes: the panel's 8 rows) = the chunk's sums of activation rows x[t] (t < 4:
   quants at the chunk's first block, scales dx, sums os of off * quants, Q8_0's s), nb
   blocks; `five` and `mode` constants at each call.  GQ_SGN (Q8_0, IQ4_NL): signed
   values, |w| against q with w's sign, each product pair widened at once (two of 127 *
   127 overflow int16) */
enum { GQ_OFF, GQ_MIN, GQ_SGN };
static inline __attribute__((always_inline)) void gq_tile8(
        const gq_p8 *P, int64_t nb, const int8_t *const x[4], const float *const dx[4],
        const int32_t *const os[4], const float *const sx[4], int five, int mode,
        __m256 out[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[4];
    for (int t = 0; t < 4; t++) a[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i i[4];
        for (int t = 0; t < 4; t++) i[t] = _mm256_setzero_si256();
        if (mode == GQ_SGN) {
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_load_si256((const __m256i *)P[b].n[g]);
                const __m256i wa = _mm256_sign_epi8(w, w);
                for (int t = 0; t < 4; t++) {
                    int32_t y;
                    memcpy(&y, x[t] + 32 * b + 4 * g, 4);
                    const __m256i q = _mm256_sign_epi8(_mm256_set1_epi32(y), w);
                    i[t] = _mm256_add_epi32(
                        i[t], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, q), ones));
                    GQ_REG(i[t]);  /* in order, in registers (as GQ_DOTS8's) */
                }
            }
        } else {
            GQ_DOTS8(P[b].n, x, 32 * b, five ? 4 : 8, ones, i);
        }
        const __m256 dw = _mm256_load_ps(P[b].d), mw = _mm256_load_ps(P[b].m);
        for (int t = 0; t < 4; t++) {
            __m256i v = i[t];
            if (mode == GQ_OFF) v = _mm256_sub_epi32(v, _mm256_set1_epi32(os[t][b]));
            a[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[t][b])),
                                   _mm256_cvtepi32_ps(v), a[t]);
            if (mode == GQ_MIN) a[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[t][b]), a[t]);
        }
    }
    for (int t = 0; t < 4; t++) out[t] = a[t];
}

/* the same for the K-quants: nb super-blocks, Q8_K scales dx, pairs of sums bp (Q4_K /
   Q5_K: of 32, 4 a super-block; else of 16, 8); constants at each call: `per`, the
   vectors between widenings (8, Q5_K 4, Q6_K 2, Q2_K / Q3_K 4 as their sub-blocks of
   16); `shift`, the offset's power of two (Q6_K 5, Q3_K 2; 0: mins) */
static inline __attribute__((always_inline)) void gq_tilek8(
        const gq_pk8 *P, int64_t nb, const int8_t *const x[4], const float *const dx[4],
        const int32_t *const bp[4], int per, int shift, int sub16, __m256 out[4]) {
    const int np = sub16 ? 8 : 4;
    __m256 a[4];
    for (int t = 0; t < 4; t++) a[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i i[4], m[4];
        for (int t = 0; t < 4; t++) i[t] = m[t] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {  /* 32 values: sub-blocks of 16 2c, 2c + 1 */
            if (sub16) {
                __m256i sa = _mm256_load_si256((const __m256i *)P[b].sc[2 * c]);
                __m256i sb = _mm256_load_si256((const __m256i *)P[b].sc[2 * c + 1]);
                GQ_REG(sa);
                GQ_REG(sb);
                GQ_DOTS8(P[b].n[c], x, 256 * b + 32 * c, per, g < 4 ? sa : sb, i);
            } else {
                __m256i sc = _mm256_load_si256((const __m256i *)P[b].sc[c]);
                GQ_REG(sc);
                GQ_DOTS8(P[b].n[c], x, 256 * b + 32 * c, per, sc, i);
            }
        }
        for (int j = 0; j < np; j++) {
            const __m256i mn = _mm256_load_si256((const __m256i *)P[b].mn[j]);
            for (int t = 0; t < 4; t++)
                m[t] = _mm256_add_epi32(m[t], _mm256_madd_epi16(
                                                  mn, _mm256_set1_epi32(bp[t][np * b + j])));
        }
        const __m256 dw = _mm256_load_ps(P[b].d), dm = _mm256_load_ps(P[b].dm);
        for (int t = 0; t < 4; t++) {
            const __m256 x_ = _mm256_set1_ps(dx[t][b]);
            if (shift) {  /* the offset */
                const __m256i v = _mm256_sub_epi32(i[t], _mm256_slli_epi32(m[t], shift));
                a[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, x_), _mm256_cvtepi32_ps(v), a[t]);
                continue;
            }
            a[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, x_), _mm256_cvtepi32_ps(i[t]), a[t]);
            a[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, x_), _mm256_cvtepi32_ps(m[t]), a[t]);
        }
    }
    for (int t = 0; t < 4; t++) out[t] = a[t];
}

/* gq_gemm_rows for gq_lane_type's types: Q8_0 rows q [T, k], d and s [T, k/32] (the
   32-element types), Q8_K rows q [T, k], d [T, k/256], int16 sums of 16 [T, k/16] (the
   K-quants) */
static void gq_avx2_gemm_lanes(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                               int64_t r0, int64_t r1, const int8_t *q, const float *d,
                               const float *s, int64_t T, float *Y, int64_t ldy,
                               int accumulate, void *scratch) {
    const int kq = !gq_q80_type(type), five = type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K;
    const int six = type == T_Q6_K, sub16 = six || type == T_Q2_K || type == T_Q3_K;
    const int64_t bl = kq ? 256 : 32, nb = k / bl, kc = GQ_KC * 32 / bl;  /* blocks a chunk */
    const int mode = type == T_Q4_1 || type == T_Q5_1 ? GQ_MIN
                     : type == T_Q8_0 || type == T_IQ4_NL ? GQ_SGN : GQ_OFF;
    const int32_t off = type == T_Q4_0 ? 8 : 16;
    const int16_t *bs = (const int16_t *)(const void *)s;
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    gq_p8 *P = (gq_p8 *)(void *)base;                        /* [kc] */
    gq_pk8 *PK = (gq_pk8 *)(void *)base;
    const size_t p8 = GQ_KC * sizeof(gq_p8), pk = GQ_KC / 8 * sizeof(gq_pk8);
    int32_t *os = (int32_t *)(void *)(base + (p8 > pk ? p8 : pk));  /* [GQ_TB][GQ_KC] */
    for (int64_t tb = 0; tb < T; tb += GQ_TB) {
        const int64_t te = tb + GQ_TB < T ? tb + GQ_TB : T, tp = (te - tb + 3) / 4 * 4;
        for (int64_t b0 = 0; b0 < nb; b0 += kc) {
            const int64_t kb = nb - b0 < kc ? nb - b0 : kc;
            /* the chunk's activation sums (rows past T up to 4 are readable: zeros) */
            for (int64_t t = 0; t < tp && (kq || mode == GQ_OFF); t++)
                for (int64_t b = 0; b < kb; b++) {
                    if (kq) {  /* pairs of sums of 32 from the sums of 16 (or of 16) */
                        const int16_t *h = bs + (tb + t) * (k / 16) + 16 * (b0 + b);
                        for (int j = 0; j < (sub16 ? 8 : 4); j++) {
                            const int lo = sub16 ? h[2 * j] : h[4 * j] + h[4 * j + 1];
                            const int hi = sub16 ? h[2 * j + 1] : h[4 * j + 2] + h[4 * j + 3];
                            os[t * GQ_KC + (sub16 ? 8 : 4) * b + j] =
                                (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16);
                        }
                    } else {
                        const int8_t *qb = q + (tb + t) * k + 32 * (b0 + b);
                        int32_t sum = 0;
                        for (int l = 0; l < 32; l++) sum += qb[l];
                        os[t * GQ_KC + b] = off * sum;
                    }
                }
            for (int64_t p = r0; p < r1; p += 8) {
                const int64_t np = p + 8 <= r1 ? 8 : r1 - p;
                if (kq) gq_packk8(type, W, row_bytes, p, np, b0, kb, PK);
                else gq_pack8(type, W, row_bytes, p, np, b0, kb, P);
                for (int64_t t0 = tb; t0 < te; t0 += 4) {
                    const int8_t *x[4];
                    const float *dx[4], *sx[4];
                    const int32_t *o[4];
                    for (int t = 0; t < 4; t++) {
                        x[t] = q + (t0 + t) * k + bl * b0;
                        dx[t] = d + (t0 + t) * nb + b0;
                        sx[t] = s + (t0 + t) * nb + b0;
                        o[t] = os + (t0 + t - tb) * GQ_KC;
                    }
                    __m256 v[4];
                    if (kq) {
                        if (six) gq_tilek8(PK, kb, x, dx, o, 2, 5, 1, v);
                        else if (type == T_Q3_K) gq_tilek8(PK, kb, x, dx, o, 4, 2, 1, v);
                        else if (type == T_Q2_K) gq_tilek8(PK, kb, x, dx, o, 4, 0, 1, v);
                        else if (five) gq_tilek8(PK, kb, x, dx, o, 4, 0, 0, v);
                        else gq_tilek8(PK, kb, x, dx, o, 8, 0, 0, v);
                    } else if (mode == GQ_SGN) {
                        gq_tile8(P, kb, x, dx, o, sx, 0, GQ_SGN, v);
                    } else if (mode == GQ_MIN) {
                        if (five) gq_tile8(P, kb, x, dx, o, sx, 1, GQ_MIN, v);
                        else gq_tile8(P, kb, x, dx, o, sx, 0, GQ_MIN, v);
                    } else {
                        if (five) gq_tile8(P, kb, x, dx, o, sx, 1, GQ_OFF, v);
                        else gq_tile8(P, kb, x, dx, o, sx, 0, GQ_OFF, v);
                    }
                    const int add = accumulate || b0 > 0;
                    for (int64_t t = 0; t < 4 && t0 + t < te; t++) {
                        float f[8];
                        _mm256_storeu_ps(f, v[t]);
                        float *y = Y + (t0 + t) * ldy + p;
                        for (int64_t r = 0; r < np; r++) y[r] = add ? y[r] + f[r] : f[r];
                    }
                }
            }
        }
    }
}

int64_t gq_avx2_scratch_bytes(int64_t k) {
    const int64_t nb = k / 256;
    const int64_t kq = GQ_PANEL * nb * ((int64_t)sizeof(gq_ub) + 8) + 16 * nb + 128;
    const int64_t pk = GQ_KC / 8 * (int64_t)sizeof(gq_pk8), p8 = GQ_KC * (int64_t)sizeof(gq_p8);
    const int64_t n32 = (pk > p8 ? pk : p8) + GQ_TB * GQ_KC * 4 + 64;
    return kq > n32 ? kq : n32;
}

/* gq_gemm_rows for the K-quants and the IQ types: Q8_K rows q [T, k], d [T, k/256], bs
   [T, k/16] */
static void gq_avx2_gemm_k(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                           int64_t r0, int64_t r1, const int8_t *q, const float *d,
                           const int16_t *bs, int64_t T, float *Y, int64_t ldy, int accumulate,
                           void *scratch) {
    const int64_t nb = k / 256;
    const int two = type == T_Q2_K, three = type == T_Q3_K, five = type == T_Q5_K;
    const int six = type == T_Q6_K || three, iq4 = type == T_IQ4_XS, iq = gq_iq_type(type);
    const int mode = iq4 || iq ? GQ_SIGNED : six ? GQ_OFFSET : GQ_MINS;
    const int64_t by = two ? 84 : three ? 110 : type == T_Q6_K ? 210 : five ? 176
                       : iq4 ? 136 : iq ? gq_iq_bytes(type) : 144;
    gq_ub *U = (gq_ub *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  /* [GQ_PANEL][nb] */
    float *dw = (float *)(U + GQ_PANEL * nb), *dm = dw + GQ_PANEL * nb;  /* [GQ_PANEL][nb] */
    float *dx = dm + GQ_PANEL * nb;                                      /* [nb][4] */
    for (int64_t p = r0; p < r1; p += GQ_PANEL) {
        const int64_t np = p + GQ_PANEL <= r1 ? GQ_PANEL : r1 - p;
        for (int64_t i = 0; i < GQ_PANEL; i++)
            for (int64_t b = 0; b < nb; b++) {
                gq_ub *u = U + i * nb + b;
                const uint8_t *blk = W + (p + i) * row_bytes + b * by;
                if (i >= np) {  /* a row past the panel's end: zeros, its sums dropped */
                    memset(u, 0, sizeof *u);
                    dw[i * nb + b] = dm[i * nb + b] = 0.0f;
                } else if (iq4) {
                    gq_unpack_iq4xs(blk, u, dw + i * nb + b, dm + i * nb + b);
#ifdef GB_IQ_TABLES
                } else if (iq) {
                    gq_unpack_iq(type, blk, u, dw + i * nb + b, dm + i * nb + b);
#endif
                } else if (two) {
                    gq_unpack_q2k(blk, u, dw + i * nb + b, dm + i * nb + b);
                } else if (three) {
                    gq_unpack_q3k(blk, u, dw + i * nb + b, dm + i * nb + b);
                } else if (six) {
                    gq_unpack_q6k(blk, u, dw + i * nb + b, dm + i * nb + b);
                } else {
                    gq_unpack_k45(blk, five, u, dw + i * nb + b, dm + i * nb + b);
                }
            }
        for (int64_t t0 = 0; t0 < T; t0 += 4) {  /* rows past T up to 4 are readable */
            const int8_t *y[4];
            const int16_t *s[4];
            for (int t = 0; t < 4; t++) {
                y[t] = q + (t0 + t) * k;
                s[t] = bs + (t0 + t) * (k / 16);
                for (int64_t b = 0; b < nb; b++) dx[4 * b + t] = d[(t0 + t) * nb + b];
            }
            const int64_t nt = t0 + 4 <= T ? 4 : T - t0;
            for (int64_t i = 0; i < np; i += 2) {
                float v[8];
                const gq_ub *ua = U + i * nb, *ub = U + (i + 1) * nb;
                const float *da = dw + i * nb, *db = dw + (i + 1) * nb;
                const float *ma = dm + i * nb, *mb = dm + (i + 1) * nb;
                _mm256_storeu_ps(v, mode == GQ_SIGNED
                                        ? gq_tile(ua, ub, da, db, ma, mb, y, s, dx, nb, GQ_SIGNED)
                                    : mode == GQ_OFFSET
                                        ? gq_tile(ua, ub, da, db, ma, mb, y, s, dx, nb, GQ_OFFSET)
                                        : gq_tile(ua, ub, da, db, ma, mb, y, s, dx, nb, GQ_MINS));
                for (int r = 0; r < 2 && i + r < np; r++)
                    for (int64_t t = 0; t < nt; t++) {
                        float *o = Y + (t0 + t) * ldy + p + i + r;
                        *o = accumulate ? *o + v[4 * r + t] : v[4 * r + t];
                    }
            }
        }
    }
}

#else
int gq_avx2_build(void) { return 0; }  /* whether this build has the AVX2 GEMM */
int64_t gq_avx2_scratch_bytes(int64_t k) { (void)k; return 0; }
static int gq_avx2_lanes(void) { return 0; }
static inline int gq_q80_type(int64_t t) { (void)t; return 0; }
#endif

/* the row form the prefill's integer GEMM reads against a weight type here (GQ_Q80,
   GQ_Q8K), 0: the float32 GEMM; the IQ types take the AVX2 one on AMX hosts too */
int gq_gemm_type(int64_t type) {
    if (gq_avx2_build() && (type == T_IQ4_XS || gq_iq_type(type))) return GQ_Q8K;
    if (gq_amx_ready()) return gq_amx_type(type);
    if (gq_avx2_build() && gq_avx2_lanes() && gq_q80_type(type)) return GQ_Q80;
    return gq_avx2_build() && (gq_amx_type(type) == GQ_Q8K || type == T_Q2_K || type == T_Q3_K)
           ? GQ_Q8K : 0;
}

/* the values each of a Q8_K row's sums covers for the GEMM in force: 32 (AMX), 16 */
int gq_gemm_sums(void) { return gq_amx_ready() ? 32 : 16; }

int64_t gq_gemm_scratch_bytes(int64_t k) {
    const int64_t a = gq_amx_scratch_bytes(k), b = gq_avx2_scratch_bytes(k);
    return a > b ? a : b;
}

/* Y[t, r] (+)= the scheme's dot of weight row r (r0 <= r < r1) with activation row t < T,
   for a type gq_gemm_type takes: 32-element block types against Q8_0 rows (q [T, k], d
   and s [T, k/32]: gq_q8_0_rows), K-quants against Q8_K rows (q, d [T, k/256], s holding
   the int16 sums of gq_gemm_sums() values: gq_q8_k_rows).  Rows past T up to a multiple
   of 16 must be readable; their sums are dropped.  `scratch`: gq_gemm_scratch_bytes(k). */
void gq_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k, int64_t r0,
                  int64_t r1, const int8_t *q, const float *d, const float *s, int64_t T,
                  float *Y, int64_t ldy, int accumulate, void *scratch) {
    if (gq_amx_ready() && gq_amx_type(type)) {
        gq_amx_gemm_rows(type, W, row_bytes, k, r0, r1, q, d, s, T, Y, ldy, accumulate, scratch);
        return;
    }
#if defined(__AVX2__) && defined(__FMA__) && !defined(GV_EMULATE)
    if (gq_lane_type(type))
        gq_avx2_gemm_lanes(type, W, row_bytes, k, r0, r1, q, d, s, T, Y, ldy, accumulate,
                           scratch);
    else
        gq_avx2_gemm_k(type, W, row_bytes, k, r0, r1, q, d, (const int16_t *)(const void *)s, T,
                       Y, ldy, accumulate, scratch);
#endif
}

/* the 8-bit rows of X [T, k] in the form f into buf (gq_gemm_buf_bytes: q [Tp, k], d and
   s [Tp, k/32] floats' room, Tp = T up to a multiple of 16, zero rows past T) */
int64_t gq_gemm_buf_bytes(int64_t T, int64_t k) {
    const int64_t tp = (T + 15) / 16 * 16;
    return tp * k + 2 * tp * (k / 32) * 4 + 64;
}

/* Y[T, rows] = X [T, k] through the GEMM in force (X quantized into buf), rows split over
   nthreads threads: the kernels' test and bench entry (the prefill calls gq_gemm_rows).
   Returns 0, or -1 where no integer GEMM takes the type here. */
int gq_gemm_matmul(int64_t type, const uint8_t *W, int64_t rows, int64_t k, int64_t row_bytes,
                   const float *X, int64_t T, float *Y, int64_t nthreads, void *buf,
                   void *scratch) {
    const int form = gq_gemm_type(type);
    if (!form || k % (form == GQ_Q8K ? 256 : 32)) return -1;
    const int64_t tp = (T + 15) / 16 * 16;
    int8_t *q = (int8_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *d = (float *)(q + tp * k), *s = d + tp * (k / 32);
    memset(q, 0, tp * k);
    memset(d, 0, 2 * tp * (k / 32) * sizeof(float));
    if (form == GQ_Q8K) gq_q8_k_rows(X, 0, T, k, q, d, (int16_t *)(void *)s, gq_gemm_sums());
    else gq_q8_0_rows(X, 0, T, k, q, d, s);
    if (nthreads < 1) nthreads = 1;
    const int64_t sb = (gq_gemm_scratch_bytes(k) + 63) / 64 * 64;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)nthreads) if (nthreads > 1)
    {
        const int64_t t = omp_get_thread_num();
        int64_t a, e;
        gq_share(rows, t, omp_get_num_threads(), &a, &e);
        if (a < e)
            gq_gemm_rows(type, W, row_bytes, k, a, e, q, d, s, T, Y, rows, 0,
                         (uint8_t *)scratch + t * sb);
    }
#else
    gq_gemm_rows(type, W, row_bytes, k, 0, rows, q, d, s, T, Y, rows, 0, scratch);
#endif
    return 0;
}
