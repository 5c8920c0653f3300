/* The tiled attention (../../../tiled.py's fwd_attn / fwd_attn_grad) fused into one C call
   each, float32: the GEMMs on tile_gemm.h's register blocks and the softmax work of
   tiled.c on the same tiles, while they are in cache.

   The unit of work is one block of R query rows of one kv head (its g query heads
   stacked: M = g * R rows, row gi * R + r is head h * g + gi at query row r), walking
   the key tiles the rows see (FA_KT keys each) with an online softmax:
     forward:  S = Q K^T, p = exp(cap(S * iscale) - m), O = sum p V / l, lse = m + log l;
     backward: p recomputed from lse, dV += p^T dO, dS = p * (dO V^T - D) (times 1 -
               tanh^2 under a cap) * iscale with D = rowsum(dO * O) - dlse, dQ += dS K,
               dK += dS^T Q.
   The units are spread over the threads (OpenMP, the heaviest first); a unit owns its
   rows' O, lse and dQ; dK and dV of a key row take adds from many units, so each thread
   adds into a buffer of its own and the buffers are summed at the end; the backward's
   units are dealt round robin, so each buffer sums the same terms in the same order in
   every run (a resumed run equals an uninterrupted one).  The keys row i (at position
   past + i) sees are the positions [lo, hi): hi = past + i + 1 (causal), lo = its
   window's first key and its packed example's first row (starts), the same rules as
   tiled.AttnLayout; segment ids that are not contiguous runs take the NumPy
   walk.  Sums in float32 in another order than tiled.py's: equal to it within float32
   rounding, not bitwise.

   bf16 (gt_flash_*_bf16, for --compute bf16): the seven GEMMs take bf16 inputs and sum
   in float32 (tile_gemm.h's tg_gemm16): the keys and values are packed as bf16 once,
   each unit's q and dO once, and each tile's p and dS as they are made; the softmax,
   its statistics, D and every sum stay float32.  D must equal sum_j p_j dP_j as the
   backward computes them, or a row whose p sits on a few keys (an attention sink)
   loses its dS to the cancellation in dP - D: so D takes dO rounded as dP's GEMM takes
   it, and the forward's P V adds the remainder p - bf16(p) of every large p
   (fa_pv_remainder), as exact as the backward's float32 p.
   The softmax's exp is fa_exp, not gt_expf: the same polynomial, fused. */
#include <pthread.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "tiled.c"
#include "tile_gemm.h"

#define FA_KT 256  /* keys per tile */

typedef struct {
    const float *q, *k, *v;  /* [n_seq * tq, nh * hd], [n_seq * tk, nkv * hd] (x2) */
    long n_seq, nh, nkv, hd, g, tq, tk, past, window, R;
    float iscale, cap;
    const int64_t *starts;  /* [n_seq * tq]: each row's example's first position, or 0 */
    int bf16;               /* the GEMMs' inputs in bf16 (tg_gemm16), else float32 */
    /* per sequence and kv head, packed once for all the units (tile_gemm.h's panels,
       float32 or bf16): K^T and V^T as [hd, tk] (kt, vt), K and V as [tk, hd] (kr, vr);
       0 if unused */
    void *kt, *vt, *kr, *vr;
} fa_t;

/* bytes of one packed value */
static long fa_esize(const fa_t *f) { return f->bf16 ? sizeof(tg_bf16) : sizeof(float); }
/* values of one sequence's and kv head's [hd, tk] panels, and of its [tk, hd] ones */
static long fa_cols_size(const fa_t *f) {
    return f->bf16 ? tg_packed16_size(f->hd, f->tk) : tg_packed_size(f->hd, f->tk);
}
static long fa_rows_size(const fa_t *f) {
    return f->bf16 ? tg_packed16_size(f->tk, f->hd) : tg_packed_size(f->tk, f->hd);
}
/* values of one panel of k rows (the panel stride) */
static long fa_panel(const fa_t *f, long k) { return (f->bf16 ? 2 * tg_pairs(k) : k) * TG_NR; }
/* B [k, n] (element (p, j) at B[p * rs + j * cs]) into panels at pb, in the GEMMs' type */
static void fa_pack_b(const fa_t *f, const float *B, long rs, long cs, long k, long n,
                      void *pb) {
    if (f->bf16) tg_pack16(B, rs, cs, k, n, pb);
    else tg_pack(B, rs, cs, k, n, pb);
}

