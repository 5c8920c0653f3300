/* Frozen weights in their stored ggml type: dequantized rows and tiled GEMMs.

   Dequantization is ggml_blocks.h's:
   a dequantized row is bit for bit the NumPy reference, gguf.quants.dequantize.

   The GEMMs never hold the whole float matrix: a tile of W (rows r0.., block-aligned
   columns c0..) is dequantized into a caller-owned scratch buffer and multiplied by
   BLAS (NumPy's OpenBLAS, whose cblas_[sd]gemm the caller passes as a pointer):
     qgemm    y[T, rows]  = x[T, k] @ W^T   (y[:, r] += x[:, c] @ tile^T over column tiles)
     qgemm_t  z[T, k]     = g[T, rows] @ W  (z[:, c] += g[:, r] @ tile over row tiles)
   Tiles are dequantized with their rows split over the threads (OpenMP).  Type ids are
   ggml's.  This file knows nothing of Python; ../qgemm.py loads it. */
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gt_prelude.h"
#include "ggml_blocks.h"

/* float32 rows ids[0..n) (all rows in order when ids is NULL) of a [*, k] matrix whose
   rows are rb bytes apart: out [n, k] */
int gt_deq_rows(int t, const uint8_t *w, long rb, const int64_t *ids, long n, long k,
                float *out) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by)) return -1;
    for (long i = 0; i < n; i++) f(w + (ids ? ids[i] : i) * rb, out + i * k, k / bl);
    return 0;
}

/* the same into float64 (each float32 value widened exactly): the row is dequantized
   into the upper half of its own output row, then widened front to back */
int gt_deq_rows_f64(int t, const uint8_t *w, long rb, const int64_t *ids, long n, long k,
                    double *out) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by)) return -1;
    for (long i = 0; i < n; i++) {
        double *o = out + i * k;
        float *tmp = (float *)o + k;
        f(w + (ids ? ids[i] : i) * rb, tmp, k / bl);
        for (long j = 0; j < k; j++) o[j] = (double)tmp[j];
    }
    return 0;
}

/* --- bf16 tiles: the operands of the bf16 GEMMs (``--compute bf16``) ------------------
   Rounded as gt_bf16 (the prelude's; nearest even, NaN kept quiet), which is how ggml
   rounds float32 to bf16.  A row is dequantized a chunk at a time into float32 kept in
   L1, then rounded (a loop that vectorizes); rows split over the threads. */
#define BF16_CHUNK 1024  /* a multiple of every block size */

#ifdef __AVX512F__
/* With AVX-512, Q4_K and Q6_K (the blocks of a Q4_K_M file) go straight to bf16 in
   registers: each 32 bytes of quants read once (Q4_K: both nibbles; Q6_K: the 6-bit
   values put together as bytes, 32 at a time), the same float32 operations as
   ggml_blocks.h (a multiply, then a subtract), rounded as gt_bf16 (nearest even, NaN
   kept quiet) with integer operations, or by AVX512-BF16's conversion where the CPU has
   it (32 values at a time), so the bits are the same as the scalar path's.  Faster
   than the scalar path: no float32 row goes through memory, and Q4_K's scales and mins
   are made as one vector.  For rows streamed from memory, see PF_MIN_BYTES. */
static inline void bf16_store16(uint16_t *o, __m512 v) {
#ifdef __AVX512BF16__
    /* one instruction, the same rounding (nearest even, NaN made quiet); it also takes
       denormal inputs as zero, which values scaled by float16 factors never are */
    _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                    _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q)));
#endif
}

/* a value vector stored at element i of o as float32 (STORE_F32), bf16 (STORE_BF16) or
   int8 (STORE_S8: times inv[i ..], rounded half away from zero, as s8_round below): the
   kernels below are inlined with a constant kind, so each copy has one kind of store */
enum { STORE_F32, STORE_BF16, STORE_S8 };

static inline __attribute__((always_inline)) void store16(void *o, long i, __m512 v,
                                                          int kind, const float *inv) {
    if (kind == STORE_BF16) {
        bf16_store16((uint16_t *)o + i, v);
    } else if (kind == STORE_S8) {
        const __m512 t = _mm512_mul_ps(v, _mm512_loadu_ps(inv + i));
        const __m512 half = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(_mm512_set1_ps(0.5f)),
            _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32((int)0x80000000))));
        _mm_storeu_si128((__m128i *)((int8_t *)o + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(_mm512_add_ps(t, half))));
    } else {
        _mm512_storeu_ps((float *)o + i, v);
    }
}

/* vectors a and b stored at elements i and i + 16 of o: bf16 by one conversion of both
   where the CPU has AVX512-BF16 (the same rounding as bf16_store16's), else store16 */
static inline __attribute__((always_inline)) void store32(void *o, long i, __m512 a, __m512 b,
                                                          int kind, const float *inv) {
#ifdef __AVX512BF16__
    if (kind == STORE_BF16) {
        _mm512_storeu_si512((uint16_t *)o + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        return;
    }
#endif
    store16(o, i, a, kind, inv);
    store16(o, i + 16, b, kind, inv);
}

static inline __attribute__((always_inline)) void regs_q4_k(const uint8_t *b, void *o,
                                                            int kind, const float *inv) {
    uint8_t scm[16];
    k_scale_min_bytes(b + 4, scm);
    /* d sc[s] and dmin mn[s] for the eight sub-blocks, eight float32 products each (the
       same products as the scalar path's), in lanes 0..8 and 8..16 */
    const __m512 dd = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(gb_h2f(b))), _mm256_castps_pd(_mm256_set1_ps(gb_h2f(b + 2))), 1));
    const __m512 DM = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i *)scm))));
    const __m512i lo4 = _mm512_set1_epi32(0xF);
    for (int s = 0; s < 8; s += 2) {  /* sub-blocks s and s + 1: the low and high nibbles */
        const uint8_t *q = b + 16 + 16 * s;
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        for (int u = 0; u < 2; u++) {
            const __m512 D = _mm512_permutexvar_ps(_mm512_set1_epi32(s + u), DM);
            const __m512 M = _mm512_permutexvar_ps(_mm512_set1_epi32(8 + s + u), DM);
            const __m512i x0 = u ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, lo4);
            const __m512i x1 = u ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, lo4);
            store32(o, 32 * (s + u), _mm512_sub_ps(_mm512_mul_ps(D, _mm512_cvtepi32_ps(x0)), M),
                    _mm512_sub_ps(_mm512_mul_ps(D, _mm512_cvtepi32_ps(x1)), M), kind, inv);
        }
    }
}

/* the 6-bit values 128 h + l + 32 u (l < 32) of a Q6_K block's half h as bytes, minus 32
   (u = 0..4): low nibbles of ql, high bits 2u, 2u + 1 of qh[l] (16-bit shifts, masked to
   their bytes) */
static inline void q6k_half(const uint8_t *b, int h, __m256i q[4]) {
    const __m256i lo4 = _mm256_set1_epi8(0xF), hi2 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), hi2));
    q[1] = _mm256_or_si256(_mm256_and_si256(c, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), hi2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), _mm256_and_si256(hb, hi2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), lo4),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), hi2));
    for (int u = 0; u < 4; u++) q[u] = _mm256_sub_epi8(q[u], _mm256_set1_epi8(32));
}

static inline __attribute__((always_inline)) void regs_q6_k(const uint8_t *b, void *o,
                                                            int kind, const float *inv) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = gb_h2f(b + 208);
    for (int h = 0; h < 2; h++) {  /* a half: 128 values, 32 bytes at a time */
        __m256i q[4];
        q6k_half(b, h, q);
        for (int u = 0; u < 4; u++) {  /* values l + 32 u: scale (l + 32 u) / 16 */
            const __m256i v = q[u];
            const __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
            const __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
            store32(o, 128 * h + 32 * u,
                    _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * u]), x0),
                    _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * u + 1]), x1), kind, inv);
        }
    }
}

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
/* A block's 256 values as 8 vectors of 32 bf16 words, in registers: what the plain rows
   store (bf16_q4_k) and the blocked layout rearranges (vnni_pair, vnni_panel). */
#define BF16_VECS
typedef void (*vecs_fn)(const uint8_t *, __m512i *);

/* Q4_K by table: a sub-block's 32 values take 16 distinct ones, D q - M for the nibbles
   q = 0..15 (the float32 products and difference of regs_q4_k, rounded by the same
   conversion), so the 16 of two sub-blocks are made as one vector of 32 bf16 words and
   each nibble, widened to a word, picks its value from it (vpermw).  The same bits as
   regs_q4_k for less float work: 16 values made per sub-block instead of 32, and no
   quant converted to float32. */
static void vecs_q4_k(const uint8_t *b, __m512i *v) {
    uint8_t scm[16];
    k_scale_min_bytes(b + 4, scm);
    const __m512 dd = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(gb_h2f(b))), _mm256_castps_pd(_mm256_set1_ps(gb_h2f(b + 2))), 1));
    float dm[16];  /* D for sub-blocks 0..8, then M */
    _mm512_storeu_ps(dm, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i *)scm)))));
    const __m512 q16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int s = 0; s < 8; s += 2) {  /* sub-blocks s and s + 1: the low and high nibbles */
        const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dm[s]), q16),
                                        _mm512_set1_ps(dm[8 + s]));
        const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dm[s + 1]), q16),
                                        _mm512_set1_ps(dm[9 + s]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);  /* words 0..16: s */
        const __m512i q = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256((const __m256i *)(b + 16 + 16 * s)));
        v[s] = _mm512_permutexvar_epi16(_mm512_and_si512(q, _mm512_set1_epi16(0xF)), table);
        v[s + 1] = _mm512_permutexvar_epi16(
            _mm512_or_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi16(16)), table);
    }
}

