/* The prefill's integer GEMM on AMX tiles: many activation rows quantized to 8 bits (as
   the decode step quantizes its one row: q8_dots.c's gq_q8_0 and gq_q8_k) against block
   weights, the same scheme as q8_dots.c's dots summed over many rows at once.  For the
   32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8_0 rows:
     y[t, r] = sum_b (d_w[r,b] d_x[t,b]) * (n_w[r,b] . q_x[t,b])  (+ m_w[r,b] s_x[t,b] for
     Q4_1 / Q5_1), the integer block dot exact in int32, the rest float32;
   for the K-quants (Q4_K, Q5_K, Q6_K) against Q8_K rows, gq_amx_gemm_k's sums.
   A panel of 16 weight rows is unpacked once into signed bytes (Q4_0 n - 8, Q5_0 n - 16,
   Q8_0 as stored, Q4_1 / Q5_1 n) in the tiles' VNNI layout (each block 8 rows of 16
   columns x 4 consecutive values) with its scales; then for each 16 activation rows and
   each block, one tdpbssd gives the 16 x 16 block dots, which AVX-512 scales into 16
   float32 accumulators held in registers.  A K-quant's units are its sub-blocks (32
   values; Q6_K's 16), whose tile dots are scaled by their integer scales in int32 lanes.
   Only where the build has AMX-INT8 (the native class on such a CPU) and Linux grants
   the tile state; elsewhere gq_amx_ready() is 0 and q8_gemm.c picks the prefill's
   other GEMMs. */
#include <stdint.h>
#include <string.h>
#include "gt_prelude.h"
#include "ggml_blocks.h"
#include "q8_dots.h"

/* the form of the rows the GEMM reads against a weight type: GQ_Q80 (32-element block
   types), GQ_Q8K (the K-quants), 0: no AMX GEMM */
int gq_amx_type(int64_t type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return GQ_Q80;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return GQ_Q8K;
    }
    return 0;
}

/* the panel (at most 640 bytes per 32 values: Q4_K's 16 x 32 bytes of quants, scales
   and mins; Q6_K's 16 x 32 bytes and scales for two 16-value sub-blocks), C tiles for
   two groups, two [16][16] float accumulators */
int64_t gq_amx_scratch_bytes(int64_t k) {
    return (k / 32) * 704 + 2 * 4 * 1024 + 2 * 1024 + 128;  /* GQ_GROUP = 4 */
}

/* X [T, k] (k a multiple of 32) as Q8_0 rows: q [T, k], d and s [T, k/32] (gq_q8_0's
   rounding), rows t0 .. t1 */
void gq_q8_0_rows(const float *X, int64_t t0, int64_t t1, int64_t k, int8_t *q, float *d,
                  float *s) {
    int32_t z[k / 4 > 0 ? k / 4 : 1];  /* Q5_0's AVX2 offset term: not used here */
    for (int64_t t = t0; t < t1; t++)
        gq_q8_0(X + t * k, k, q + t * k, d + t * (k / 32), s + t * (k / 32), z);
}

/* X [T, k] (k a multiple of 256) as Q8_K rows: q [T, k], d [T, k/256] (gq_q8_k's
   rounding) and the int16 sums of each `per` quants (32: the AMX GEMM's, 16: the AVX2
   GEMM's) sums [T, k/per], rows t0 .. t1 */