/* x [n_seq * tk, nkv * hd] packed per sequence and kv head, transposed (into t) and as
   rows (into r), where those are asked for */
static void fa_pack(const fa_t *f, const float *x, void *t, void *r) {
    const long ld = f->nkv * f->hd, es = fa_esize(f);
    _Pragma("omp for schedule(dynamic, 1)")
    for (long u = 0; u < 2 * f->n_seq * f->nkv; u++) {
        const long bh = u / 2;
        const float *src = x + bh / f->nkv * f->tk * ld + bh % f->nkv * f->hd;
        if (u % 2 == 0 && t)
            fa_pack_b(f, src, 1, ld, f->hd, f->tk, (char *)t + bh * fa_cols_size(f) * es);
        if (u % 2 == 1 && r)
            fa_pack_b(f, src, ld, 1, f->tk, f->hd, (char *)r + bh * fa_rows_size(f) * es);
    }
}

/* the panels of key tile j0 (a multiple of NR) of sequence b, kv head h in a [hd, tk]
   packing (panel stride fa_panel(hd)) and a [tk, hd] one (panel stride fa_panel(tk);
   j0 * NR values in either type, j0 being even) */
static inline const void *fa_tcols(const fa_t *f, const void *t, long b, long h, long j0) {
    const long at = (b * f->nkv + h) * fa_cols_size(f) + j0 / TG_NR * fa_panel(f, f->hd);
    return (const char *)t + at * fa_esize(f);
}
static inline const void *fa_trows(const fa_t *f, const void *r, long b, long h, long j0) {
    return (const char *)r + ((b * f->nkv + h) * fa_rows_size(f) + j0 * TG_NR) * fa_esize(f);
}

/* one thread's scratch, for blocks of up to M rows */
typedef struct {
    long *lo, *hi;                     /* [R]: the visible key positions of each row */
    float *qb, *dob, *acc;             /* [M, hd]: the block's q, dO; O or dQ */
    float *s, *dp, *t;                 /* [M, FA_KT]: scores / p, dp / dS, 1 - tanh^2 */
    float *m, *l, *lse, *D;            /* [M] */
    float *lo_min;                     /* [M]: the forward's, see fa_pv_remainder */
    void *pq, *pdo;                    /* the block's q, dO packed (float32 or bf16) */
    tg_bf16 *q16, *do16;               /* bf16: q, dO as pairs along hd, [M, 2 * hdp] */
    tg_bf16 *a16, *at16;               /* bf16: a tile's p or dS [M, FA_KT] and its
                                          transpose (pairs along M) [M + 1, FA_KT] */
} fa_buf;

/* bytes of one thread's scratch (fa_buf), a multiple of 64 */
static long fa_buf_bytes(const fa_t *f) {
    const long M = f->g * f->R, hd = f->hd, rows = tg_packed_size(M, hd);
    /* bf16 copies, counted in floats (a float32 panel of M rows holds a bf16 one) */
    const long hd2 = 2 * tg_pairs(hd);
    const long b16 = f->bf16 ? (2 * M * hd2 + (2 * M + 1) * FA_KT) / 2 + 1 : 0;
    const long floats = 3 * M * hd + 3 * M * FA_KT + 5 * M + 2 * rows + b16;
    return (2 * f->R * (long)sizeof(long) + floats * (long)sizeof(float) + 63) / 64 * 64;
}

/* one thread's scratch laid out in mem (fa_buf_bytes) */
static fa_buf fa_layout(const fa_t *f, char *mem) {
    const long M = f->g * f->R, hd = f->hd, rows = tg_packed_size(M, hd);
    const long hd2 = 2 * tg_pairs(hd);
    fa_buf w;
    memset(&w, 0, sizeof w);
    w.lo = (long *)mem;
    w.hi = w.lo + f->R;
    float *p = (float *)(w.hi + f->R);
    w.qb = p; p += M * hd;   w.dob = p; p += M * hd;   w.acc = p; p += M * hd;
    w.s = p; p += M * FA_KT; w.dp = p; p += M * FA_KT; w.t = p; p += M * FA_KT;
    w.m = p; p += M; w.l = p; p += M; w.lse = p; p += M; w.D = p; p += M;
    w.lo_min = p; p += M;
    w.pq = p; p += rows; w.pdo = p; p += rows;
    if (f->bf16) {
        tg_bf16 *h = (tg_bf16 *)p;
        w.q16 = h; h += M * hd2;  w.do16 = h; h += M * hd2;
        w.a16 = h; h += M * FA_KT; w.at16 = h;
    }
    return w;
}