/* Q6_K: regs_q6_k's float32 products, rounded by the same conversion */
static void vecs_q6_k(const uint8_t *b, __m512i *v) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = gb_h2f(b + 208);
    for (int h = 0; h < 2; h++) {
        __m256i q[4];
        q6k_half(b, h, q);
        for (int u = 0; u < 4; u++) {
            const __m256i x = q[u];
            const __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(x)));
            const __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(x, 1)));
            v[4 * h + u] = (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * u + 1]), x1),
                _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * u]), x0));
        }
    }
}

static vecs_fn bf16_vecs(int t) { return t == T_Q4_K ? vecs_q4_k : t == T_Q6_K ? vecs_q6_k : 0; }

static void bf16_q4_k(const uint8_t *b, uint16_t *o) {
    __m512i v[8];
    vecs_q4_k(b, v);
    for (int i = 0; i < 8; i++) _mm512_storeu_si512(o + 32 * i, v[i]);
}

/* The same block of two rows, a = W[2p, j] and b = W[2p + 1, j], as the 32-bit words (a
   in the low half) of four rows of 64 words of gt_deq_tile_vnni's panels, panel words
   apart from dst: the two rows' values interleaved in registers (vpermt2w) instead of
   through a row of each in memory (a store and a reload of every value). */
static void vnni_pair(vecs_fn vecs, const uint8_t *a, const uint8_t *b, uint32_t *dst,
                      long panel) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                           41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
                                           34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    __m512i va[8], vb[8];
    vecs(a, va);
    vecs(b, vb);
    for (int s = 0; s < 8; s++) {  /* values 32 s .. 32 s + 32: half a panel's row */
        uint32_t *o = dst + s / 2 * panel + 32 * (s & 1);
        _mm512_storeu_si512(o, _mm512_permutex2var_epi16(va[s], first, vb[s]));
        _mm512_storeu_si512(o + 16, _mm512_permutex2var_epi16(va[s], second, vb[s]));
    }
}
#else
static void bf16_q4_k(const uint8_t *b, uint16_t *o) { regs_q4_k(b, o, STORE_BF16, 0); }
#endif
static void bf16_q6_k(const uint8_t *b, uint16_t *o) { regs_q6_k(b, o, STORE_BF16, 0); }
static void f32_q4_k(const uint8_t *b, float *o) { regs_q4_k(b, o, STORE_F32, 0); }
static void f32_q6_k(const uint8_t *b, float *o) { regs_q6_k(b, o, STORE_F32, 0); }
static void s8_q4_k(const uint8_t *b, int8_t *o, const float *inv) {
    regs_q4_k(b, o, STORE_S8, inv);
}
static void s8_q6_k(const uint8_t *b, int8_t *o, const float *inv) {
    regs_q6_k(b, o, STORE_S8, inv);
}
#endif

/* Streaming a matrix's blocks row after row, the dequantization waits on memory (plain
   rows and the blocked layout alike) unless each row's blocks are fetched while the row
   before is dequantized.  Where a tile takes less of each row (its columns of a tall W:
   one block a row, 2 KB apart) the cores' own prefetchers keep up, and nothing is
   fetched ahead (pf_rows 0). */
#define PF_MIN_BYTES 1024
/* the rows ahead of the one dequantized whose blocks [c0, c0 + nc) are fetched, or 0 */
static inline long pf_rows(long nc, int bl, int by) {
    return nc / bl * by >= PF_MIN_BYTES ? 1 : 0;
}
/* the blocks of row i + d of n (rows rb bytes apart from w), or NULL past the last or
   where d is 0 */
static inline const uint8_t *pf_row(const uint8_t *w, long rb, const int64_t *ids, long r0,
                                    long i, long d, long n) {
    return d && i + d < n ? w + (ids ? ids[i + d] : r0 + i + d) * rb : 0;
}

/* the cache lines of [p, p + bytes) asked for */
static inline void pf_bytes(const uint8_t *p, long bytes) {
    for (long b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* bf16 of W's row (its blocks at row) over columns [c0, c0 + nc) into o; the same
   columns of the row at ahead (or NULL) are asked for meanwhile, a block (or a chunk)
   at a time */
static void row_bf16(int t, gb_deq_fn f, int bl, int by, const uint8_t *row,
                     const uint8_t *ahead, long c0, long nc, uint16_t *restrict o) {
#ifdef __AVX512F__
    void (*direct)(const uint8_t *, uint16_t *) = t == T_Q4_K ? bf16_q4_k
                                                  : t == T_Q6_K ? bf16_q6_k : 0;
    if (direct) {
        for (long j = 0; j < nc; j += 256) {
            const long at = (c0 + j) / 256 * by;
            if (ahead) pf_bytes(ahead + at, by);
            direct(row + at, o + j);
        }
        return;
    }
    /* F16: 32 halves at a time widened and rounded in registers; the widening is exact,
       makes no float32 denormal, and quiets a signalling NaN as the rounding would */
    if (t == T_F16) {
        const uint8_t *h = row + 2 * c0;
        long j = 0;
        for (; j + 32 <= nc; j += 32) {
            if (ahead && j % BF16_CHUNK == 0) pf_bytes(ahead + 2 * (c0 + j), 2 * BF16_CHUNK);
            store32(o, j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 2 * j))),
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 2 * j + 32))),
                    STORE_BF16, 0);
        }
        for (; j < nc; j++) o[j] = gt_bf16(gb_h2f_bits(h + 2 * j));
        return;
    }
#endif
    if (t == T_BF16) {  /* already bf16: copied, a NaN made quiet as gt_bf16 makes it */
        const uint8_t *h = row + 2 * c0;
        for (long j = 0; j < nc; j += BF16_CHUNK) {
            const long m = nc - j < BF16_CHUNK ? nc - j : BF16_CHUNK;
            if (ahead) pf_bytes(ahead + 2 * (c0 + j), 2 * m);
            for (long i = j; i < j + m; i++) {
                uint16_t v;
                memcpy(&v, h + 2 * i, 2);
                o[i] = (v & 0x7FFF) > 0x7F80 ? v | 0x40 : v;
            }
        }
        return;
    }
    float tmp[BF16_CHUNK];
    for (long j = 0; j < nc; j += BF16_CHUNK) {
        const long m = nc - j < BF16_CHUNK ? nc - j : BF16_CHUNK, at = (c0 + j) / bl * by;
        if (ahead) pf_bytes(ahead + at, m / bl * by);
        f(row + at, tmp, m / bl);
        gt_bf16_n(tmp, o + j, m);
    }
}

/* out[i * ldo + j] = bf16 of W[row, c0 + j] for j < nc, row = ids[i] (r0 + i when ids
   is NULL), i < n; c0 and nc multiples of the block */
int gt_deq_tile_bf16(int t, const uint8_t *w, long rb, const int64_t *ids, long r0, long n,
                     long c0, long nc, uint16_t *out, long ldo) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by) || c0 % bl || nc % bl) return -1;
    const long d = pf_rows(nc, bl, by);
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++)
        row_bf16(t, f, bl, by, w + (ids ? ids[i] : r0 + i) * rb,
                 pf_row(w, rb, ids, r0, i, d, n), c0, nc, out + i * ldo);
    return 0;
}

/* The same tile written straight into the blocked layout oneDNN's bf16 matmul keeps its
   weights in (BA16a64b2a; onednn.py checks that the primitive asks for it), so that no
   GEMM reorders it per call.  The GEMM's weights B [K, N] are cut into panels of 64
   columns, each [Kp / 2][64][2]: the pair (B[2p, j], B[2p + 1, j]) is the 32-bit word
   out32[(j / 64) * Kp * 32 + p * 64 + j % 64]; K is padded to Kp (a multiple of 32) and
   N to a multiple of 64 with zeros.  by_rows: B = W[r0 : r0 + n, c0 : c0 + nc]^T (K =
   nc, N = n; y = x W^T), else B = W[r0 : r0 + n, c0 : c0 + nc] (K = n, N = nc; z = g W).
   Panels (by_rows) or pairs of W's rows (else) are split over the threads. */
#define VN_N 64   /* columns of B per panel */
#define VN_K 32   /* K is padded to a multiple of this */

#ifdef __AVX512F__
/* r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit words in registers */
static inline void vn_t16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}
#endif

/* words p < np (a multiple of 16) of the 16 rows of t (ld words apart) into dst[p * 64
   + i], row i: the slab transposed into 16 columns of a panel */
static void vn_transpose16(const uint32_t *restrict t, long ld, long np,
                           uint32_t *restrict dst) {
#ifdef __AVX512F__
    for (long p0 = 0; p0 < np; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(t + i * ld + p0);
        vn_t16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + (p0 + i) * VN_N, r[i]);
    }
