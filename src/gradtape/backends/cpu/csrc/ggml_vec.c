/* Matrix-vector products straight from ggml quantized blocks (decode).

   y[t, r] = sum_j deq(W)[r, j] * x[t, j] for T <= 4 rows x, W [rows, k] stored as ggml
   blocks (each row a whole number of blocks, row_bytes apart).  A block is dequantized
   into registers / a 256-float scratch by ggml_blocks.h (bit-identical to
   gguf.quants.dequantize), then multiplied into 16 float32 lane
   accumulators per x row; the lanes are summed at the end of the row.  With AVX-512 or
   AVX2 + FMA (gv_simd.h), Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K rows against one x row
   and the prefill GEMM's register block take vector fast paths (GV_W lanes, fused
   multiply-adds).  Only the summation order differs from a float32 BLAS dot product.
   Nothing here quantizes the activations. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gt_prelude.h"
#include "ggml_blocks.h"
#include "ggml_vec.h"
#include "gv_simd.h"

/* 16 values of a plain row: the dot kernels' pseudo-block for F16 / BF16 / F32 */
static inline void deq_f16(const uint8_t *b, float *o) {
#ifdef GV_W
    for (int l = 0; l < 16; l += GV_W) gv_store(o + l, gv_f16(b + 2 * l));
#else
    for (int l = 0; l < 16; l++) o[l] = gb_h2f(b + 2 * l);
#endif
}
static inline void deq_bf16(const uint8_t *b, float *o) {
    for (int l = 0; l < 16; l++) {
        uint16_t h; memcpy(&h, b + 2 * l, 2);
        uint32_t u = (uint32_t)h << 16; memcpy(o + l, &u, 4);
    }
}
static inline void deq_f32(const uint8_t *b, float *o) { memcpy(o, b, 64); }

/* --- dot products of one weight row with T <= 4 rows of x ---------------------------- */

/* Lane accumulators: acc[t][l] sums the products of elements j = l (mod 16), so the inner
   loop is one 16-wide multiply and add per x row (vectorized without reassociation). */
#define GV_DOT(NAME, QK, BS, DEQ)                                                          \
static void NAME(const uint8_t *row, int64_t nb, const float *x, int64_t T, int64_t ldx,   \
                 float *out) {                                                             \
    float w[QK];                                                                           \
    if (T == 1) {                                                                          \
        float a[16] = {0};                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                 \
            DEQ(row + b * BS, w);                                                          \
            const float *xb = x + b * QK;                                                  \
            for (int j = 0; j < QK; j += 16)                                               \
                for (int l = 0; l < 16; l++) a[l] += w[j + l] * xb[j + l];                 \
        }                                                                                  \
        out[0] = gv_hsum(a);                                                               \
        return;                                                                            \
    }                                                                                      \
    float a[4][16];                                                                        \
    memset(a, 0, sizeof a);                                                                \
    for (int64_t b = 0; b < nb; b++) {                                                     \
        DEQ(row + b * BS, w);                                                              \
        for (int64_t t = 0; t < T; t++) {                                                  \
            const float *xb = x + t * ldx + b * QK;                                        \
            for (int j = 0; j < QK; j += 16)                                               \
                for (int l = 0; l < 16; l++) a[t][l] += w[j + l] * xb[j + l];              \
        }                                                                                  \
    }                                                                                      \
    for (int64_t t = 0; t < T; t++) out[t] = gv_hsum(a[t]);                                \
}