/* rows [i0, i0 + n) of sequence b: each row's visible key positions; the union's range */
static void fa_ranges(const fa_t *f, long b, long i0, long n, fa_buf *w, long *jlo,
                      long *jhi) {
    *jlo = f->tk, *jhi = 0;
    for (long r = 0; r < n; r++) {
        const long p = f->past + i0 + r;
        long lo = f->window > 0 && p - f->window + 1 > 0 ? p - f->window + 1 : 0;
        if (f->starts && f->starts[b * f->tq + i0 + r] > lo) lo = f->starts[b * f->tq + i0 + r];
        w->lo[r] = lo;
        w->hi[r] = p + 1;
        if (lo < *jlo) *jlo = lo;
        if (p + 1 > *jhi) *jhi = p + 1;
    }
}

/* the block's rows of a [N, nh * hd (+ ...)] array, head by head, into dst [M, hd]
   (copied in the loop, not by memcpy: a call per row of only 64-128 values costs more
   than the copy) */
static void fa_gather(const fa_t *f, const float *restrict src, long ld, long b, long h,
                      long i0, long n, float *restrict dst) {
    const long hd = f->hd;
    for (long gi = 0; gi < f->g; gi++)
        for (long r = 0; r < n; r++) {
            const float *restrict s = src + (b * f->tq + i0 + r) * ld + (h * f->g + gi) * hd;
            float *restrict d = dst + (gi * n + r) * hd;
            _Pragma("omp simd")
            for (long c = 0; c < hd; c++) d[c] = s[c];
        }
}

/* row x of the block: the visible columns [a, e) of the key tile at j0 (kn keys), 0 <=
   a <= e <= kn; empty where the row sees none of it: a row past a packed example's
   first row, in the block with rows of the example before, starts its keys at a later
   tile than they do */
static inline void fa_cols(const fa_buf *w, long x, long n, long j0, long kn, long *a,
                           long *e) {
    const long r = x % n;
    *a = w->lo[r] - j0 > 0 ? w->lo[r] - j0 : 0;
    if (*a > kn) *a = kn;
    *e = w->hi[r] - j0 < kn ? w->hi[r] - j0 : kn;
    if (*e < *a) *e = *a;
}

/* the scores row[a, e) -> cap(row * iscale) in place when capped; their max, scaled */
static inline float fa_scores(const fa_t *f, float *row, long a, long e, float *sc) {
    if (f->cap) {
        *sc = 1.0f;
        return scores_f32(row + a, 0, e - a, f->iscale, f->cap);
    }
    *sc = f->iscale;
    return rowmax_f32(row + a, 0, e - a) * f->iscale;
}

/* exp(x) for the softmax's x (a score less its row's max or lse: at most about 0), as
   gt_expf (2^n exp(r), Cephes' polynomial) with its multiply-adds fused and one power
   of two: a third of gt_expf's instructions.  0 below -87, where exp(x) (1.6e-38 at -87)
   leaves float32's normal range; NaN stays NaN. */
static inline float fa_exp(float x) {
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer n */
    const float xc = x < -87.0f ? -87.0f : x;
    const float fn = fmaf(xc, 1.44269504088896341f, magic), n = fn - magic;
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float y = fmaf(1.9875691500E-4f, r, 1.3981999507E-3f);
    y = fmaf(y, r, 8.3334519073E-3f);
    y = fmaf(y, r, 4.1665795894E-2f);
    y = fmaf(y, r, 1.6666665459E-1f);
    y = fmaf(y, r, 5.0000001201E-1f);
    y = fmaf(y, r * r, r + 1.0f);
    uint32_t bits;  /* fn's low bits hold n: shifted into the exponent, 2^n */
    memcpy(&bits, &fn, 4);
    bits = (bits << 23) + (127u << 23);
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : y * scale;
}

/* row[j] = exp(row[j] * sc - sub) over [0, n); their sum.  Inlined into the row loops,
   so the polynomial's constants stay in registers across rows (a short tile's rows are
   a hundred values: a call each spent more on its set-up than on its exps) */
static inline __attribute__((always_inline)) float fa_pexp(float *row, long n, float sc,
                                                           float sub) {
    float sum = 0.0f;
    _Pragma("omp simd reduction(+:sum)")
    for (long j = 0; j < n; j++) {
        const float p = fa_exp(fmaf(row[j], sc, -sub));
        row[j] = p;
        sum += p;
    }
    return sum;
}