#else
    for (long p = 0; p < np; p++)
        for (long i = 0; i < 16; i++) dst[p * VN_N + i] = t[i * ld + p];
#endif
}

#ifdef BF16_VECS
#define VN_CHUNK 8  /* blocks of a panel's rows that one vnni_panel call takes */
/* A panel's 64 rows of W (rows rb bytes apart from w; blocks of 256 values, by bytes),
   columns [c0, c0 + nc) (at most VN_CHUNK blocks), as its 64 columns (B = W^T: word p
   of row i at dst[p * 64 + i]): for each 16 rows, each vector's 16 words a row
   transposed in registers (vn_t16), the next 16 rows' blocks asked for meanwhile.  The
   chunk's rows of the panel (256 KB) stay in L2 for all four 16 rows, instead of each
   row going through a slab. */
static void vnni_panel(vecs_fn vecs, const uint8_t *w, long rb, long c0, long nc, int by,
                       uint32_t *dst) {
    __m512i v[16][8], r[16];
    const long first = c0 / 256 * by, bytes = nc / 256 * by;
    for (int g = 0; g < VN_N; g += 16) {
        if (g + 16 < VN_N)
            for (int i = 0; i < 16; i++) pf_bytes(w + (g + 16 + i) * rb + first, bytes);
        for (long j = 0; j < nc; j += 256) {
            const long at = first + j / 256 * by;
            for (int i = 0; i < 16; i++) vecs(w + (g + i) * rb + at, v[i]);
            for (int s = 0; s < 8; s++) {  /* values 32 s ..: words (j + 32 s) / 2 .. + 16 */
                for (int i = 0; i < 16; i++) r[i] = v[i][s];
                vn_t16(r);
                uint32_t *o = dst + (j + 32 * s) / 2 * VN_N + g;
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(o + p * VN_N, r[p]);
            }
        }
    }
}
#endif

int gt_deq_tile_vnni(int t, const uint8_t *w, long rb, long r0, long n, long c0, long nc,
                     int by_rows, uint16_t *out) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by) || c0 % bl || nc % bl) return -1;
    const long K = by_rows ? nc : n, N = by_rows ? n : nc;
    const long kp = (K + VN_K - 1) / VN_K * VN_K, panels = (N + VN_N - 1) / VN_N;
    const long pairs = kp / 2, panel = pairs * VN_N;  /* 32-bit words */
    uint32_t *o32 = (uint32_t *)out;
    const long d = pf_rows(nc, bl, by);
    int failed = 0;
    if (by_rows) {
        long first = 0;  /* the first panel left to the slab below */
#ifdef BF16_VECS
        if (bf16_vecs(t)) {
            /* whole panels without a slab (vnni_panel), VN_CHUNK blocks of their rows
               at a time split over the threads: a tile may be one panel (a down
               projection's 64 rows of 14336 values) */
            const long full = n / VN_N, span = VN_CHUNK * 256, chunks = (nc + span - 1) / span;
            #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
            for (long u = 0; u < full * chunks; u++) {
                const long c = u / chunks, j = u % chunks * span;
                uint32_t *dst = o32 + c * panel;
                vnni_panel(bf16_vecs(t), w + (r0 + c * VN_N) * rb, rb, c0 + j,
                           nc - j < span ? nc - j : span, by, dst + j / 2 * VN_N);
                if (j + span >= nc)  /* the panel's padding past K */
                    memset(dst + nc / 2 * VN_N, 0, (pairs - nc / 2) * VN_N * sizeof(uint32_t));
            }
            first = full;
        }
#endif
        /* the other panels (a last one of fewer than 64 rows; every panel of a type
           without vectors of its own): 16 rows of W at a time, each dequantized whole
           (W read in order) into a slab, then transposed into their 16 columns of the
           panel (not each row a chunk at a time: that makes 64 streams over W, which
           the prefetchers do not follow, and the reads miss) */
        const long ld = nc / 2 + 16;  /* words; a cache line past a power of two */
        #pragma omp parallel if ((panels - first) * VN_N * nc >= (1L << 16))
        {
            uint32_t *slab = first < panels ? malloc(16 * ld * sizeof(uint32_t)) : 0;
            if (first < panels && !slab) failed = 1;
            #pragma omp for schedule(static)
            for (long c = first; c < panels; c++) {
                if (!slab) continue;
                uint32_t *dst = o32 + c * panel;
                for (long j0 = 0; j0 < VN_N; j0 += 16) {
                    for (long i = 0; i < 16; i++) {
                        const long r = c * VN_N + j0 + i;
                        if (r < n) row_bf16(t, f, bl, by, w + (r0 + r) * rb,
                                            pf_row(w, rb, 0, r0, r, d, n), c0, nc,
                                            (uint16_t *)(slab + i * ld));
                        else memset(slab + i * ld, 0, nc / 2 * sizeof(uint32_t));
                    }
                    vn_transpose16(slab, ld, nc / 2, dst + j0);
                }
                memset(dst + nc / 2 * VN_N, 0, (pairs - nc / 2) * VN_N * sizeof(uint32_t));
            }
            free(slab);
        }
    } else {
        /* a pair of W's rows (2p, 2p + 1) dequantized, interleaved into word row p of
           every panel */
        #pragma omp parallel if (n * nc >= (1L << 16))
        {
            uint16_t *lo = malloc(2 * panels * VN_N * sizeof(uint16_t)), *hi;
            if (!lo) failed = 1;
            else {
                hi = lo + panels * VN_N;  /* zeros past nc: the padded columns */
                memset(lo + nc, 0, (panels * VN_N - nc) * sizeof(uint16_t));
                memset(hi + nc, 0, (panels * VN_N - nc) * sizeof(uint16_t));
            }
            #pragma omp for schedule(static)
            for (long p = 0; p < pairs; p++) {
#ifdef BF16_VECS
                if (bf16_vecs(t) && 2 * p + 1 < n) {  /* both rows: straight into words */
                    /* the second row of the pair d pairs ahead, where it exists */
                    const uint8_t *ra = w + (r0 + 2 * p) * rb, *ahead =
                        pf_row(w, rb, 0, r0, 2 * p + 1, 2 * d, n);
                    for (long j = 0; j < nc; j += 256) {
                        const long at = (c0 + j) / 256 * by;
                        if (ahead) {
                            pf_bytes(ahead - rb + at, by);
                            pf_bytes(ahead + at, by);
                        }
                        vnni_pair(bf16_vecs(t), ra + at, ra + rb + at,
                                  o32 + j / VN_N * panel + p * VN_N, panel);
                    }
                    continue;
                }
#endif
                if (!lo) continue;
                if (2 * p < n) row_bf16(t, f, bl, by, w + (r0 + 2 * p) * rb,
                                        pf_row(w, rb, 0, r0, 2 * p, 2 * d, n), c0, nc, lo);
                else memset(lo, 0, nc * sizeof(uint16_t));
                if (2 * p + 1 < n) row_bf16(t, f, bl, by, w + (r0 + 2 * p + 1) * rb,
                                            pf_row(w, rb, 0, r0, 2 * p + 1, 2 * d, n), c0,
                                            nc, hi);
                else memset(hi, 0, nc * sizeof(uint16_t));
                for (long c = 0; c < panels; c++) {
                    uint32_t *restrict dst = o32 + c * panel + p * VN_N;
                    const uint16_t *l = lo + c * VN_N, *h = hi + c * VN_N;
                    _Pragma("omp simd")
                    for (long j = 0; j < VN_N; j++) dst[j] = (uint32_t)l[j] | (uint32_t)h[j] << 16;
                }
            }
            free(lo);
        }
    }
    return failed ? -2 : 0;
}

/* dst[j * ldd + i] = src[i * lds + j] for i < m, j in [j0, j1) (at most 16 columns):
   16 x 16 words at a time transposed in registers */
static void cols_t(const float *restrict src, long lds, long m, long j0, long j1,
                   float *restrict dst, long ldd) {
    for (long i0 = 0; i0 < m; i0 += 16) {
#ifdef __AVX512F__
        if (i0 + 16 <= m && j1 - j0 == 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + (i0 + i) * lds + j0);
            vn_t16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (j0 + j) * ldd + i0, r[j]);
            continue;
        }
#endif
        for (long j = j0; j < j1; j++)
            for (long i = i0; i < m && i < i0 + 16; i++) dst[j * ldd + i] = src[i * lds + j];
    }
}

/* --- fused: dequantization and GEMM in one pass, each core on its own part of W -------
   y = x W^T (forward) or z = g W (backward), bf16 operands, float32 sums, for W's blocks
   as stored (Q4_K, Q6_K).  Each core takes its own part of W and dequantizes it
   FUSED_KC values of K at a time into its own part of the scratch, then multiplies the
   chunk at once, while it is in its L2: no tile is shared between the cores and no
   barrier is crossed per tile, as with a oneDNN GEMM per tile.  Forward, as y^T = W x^T
   (the swapped way's orientation): FUSED_ROWS of W's rows at a time, plain rows (the
   fastest dequantization), times x16^T packed once in the blocked layout; their [rows,
   T] sums are transposed into y at the end.  Backward: four panels of 64 of z's columns
   at a time, W's chunk in the blocked layout (vnni_pair), times g16 read in place.
   The GEMM is ours: a micro-kernel keeping a 6 x 64 block of C in 24 registers, adding
   per pair of K the panel's 4 vectors times each of A's 6 rows' pair (a 32-bit
   broadcast; vdpbf16ps sums two bf16 products into each float32 lane).
   It gains most over a oneDNN GEMM per tile where that GEMM re-reads and re-writes a
   large product per tile (an LM head's backward, [256, vocab] x W); the figures are in
   docs/benchmarks.md. */