void gq_q8_k_rows(const float *X, int64_t t0, int64_t t1, int64_t k, int8_t *q, float *d,
                  int16_t *sums, int per) {
    int16_t bs[k / 16 > 0 ? k / 16 : 1];
    for (int64_t t = t0; t < t1; t++) {
        if (per == 16) {
            gq_q8_k(X + t * k, k, q + t * k, d + t * (k / 256), sums + t * (k / 16));
            continue;
        }
        gq_q8_k(X + t * k, k, q + t * k, d + t * (k / 256), bs);
        for (int64_t j = 0; j < k / 32; j++)
            sums[t * (k / 32) + j] = (int16_t)(bs[2 * j] + bs[2 * j + 1]);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) \
    && defined(__AVX512VNNI__) && !defined(GV_EMULATE)
#include <immintrin.h>
#include "amx_tiles.h"

int gq_amx_build(void) { return 1; }

int gq_amx_ready(void) { return gt_amx_permitted(); }

/* tmm0-3: C, 16 x 16 int32 (a group of blocks); tmm4-5: A, 16 rows x 32 bytes (one block
   of 16 activation rows; 16 bytes for Q6_K's sub-blocks); tmm6-7: B, 8 rows x 64 bytes
   (one block of the panel's 16 weight rows; 4 rows for Q6_K) */
static void gq_amx_configure(int kb) {  /* kb: the values of a unit (32, or 16: Q6_K) */
    gt_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    for (int t = 4; t < 6; t++) { cfg.colsb[t] = kb; cfg.rows[t] = 16; }
    for (int t = 6; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = kb / 4; }
    _tile_loadconfig(&cfg);
}

/* byte j = 16 where bit j of the u32 at qh is set, else 0 (Q5_0 / Q5_1's fifth bits) */
static inline __m256i gq_bit16(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_maskz_mov_epi8((__mmask32)h, _mm256_set1_epi8(16));
}

/* block p of a 32-element type as 32 signed bytes in element order, its scale d and its
   min m (0 where the type has none) */
static inline __m256i gq_unpack32(int64_t type, const uint8_t *p, float *d, float *m) {
    *d = gb_h2f(p);
    *m = 0.0f;
    switch (type) {
    case T_Q4_0: return _mm256_sub_epi8(gq_nibs(p + 2), _mm256_set1_epi8(8));
    case T_Q4_1: *m = gb_h2f(p + 2); return gq_nibs(p + 4);
    case T_Q5_0:
        return _mm256_sub_epi8(_mm256_or_si256(gq_nibs(p + 6), gq_bit16(p + 2)),
                               _mm256_set1_epi8(16));
    case T_Q5_1: *m = gb_h2f(p + 2); return _mm256_or_si256(gq_nibs(p + 8), gq_bit16(p + 4));
    default: return _mm256_loadu_si256((const __m256i *)(p + 2));  /* Q8_0 */
    }
}

static int gq_block_bytes(int64_t type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    }
    return 0;
}

#define GQ_GROUP 4  /* blocks whose dots are in C tiles (tmm0-3) at once */

/* the dots of units b0 .. b0 + n (n <= GQ_GROUP; a unit: kb values, a block or a
   K-quant's sub-block) of 16 activation rows (qa, k bytes apart) and the panel B into
   tiles tmm0 .. tmm(n-1), stored to C [n][16][16] */
static inline void gq_group_dots(const int8_t *qa, int64_t k, const uint32_t *B, int64_t b0,
                                 int n, int32_t *C, int kb) {
    /* tile numbers must be constants: one case per count; a unit is kb values */
#define GQ_DP(j, a, bt) do { _tile_zero(j); _tile_loadd(a, qa + kb * (b0 + j), k);          \
        _tile_loadd(bt, B + (b0 + j) * 4 * kb, 64); _tile_dpbssd(j, a, bt); } while (0)
    GQ_DP(0, 4, 6);
    if (n > 1) GQ_DP(1, 5, 7);
    if (n > 2) GQ_DP(2, 4, 6);
    if (n > 3) GQ_DP(3, 5, 7);
    _tile_stored(0, C, 64);
    if (n > 1) _tile_stored(1, C + 256, 64);
    if (n > 2) _tile_stored(2, C + 512, 64);
    if (n > 3) _tile_stored(3, C + 768, 64);
#undef GQ_DP
}