/* Test builds only (-DFA_GEMM_LOG=n): the first n GEMM calls' (kind, m, n, k), kind 0
   for fa_mm_xyt, 1 fa_mm_ay, 2 fa_mm_atx, read back and cleared by gt_flash_gemm_log;
   what tiled.flash_gemms lists is held to it (tests/backends/test_flash_gemms.py). */
#ifdef FA_GEMM_LOG
static long fa_log[FA_GEMM_LOG][4];
static long fa_log_n;
static void fa_note(long kind, long m, long n, long k) {
    const long i = __atomic_fetch_add(&fa_log_n, 1, __ATOMIC_RELAXED);
    if (i < FA_GEMM_LOG) fa_log[i][0] = kind, fa_log[i][1] = m, fa_log[i][2] = n, fa_log[i][3] = k;
}
/* the calls logged since the last read into out [cap, 4]; their count (may exceed cap) */
long gt_flash_gemm_log(long *out, long cap) {
    const long n = fa_log_n;
    for (long i = 0; i < n && i < cap && i < FA_GEMM_LOG; i++)
        for (int c = 0; c < 4; c++) out[4 * i + c] = fa_log[i][c];
    fa_log_n = 0;
    return n;
}
#else
#define fa_note(kind, m, n, k) ((void)0)
#endif

/* The three shapes of the seven GEMMs, in float32 or bf16 (x16, a16, at16: the bf16
   copies' scratch).  c[M, kn] = x[M, hd] Y^T over key tile j0, Y^T packed as [hd, tk]
   (yt): S = Q K^T, dP = dO V^T. */
static void fa_mm_xyt(const fa_t *f, long M, long kn, const float *x, const tg_bf16 *x16,
                      const void *yt, long b, long h, long j0, float *c) {
    const void *pb = fa_tcols(f, yt, b, h, j0);
    fa_note(0, M, kn, f->hd);
    if (f->bf16)
        tg_gemm16(M, kn, f->hd, x16, 2 * tg_pairs(f->hd), 2, pb, fa_panel(f, f->hd), c, FA_KT, 0);
    else
        tg_gemm(M, kn, f->hd, x, f->hd, 1, pb, fa_panel(f, f->hd), c, FA_KT, 0);
}

/* acc[M, hd] += a[M, kn] Y[j0 : j0 + kn], Y packed as [tk, hd] (yr): O += P V, dQ += dS K */
static void fa_mm_ay(const fa_t *f, long M, long kn, const float *a, tg_bf16 *a16,
                     const void *yr, long b, long h, long j0, float *acc) {
    const void *pb = fa_trows(f, yr, b, h, j0);
    fa_note(1, M, f->hd, kn);
    if (f->bf16) {
        tg_rows16(a, FA_KT, M, kn, a16, FA_KT);
        tg_gemm16(M, f->hd, kn, a16, FA_KT, 2, pb, fa_panel(f, f->tk), acc, f->hd, 1);
    } else {
        tg_gemm(M, f->hd, kn, a, FA_KT, 1, pb, fa_panel(f, f->tk), acc, f->hd, 1);
    }
}

/* The forward's remainder under bf16: acc[x] += (p - bf16(p)) V16[j] for each p of the
   tile above lo_min[x], FA_LO_MIN of its row's sum so far (INFINITY where the tile's
   largest p is not above it), so that the backward's D = rowsum(dO O) is sum_j p_j dP_j
   (see the top of this file).  p is in s, its bf16 copy in a16 as fa_mm_ay left it,
   V16 is V's rows rounded as the packed ones.  The row's sum only grows (in the units
   of its running max), so every p above FA_LO_MIN of the final sum is among these; each
   other p leaves out at most FA_LO_MIN 2^-9 of the sum from O: a sink's dS = p (dP - D)
   stays as accurate as with every remainder, as only its own p is large.  In place of
   a second GEMM over every p's remainder (a third of the forward's products). */