#if defined(BF16_VECS) && defined(__AVX512BW__)
#define FUSED
#define GEMM_MR 6
#define GEMM_AHEAD 8      /* pairs: B asked for ahead of the micro-kernel */
#define GEMM_AHEAD_A 64   /* and A */
#define FUSED_KC 512    /* values of K dequantized and multiplied at a time */
#define FUSED_GROUP 4   /* panels of 64 a core takes at a time */
#define FUSED_PANEL (FUSED_KC / 2 * VN_N)  /* 32-bit words of a panel's chunk */
#define FUSED_ROWS 96   /* W's rows a core takes at a time, forward (16 blocks of 6) */
#define FUSED_LDA (FUSED_KC + 32)  /* values between their rows: off the 4 KB sets */

/* s[r][q] += A's row r's pair p (a 32-bit word) times the panel's row of pairs b */
static inline __attribute__((always_inline)) void gemm_pair(
        __m512 s[GEMM_MR][4], int mr, const uint16_t *a, long lda, long p, const uint32_t *b) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 16);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 32);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 48);
    for (int r = 0; r < mr; r++) {
        uint32_t pair;
        memcpy(&pair, a + r * lda + 2 * p, 4);
        const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)pair);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], ar, b0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], ar, b1);
        s[r][2] = _mm512_dpbf16_ps(s[r][2], ar, b2);
        s[r][3] = _mm512_dpbf16_ps(s[r][3], ar, b3);
    }
}

/* C's block [mr, 64] (+= where add) A's rows' first 2 * pairs values times the panel's
   rows of pairs b; the lines GEMM_AHEAD(_A) pairs on asked for meanwhile, so that they
   are in L1 when reached */