/* the 32-element block types: gq_amx_gemm_rows' arguments */
static void gq_amx_gemm_32(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                           int64_t r0, int64_t r1, const int8_t *q, const float *d,
                           const float *s, int64_t T, float *Y, int64_t ldy, int accumulate,
                           void *scratch) {
    const int64_t nb = k / 32, by = gq_block_bytes(type);
    const int min = type == T_Q4_1 || type == T_Q5_1;
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint32_t *B = (uint32_t *)base;                   /* [nb][8][16] */
    float *dw = (float *)(base + nb * 512);           /* [nb][16] */
    float *mw = dw + nb * 16;                         /* [nb][16] */
    int32_t *C = (int32_t *)(mw + nb * 16);           /* [2][GQ_GROUP][16][16] */
    /* row i's 8 dwords of a block go to B + 16 j + i */
    const __m256i at = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    gq_amx_configure(32);
    for (int64_t p = r0; p < r1; p += 16) {
        const int64_t np = p + 16 <= r1 ? 16 : r1 - p;
        for (int64_t i = 0; i < 16; i++) {  /* the panel in the tiles' layout */
            const uint8_t *row = W + (p + i) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                float dd = 0.0f, mm = 0.0f;
                const __m256i w = i < np ? gq_unpack32(type, row + b * by, &dd, &mm)
                                         : _mm256_setzero_si256();
                _mm256_i32scatter_epi32((int *)(B + b * 128 + i), at, w, 4);
                dw[b * 16 + i] = dd;
                mw[b * 16 + i] = mm;
            }
        }
        for (int64_t t0 = 0; t0 < T; t0 += 16) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            const int8_t *qa = q + t0 * k;
            const float *da = d + t0 * nb, *sa = s + t0 * nb;
            /* the tiles of group g + 1 run while AVX-512 scales group g's dots */
            int cur = 0;
            gq_group_dots(qa, k, B, 0, nb < GQ_GROUP ? (int)nb : GQ_GROUP, C, 32);
            for (int64_t g = 0; g < nb; g += GQ_GROUP) {
                const int n = g + GQ_GROUP <= nb ? GQ_GROUP : (int)(nb - g);
                const int64_t g1 = g + GQ_GROUP;
                if (g1 < nb)
                    gq_group_dots(qa, k, B, g1, g1 + GQ_GROUP <= nb ? GQ_GROUP : (int)(nb - g1),
                                  C + (1 - cur) * GQ_GROUP * 256, 32);
                const int32_t *Cg = C + cur * GQ_GROUP * 256;
                for (int j = 0; j < n; j++) {
                    const int64_t b = g + j;
                    const __m512 dv = _mm512_loadu_ps(dw + b * 16);
                    /* (d_w d_x) * dot, in the decode dots' order of the two factors */
                    for (int i = 0; i < 16; i++)
                        acc[i] = _mm512_fmadd_ps(
                            _mm512_mul_ps(dv, _mm512_set1_ps(da[i * nb + b])),
                            _mm512_cvtepi32_ps(_mm512_loadu_si512(Cg + 256 * j + 16 * i)),
                            acc[i]);
                    if (min) {
                        const __m512 mv = _mm512_loadu_ps(mw + b * 16);
                        for (int i = 0; i < 16; i++)
                            acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sa[i * nb + b]), acc[i]);
                    }
                }
                cur = 1 - cur;
            }
            const int64_t nt = t0 + 16 <= T ? 16 : T - t0;
            const __mmask16 keep = (__mmask16)((1u << np) - 1);
            for (int64_t i = 0; i < nt; i++) {
                float *y = Y + (t0 + i) * ldy + p;
                __m512 v = acc[i];
                if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, y));
                _mm512_mask_storeu_ps(y, keep, v);
            }
        }
    }
    _tile_release();
}

/* a K-quant super-block of weight row i (256 values) into the panel: its units' quants
   (Q4_K / Q5_K: 8 sub-blocks of 32, n unsigned; Q6_K: 16 of 16, n - 32 signed) at B +
   u * 4 * kb + 16 j + i (u the unit within the row), each unit's integer scale sc, and
   Q4_K / Q5_K's mins as int16 pairs mp [4] (mn 2p low, mn 2p + 1 high), d and dmin */
static void gq_unpack_k(int64_t type, const uint8_t *p, uint32_t *B, int64_t i, int32_t *sc,
                        int32_t *mp, float *d, float *dmin) {
    uint8_t n[256];
    int8_t *w = (int8_t *)n;
    if (type == T_Q6_K) {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *s6 = (const int8_t *)(p + 192);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++)
                    w[128 * h + 32 * g + l] = (int8_t)(
                        (((ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15)
                         | (((qh[32 * h + l] >> (2 * g)) & 3) << 4)) - 32);
        for (int u = 0; u < 16; u++) {
            sc[16 * u] = s6[u];
            for (int j = 0; j < 4; j++) memcpy(B + u * 64 + 16 * j + i, w + 16 * u + 4 * j, 4);
        }
        *d = gb_h2f(p + 208);
        *dmin = 0.0f;
        return;
    }
    const int five = type == T_Q5_K;
    const uint8_t *qs = p + (five ? 48 : 16), *qh = p + 16;
    int s8[8], m8[8];
    k_scale_min(p + 4, s8, m8);
    for (int u = 0; u < 8; u++) {
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (u / 2) + l] >> (4 * (u & 1))) & 15;
            if (five) v |= ((qh[l] >> u) & 1) << 4;
            n[32 * u + l] = (uint8_t)v;
        }
        sc[16 * u] = s8[u];
        for (int j = 0; j < 8; j++) memcpy(B + u * 128 + 16 * j + i, n + 32 * u + 4 * j, 4);
    }
    for (int pr = 0; pr < 4; pr++)
        mp[16 * pr] = (int32_t)((uint32_t)(uint16_t)m8[2 * pr] | (uint32_t)m8[2 * pr + 1] << 16);
    *d = gb_h2f(p);
    *dmin = gb_h2f(p + 2);
}