#define FA_LO_MIN (1.0f / 16)
static void fa_pv_remainder(const fa_t *f, long M, long kn, const float *s,
                            const tg_bf16 *a16, const float *lo_min, long b, long h,
                            long j0, float *acc) {
    const long hd = f->hd, ld = f->nkv * hd;
    const float *v = f->v + (b * f->tk + j0) * ld + h * hd;
    for (long x = 0; x < M; x++) {
        const float *px = s + x * FA_KT, min = lo_min[x];
        if (min == INFINITY) continue;
        const tg_bf16 *hx = a16 + x * FA_KT;
        float *ax = acc + x * hd;
        for (long c = 0; c < kn; c += 16) {  /* 16 p at a time, most with none above */
            const long e = kn - c < 16 ? kn : c + 16;
            uint32_t above = 0;  /* bit j - c: p_j above min */
#ifdef __AVX512F__
            if (e - c == 16)
                above = _mm512_cmp_ps_mask(_mm512_loadu_ps(px + c), _mm512_set1_ps(min),
                                           _CMP_GT_OQ);
            else
#endif
                for (long j = c; j < e; j++) above |= (uint32_t)(px[j] > min) << (j - c);
            for (; above; above &= above - 1) {
                const long j = c + __builtin_ctz(above);
                const float lo = px[j] - tg_f32(hx[j]);
                const float *vj = v + j * ld;
                _Pragma("omp simd")
                for (long d = 0; d < hd; d++) ax[d] += lo * tg_f32(gt_bf16(vj[d]));
            }
        }
    }
}

/* d[kn, hd] (rows ldd apart) += a[M, kn]^T X, X [M, hd] packed (xp): dV += P^T dO,
   dK += dS^T Q */
static void fa_mm_atx(const fa_t *f, long M, long kn, const float *a, tg_bf16 *at16,
                      const void *xp, float *d, long ldd) {
    fa_note(2, kn, f->hd, M);
    if (f->bf16) {
        tg_cols16(a, FA_KT, M, kn, at16, FA_KT);
        tg_gemm16(kn, f->hd, M, at16, 2, 2 * FA_KT, xp, fa_panel(f, M), d, ldd, 1);
    } else {
        tg_gemm(kn, f->hd, M, a, 1, FA_KT, xp, fa_panel(f, M), d, ldd, 1);
    }
}

static void fa_fwd_unit(const fa_t *f, long b, long h, long i0, long n, float *out,
                        fa_buf *w) {
    const long M = f->g * n, hd = f->hd, ldo = f->nh * hd + f->nh;
    long jlo, jhi;
    fa_ranges(f, b, i0, n, w, &jlo, &jhi);
    fa_gather(f, f->q, f->nh * hd, b, h, i0, n, w->qb);
    if (f->bf16) tg_rows16(w->qb, hd, M, hd, w->q16, 2 * tg_pairs(hd));
    for (long x = 0; x < M; x++) w->m[x] = -INFINITY, w->l[x] = 0.0f;
    memset(w->acc, 0, M * hd * sizeof(float));
    for (long j0 = jlo - jlo % TG_NR; j0 < jhi; j0 += FA_KT) {
        const long kn = jhi - j0 < FA_KT ? jhi - j0 : FA_KT;
        fa_mm_xyt(f, M, kn, w->qb, w->q16, f->kt, b, h, j0, w->s);
        for (long x = 0; x < M; x++) {
            float *row = w->s + x * FA_KT, sc;
            long a, e;
            fa_cols(w, x, n, j0, kn, &a, &e);
            w->lo_min[x] = INFINITY;
            if (e > a) {
                const float mx = fa_scores(f, row, a, e, &sc);
                const float mn = w->m[x] > mx ? w->m[x] : mx;
                const float alpha = w->m[x] == -INFINITY ? 0.0f : gt_expf(w->m[x] - mn);
                const float sum = fa_pexp(row + a, e - a, sc, mn);
                w->l[x] = w->l[x] * alpha + sum;
                w->m[x] = mn;
                /* the tile's largest p is exp(mx - mn) (with a margin for fa_exp's
                   rounding): where it is not above FA_LO_MIN l, no p of the row is */
                const float lo_min = FA_LO_MIN * w->l[x];
                w->lo_min[x] = 1.001f * gt_expf(mx - mn) > lo_min ? lo_min : INFINITY;
                float *ax = w->acc + x * hd;
                _Pragma("omp simd")
                for (long d = 0; d < hd; d++) ax[d] *= alpha;
            }
            memset(row, 0, a * sizeof(float));
            memset(row + e, 0, (kn - e) * sizeof(float));
        }
        fa_mm_ay(f, M, kn, w->s, w->a16, f->vr, b, h, j0, w->acc);
        if (f->bf16) fa_pv_remainder(f, M, kn, w->s, w->a16, w->lo_min, b, h, j0, w->acc);
    }
    for (long gi = 0; gi < f->g; gi++)
        for (long r = 0; r < n; r++) {
            const long x = gi * n + r, head = h * f->g + gi;
            float *o = out + (b * f->tq + i0 + r) * ldo;
            const float inv = 1.0f / w->l[x];
            _Pragma("omp simd")
            for (long d = 0; d < hd; d++) o[head * hd + d] = w->acc[x * hd + d] * inv;
            o[f->nh * hd + head] = w->m[x] + logf(w->l[x]);
        }
}