static inline __attribute__((always_inline)) void gemm_tile(
        int mr, const uint16_t *a, long lda, const uint32_t *b, long pairs, float *c, long ldc,
        int add) {
    __m512 s[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++)
            s[r][q] = add ? _mm512_loadu_ps(c + r * ldc + 16 * q) : _mm512_setzero_ps();
    for (long p = 0; p < pairs; p++) {
        if (p % 16 == 0)  /* A's rows: a cache line of pairs GEMM_AHEAD_A pairs on */
            for (int r = 0; r < mr; r++)
                _mm_prefetch((const char *)(a + r * lda + 2 * (p + GEMM_AHEAD_A)), _MM_HINT_T0);
        for (int q = 0; q < 4; q++)  /* the panel's row GEMM_AHEAD pairs on */
            _mm_prefetch((const char *)(b + VN_N * (p + GEMM_AHEAD) + 16 * q), _MM_HINT_T0);
        gemm_pair(s, mr, a, lda, p, b + VN_N * p);
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(c + r * ldc + 16 * q, s[r][q]);
}

/* gemm_tile for mr rows of A, each count a copy of its own (its loops unrolled) */
static void gemm_rows(int mr, const uint16_t *a, long lda, const uint32_t *b, long pairs,
                      float *c, long ldc, int add) {
    switch (mr) {
    case 6: gemm_tile(6, a, lda, b, pairs, c, ldc, add); break;
    case 5: gemm_tile(5, a, lda, b, pairs, c, ldc, add); break;
    case 4: gemm_tile(4, a, lda, b, pairs, c, ldc, add); break;
    case 3: gemm_tile(3, a, lda, b, pairs, c, ldc, add); break;
    case 2: gemm_tile(2, a, lda, b, pairs, c, ldc, add); break;
    default: gemm_tile(1, a, lda, b, pairs, c, ldc, add); break;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same product on AMX tiles (gt_qgemm_bf16_amx): C's block [m, 64] (+)= A [m, 2 pairs]
   times the panel's rows of pairs, 32 x 32 of C at a time in four 16 x 16 float32 tiles
   (tmm0-3), two tiles of A's 16 rows x 32 values (tmm4-5) and two of the panel's 16 pairs
   x 16 columns (tmm6-7, rows 256 bytes apart: the panel's words are the tiles' rows).
   Rows past the last 16 and pairs past the last 16 go to gemm_rows. */
#define AMX
#define AMX_KC 256  /* values of K a chunk on tiles (a multiple of 256, at most FUSED_KC):
                       a chunk's A and B then stay in L1 */
#include "amx_tiles.h"

/* each thread's tiles: eight of 16 rows x 64 bytes */
static void amx_configure(void) {
    gt_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#define AMX_C_LOAD(t, ptr) do { if (add) _tile_loadd(t, ptr, ldc * 4); else _tile_zero(t); } while (0)

/* C's 32 x 32 block at c (+)= A's 32 rows at a (pairs, a multiple of 16, of values) times
   the 32 columns of the panel's rows of pairs at b: four C tiles, two of A, two of B */
static inline void amx_block32(const uint16_t *a, long lda, const uint32_t *b, long pairs,
                               float *c, long ldc, int add) {
    float *c0 = c, *c1 = c + 16 * ldc;
    AMX_C_LOAD(0, c0); AMX_C_LOAD(1, c0 + 16); AMX_C_LOAD(2, c1); AMX_C_LOAD(3, c1 + 16);
    for (long p = 0; p < pairs; p += 16) {
        _tile_loadd(4, a + 2 * p, lda * 2);
        _tile_loadd(5, a + 16 * lda + 2 * p, lda * 2);
        _tile_loadd(6, b + p * VN_N, VN_N * 4);
        _tile_loadd(7, b + p * VN_N + 16, VN_N * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c0, ldc * 4); _tile_stored(1, c0 + 16, ldc * 4);
    _tile_stored(2, c1, ldc * 4); _tile_stored(3, c1 + 16, ldc * 4);
}

static void amx_rows(long m, const uint16_t *a, long lda, const uint32_t *b, long pairs,
                     float *c, long ldc, int add) {
    const long p16 = pairs / 16 * 16, m16 = m / 16 * 16;
    for (long cb = 0; cb < VN_N && p16; cb += 32) {
        long i = 0;
        for (; i + 32 <= m16; i += 32)
            amx_block32(a + i * lda, lda, b + cb, p16, c + i * ldc + cb, ldc, add);
        if (i < m16) {  /* 16 rows left */
            float *c0 = c + i * ldc + cb;
            AMX_C_LOAD(0, c0); AMX_C_LOAD(1, c0 + 16);
            for (long p = 0; p < p16; p += 16) {
                _tile_loadd(4, a + i * lda + 2 * p, lda * 2);
                _tile_loadd(6, b + p * VN_N + cb, VN_N * 4);
                _tile_loadd(7, b + p * VN_N + cb + 16, VN_N * 4);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, c0, ldc * 4); _tile_stored(1, c0 + 16, ldc * 4);
        }
    }
    const long m0 = p16 ? m16 : 0;  /* the rows the tiles took */
    if (p16 < pairs)  /* their pairs past the last 16 */
        for (long i = 0; i < m0; i += GEMM_MR)
            gemm_rows(m0 - i < GEMM_MR ? (int)(m0 - i) : GEMM_MR, a + i * lda + 2 * p16, lda,
                      b + p16 * VN_N, pairs - p16, c + i * ldc, ldc, 1);
    for (long i = m0; i < m; i += GEMM_MR)  /* the rows past them, all pairs */
        gemm_rows(m - i < GEMM_MR ? (int)(m - i) : GEMM_MR, a + i * lda, lda, b, pairs,
                  c + i * ldc, ldc, add);
}

/* amx_rows over a group's FUSED_GROUP panels (FUSED_PANEL words apart), A's rows
   outermost: each 32 rows of A stay in L1 while the group's panels pass under them
   (amx_rows reads all of A's chunk per panel, which at a few hundred rows no longer
   fits); rows and pairs past the tiles' multiples go to amx_rows */
static void amx_group(long m, const uint16_t *a, long lda, const uint32_t *b, long pairs,
                      float *c, long ldc, int add) {
    const long m32 = pairs % 16 ? 0 : m / 32 * 32;
    for (long i = 0; i < m32; i += 32)
        for (long q = 0; q < FUSED_GROUP; q++)
            for (long cb = 0; cb < VN_N; cb += 32)
                amx_block32(a + i * lda, lda, b + q * FUSED_PANEL + cb, pairs,
                            c + i * ldc + q * VN_N + cb, ldc, add);
    if (m32 < m)
        for (long q = 0; q < FUSED_GROUP; q++)
            amx_rows(m - m32, a + m32 * lda, lda, b + q * FUSED_PANEL, pairs,
                     c + m32 * ldc + q * VN_N, ldc, add);
}
#endif

/* backward: W's rows [k0, k0 + kc) over its columns 64 j .. (a block of 256 per four
   panels) as B = W's chunk in the blocked layout, pairs of rows, the rows 8 on asked for */
static void fused_chunk(vecs_fn vecs, int by, const uint8_t *w, long rb, long j, long np,
                        long k0, long kc, uint32_t *buf) {
    const long first = j * VN_N / 256 * by, bytes = np / 4 * by;
    for (long p = 0; p < kc / 2; p++) {
        const uint8_t *ra = w + (k0 + 2 * p) * rb + first;
        if (2 * p + 8 < kc) {
            pf_bytes(ra + 8 * rb, bytes);
            pf_bytes(ra + 9 * rb, bytes);
        }
        for (long b = 0; b < np / 4; b++)
            vnni_pair(vecs, ra + b * by, ra + rb + b * by,
                      buf + 4 * b * FUSED_PANEL + p * VN_N, FUSED_PANEL);
    }
}

/* forward: W's rows [r0, r0 + n) over K's values [k0, k0 + kc) as plain bf16 rows
   FUSED_LDA apart (A of y^T = W x^T), the row 4 on asked for meanwhile */
static void fused_rows(void (*direct)(const uint8_t *, uint16_t *), int by, const uint8_t *w,
                       long rb, long r0, long n, long k0, long kc, uint16_t *tile) {
    const long first = k0 / 256 * by, blocks = kc / 256;
    for (long i = 0; i < n; i++) {
        const uint8_t *row = w + (r0 + i) * rb + first;
        if (i + 4 < n) pf_bytes(row + 4 * rb, blocks * by);
        /* and this row's blocks of the next chunk: the rows are too many streams for the
           cores' own prefetchers, and the chunk is reached well after they arrive */
        pf_bytes(row + blocks * by, blocks * by);
        for (long b = 0; b < blocks; b++) direct(row + b * by, tile + i * FUSED_LDA + 256 * b);
    }
}

static long pad64(long n) { return (n + VN_N - 1) / VN_N * VN_N; }

/* the calling core's number and its share [g0, g1) of n groups (in a parallel region) */
static void core_share(long n, long *id, long *g0, long *g1) {
#ifdef _OPENMP
    const long nt = omp_get_num_threads();
    *id = omp_get_thread_num();
#else
    const long nt = 1;
    *id = 0;
#endif
    *g0 = n * *id / nt;
    *g1 = n * (*id + 1) / nt;
}

/* seconds, for a profile's split */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* *total += this core's seconds over the number of cores (in a parallel region) */
static void add_mean(double *total, double seconds) {
#ifdef _OPENMP
    seconds /= omp_get_num_threads();
#endif
    #pragma omp atomic
    *total += seconds;
}

/* a core's scratch: backward, its chunk of panels; forward, its rows' chunk and their
   float32 sums [FUSED_ROWS, pad64(T)] (bf16 values) */
static long core_elems(int backward, long T) {
    return backward ? FUSED_GROUP * FUSED_PANEL * 2
                    : FUSED_ROWS * FUSED_LDA + 2 * FUSED_ROWS * pad64(T);
}

/* backward on AMX with A's rows outermost (amx_group): a core's group of z's columns
   summed in its own rows BWD_CLD floats apart, and each chunk of g's columns copied into
   rows BWD_ALD values apart; both strides off the 4 KB sets that rows of g and z
   (widths of powers of two, or 7 * 2^11) all fall on */
#define BWD_CLD (FUSED_GROUP * VN_N + 16)
#define BWD_ALD (FUSED_KC + 32)
static long rows_outer_elems(long T) { return 2 * T * BWD_CLD + T * BWD_ALD; }
#endif

/* the bf16 values of scratch gt_qgemm_bf16_fused needs for T rows of the activation,
   or 0 where this build has no fused kernel for type t and W [rows, k] (k a multiple
   of 256; backward, rows even) */
long gt_fused_scratch(int t, long rows, long k, long T, int backward) {
#ifdef FUSED
    if (!bf16_vecs(t) || k % 256 || (backward && rows % 2)) return 0;
#ifdef _OPENMP
    const long nt = omp_get_max_threads();
#else
    const long nt = 1;
#endif
    long extra = 0;
#ifdef AMX
    if (backward && gt_amx_permitted()) extra = rows_outer_elems(T);  /* the amx rows way's */
#endif
    return nt * (core_elems(backward, T) + extra);
#else
    (void)t; (void)rows; (void)k; (void)T; (void)backward;
    return 0;
#endif
}

/* forward: c [T, rows] = a [T, k] W^T, as y^T = W x^T: xt, a^T in the blocked layout
   (gt_rows_vnni's), is the GEMM's B, each core's rows of W (dequantized FUSED_ROWS at a
   time, plain) its A, their [rows, T] sums transposed into c's columns at the end;
   backward: c [T, k] = a [T, rows] W, a the GEMM's A, each core's panels of W its B.
   a: bf16 rows; scratch: at least gt_fused_scratch values.  deq: NULL, or where the
   seconds the cores spent dequantizing (their mean) are added (a profile's split).
   -1 where the scratch needed is 0. */
static int fused_product(int t, const uint8_t *w, long rb, long rows, long k, int backward,
                         const uint16_t *a, const uint16_t *xt, long T, float *c,
                         uint16_t *scratch, long scratch_elems, double *deq, int amx) {
    const long need = gt_fused_scratch(t, rows, k, T, backward);
    if (!need || scratch_elems < need || (amx == 2 && !backward)) return -1;
#ifndef AMX
    if (amx) return -1;
#endif
#ifdef FUSED
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by)) return -1;
#ifdef AMX
    const long KC = amx ? AMX_KC : FUSED_KC;  /* values of K a chunk */
#else
    const long KC = FUSED_KC;
#endif
    const long each = core_elems(backward, T) + (amx == 2 ? rows_outer_elems(T) : 0);
    if (!backward) {
        void (*direct)(const uint8_t *, uint16_t *) = t == T_Q4_K ? bf16_q4_k : bf16_q6_k;
        const long Tp = pad64(T), blocks = (rows + GEMM_MR - 1) / GEMM_MR;
        const uint32_t *b = (const uint32_t *)xt;
        #pragma omp parallel
        {
            /* each core's share of W's rows in blocks of the micro-kernel's, FUSED_ROWS
               at a time (not whole groups of FUSED_ROWS: a few groups split unevenly
               over the cores, W [1024, 4096]'s 11 as 6 and 5) */
            long id, g0, g1;
            core_share(blocks, &id, &g0, &g1);
            const long first = g0 * GEMM_MR, end = g1 * GEMM_MR < rows ? g1 * GEMM_MR : rows;
            uint16_t *tile = scratch + id * each;
            float *sums = (float *)(tile + FUSED_ROWS * FUSED_LDA);
            double spent = 0.0;
#ifdef AMX
            if (amx) amx_configure();
#endif
            for (long r0 = first; r0 < end; r0 += FUSED_ROWS) {
                const long n = end - r0 < FUSED_ROWS ? end - r0 : FUSED_ROWS;
                for (long k0 = 0; k0 < k; k0 += KC) {
                    const long kc = k - k0 < KC ? k - k0 : KC;
                    const double t0 = deq ? now() : 0.0;
                    fused_rows(direct, by, w, rb, r0, n, k0, kc, tile);
                    if (deq) spent += now() - t0;
                    for (long q = 0; q < Tp / VN_N; q++)
#ifdef AMX
                        if (amx)
                            amx_rows(n, tile, FUSED_LDA, b + q * (k / 2 * VN_N) + k0 / 2 * VN_N,
                                     kc / 2, sums + q * VN_N, Tp, k0 > 0);
                        else
#endif
                        for (long i = 0; i < n; i += GEMM_MR)
                            gemm_rows(n - i < GEMM_MR ? n - i : GEMM_MR, tile + i * FUSED_LDA,
                                      FUSED_LDA, b + q * (k / 2 * VN_N) + k0 / 2 * VN_N,
                                      kc / 2, sums + i * Tp + q * VN_N, Tp, k0 > 0);
                }
                for (long j0 = 0; j0 < T; j0 += 16)
                    cols_t(sums, Tp, n, j0, j0 + 16 < T ? j0 + 16 : T, c + r0, rows);
            }
#ifdef AMX
            if (amx) _tile_release();
#endif
            if (deq) add_mean(deq, spent);
        }
        return 0;
    }
    const vecs_fn vecs = bf16_vecs(t);
    const long panels = k / VN_N, groups = panels / FUSED_GROUP;
    #pragma omp parallel
    {
        long id, g0, g1;
        core_share(groups, &id, &g0, &g1);
        uint32_t *buf = (uint32_t *)(scratch + id * each);
        float *sums = (float *)(scratch + id * each + FUSED_GROUP * FUSED_PANEL * 2);
        uint16_t *rows_a = (uint16_t *)(sums + T * BWD_CLD);  /* (amx == 2) */
        double spent = 0.0;
#ifdef AMX
        if (amx) amx_configure();
#endif
        for (long g = g0; g < g1; g++) {
            const long j = g * FUSED_GROUP;
            for (long k0 = 0; k0 < rows; k0 += KC) {
                const long kc = rows - k0 < KC ? rows - k0 : KC;
                const double t0 = deq ? now() : 0.0;
                fused_chunk(vecs, by, w, rb, j, FUSED_GROUP, k0, kc, buf);
                if (deq) spent += now() - t0;
#ifdef AMX
                if (amx == 2) {
                    for (long i = 0; i < T; i++)
                        memcpy(rows_a + i * BWD_ALD, a + i * rows + k0, 2 * kc);
                    amx_group(T, rows_a, BWD_ALD, buf, kc / 2, sums, BWD_CLD, k0 > 0);
                    continue;
                }
#endif
                for (long q = 0; q < FUSED_GROUP; q++)
#ifdef AMX
                    if (amx)
                        amx_rows(T, a + k0, rows, buf + q * FUSED_PANEL, kc / 2,
                                 c + (j + q) * VN_N, k, k0 > 0);
                    else
#endif
                    for (long i = 0; i < T; i += GEMM_MR)
                        gemm_rows(T - i < GEMM_MR ? T - i : GEMM_MR, a + i * rows + k0, rows,
                                  buf + q * FUSED_PANEL, kc / 2, c + i * k + (j + q) * VN_N,
                                  k, k0 > 0);
            }
            if (amx == 2)  /* the group's sums into their columns of z */
                for (long i = 0; i < T; i++)
                    memcpy(c + i * k + j * VN_N, sums + i * BWD_CLD, 4 * FUSED_GROUP * VN_N);
        }
#ifdef AMX
        if (amx) _tile_release();
#endif
        if (deq) add_mean(deq, spent);
    }
    return 0;
#else
    (void)w; (void)rb; (void)a; (void)xt; (void)T; (void)c; (void)scratch; (void)deq;
    (void)amx;
    return -1;
#endif
}

int gt_qgemm_bf16_fused(int t, const uint8_t *w, long rb, long rows, long k, int backward,
                        const uint16_t *a, const uint16_t *xt, long T, float *c,
                        uint16_t *scratch, long scratch_elems, double *deq) {
    return fused_product(t, w, rb, rows, k, backward, a, xt, T, c, scratch, scratch_elems,
                         deq, 0);
}

/* whether gt_qgemm_bf16_amx runs here: built with AMX's instructions, and Linux lets
   this process use its tiles */
int gt_amx_ready(void) {
#ifdef AMX
    return gt_amx_permitted();
#else
    return 0;
#endif
}

/* gt_qgemm_bf16_fused with its GEMM on AMX tiles (-1 where gt_amx_ready says no) */
int gt_qgemm_bf16_amx(int t, const uint8_t *w, long rb, long rows, long k, int backward,
                      const uint16_t *a, const uint16_t *xt, long T, float *c,
                      uint16_t *scratch, long scratch_elems, double *deq) {
    if (!gt_amx_ready()) return -1;
    return fused_product(t, w, rb, rows, k, backward, a, xt, T, c, scratch, scratch_elems,
                         deq, 1);
}

/* the backward product of gt_qgemm_bf16_amx with g's rows outermost (amx_group), its
   chunks of g and its sums in the core's own rows (rows_outer_elems): the same sums in
   the same order, so the same bits; -1 forward, or where gt_amx_ready says no */
int gt_qgemm_bf16_amx_rows(int t, const uint8_t *w, long rb, long rows, long k,
                           int backward, const uint16_t *a, const uint16_t *xt, long T,
                           float *c, uint16_t *scratch, long scratch_elems, double *deq) {
    if (!gt_amx_ready()) return -1;
    return fused_product(t, w, rb, rows, k, backward, a, xt, T, c, scratch, scratch_elems,
                         deq, 2);
}

/* dst[i * ldd + j] = src[i * n + j] for i < m, j < n: a GEMM's product, written into
   contiguous scratch, moved into its columns of the result (see qgemm_bf16.py) */
void gt_copy_cols(const float *restrict src, long m, long n, float *restrict dst, long ldd) {
    #pragma omp parallel for schedule(static) if (m * n >= (1L << 16))
    for (long i = 0; i < m; i++) memcpy(dst + i * ldd, src + i * n, n * sizeof(float));
}

/* The activation's bf16 rows x16 [m, k] (k a multiple of 32) as the weights of a
   swapped product, B = x16^T [K = k, N = m] in gt_deq_tile_vnni's layout: a word of a
   row of x16 is already a pair of K, so each 16 rows' words are transposed into their
   16 columns of a panel (rows past m: zeros), in place of oneDNN's own reorder, which is
   far slower.  See qgemm_bf16.py. */
void gt_rows_vnni(const uint16_t *restrict x16, long m, long k, uint16_t *restrict out) {
    const long words = k / 2, panel = words * VN_N;
    const uint32_t *x32 = (const uint32_t *)x16;
    uint32_t *o32 = (uint32_t *)out;
    #pragma omp parallel for schedule(static) if (m * k >= (1L << 16))
    for (long r = 0; r < (m + VN_N - 1) / VN_N * VN_N; r += 16) {
        uint32_t *dst = o32 + r / VN_N * panel + r % VN_N;
        if (r + 16 <= m) {
            vn_transpose16(x32 + r * words, words, words, dst);
        } else {  /* a last group of fewer than 16 rows, or none */
            for (long p = 0; p < words; p++)
                for (long i = 0; i < 16; i++)
                    dst[p * VN_N + i] = r + i < m ? x32[(r + i) * words + p] : 0;
        }
    }
}

/* dst[j * ldd + i] = src[i * n + j] for i < m, j < n: a swapped product's [m, n] block
   (y^T's rows) transposed into its columns of the result (cols_t, its columns split
   over the threads) */
void gt_copy_cols_t(const float *restrict src, long m, long n, float *restrict dst,
                    long ldd) {
    #pragma omp parallel for schedule(static) if (m * n >= (1L << 16))
    for (long j0 = 0; j0 < n; j0 += 16)
        cols_t(src, n, m, j0, j0 + 16 < n ? j0 + 16 : n, dst, ldd);
}

/* o[i] = bf16 of x[i]: the activation operand of a bf16 GEMM */
void gt_f32_bf16(const float *restrict x, uint16_t *restrict o, long n) {
    if (n >= (1L << 16)) gt_bf16_par(x, o, n);
    else gt_bf16_n(x, o, n);
}

/* o [m, n] = bf16 of the block x [m, n] whose rows are ldx apart (a block of columns of
   an activation, made one contiguous GEMM operand) */
void gt_f32_bf16_block(const float *restrict x, long ldx, long m, long n,
                       uint16_t *restrict o) {
    #pragma omp parallel for schedule(static) if (m * n >= (1L << 16))
    for (long i = 0; i < m; i++) gt_bf16_n(x + i * ldx, o + i * n, n);
}

/* --- int8 tiles: the operands of the int8 GEMMs (``--compute int8``) ------------------
   Symmetric quantization, q = round(v / s) with s = max|v| / 127 over the values sharing
   s (ties away from zero; a zero range gives s = 0 and q = 0).  The GEMM (oneDNN, int32
   accumulation) multiplies the integers; gt_s32_scale applies both operands' scales. */

/* values [c0, c0 + n) of a row as float32 into tmp (c0, n multiples of the block): Q4_K
   and Q6_K in registers with AVX-512 (the same operations as ggml_blocks.h) */
static void row_f32(int t, gb_deq_fn f, int bl, int by, const uint8_t *row, long c0, long n,
                    float *restrict tmp) {
#ifdef __AVX512F__
    void (*direct)(const uint8_t *, float *) = t == T_Q4_K ? f32_q4_k
                                               : t == T_Q6_K ? f32_q6_k : 0;
    if (direct) {
        for (long j = 0; j < n; j += 256) direct(row + (c0 + j) / 256 * by, tmp + j);
        return;
    }
#endif
    (void)t;
    f(row + c0 / bl * by, tmp, n / bl);
}

static inline int8_t s8_round(float v) { return (int8_t)(v >= 0.0f ? v + 0.5f : v - 0.5f); }

/* q[i, :] and s[i] of the rows x[i, :] * cm (n values each, rows ldx apart; cm: a factor
   per column, or NULL for none), i < m; u8: q + 128 stored (unsigned, the activation
   operand of a u8 x s8 GEMM).  0, or -2 where scratch could not be allocated. */
int gt_quant_rows_s8(const float *restrict x, long ldx, long m, long n,
                     const float *restrict cm, int u8, int8_t *restrict q,
                     float *restrict s) {
    int failed = 0;
    #pragma omp parallel if (m * n >= (1L << 16))
    {
        float *tmp = cm ? malloc(n * sizeof(float)) : NULL;
        if (cm && !tmp) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < m; i++) {
            const float *xi = x + i * ldx;
            if (cm) {
                if (!tmp) continue;
                for (long j = 0; j < n; j++) tmp[j] = xi[j] * cm[j];
                xi = tmp;
            }
            float mx = 0.0f;
            #pragma omp simd reduction(max : mx)
            for (long j = 0; j < n; j++) {
                const float a = fabsf(xi[j]);
                mx = a > mx ? a : mx;
            }
            const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            if (u8) {
                uint8_t *qu = (uint8_t *)q + i * n;
                for (long j = 0; j < n; j++) qu[j] = (uint8_t)(s8_round(xi[j] * inv) + 128);
            } else {
                for (long j = 0; j < n; j++) q[i * n + j] = s8_round(xi[j] * inv);
            }
            s[i] = mx / 127.0f;
        }
        free(tmp);
    }
    return failed ? -2 : 0;
}

/* out[j] = max over the rows of |x[:, j]| (x [m, n], rows ldx apart) */
void gt_absmax_cols(const float *restrict x, long ldx, long m, long n, float *restrict out) {
    for (long j = 0; j < n; j++) out[j] = 0.0f;
    for (long i = 0; i < m; i++)
        for (long j = 0; j < n; j++) {
            const float a = fabsf(x[i * ldx + j]);
            out[j] = a > out[j] ? a : out[j];
        }
}

/* out[i, j] = q of W[r0 + i, c0 + j] (i < n, j < nc; rows ldo apart), c0 and nc multiples
   of the block.  inv NULL: each row's own scale, written to rs[i] (the tile must hold
   whole rows), of the row times cm (a factor per column, or NULL for none); else column
   c0 + j is multiplied by inv[j], 1 / its scale (the scales gt_col_absmax's maxima
   give, shared by every tile of W). */
/* q[j] (j < nc) of row `row`'s values [c0, c0 + nc) (tmp: nc floats of scratch): with
   its own scale, written to *rs, of the row times cm (a factor per column, or NULL) where
   inv is NULL, else each value times inv[j]; the sum of the q[j] into *sum where not NULL */
static void row_s8(int t, gb_deq_fn f, int bl, int by, const uint8_t *row, long c0, long nc,
                   const float *restrict inv, const float *restrict cm, float *restrict tmp,
                   int8_t *restrict q, float *rs, int32_t *sum) {
#ifdef __AVX512F__
    void (*direct)(const uint8_t *, int8_t *, const float *) = t == T_Q4_K ? s8_q4_k
                                                              : t == T_Q6_K ? s8_q6_k : 0;
    if (inv && direct && !sum) {  /* column scales: quantized in registers */
        for (long j = 0; j < nc; j += 256) direct(row + (c0 + j) / 256 * by, q + j, inv + j);
        return;
    }
#endif
    row_f32(t, f, bl, by, row, c0, nc, tmp);
    float r = 1.0f;
    if (inv) {
        for (long j = 0; j < nc; j++) tmp[j] *= inv[j];
    } else {
        float mx = 0.0f;
        #pragma omp simd reduction(max : mx)
        for (long j = 0; j < nc; j++) {
            const float v = cm ? tmp[j] * cm[j] : tmp[j];
            const float a = fabsf(v);
            tmp[j] = v;
            mx = a > mx ? a : mx;
        }
        r = mx > 0.0f ? 127.0f / mx : 0.0f;
        *rs = mx / 127.0f;
    }
    if (!sum) {
        for (long j = 0; j < nc; j++) q[j] = s8_round(tmp[j] * r);
        return;
    }
    int32_t total = 0;
    #pragma omp simd reduction(+ : total)
    for (long j = 0; j < nc; j++) {
        q[j] = s8_round(tmp[j] * r);
        total += q[j];
    }
    *sum += total;
}

/* out[i, j] = q of W[r0 + i, c0 + j] (i < n, j < nc; rows ldo apart), c0 and nc multiples
   of the block.  inv NULL: each row's own scale, written to rs[i] (the tile must hold
   whole rows), of the row times cm (a factor per column, or NULL for none); else column
   c0 + j is multiplied by inv[j], 1 / its scale (the scales gt_col_absmax's maxima give,
   shared by every tile of W). */
int gt_deq_tile_s8(int t, const uint8_t *w, long rb, long r0, long n, long c0, long nc,
                   const float *restrict inv, const float *restrict cm,
                   int8_t *restrict out, long ldo, float *restrict rs) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by) || c0 % bl || nc % bl) return -1;
    int failed = 0;
    #pragma omp parallel if (n * nc >= (1L << 16))
    {
        float *tmp = malloc(nc * sizeof(float));
        if (!tmp) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < n; i++)
            if (tmp) row_s8(t, f, bl, by, w + (r0 + i) * rb, c0, nc, inv, cm, tmp,
                            out + i * ldo, inv ? NULL : rs + i, NULL);
        free(tmp);
    }
    return failed ? -2 : 0;
}