static int gq_k_bytes(int64_t type) {
    return type == T_Q6_K ? 210 : type == T_Q5_K ? 176 : 144;
}

/* the K-quants against Q8_K rows (q [T, k], d [T, k/256], b32 [T, k/32]: gq_q8_k_rows):
     y = sum_b (d_w d_x) isum_b  -  sum_b (dmin_w d_x) imin_b  (the two sums in float32),
     isum_b = sum_u sc_u (n . q)_u (Q6_K: n - 32), imin_b = sum_s mn_s b32_s  (Q4_K / Q5_K),
   the unit dots on tiles, their scaled sums in int32 lanes (exact: |isum| < 2^31) */
static void gq_amx_gemm_k(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                          int64_t r0, int64_t r1, const int8_t *q, const float *d,
                          const int16_t *b32, int64_t T, float *Y, int64_t ldy, int accumulate,
                          void *scratch) {
    const int six = type == T_Q6_K, kb = six ? 16 : 32, nu = 256 / kb;  /* units a block */
    const int64_t nb = k / 256, units = k / kb, by = gq_k_bytes(type);
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint32_t *B = (uint32_t *)base;                   /* [units][kb / 4][16] */
    int32_t *sc = (int32_t *)(base + k * 16);         /* [units][16] */
    int32_t *mp = sc + units * 16;                    /* [nb][4][16] */
    float *dw = (float *)(mp + nb * 64), *dm = dw + nb * 16;  /* [nb][16] */
    int32_t *C = (int32_t *)(dm + nb * 16);           /* [2][GQ_GROUP][16][16] */
    float *aS = (float *)(C + 2 * GQ_GROUP * 256), *aM = aS + 256;  /* [16][16] */
    gq_amx_configure(kb);
    for (int64_t p = r0; p < r1; p += 16) {
        const int64_t np = p + 16 <= r1 ? 16 : r1 - p;
        for (int64_t i = 0; i < 16; i++)
            for (int64_t b = 0; b < nb; b++) {
                if (i < np) {
                    gq_unpack_k(type, W + (p + i) * row_bytes + b * by, B + b * nu * 4 * kb, i,
                                sc + b * nu * 16 + i, mp + b * 64 + i, dw + b * 16 + i,
                                dm + b * 16 + i);
                } else {
                    for (int u = 0; u < nu; u++) {
                        sc[(b * nu + u) * 16 + i] = 0;
                        for (int j = 0; j < kb / 4; j++) B[(b * nu + u) * 4 * kb + 16 * j + i] = 0;
                    }
                    for (int pr = 0; pr < 4; pr++) mp[b * 64 + 16 * pr + i] = 0;
                    dw[b * 16 + i] = dm[b * 16 + i] = 0.0f;
                }
            }
        for (int64_t t0 = 0; t0 < T; t0 += 16) {
            __m512i is[16];
            for (int i = 0; i < 16; i++) {
                is[i] = _mm512_setzero_si512();
                _mm512_storeu_ps(aS + 16 * i, _mm512_setzero_ps());
                _mm512_storeu_ps(aM + 16 * i, _mm512_setzero_ps());
            }
            const int8_t *qa = q + t0 * k;
            int cur = 0;
            gq_group_dots(qa, k, B, 0, units < GQ_GROUP ? (int)units : GQ_GROUP, C, kb);
            for (int64_t g = 0; g < units; g += GQ_GROUP) {
                const int n = g + GQ_GROUP <= units ? GQ_GROUP : (int)(units - g);
                const int64_t g1 = g + GQ_GROUP;
                if (g1 < units)
                    gq_group_dots(qa, k, B, g1, g1 + GQ_GROUP <= units ? GQ_GROUP : (int)(units - g1),
                                  C + (1 - cur) * GQ_GROUP * 256, kb);
                const int32_t *Cg = C + cur * GQ_GROUP * 256;
                for (int j = 0; j < n; j++) {
                    const int64_t u = g + j;
                    const __m512i sv = _mm512_loadu_si512(sc + u * 16);
                    for (int i = 0; i < 16; i++)
                        is[i] = _mm512_add_epi32(is[i], _mm512_mullo_epi32(
                                    sv, _mm512_loadu_si512(Cg + 256 * j + 16 * i)));
                    if ((u + 1) % nu)
                        continue;
                    /* the block's end: its integer sums into the float32 sums */
                    const int64_t b = u / nu;
                    const __m512 dv = _mm512_loadu_ps(dw + b * 16);
                    for (int i = 0; i < 16; i++) {
                        const float dx = d[(t0 + i) * nb + b];
                        _mm512_storeu_ps(aS + 16 * i, _mm512_fmadd_ps(
                            _mm512_mul_ps(dv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(is[i]),
                            _mm512_loadu_ps(aS + 16 * i)));
                        is[i] = _mm512_setzero_si512();
                    }
                    if (six)
                        continue;
                    const __m512 mv = _mm512_loadu_ps(dm + b * 16);
                    for (int i = 0; i < 16; i++) {
                        const int32_t *bp = (const int32_t *)(b32 + (t0 + i) * (k / 32) + 8 * b);
                        __m512i im = _mm512_setzero_si512();
                        for (int pr = 0; pr < 4; pr++)
                            im = _mm512_dpwssd_epi32(im, _mm512_loadu_si512(mp + b * 64 + 16 * pr),
                                                     _mm512_set1_epi32(bp[pr]));
                        const float dx = d[(t0 + i) * nb + b];
                        _mm512_storeu_ps(aM + 16 * i, _mm512_fmadd_ps(
                            _mm512_mul_ps(mv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(im),
                            _mm512_loadu_ps(aM + 16 * i)));
                    }
                }
                cur = 1 - cur;
            }
            const int64_t nt = t0 + 16 <= T ? 16 : T - t0;
            const __mmask16 keep = (__mmask16)((1u << np) - 1);
            for (int64_t i = 0; i < nt; i++) {
                float *y = Y + (t0 + i) * ldy + p;
                __m512 v = _mm512_sub_ps(_mm512_loadu_ps(aS + 16 * i), _mm512_loadu_ps(aM + 16 * i));
                if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, y));
                _mm512_mask_storeu_ps(y, keep, v);
            }
        }
    }
    _tile_release();
}