static void fa_bwd_unit(const fa_t *f, long b, long h, long i0, long n, const float *gy,
                        const float *y, float *dq, float *dk, float *dv, fa_buf *w) {
    const long M = f->g * n, hd = f->hd, ldk = f->nkv * hd, ldq = f->nh * hd;
    const long ldo = ldq + f->nh;
    long jlo, jhi;
    fa_ranges(f, b, i0, n, w, &jlo, &jhi);
    fa_gather(f, f->q, ldq, b, h, i0, n, w->qb);
    fa_gather(f, gy, ldo, b, h, i0, n, w->dob);
    for (long gi = 0; gi < f->g; gi++)
        for (long r = 0; r < n; r++) {
            const long x = gi * n + r, row = b * f->tq + i0 + r, head = h * f->g + gi;
            const float *o = y + row * ldo + head * hd, *dob = w->dob + x * hd;
            float D = 0.0f;
            /* dO as dP = dO V^T sees it: rounded to bf16 there */
            if (f->bf16) {
                _Pragma("omp simd reduction(+:D)")
                for (long d = 0; d < hd; d++) D += tg_f32(gt_bf16(dob[d])) * o[d];
            } else {
                _Pragma("omp simd reduction(+:D)")
                for (long d = 0; d < hd; d++) D += dob[d] * o[d];
            }
            w->D[x] = D - gy[row * ldo + ldq + head];
            w->lse[x] = y[row * ldo + ldq + head];
        }
    memset(w->acc, 0, M * hd * sizeof(float));  /* dQ */
    fa_pack_b(f, w->qb, hd, 1, M, hd, w->pq);
    fa_pack_b(f, w->dob, hd, 1, M, hd, w->pdo);
    if (f->bf16) {
        tg_rows16(w->qb, hd, M, hd, w->q16, 2 * tg_pairs(hd));
        tg_rows16(w->dob, hd, M, hd, w->do16, 2 * tg_pairs(hd));
    }
    for (long j0 = jlo - jlo % TG_NR; j0 < jhi; j0 += FA_KT) {
        const long kn = jhi - j0 < FA_KT ? jhi - j0 : FA_KT;
        float *dkj = dk + (b * f->tk + j0) * ldk + h * hd;
        float *dvj = dv + (b * f->tk + j0) * ldk + h * hd;
        fa_mm_xyt(f, M, kn, w->qb, w->q16, f->kt, b, h, j0, w->s);
        for (long x = 0; x < M; x++) {  /* s: p */
            float *row = w->s + x * FA_KT, sc = f->iscale;
            long a, e;
            fa_cols(w, x, n, j0, kn, &a, &e);
            if (f->cap) {
                float *tr = w->t + x * FA_KT;
                const float ic = 1.0f / f->cap;
                for (long j = a; j < e; j++) {
                    const float th = tanhf(row[j] * f->iscale * ic);
                    tr[j] = 1.0f - th * th;
                    row[j] = f->cap * th;
                }
                sc = 1.0f;
            }
            fa_pexp(row + a, e - a, sc, w->lse[x]);
            memset(row, 0, a * sizeof(float));
            memset(row + e, 0, (kn - e) * sizeof(float));
        }
        fa_mm_atx(f, M, kn, w->s, w->at16, w->pdo, dvj, ldk);  /* dV[j] += p^T dO */
        fa_mm_xyt(f, M, kn, w->dob, w->do16, f->vt, b, h, j0, w->dp);
        for (long x = 0; x < M; x++) {  /* dp: dS (0 where p is) */
            float *row = w->dp + x * FA_KT;
            const float *pr = w->s + x * FA_KT, *tr = w->t + x * FA_KT, D = w->D[x];
            long a, e;
            fa_cols(w, x, n, j0, kn, &a, &e);
            if (f->cap) {
                for (long j = a; j < e; j++) row[j] = pr[j] * (row[j] - D) * tr[j] * f->iscale;
            } else {
                _Pragma("omp simd")
                for (long j = a; j < e; j++) row[j] = pr[j] * (row[j] - D) * f->iscale;
            }
            memset(row, 0, a * sizeof(float));
            memset(row + e, 0, (kn - e) * sizeof(float));
        }
        fa_mm_atx(f, M, kn, w->dp, w->at16, w->pq, dkj, ldk);  /* dK += dS^T Q */
        fa_mm_ay(f, M, kn, w->dp, w->a16, f->kr, b, h, j0, w->acc);  /* dQ += dS K */
    }
    for (long gi = 0; gi < f->g; gi++)
        for (long r = 0; r < n; r++) {
            float *restrict d = dq + (b * f->tq + i0 + r) * ldq + (h * f->g + gi) * hd;
            const float *restrict s = w->acc + (gi * n + r) * hd;
            _Pragma("omp simd")
            for (long c = 0; c < hd; c++) d[c] = s[c];
        }
}