/* The same tile in the blocked layout oneDNN's u8 x s8 matmul keeps its weights in with
   AVX512-VNNI (BA16a64b4a; onednn.py checks that the primitive asks for it): B [K, N] cut
   into panels of 64 columns, each [Kp / 4][64][4]: the quad B[4p .. 4p + 3, j] is the
   32-bit word out32[(j / 64) * Kp * 16 + p * 64 + j % 64]; K padded to Kp (a multiple of
   64) and N to a multiple of 64, with zeros.  by_rows: B = W[r0 : r0 + n, c0 : c0 +
   nc]^T (K = nc, N = n; y = x W^T; each row of W its own scale, as inv NULL above), else
   B = W[r0 : r0 + n, c0 : c0 + nc] (K = n, N = nc; z = g W; inv's column scales).  The
   sums of B's columns are added to csum[j] (the activation goes in as q + 128, and the
   caller takes 128 csum[j] off).  Panels (by_rows) or quads of W's rows (else) are split
   over the threads. */
#define Q8_K 64  /* K is padded to a multiple of this */

int gt_deq_tile_s8_vnni(int t, const uint8_t *w, long rb, long r0, long n, long c0, long nc,
                        int by_rows, const float *restrict inv, const float *restrict cm,
                        uint32_t *restrict out, float *restrict rs, int32_t *restrict csum) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by) || c0 % bl || nc % bl) return -1;
    const long K = by_rows ? nc : n, N = by_rows ? n : nc;
    const long kp = (K + Q8_K - 1) / Q8_K * Q8_K, panels = (N + VN_N - 1) / VN_N;
    const long quads = kp / 4, panel = quads * VN_N;  /* 32-bit words */
    int failed = 0;
    if (by_rows) {
        /* 16 rows of W at a time into a slab of words (4 values of a row each, zeros
           past nc), transposed into their 16 columns of the panel (as the bf16 tiles) */
        const long ld = quads + 16;
        #pragma omp parallel if (n * nc >= (1L << 16))
        {
            uint32_t *slab = calloc(16 * ld, sizeof(uint32_t));
            float *tmp = malloc(nc * sizeof(float));
            if (!slab || !tmp) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(static)
            for (long c = 0; c < panels; c++) {
                if (!slab || !tmp) continue;
                for (long j0 = 0; j0 < VN_N; j0 += 16) {
                    for (long i = 0; i < 16; i++) {
                        const long r = c * VN_N + j0 + i;
                        int8_t *q = (int8_t *)(slab + i * ld);
                        if (r < n) row_s8(t, f, bl, by, w + (r0 + r) * rb, c0, nc, NULL, cm,
                                          tmp, q, rs + r, csum + r);
                        else memset(q, 0, nc);
                    }
                    vn_transpose16(slab, ld, quads, out + c * panel + j0);
                }
            }
            free(slab);
            free(tmp);
        }
    } else {
        /* 4 rows of W quantized, interleaved into word row p of every panel; each
           thread sums its columns, added into csum at the end */
        const long width = panels * VN_N;
        #pragma omp parallel if (n * nc >= (1L << 16))
        {
            int8_t *b = calloc(4 * width, 1);
            int32_t *sums = calloc(width, sizeof(int32_t));
            float *tmp = malloc(nc * sizeof(float));
            if (!b || !sums || !tmp) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(static)
            for (long p = 0; p < quads; p++) {
                if (!b || !sums || !tmp) continue;
                for (int u = 0; u < 4; u++) {
                    int8_t *q = b + u * width;
                    if (4 * p + u < n) row_s8(t, f, bl, by, w + (r0 + 4 * p + u) * rb, c0, nc,
                                              inv, NULL, tmp, q, NULL, NULL);
                    else memset(q, 0, nc);
                }
                const uint8_t *q0 = (const uint8_t *)b, *q1 = q0 + width, *q2 = q1 + width,
                              *q3 = q2 + width;
                for (long j = 0; j < nc; j++)
                    sums[j] += (int8_t)q0[j] + (int8_t)q1[j] + (int8_t)q2[j] + (int8_t)q3[j];
                for (long c = 0; c < panels; c++) {
                    uint32_t *restrict dst = out + c * panel + p * VN_N;
                    const long o = c * VN_N;
                    _Pragma("omp simd")
                    for (long j = 0; j < VN_N; j++)
                        dst[j] = (uint32_t)q0[o + j] | (uint32_t)q1[o + j] << 8
                                 | (uint32_t)q2[o + j] << 16 | (uint32_t)q3[o + j] << 24;
                }
            }
            if (sums) {
                #pragma omp critical
                for (long j = 0; j < nc; j++) csum[j] += sums[j];
            }
            free(b);
            free(sums);
            free(tmp);
        }
    }
    return failed ? -2 : 0;
}