GV_DOT(dot_q4_0, 32, 18, deq_q4_0)
GV_DOT(dot_q4_1, 32, 20, deq_q4_1)
GV_DOT(dot_q5_0, 32, 22, deq_q5_0)
GV_DOT(dot_q5_1, 32, 24, deq_q5_1)
GV_DOT(dot_q8_0, 32, 34, deq_q8_0)
GV_DOT(dot_q4_k, 256, 144, deq_q4_k)
GV_DOT(dot_q5_k, 256, 176, deq_q5_k)
GV_DOT(dot_q6_k, 256, 210, deq_q6_k)
GV_DOT(dot_q2_k, 256, 84, deq_q2_k)
GV_DOT(dot_q3_k, 256, 110, deq_q3_k)
GV_DOT(dot_iq4_nl, 32, 18, deq_iq4_nl)
GV_DOT(dot_iq4_xs, 256, 136, deq_iq4_xs)
#ifdef GB_IQ_TABLES
GV_DOT(dot_iq2_xxs, 256, 66, deq_iq2_xxs)
GV_DOT(dot_iq2_xs, 256, 74, deq_iq2_xs)
GV_DOT(dot_iq2_s, 256, 82, deq_iq2_s)
GV_DOT(dot_iq3_xxs, 256, 98, deq_iq3_xxs)
GV_DOT(dot_iq3_s, 256, 110, deq_iq3_s)
#endif
GV_DOT(dot_f16, 16, 32, deq_f16)
GV_DOT(dot_bf16, 16, 32, deq_bf16)
GV_DOT(dot_f32, 16, 64, deq_f32)

/* --- vector single-row dots (T = 1) of the common types --------------------------------
   The block scale is factored out of the block's sum: for Q4_1,
     sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * xs_b,   xs_b = sum_j x_j of block b
   (xs precomputed once per x for all rows), so a block costs 32 int->float converts and
   multiply-adds (GV_W at a time) and one scaled accumulate; Q4_0 is the same with
   m = -8 d (w = d (q - 8)), Q8_0 has no m.  Same weights, float32 sums; only the
   rounding order differs from dequantizing first. */
#ifdef GV_W
#define GV_FAST 1
/* sum over a 32-element block of nib_j * x_j, in GV_W lanes (element j < 16 is the low
   nibble of qs[j], element j + 16 its high nibble) */
static inline gv_f gv_q4_sum(const uint8_t *qs, const float *xb) {
    gv_f lo, hi;
    gv_nibs(qs, 0, &lo, &hi);
    gv_f s = gv_fma(hi, gv_load(xb + 16), gv_mul(lo, gv_load(xb)));
    for (int h = 1; h < 16 / GV_W; h++) {
        gv_nibs(qs, h, &lo, &hi);
        s = gv_fma(lo, gv_load(xb + GV_W * h), s);
        s = gv_fma(hi, gv_load(xb + 16 + GV_W * h), s);
    }
    return s;
}
/* sum over a 32-element block of q_j * x_j, q signed bytes, in GV_W lanes */
static inline gv_f gv_q8_sum(const uint8_t *qs, const float *xb) {
    gv_f s = gv_mul(gv_i8(qs), gv_load(xb));
    for (int j = GV_W; j < 32; j += GV_W) s = gv_fma(gv_i8(qs + j), gv_load(xb + j), s);
    return s;
}
/* acc + d * (the block's q . x in lanes), and m * xs_b added to *m (Q4_0 / Q4_1; Q4_0's
   (-8 d) xs_b is exactly -(8 d xs_b): negation is exact) */
static inline gv_f gv_block1(int64_t type, const uint8_t *p, const float *xb, float xsb,
                             gv_f acc, float *m) {
    const float d = gb_h2f(p);
    if (type == T_Q8_0) return gv_fma(gv_set1(d), gv_q8_sum(p + 2, xb), acc);
    *m += (type == T_Q4_1 ? gb_h2f(p + 2) : -8.0f * d) * xsb;
    return gv_fma(gv_set1(d), gv_q4_sum(p + (type == T_Q4_1 ? 4 : 2), xb), acc);
}
/* two blocks per iteration into two accumulators: the multiply-add chains overlap */
#define GV_DOT1(NAME, TYPE, BS)                                                            \
static float NAME(const uint8_t *row, int64_t nb, const float *x, const float *xs) {       \
    gv_f a0 = gv_zero(), a1 = gv_zero();                                                   \
    float m0 = 0.0f, m1 = 0.0f;                                                            \
    int64_t b = 0;                                                                         \
    for (; b + 1 < nb; b += 2) {                                                           \
        a0 = gv_block1(TYPE, row + BS * b, x + 32 * b, xs[b], a0, &m0);                    \
        a1 = gv_block1(TYPE, row + BS * b + BS, x + 32 * b + 32, xs[b + 1], a1, &m1);      \
    }                                                                                      \
    if (b < nb) a0 = gv_block1(TYPE, row + BS * b, x + 32 * b, xs[b], a0, &m0);            \
    const float s = gv_sum(gv_add(a0, a1));                                                \
    return TYPE == T_Q8_0 ? s : s + (m0 + m1);                                             \
}
GV_DOT1(dot1_q4_0, T_Q4_0, 18)
GV_DOT1(dot1_q4_1, T_Q4_1, 20)
GV_DOT1(dot1_q8_0, T_Q8_0, 34)