/* the units, heaviest first: unit u is block nblk - 1 - u / (n_seq * nkv) of its
   sequence and kv head (later blocks see more keys) */
static inline void fa_unit(const fa_t *f, long u, long *b, long *h, long *i0, long *n) {
    const long nblk = (f->tq + f->R - 1) / f->R, per = f->n_seq * f->nkv;
    const long blk = nblk - 1 - u / per;
    *b = u % per / f->nkv;
    *h = u % f->nkv;
    *i0 = blk * f->R;
    *n = f->tq - *i0 < f->R ? f->tq - *i0 : f->R;
}

/* query rows per unit for g heads per kv head and tq query rows: M = g * R, about a
   hundred rows */
long gt_flash_unit_rows(long g, long tq) {
    const long R = 96 / g > 16 ? 96 / g : 16;
    return R > tq ? tq : R;
}

static fa_t fa_make(const float *q, const float *k, const float *v, const int64_t *starts,
                    long n_seq, long nq, long nk, long nh, long nkv, long hd, double iscale,
                    double cap, long window, int bf16) {
    fa_t f = {q, k, v, n_seq, nh, nkv, hd, nh / nkv, nq / n_seq, nk / n_seq, 0, window, 0,
              (float)iscale, (float)cap, starts, bf16, 0, 0, 0, 0};
    f.past = f.tk - f.tq;
    f.R = gt_flash_unit_rows(f.g, f.tq);
    return f;
}

static long fa_units(const fa_t *f) {
    return (f->tq + f->R - 1) / f->R * f->n_seq * f->nkv;
}

/* The scratch of every call (the packed keys and values, the threads' dK and dV, each
   thread's fa_buf) is one block kept for the next call, grown as needed, so the call's
   speed does not hang on the allocator's state: where malloc hands back fresh pages
   (a process calling the attention alone, as bench/long_kernels.py), each faults once,
   and the first add into a zeroed page faults again and interrupts the other core to
   flush its TLB.  A training step's own allocations keep that memory mapped already.
   One call at a time holds the block; the largest call's stays allocated (SmolLM2's
   backward at T=2048: about 7 MB). */
static pthread_mutex_t fa_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static char *fa_pool;
static size_t fa_pool_bytes;

static char *fa_pool_get(size_t bytes) {
    if (bytes > fa_pool_bytes) {
        free(fa_pool);
        fa_pool = malloc(bytes);
        fa_pool_bytes = fa_pool ? bytes : 0;
    }
    return fa_pool;
}

/* Forward (gy null): out [nq, nh * hd + nh] = [O | lse].  Backward: out = [dq | dk |
   dv] flattened (dq [nq, nh * hd], dk and dv [nk, nkv * hd]) from the cotangent gy and
   the forward's y.  Returns 0, or -1 when the scratch could not be allocated. */