/* Y[t, r] (+)= the scheme's dot of weight row r (r0 <= r < r1) with activation row t < T:
   32-element block types against Q8_0 rows (q [T, k], d and s [T, k/32]: gq_q8_0_rows),
   K-quants against Q8_K rows (q, d [T, k/256], s holding b32 [T, k/32] int16:
   gq_q8_k_rows).  Rows past T up to a multiple of 16 must be readable; their sums are
   dropped.  `scratch` holds gq_amx_scratch_bytes(k) bytes. */
void gq_amx_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                      int64_t r0, int64_t r1, const int8_t *q, const float *d, const float *s,
                      int64_t T, float *Y, int64_t ldy, int accumulate, void *scratch) {
    if (gq_amx_type(type) == GQ_Q8K)
        gq_amx_gemm_k(type, W, row_bytes, k, r0, r1, q, d, (const int16_t *)(const void *)s, T,
                      Y, ldy, accumulate, scratch);
    else
        gq_amx_gemm_32(type, W, row_bytes, k, r0, r1, q, d, s, T, Y, ldy, accumulate, scratch);
}

#else
int gq_amx_build(void) { return 0; }  /* whether this build has the AMX GEMM */
int gq_amx_ready(void) { return 0; }

void gq_amx_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                      int64_t r0, int64_t r1, const int8_t *q, const float *d, const float *s,
                      int64_t T, float *Y, int64_t ldy, int accumulate, void *scratch) {
    (void)type; (void)W; (void)row_bytes; (void)k; (void)r0; (void)r1; (void)q; (void)d;
    (void)s; (void)T; (void)Y; (void)ldy; (void)accumulate; (void)scratch;
}
#endif