/* out[j] = max over the rows of |W[:, j]| (j < k): the column scales of W as the
   right-hand operand of g @ W, where the sum runs over W's rows */
int gt_col_absmax(int t, const uint8_t *w, long rb, long rows, long k, float *restrict out) {
    gb_deq_fn f; int bl, by;
    if (gb_layout(t, &f, &bl, &by)) return -1;
    for (long j = 0; j < k; j++) out[j] = 0.0f;
    int failed = 0;
    #pragma omp parallel
    {
        float *tmp = malloc(2 * k * sizeof(float)), *mx = tmp + k;
        if (!tmp) {
            #pragma omp atomic write
            failed = 1;
        } else {
            for (long j = 0; j < k; j++) mx[j] = 0.0f;
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < rows; i++) {
            if (!tmp) continue;
            row_f32(t, f, bl, by, w + i * rb, 0, k, tmp);
            for (long j = 0; j < k; j++) {
                const float a = fabsf(tmp[j]);
                mx[j] = a > mx[j] ? a : mx[j];
            }
        }
        if (tmp) {
            #pragma omp critical
            for (long j = 0; j < k; j++) out[j] = mx[j] > out[j] ? mx[j] : out[j];
        }
        free(tmp);
    }
    return failed ? -2 : 0;
}

/* out[i, j] = (acc[i, j] - 128 csum[j]) * sa[i] * sb[j] (i < m, j < n; rows lda and ldo
   apart; csum NULL: no term): an int8 GEMM's int32 sums scaled back to float32, less
   what the u8 activation's offset of 128 added (csum: the sums of B's columns); out may
   be acc itself (the same bytes) */