/* The K-quants' 256-value super-blocks, the same way, one scale per sub-block:
     Q4_K  w = D_s nib - M_s (D_s = d sc_s, M_s = dmin mn_s, sub-blocks s of 32):
           sum_j w_j x_j = sum_s D_s * sum_j nib_j x_j - dmin * sum_s mn_s xs_s
           (xs_s: the sum of x over sub-block s, the 32-element sums above)
     Q6_K  w = D_s (q - 32) (D_s = d scale_s, sub-blocks s of 16): the offset is taken
           off in integers (gv_q6), D_s times each sub-block's q . x
   The scaled accumulates go round several accumulators (Q4_K's sub-block s into a[s % 4],
   Q6_K's value group g into a[g % 2]: four would spill on AVX2), so that they form short
   chains rather than one long one. */
/* a Q4_K / Q5_K super-block at p: its scale d, its sub-blocks' scales sc[8], and its min
   term dmin * sum_s mn_s xs_s (xsb: the super-block's 8 sub-block sums of x) */
static inline float k_head(const uint8_t *p, const float *xsb, float *d, int *sc) {
    int mn[8];
    *d = gb_h2f(p);
    k_scale_min(p + 4, sc, mn);
    float mb = 0.0f;
    for (int s = 0; s < 8; s++) mb += (float)mn[s] * xsb[s];
    return gb_h2f(p + 2) * mb;
}
/* the nib . x sums of the two Q4_K sub-blocks packed in 32 bytes qs: the low nibbles
   (values xb[0, 32)) into *lo, the high nibbles (xb[32, 64)) into *hi, in GV_W lanes */
static inline void gv_q4k_sums(const uint8_t *qs, const float *xb, gv_f *lo, gv_f *hi) {
    gv_f l, h;
    gv_nibs(qs, 0, &l, &h);
    *lo = gv_mul(l, gv_load(xb));
    *hi = gv_mul(h, gv_load(xb + 32));
    for (int j = GV_W; j < 32; j += GV_W) {
        gv_nibs(qs + j, 0, &l, &h);
        *lo = gv_fma(l, gv_load(xb + j), *lo);
        *hi = gv_fma(h, gv_load(xb + 32 + j), *hi);
    }
}
static float dot1_q4_k(const uint8_t *row, int64_t nb, const float *x, const float *xs) {
    gv_f a[4] = {gv_zero(), gv_zero(), gv_zero(), gv_zero()};
    float m = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 144 * b;
        const float *xb = x + 256 * b;
        float d;
        int sc[8];
        m += k_head(p, xs + 8 * b, &d, sc);
        for (int s = 0; s < 8; s += 2) {  /* sub-blocks s, s + 1: the nibbles of 32 bytes */
            gv_f lo, hi;
            gv_q4k_sums(p + 16 + 16 * s, xb + 32 * s, &lo, &hi);
            a[s & 3] = gv_fma(gv_set1(d * (float)sc[s]), lo, a[s & 3]);
            a[(s + 1) & 3] = gv_fma(gv_set1(d * (float)sc[s + 1]), hi, a[(s + 1) & 3]);
        }
    }
    return gv_sum(gv_add(gv_add(a[0], a[1]), gv_add(a[2], a[3]))) - m;
}
/* Q5_K as Q4_K with a fifth bit (deq_q5_k): sub-block s's values have their low bits in
   nibble s & 1 of qs[32 (s / 2) + l] and their high bit in qh[l] >> s */