static int fa_run(fa_t *f, float *out, const float *gy, const float *y) {
    const long kv = f->n_seq * f->tk * f->nkv * f->hd, bh = f->n_seq * f->nkv;
    const long cols = bh * fa_cols_size(f), rows = bh * fa_rows_size(f);
    float *dq = out, *dk = out + f->n_seq * f->tq * f->nh * f->hd, *dv = dk + kv;
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
#else
    const int nt = 1;
#endif
    /* the packed keys and values; backward: thread t > 0 adds its dK, dV into
       extra + (t - 1) * 2 * kv, thread 0 into out; then each thread's fa_buf */
    const long extra_floats = gy ? (nt - 1) * 2 * kv : 0;
    const long es = fa_esize(f);
    const long packed_bytes = ((gy ? 2 * cols + 2 * rows : cols + rows) * es + 63) / 64 * 64;
    const long buf_bytes = fa_buf_bytes(f);
    const long extra_bytes = (extra_floats * (long)sizeof(float) + 63) / 64 * 64;
    pthread_mutex_lock(&fa_pool_lock);
    char *pool = fa_pool_get(packed_bytes + extra_bytes + nt * buf_bytes);
    if (!pool) {
        pthread_mutex_unlock(&fa_pool_lock);
        return -1;
    }
    char *packed = pool, *bufs = pool + packed_bytes + extra_bytes;
    float *extra = extra_floats ? (float *)(pool + packed_bytes) : 0;
    if (extra) memset(extra, 0, extra_floats * sizeof(float));
    f->kt = packed;
    f->vr = packed + cols * es;
    if (gy) {
        f->kr = (char *)f->vr + rows * es;
        f->vt = (char *)f->kr + rows * es;
        memset(dk, 0, 2 * kv * sizeof(float));
    }
    _Pragma("omp parallel num_threads(nt)")
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        fa_pack(f, f->k, f->kt, f->kr);
        fa_pack(f, f->v, f->vt, f->vr);
        fa_buf w = fa_layout(f, bufs + tid * buf_bytes);
        float *mdk = tid ? extra + (tid - 1) * 2 * kv : dk, *mdv = tid ? mdk + kv : dv;
        if (gy) {
            /* each thread's units fixed (round robin over the heaviest-first order), so
               each dK, dV buffer sums the same terms in the same order in every run */
            _Pragma("omp for schedule(static, 1)")
            for (long u = 0; u < fa_units(f); u++) {
                long b, h, i0, n;
                fa_unit(f, u, &b, &h, &i0, &n);
                fa_bwd_unit(f, b, h, i0, n, gy, y, dq, mdk, mdv, &w);
            }
        } else {
            _Pragma("omp for schedule(dynamic, 1)")
            for (long u = 0; u < fa_units(f); u++) {
                long b, h, i0, n;
                fa_unit(f, u, &b, &h, &i0, &n);
                fa_fwd_unit(f, b, h, i0, n, out, &w);
            }
        }
        if (extra) {
            _Pragma("omp for schedule(static)")
            for (long i = 0; i < 2 * kv; i++)
                for (int t = 1; t < nt; t++) dk[i] += extra[(t - 1) * 2 * kv + i];
        }
    }
    pthread_mutex_unlock(&fa_pool_lock);
    return 0;
}

/* the tiling tiled.flash_gemms mirrors: keys per tile, columns per register block */
long gt_flash_key_tile(void) { return FA_KT; }
long gt_flash_panel(void) { return TG_NR; }

/* float32 lanes of the GEMM register blocks' vectors (0: plain C) */
int gt_flash_lanes(void) {
#ifdef GV_W
    return GV_W;
#else
    return 0;
#endif
}

/* the entry points: float32 GEMMs (_f32) or bf16 ones (_bf16), float32 data either way */
#define FA_ENTRY(suffix, bf16)                                                             \
int gt_flash_fwd_##suffix(float *out, const float *q, const float *k, const float *v,      \
                          const int64_t *starts, long n_seq, long nq, long nk, long nh,    \
                          long nkv, long hd, double iscale, double cap, long window) {     \
    fa_t f = fa_make(q, k, v, starts, n_seq, nq, nk, nh, nkv, hd, iscale, cap, window,     \
                     bf16);                                                                \
    return fa_run(&f, out, 0, 0);                                                          \
}                                                                                          \
int gt_flash_bwd_##suffix(float *out, const float *gy, const float *q, const float *k,     \
                          const float *v, const float *y, const int64_t *starts,           \
                          long n_seq, long nq, long nk, long nh, long nkv, long hd,        \
                          double iscale, double cap, long window) {                        \
    fa_t f = fa_make(q, k, v, starts, n_seq, nq, nk, nh, nkv, hd, iscale, cap, window,     \
                     bf16);                                                                \
    return fa_run(&f, out, gy, y);                                                         \
}
FA_ENTRY(f32, 0)
FA_ENTRY(bf16, 1)

/* 1 where the bf16 GEMMs run on AVX512-BF16 instructions, 0 where plain C emulates them */
int gt_flash_bf16_native(void) {
#if defined(__AVX512BF16__) && !defined(GV_EMULATE) && TG_NR == 32
    return 1;
#else
    return 0;
#endif
}