void gt_s32_scale(const int32_t *acc, long lda, long m, long n, const float *restrict sa,
                  const float *restrict sb, const int32_t *restrict csum, float *out,
                  long ldo) {
    #pragma omp parallel for schedule(static) if (m * n >= (1L << 16))
    for (long i = 0; i < m; i++) {
        const int32_t *a = acc + i * lda;
        float *o = out + i * ldo;
        const float s = sa[i];
        if (csum)
            for (long j = 0; j < n; j++) o[j] = (float)(a[j] - 128 * csum[j]) * s * sb[j];
        else
            for (long j = 0; j < n; j++) o[j] = (float)a[j] * s * sb[j];
    }
}

/* --- tiled GEMMs -------------------------------------------------------------------- */

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *,
                          int64_t, const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float *,
                          int32_t, const float *, int32_t, float, float *, int32_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double, const double *,
                          int64_t, const double *, int64_t, double, double *, int64_t);
typedef void (*dgemm32_t)(int, int, int, int32_t, int32_t, int32_t, double, const double *,
                          int32_t, const double *, int32_t, double, double *, int32_t);

#define TR(t) ((t) ? TRANS : NO_TRANS)

static void gemm_f(void *fn, int ilp64, int ta, int tb, long m, long n, long k,
                   const float *a, long lda, const float *b, long ldb, float beta, float *c,
                   long ldc) {
    if (ilp64)
        ((sgemm64_t)fn)(ROW_MAJOR, TR(ta), TR(tb), m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    else
        ((sgemm32_t)fn)(ROW_MAJOR, TR(ta), TR(tb), (int32_t)m, (int32_t)n, (int32_t)k, 1.0f,
                        a, (int32_t)lda, b, (int32_t)ldb, beta, c, (int32_t)ldc);
}

static void gemm_d(void *fn, int ilp64, int ta, int tb, long m, long n, long k,
                   const double *a, long lda, const double *b, long ldb, double beta,
                   double *c, long ldc) {
    if (ilp64)
        ((dgemm64_t)fn)(ROW_MAJOR, TR(ta), TR(tb), m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc);
    else
        ((dgemm32_t)fn)(ROW_MAJOR, TR(ta), TR(tb), (int32_t)m, (int32_t)n, (int32_t)k, 1.0,
                        a, (int32_t)lda, b, (int32_t)ldb, beta, c, (int32_t)ldc);
}

/* dst[j * ldd + i] = src[i * m + j] for i < n, j < m: a [n, m] block transposed into a
   matrix with row stride ldd, in cache-sized squares */
#define TRANSPOSE(NAME, TYPE)                                                         \
static void NAME(const TYPE *restrict src, long n, long m, TYPE *restrict dst, long ldd) { \
    for (long i0 = 0; i0 < n; i0 += 32)                                              \
        for (long j0 = 0; j0 < m; j0 += 32) {                                        \
            const long i1 = i0 + 32 < n ? i0 + 32 : n, j1 = j0 + 32 < m ? j0 + 32 : m; \
            for (long j = j0; j < j1; j++)                                           \
                for (long i = i0; i < i1; i++) dst[j * ldd + i] = src[i * m + j];    \
        }                                                                            \
}
TRANSPOSE(transpose_f, float)
TRANSPOSE(transpose_d, double)

/* tile [n, nc] of W: rows r0.., columns c0.. (c0, nc multiples of the block) */
static void tile_f(gb_deq_fn f, int bl, int by, const uint8_t *w, long rb, long r0, long n,
                   long c0, long nc, float *tile) {
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++) f(w + (r0 + i) * rb + c0 / bl * by, tile + i * nc, nc / bl);
}

static void tile_d(gb_deq_fn f, int bl, int by, const uint8_t *w, long rb, long r0, long n,
                   long c0, long nc, double *tile) {
    #pragma omp parallel for schedule(static) if (n * nc >= (1L << 16))
    for (long i = 0; i < n; i++) {
        double *o = tile + i * nc;
        float *tmp = (float *)o + nc;
        f(w + (r0 + i) * rb + c0 / bl * by, tmp, nc / bl);
        for (long j = 0; j < nc; j++) o[j] = (double)tmp[j];
    }
}

/* The drivers.  y[T, rows] = x[T, k] @ W^T and z[T, k] = g[T, rows] @ W over tiles of R
   rows x C block-aligned columns of W (``tile``: R * C values of scratch).

   ``lay`` 0 writes each product straight into the output's column block (BLAS with
   ldc = the output's row length).  ``lay`` 1 computes the transposed block
   ([rows of W, T], ``tbuf``: max(R, C) * T more values of scratch) and transposes it into
   place: OpenBLAS's Haswell kernels run tile @ x^T (the long side first) much faster
   than x @ tile^T at T in the hundreds, and the transpose costs one pass over T x R
   values per tile. */
#define DRIVERS(SUF, TYPE, TILE, GEMM, TRANSPOSE_FN)                                   \
int gt_qgemm_##SUF(int t, const uint8_t *w, long rb, long rows, long k, const TYPE *x, \
                   long T, TYPE *y, TYPE *tile, long R, long C, void *gemm, int ilp64, \
                   int lay, TYPE *tbuf) {                                              \
    gb_deq_fn f; int bl, by;                                                           \
    if (gb_layout(t, &f, &bl, &by) || C % bl) return -1;                               \
    for (long r0 = 0; r0 < rows; r0 += R) {                                            \
        const long n = rows - r0 < R ? rows - r0 : R;                                  \
        for (long c0 = 0; c0 < k; c0 += C) {                                           \
            const long nc = k - c0 < C ? k - c0 : C;                                   \
            TILE(f, bl, by, w, rb, r0, n, c0, nc, tile);                               \
            if (lay) /* tbuf[n, T] (+)= tile @ x[:, c0..]^T */                         \
                GEMM(gemm, ilp64, 0, 1, n, T, nc, tile, nc, x + c0, k, c0 ? 1 : 0,     \
                     tbuf, T);                                                         \
            else /* y[:, r0..] (+)= x[:, c0..] @ tile^T */                             \
                GEMM(gemm, ilp64, 0, 1, T, n, nc, x + c0, k, tile, nc, c0 ? 1 : 0,     \
                     y + r0, rows);                                                    \
        }                                                                              \
        if (lay) TRANSPOSE_FN(tbuf, n, T, y + r0, rows);                               \
    }                                                                                  \
    return 0;                                                                          \
}                                                                                      \
int gt_qgemm_t_##SUF(int t, const uint8_t *w, long rb, long rows, long k, const TYPE *g, \
                     long T, TYPE *z, TYPE *tile, long R, long C, void *gemm, int ilp64, \
                     int lay, TYPE *tbuf) {                                            \
    gb_deq_fn f; int bl, by;                                                           \
    if (gb_layout(t, &f, &bl, &by) || C % bl) return -1;                               \
    for (long c0 = 0; c0 < k; c0 += C) {                                               \
        const long nc = k - c0 < C ? k - c0 : C;                                       \
        for (long r0 = 0; r0 < rows; r0 += R) {                                        \
            const long n = rows - r0 < R ? rows - r0 : R;                              \
            TILE(f, bl, by, w, rb, r0, n, c0, nc, tile);                               \
            if (lay) /* tbuf[nc, T] (+)= tile^T @ g[:, r0..]^T */                      \
                GEMM(gemm, ilp64, 1, 1, nc, T, n, tile, nc, g + r0, rows, r0 ? 1 : 0,  \
                     tbuf, T);                                                         \
            else /* z[:, c0..] (+)= g[:, r0..] @ tile */                               \
                GEMM(gemm, ilp64, 0, 0, T, nc, n, g + r0, rows, tile, nc, r0 ? 1 : 0,  \
                     z + c0, k);                                                       \
        }                                                                              \
        if (lay) TRANSPOSE_FN(tbuf, nc, T, z + c0, k);                                 \
    }                                                                                  \
    return 0;                                                                          \
}

DRIVERS(f32, float, tile_f, gemm_f, transpose_f)
DRIVERS(f64, double, tile_d, gemm_d, transpose_d)