static float dot1_q5_k(const uint8_t *row, int64_t nb, const float *x, const float *xs) {
    gv_f a[4] = {gv_zero(), gv_zero(), gv_zero(), gv_zero()};
    float m = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 176 * b, *qh = p + 16;
        const float *xb = x + 256 * b;
        float d;
        int sc[8];
        m += k_head(p, xs + 8 * b, &d, sc);
        for (int s = 0; s < 8; s += 2) {  /* sub-blocks s, s + 1: the nibbles of 32 bytes */
            const uint8_t *ql = p + 48 + 16 * s;
            const float *xv = xb + 32 * s;
            gv_f lo = gv_mul(gv_q5(ql, qh, 0, s), gv_load(xv));
            gv_f hi = gv_mul(gv_q5(ql, qh, 4, s + 1), gv_load(xv + 32));
            for (int j = GV_W; j < 32; j += GV_W) {
                lo = gv_fma(gv_q5(ql + j, qh + j, 0, s), gv_load(xv + j), lo);
                hi = gv_fma(gv_q5(ql + j, qh + j, 4, s + 1), gv_load(xv + 32 + j), hi);
            }
            a[s & 3] = gv_fma(gv_set1(d * (float)sc[s]), lo, a[s & 3]);
            a[(s + 1) & 3] = gv_fma(gv_set1(d * (float)sc[s + 1]), hi, a[(s + 1) & 3]);
        }
    }
    return gv_sum(gv_add(gv_add(a[0], a[1]), gv_add(a[2], a[3]))) - m;
}
/* Q6_K's layout as in deq_q6_k: in half h, values 32 g + l (g < 4, l < 32) have their low
   bits in ql[64 h + 32 (g % 2) + l] >> 4 (g / 2), their high bits in
   qh[32 h + l] >> 2 g, their scale 8 h + 2 g + l / 16 */
static float dot1_q6_k(const uint8_t *row, int64_t nb, const float *x, const float *xs) {
    (void)xs;  /* no min term */
    gv_f a[2] = {gv_zero(), gv_zero()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + 210 * b;
        const int8_t *sc = (const int8_t *)(p + 192);
        const float d = gb_h2f(p + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l += 16) {  /* one sub-block of 16 */
                    const uint8_t *ql = p + 64 * h + 32 * (g & 1) + l;
                    const uint8_t *qh = p + 128 + 32 * h + l;
                    const float *xv = x + 256 * b + 128 * h + 32 * g + l;
                    const int shl = 4 * (g >> 1), shh = 2 * g;
                    gv_f s = gv_mul(gv_q6(ql, qh, shl, shh), gv_load(xv));
                    for (int j = GV_W; j < 16; j += GV_W)
                        s = gv_fma(gv_q6(ql + j, qh + j, shl, shh), gv_load(xv + j), s);
                    const float D = d * (float)sc[8 * h + 2 * g + l / 16];
                    a[g & 1] = gv_fma(gv_set1(D), s, a[g & 1]);
                }
    }
    return gv_sum(gv_add(a[0], a[1]));
}

typedef float (*gv_dot1_fn)(const uint8_t *, int64_t, const float *, const float *);
static gv_dot1_fn gv_fast1(int64_t type) {
    switch (type) {
    case T_Q4_0: return dot1_q4_0;
    case T_Q4_1: return dot1_q4_1;
    case T_Q8_0: return dot1_q8_0;
    case T_Q4_K: return dot1_q4_k;
    case T_Q5_K: return dot1_q5_k;
    case T_Q6_K: return dot1_q6_k;
    }
    return 0;
}
#endif

typedef void (*gv_dot_fn)(const uint8_t *, int64_t, const float *, int64_t, int64_t, float *);

/* block size in elements (0: unsupported) and the row kernel of a ggml type */
static int gv_qk(int64_t type, gv_dot_fn *fn) {
    switch (type) {
    case T_Q4_0: *fn = dot_q4_0; return 32;
    case T_Q4_1: *fn = dot_q4_1; return 32;
    case T_Q5_0: *fn = dot_q5_0; return 32;
    case T_Q5_1: *fn = dot_q5_1; return 32;
    case T_Q8_0: *fn = dot_q8_0; return 32;
    case T_Q4_K: *fn = dot_q4_k; return 256;
    case T_Q5_K: *fn = dot_q5_k; return 256;
    case T_Q6_K: *fn = dot_q6_k; return 256;
    case T_Q2_K: *fn = dot_q2_k; return 256;
    case T_Q3_K: *fn = dot_q3_k; return 256;
    case T_IQ4_NL: *fn = dot_iq4_nl; return 32;
    case T_IQ4_XS: *fn = dot_iq4_xs; return 256;
#ifdef GB_IQ_TABLES
    case T_IQ2_XXS: *fn = dot_iq2_xxs; return 256;
    case T_IQ2_XS: *fn = dot_iq2_xs; return 256;
    case T_IQ2_S: *fn = dot_iq2_s; return 256;
    case T_IQ3_XXS: *fn = dot_iq3_xxs; return 256;
    case T_IQ3_S: *fn = dot_iq3_s; return 256;
#endif
    case T_F16: *fn = dot_f16; return 16;
    case T_BF16: *fn = dot_bf16; return 16;
    case T_F32: *fn = dot_f32; return 16;
    }
    *fn = 0;
    return 0;
}

/* float32 lanes of the fast paths' vectors (0: the plain C loops) */
int64_t gv_lanes(void) {
#ifdef GV_W
    return GV_W;
#else
    return 0;
#endif
}

/* Block size of a type, 0 when unsupported (the Python wrapper asks before calling). */
int64_t gv_block_elems(int64_t type) { gv_dot_fn f; return gv_qk(type, &f); }

/* y[t * ldy + r] (+)= row r of W . x[t], rows [r0, r1); k a multiple of the block size. */
void gv_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
             int64_t r0, int64_t r1, const float *x, int64_t T, int64_t ldx,
             float *y, int64_t ldy, int accumulate) {
    gv_dot_fn fn;
    const int64_t qk = gv_qk(type, &fn), nb = k / qk;
    float o[4];
#ifdef GV_FAST
    gv_dot1_fn f1 = gv_fast1(type);
    if (T == 1 && f1 && k / 32 <= 4096) {
        float xs[4096];  /* the sums of x over its 32-element (sub-)blocks */
        for (int64_t b = 0; b < k / 32; b++) {
            gv_f v = gv_load(x + 32 * b);
            for (int j = GV_W; j < 32; j += GV_W) v = gv_add(v, gv_load(x + 32 * b + j));
            xs[b] = gv_sum(v);
        }
        for (int64_t r = r0; r < r1; r++) {
            const float v = f1(W + r * row_bytes, nb, x, xs);
            if (accumulate) y[r] += v;
            else y[r] = v;
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        fn(W + r * row_bytes, nb, x, T, ldx, o);
        for (int64_t t = 0; t < T; t++) {
            if (accumulate) y[t * ldy + r] += o[t];
            else y[t * ldy + r] = o[t];
        }
    }
}

/* y[T, rows] = x[T, k] @ deq(W)[rows, k]^T, T <= 4, rows split over nthreads threads. */
/* The share of rows [r0, r1) of thread `tid` of `nt`: contiguous, in multiples of 16
   rows (one pass over x per thread). */
void gv_share(int64_t rows, int64_t tid, int64_t nt, int64_t *r0, int64_t *r1) {
    const int64_t chunks = (rows + 15) / 16;
    *r0 = chunks * tid / nt * 16;
    *r1 = chunks * (tid + 1) / nt * 16;
    if (*r1 > rows) *r1 = rows;
    if (*r0 > rows) *r0 = rows;
}

/* y[T, rows] = x[T, k] @ deq(W)[rows, k]^T, T <= 4, rows split over nthreads threads. */
void gv_matvec(int64_t type, const uint8_t *W, int64_t rows, int64_t k, int64_t row_bytes,
               const float *x, int64_t T, float *y, int64_t nthreads) {
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)nthreads) if (nthreads > 1)
    {
        int64_t r0, r1;
        gv_share(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        gv_rows(type, W, row_bytes, k, r0, r1, x, T, k, y, rows, 0);
    }
#else
    gv_rows(type, W, row_bytes, k, 0, rows, x, T, k, y, rows, 0);
#endif
}

/* Rows r0 .. r0 + n of W dequantized into out[n, k] (bit-identical to gguf). */
static void gv_deq_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                        int64_t r0, int64_t n, float *out) {
    gb_deq_fn f;
    int bl, by;
    if (gb_layout(type, &f, &bl, &by)) return;  /* the Python wrapper checks the type */
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = W + (r0 + i) * row_bytes;
        if (type == T_F16)  /* 16 at a time, vectorized (F16C), not value by value */
            for (int64_t b = 0; b < k / 16; b++) deq_f16(row + 32 * b, out + i * k + 16 * b);
        else
            f(row, out + i * k, k / bl);
    }
}

/* Rows `ids` of a table (e.g. the token embedding) dequantized into out[n, k]. */
void gv_take_rows(int64_t type, const uint8_t *W, int64_t k, int64_t row_bytes,
                  const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) gv_deq_rows(type, W, row_bytes, k, ids[i], 1, out + i * k);
}

/* --- many rows of x (prefill): Y[t, r] (+)= X[t] . deq(W)[r] for rows [r0, r1) ---------
   GV_PANEL rows of W are dequantized into `tile` [GV_PANEL, k] (reused by all T rows of
   X); each GV_TR rows of X then meet the panel's rows four at a time (the X rows are read
   from L1 by all of them rather than streamed from L2 for every four), their dots: in vector registers (gv_tile_dots) where
   there is a vector unit, else 16 lane accumulators each, over k. */
#ifdef GV_W
/* X rows per register block: AVX-512's 32 registers hold 4 x 4 accumulators, AVX2's 16
   hold 4 x 3 (with the 3 x vectors and one w vector beside them: 12 independent sums,
   more than the FMA units' latency times their count, where 4 x 2 left them waiting) */
#define GV_XR (GV_W == 16 ? 4 : 3)
/* out[i][u] = tile row i . X row u for i < 4, u < nt <= 4, k a multiple of GV_W:
   4 x GV_XR blocks of one GV_W-lane accumulator each, over k */
static inline void gv_tile_dots(const float *tile, const float *X, int64_t k, int64_t nt,
                                float out[4][4]) {
    for (int64_t u0 = 0; u0 < nt; u0 += GV_XR) {
        gv_f a[4][GV_XR], xv[GV_XR];
        const float *xr[GV_XR];
        for (int u = 0; u < GV_XR; u++)  /* past nt: row u0 again, its sums unused */
            xr[u] = X + (u0 + u < nt ? u0 + u : u0) * k;
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < GV_XR; u++) a[i][u] = gv_zero();
        for (int64_t j = 0; j < k; j += GV_W) {
            for (int u = 0; u < GV_XR; u++) xv[u] = gv_load(xr[u] + j);
            for (int i = 0; i < 4; i++) {
                gv_f w = gv_load(tile + i * k + j);
#if GV_W == 8 && !defined(GV_EMULATE) && defined(__GNUC__)
                /* w in a register for its 3 uses: GCC would fold a load into each FMA,
                   15 loads for 12 FMAs, and the load ports would set the pace */
                __asm__("" : "+x"(w));
#endif
                for (int u = 0; u < GV_XR; u++) a[i][u] = gv_fma(w, xv[u], a[i][u]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < GV_XR; u++) out[i][u0 + u] = gv_sum(a[i][u]);
    }
}
#define GV_TR GV_XR  /* X rows per gv_tile_dots call */
#else
#define GV_TR 4
#endif

#if GV_W == 8 && defined(__AVX2__) && defined(__FMA__) && !defined(GV_EMULATE)
/* AVX2: the panel's 16 rows packed column by column (tile [k][16]: 16 weights of one
   column in two vectors), X rows 6 at a time broadcast against them, 6 x 2 accumulators
   over a chunk of GV_KC columns (the packed chunk, 128 KB, stays in L2 for every 6 rows);
   each output's sum is one chain of multiply-adds a chunk, the chunks' sums added in
   order.  The dot form above reads both operands along k from L2 at half the FMA units'
   rate. */
#define GV_PACKED 1
#define GV_MR 6
#define GV_KC 2048

/* the 8 x 8 floats at s (rows ls apart) transposed into d (rows ld apart) */
static inline void gv_t8x8(const float *s, int64_t ls, float *d, int64_t ld) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(s + i * ls);
    gb_t8x8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(d + i * ld, r[i]);
}

/* rows p .. p + np (np <= 16; zeros past them) of W, columns j0 .. j0 + n (n a multiple
   of 8 and of the block), packed into wt [n][16], through buf [8][256] */
static void gv_pack(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t p, int64_t np,
                    int64_t j0, int64_t n, float *wt, float *buf) {
    gb_deq_fn f;
    int bl, by;
    gb_layout(type, &f, &bl, &by);  /* bl divides 256 (1, 32 or 256) */
    for (int64_t c = 0; c < n; c += 256) {
        const int64_t m = n - c < 256 ? n - c : 256;
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < 8; i++) {
                float *o = buf + i * 256;
                const int64_t r = p + 8 * h + i;
                const uint8_t *b = W + r * row_bytes + (j0 + c) / bl * by;
                if (8 * h + i >= np) memset(o, 0, m * sizeof(float));
                else if (type == T_F16)  /* 16 at a time (F16C), as gv_deq_rows */
                    for (int64_t e = 0; e < m; e += 16) deq_f16(b + 2 * e, o + e);
                else f(b, o, m / bl);
            }
            for (int64_t j = 0; j < m; j += 8)
                gv_t8x8(buf + j, 256, wt + (c + j) * 16 + 8 * h, 16);
        }
    }
}

/* Y row y, columns .. nr (nr <= 16) (+)= the two vectors lo, hi */
static inline void gv_put16(float *y, int64_t nr, int add, __m256 lo, __m256 hi) {
    float v[16];
    _mm256_storeu_ps(v, lo);
    _mm256_storeu_ps(v + 8, hi);
    for (int64_t i = 0; i < nr; i++) y[i] = add ? y[i] + v[i] : v[i];
}
/* Y rows t .. t + mr (mr <= 6), columns r .. r + nr (nr <= 16) (+)= X rows . wt [n][16];
   the 12 accumulators named one by one: GCC keeps an array of them in memory too */
static inline void gv_k6x16(const float *wt, const float *X, int64_t ldx, int64_t n, int64_t mr,
                            float *Y, int64_t ldy, int64_t nr, int add) {
    const float *x0 = X, *x1 = X + (mr > 1) * ldx, *x2 = X + (mr > 2) * 2 * ldx;
    const float *x3 = X + (mr > 3) * 3 * ldx, *x4 = X + (mr > 4) * 4 * ldx;
    const float *x5 = X + (mr > 5) * 5 * ldx;  /* past mr: row 0 again, its sums unused */
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
/* X row x's value at column j times the 16 weights w0, w1 into a, b */
#define GV_ROW(x, a, b)                                                                  \
    do {                                                                                 \
        const __m256 v = _mm256_broadcast_ss(x + j);                                     \
        a = _mm256_fmadd_ps(w0, v, a);                                                   \
        b = _mm256_fmadd_ps(w1, v, b);                                                   \
    } while (0)
    for (int64_t j = 0; j < n; j++) {
        const __m256 w0 = _mm256_loadu_ps(wt + 16 * j), w1 = _mm256_loadu_ps(wt + 16 * j + 8);
        GV_ROW(x0, a0, b0);
        GV_ROW(x1, a1, b1);
        GV_ROW(x2, a2, b2);
        GV_ROW(x3, a3, b3);
        GV_ROW(x4, a4, b4);
        GV_ROW(x5, a5, b5);
    }
#undef GV_ROW
    gv_put16(Y, nr, add, a0, b0);
    if (mr > 1) gv_put16(Y + ldy, nr, add, a1, b1);
    if (mr > 2) gv_put16(Y + 2 * ldy, nr, add, a2, b2);
    if (mr > 3) gv_put16(Y + 3 * ldy, nr, add, a3, b3);
    if (mr > 4) gv_put16(Y + 4 * ldy, nr, add, a4, b4);
    if (mr > 5) gv_put16(Y + 5 * ldy, nr, add, a5, b5);
}
#endif

/* whether gv_gemm_rows runs the packed kernel here (it gains from more rows a call) */
int gv_packed(void) {
#ifdef GV_PACKED
    return 1;
#else
    return 0;
#endif
}

void gv_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                  int64_t r0, int64_t r1, const float *X, int64_t T, float *Y,
                  int64_t ldy, int accumulate, float *tile) {
#ifdef GV_PACKED
    if (k % (type == T_F16 ? 16 : 8) == 0) {  /* tile: a chunk [GV_KC][16], buf [8][256] */
        float *buf = tile + 16 * (k < GV_KC ? k : GV_KC);
        for (int64_t p = r0; p < r1; p += 16) {
            const int64_t np = p + 16 <= r1 ? 16 : r1 - p;
            for (int64_t j0 = 0; j0 < k; j0 += GV_KC) {
                const int64_t n = k - j0 < GV_KC ? k - j0 : GV_KC;
                gv_pack(type, W, row_bytes, p, np, j0, n, tile, buf);
                for (int64_t t = 0; t < T; t += GV_MR)
                    gv_k6x16(tile, X + t * k + j0, k, n, T - t < GV_MR ? T - t : GV_MR,
                             Y + t * ldy + p, ldy, np, accumulate || j0 > 0);
            }
        }
        return;
    }
#endif
    /* a panel of about 32 KB of float32 (L1 with the X rows beside it): 4 to GV_PANEL
       rows, a multiple of 4 */
    int64_t pr = GV_PANEL_FLOATS / k / 4 * 4;
    pr = pr < 4 ? 4 : pr > GV_PANEL ? GV_PANEL : pr;
    for (int64_t p = r0; p < r1; p += pr) {
        const int64_t np = p + pr <= r1 ? pr : r1 - p, ng = (np + 3) / 4;
        gv_deq_rows(type, W, row_bytes, k, p, np, tile);
        for (int64_t i = np; i < 4 * ng; i++) memset(tile + i * k, 0, k * sizeof(float));
        for (int64_t t = 0; t < T; t += GV_TR) {
            const int64_t nt = t + GV_TR <= T ? GV_TR : T - t;
            for (int64_t g = 0; g < ng; g++) {  /* X rows t.. stay in L1 for the panel */
                const int64_t r = p + 4 * g, nr = 4 * g + 4 <= np ? 4 : np - 4 * g;
                const float *wt = tile + 4 * g * k;
                float out[4][4];
#ifdef GV_W
                if (k % GV_W == 0) gv_tile_dots(wt, X + t * k, k, nt, out);
                else
#endif
                {
                    for (int i = 0; i < 4; i++)
                        for (int u = 0; u < nt; u++) {
                            float a16[16] = {0};
                            const float *w = wt + i * k, *x = X + (t + u) * k;
                            int64_t j = 0;
                            for (; j + 16 <= k; j += 16)
                                for (int l = 0; l < 16; l++) a16[l] += w[j + l] * x[j + l];
                            for (; j < k; j++) a16[j & 15] += w[j] * x[j];
                            out[i][u] = gv_hsum(a16);
                        }
                }
                for (int64_t i = 0; i < nr; i++)
                    for (int64_t u = 0; u < nt; u++) {
                        float *y = Y + (t + u) * ldy + r + i;
                        *y = accumulate ? *y + out[i][u] : out[i][u];
                    }
            }
        }
    }
}

/* Y[T, rows] = X[T, k] @ deq(W)^T, any T, rows split over nthreads threads; `tile`
   holds nthreads * GV_TILE(k) floats. */
void gv_matmul(int64_t type, const uint8_t *W, int64_t rows, int64_t k, int64_t row_bytes,
               const float *X, int64_t T, float *Y, int64_t nthreads, float *tile) {
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)nthreads) if (nthreads > 1)
    {
        int64_t r0, r1, tid = omp_get_thread_num();
        gv_share(rows, tid, omp_get_num_threads(), &r0, &r1);
        gv_gemm_rows(type, W, row_bytes, k, r0, r1, X, T, Y, rows, 0, tile + tid * GV_TILE(k));
    }
#else
    gv_gemm_rows(type, W, row_bytes, k, 0, rows, X, T, Y, rows, 0, tile);
#endif
}
