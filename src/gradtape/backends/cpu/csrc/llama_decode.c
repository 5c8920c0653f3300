/* One LLaMA decode step (a single new token) in one call, from the weights as stored.

   gt_expf (gt_prelude.h) is float32 exp within about 1 ulp, vectorizable; the
   matrix-vector products are ggml_vec.c's (ggml_vec.h), or with m->q8 q8_dots.c's: the
   input row quantized to 8 bits once per product (shared by q / k / v and by gate / up)
   and integer dots, for the weight types that have them.  The whole step runs in one
   OpenMP parallel region whose threads meet at the step's own spinning barrier
   (gd_sync): the matrix-vector products (the bytes of every weight are read once per
   token, and that decides the speed) split their rows over the threads, and so do the
   LoRA down-projections x @ A (their rank rows); the small row operations (RMSNorm,
   rope, the quantizations) run on one thread between barriers; attention splits over
   query heads.  The math is model.py's _block
   for one row, in float32, with sums of squares and softmax sums in double:
     h = rmsnorm(x) * w;  q, k, v = h Wq, h Wk, h Wv (+ s (h A) B) (+ bias);
     per head (where the family norms q and k: Qwen3, SmolLM3 has none) q_h = rmsnorm(q_h)
     * qn, k_h = rmsnorm(k_h) * kn over hd;  rope(q), rope(k) (NEOX half-split, the rows
     of layer i's table rope_of[i]: each layer's base and frequency factors, and cos = 1,
     sin = 0 for a layer without rope, where rope is exactly the identity);  append k, v
     to the cache at pos (rounded to halves where kv16);  per query head: softmax(q k^T *
     iscale) v over the cached rows lo .. pos, lo = max(0, pos - window[i] + 1) (window 0:
     lo = 0; a key j is seen iff j > pos - window) (GQA: query head i reads kv head i /
     (nh / nkv));
     x += attn Wo (+ bias);  h = rmsnorm(x) * w;
     x += (silu(h Wgate) * (h Wup)) Wdown;  logits = rmsnorm(x) * w  Whead.
   Gemma's block on top (each where the model has it): x = embedding * sqrt(dim) (the
   caller's embed_scale); the scores soft-capped, s = cap tanh(s / cap), after the scale
   and before the softmax; x += rmsnorm(attn Wo) * w_post and x += rmsnorm(mlp) * w_post
   (norms after attention and MLP); GeGLU, gelu_tanh(g) * u with gelu_tanh(g) = 0.5 g (1 +
   tanh(sqrt(2/pi) (g + 0.044715 g^3))), in place of silu(g) * u; logits = cap tanh(logits
   / cap).  Gemma's (1 + w) norm weights are the caller's: it passes 1 + w.
   Every linear is a gd_lin: ggml blocks [out, in] (ggml's orientation), plus an optional
   unmerged LoRA pair, A^T [r, in] and B [r, out] (float32), with its scale, and an
   optional float32 bias [out] added last (the graph adds it to the linear's output). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gt_prelude.h"
#include "ggml_blocks.h" /* the ggml type ids */
#include "ggml_vec.h"
#include "gv_simd.h"
#include "q8_dots.h"

#include <stdatomic.h>
#include <sched.h>
#if (defined(__F16C__) || defined(__AVX512F__)) && !defined(GV_EMULATE)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#define GD_FOR _Pragma("omp for schedule(static)")
#define GD_FOR_DEALT _Pragma("omp for schedule(static, 1)")  /* item i to thread i % nt */
#define GD_BARRIER _Pragma("omp barrier")
#define GD_SINGLE _Pragma("omp single")
#else
#define GD_FOR
#define GD_FOR_DEALT
#define GD_BARRIER
#define GD_SINGLE
#endif

/* The decode step's own barrier (the prefill keeps OpenMP's): a step meets about 8 times
   a layer, and OpenMP's barrier sleeps on a futex once its short spin
   (toolchain.quiet_openmp) or a user's passive wait policy runs out, a wake-up at every
   meeting.  Here the last thread to arrive starts a new generation and the others
   spin on it (pause), yielding their core after GD_SPINS pauses so that a team member
   the OS has descheduled can run. */
#define GD_SPINS 4096
typedef struct { atomic_int arrived, gen; } gd_bar;
typedef struct { int tid, nt; gd_bar *bar; } gd_team;  /* a thread of the step's team */

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
static inline void gd_pause(void) {
#if defined(__SSE2__)
    _mm_pause();
#endif
}

static void gd_sync(const gd_team *t) {
    if (t->nt == 1) return;
    gd_bar *b = t->bar;
    const int g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == t->nt - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->gen, g + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->gen, memory_order_acquire) == g; spins++) {
        if (spins < GD_SPINS) gd_pause();
        else sched_yield();
    }
}

/* the team member's contiguous share [*a, *b) of n items */
static void gd_part(const gd_team *t, int64_t n, int64_t *a, int64_t *b) {
    *a = n * t->tid / t->nt;
    *b = n * (t->tid + 1) / t->nt;
}

typedef struct {
    const uint8_t *w;       /* blocks, rows = out, row_bytes apart */
    int64_t type, rows, k, row_bytes;
    const float *at, *b;    /* LoRA A^T [r, k], B [r, rows]; NULL: none */
    int64_t r;
    float scale;
    const float *bias;      /* [rows]; NULL: none */
    const float *col;       /* DoRA: each row's factor m / ||w0 + s A B|| [rows]; NULL: none */
} gd_lin;

enum { GD_Q, GD_K, GD_V, GD_O, GD_GATE, GD_UP, GD_DOWN, GD_NLIN };

typedef struct {
    int64_t dim, n_layers, nh, nkv, hd, ffn, vocab, cap, nthreads;
    float eps;
    const gd_lin *lin;        /* [n_layers * GD_NLIN] */
    gd_lin embd, head;        /* token table [vocab, dim] and LM head [vocab, dim] */
    const float *attn_norm, *ffn_norm, *norm;   /* [n_layers, dim], ..., [dim] */
    void *kc, *vc;            /* caches [n_layers, nkv, cap, hd] (roped keys, values):
                                 float32, or IEEE halves where kv16 */
    const float *cos, *sin;   /* rope tables [n tables, cap, hd/2] */
    float *scratch;           /* gd_scratch_floats(m) floats */
    /* the family features; NULL / 0 where the block is plain LLaMA's */
    const float *q_norm, *k_norm;  /* per-head RMSNorm weights [n_layers, hd] (both or none) */
    const int64_t *rope_of;   /* [n_layers]: the layer's table; NULL: all table 0 */
    const int64_t *window;    /* [n_layers]: keys seen (0: all); NULL: all 0 */
    float iscale;             /* the factor on the scores, 1/sqrt(hd) */
    const float *post_attn_norm, *post_ffn_norm;  /* [n_layers, dim] (both or none) */
    float embed_scale;        /* 0: none, else the embeddings' factor */
    float attn_softcap, final_softcap;  /* 0: none */
    int64_t geglu;            /* 1: gelu_tanh(g) * u, 0: silu(g) * u */
    int64_t q8;               /* 1: a step's products whose weight type has integer dots
                                 (q8_dots.c) read their input quantized to 8 bits */
    int64_t kv16;             /* 1: the caches hold halves (keys and values rounded to
                                 nearest even, as llama.cpp's default f16 cache) */
} gd_model;

/* element e of a cache (float32, or halves where the model's kv16) */
static inline void *gd_kv(const gd_model *m, void *c, int64_t e) {
    return (char *)c + e * (m->kv16 ? 2 : 4);
}

static int64_t gd_kmax(const gd_model *m) {
    int64_t k = m->dim > m->ffn ? m->dim : m->ffn;
    return k > m->nh * m->hd ? k : m->nh * m->hd;
}

int64_t gd_scratch_floats(const gd_model *m) {
    /* x, h, q, k, v, att, mlp, up, lora t (4 x 64), scores per head, the 8-bit row */
    return 2 * m->dim + 2 * m->nh * m->hd + 2 * m->nkv * m->hd + 2 * m->ffn + 256
           + m->nh * (m->cap + 1) + (gq_bytes(gd_kmax(m)) + 3) / 4;
}

/* the forms of an 8-bit input row the linears a, b, c (NULL: none) read: 0 where the
   step keeps float32 inputs (m->q8 = 0) or none of them has integer dots */
static int gd_need(const gd_model *m, const gd_lin *a, const gd_lin *b, const gd_lin *c) {
    if (!m->q8) return 0;
    return (a ? gq_need(a->type) : 0) | (b ? gq_need(b->type) : 0) | (c ? gq_need(c->type) : 0);
}

static void gd_rmsnorm(const float *x, const float *w, float *out, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* the member's share [*a, *e) of a row of n elements, in whole blocks of the 8-bit forms
   need makes of it (256 elements with Q8_K, else 32; the whole row where n is no
   multiple of 32) */
static void gd_span(const gd_team *tm, int64_t n, int need, int64_t *a, int64_t *e) {
    const int64_t unit = (gq_forms(n, need) & GQ_Q8K) ? 256 : n % 32 == 0 ? 32 : n;
    gd_part(tm, n / unit, a, e);
    *a *= unit;
    *e *= unit;
}

/* h = rmsnorm(x) * w and the 8-bit row xr of h for need (0: none), split over the team:
   each member sums all of x in the same order (the same factor as gd_rmsnorm's) and
   normalizes and quantizes its share; no barrier */
static void gd_norm_q(const gd_team *tm, const float *x, const float *w, float *h, int64_t n,
                      float eps, gq_row *xr, int need) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    int64_t a, e;
    gd_span(tm, n, need, &a, &e);
    for (int64_t i = a; i < e; i++) h[i] = x[i] * r * w[i];
    gq_quantize_span(xr, h, n, need, a, e);
    if (tm->tid == 0) {
        xr->k = n;
        xr->have = gq_forms(n, need);
    }
}

/* t[j] = sum_i x[i] A[i, j] = A^T[j] . x: the LoRA down-projection (r <= 64), one
   float32 row dot product per j (A^T rows are contiguous: 16 lanes a step) */
static void gd_lora_t(const gd_lin *L, const float *x, float *t) {
    gv_rows(T_F32, (const uint8_t *)L->at, L->k * 4, L->k, 0, L->r, x, 1, L->k, t, L->r, 0);
}

/* t_s = x A_s for the adapted ones of up to three targets L[s] (NULL or no A: skipped),
   all their rank rows split over the team: every member calls it; it ends with a
   barrier when there is work. */
static void gd_lora_ts(const gd_team *tm, const gd_lin *L0, const gd_lin *L1,
                       const gd_lin *L2, const float *x, float *t0, float *t1, float *t2) {
    const gd_lin *Ls[3] = {L0 && L0->at ? L0 : 0, L1 && L1->at ? L1 : 0, L2 && L2->at ? L2 : 0};
    float *ts[3] = {t0, t1, t2};
    const int64_t n0 = Ls[0] ? Ls[0]->r : 0, n1 = n0 + (Ls[1] ? Ls[1]->r : 0);
    const int64_t n = n1 + (Ls[2] ? Ls[2]->r : 0);
    if (n == 0) return;
    int64_t a, b;
    gd_part(tm, n, &a, &b);
    for (int64_t i = a; i < b; i++) {
        const int s = i < n0 ? 0 : i < n1 ? 1 : 2;
        const int64_t j = i - (s == 0 ? 0 : s == 1 ? n0 : n1);
        const gd_lin *L = Ls[s];
        gv_rows(T_F32, (const uint8_t *)L->at, L->k * 4, L->k, j, j + 1, x, 1, L->k, ts[s],
                L->r, 0);
    }
    gd_sync(tm);
}

/* y[r] += scale * sum_j t[j] B[j, r] for rows [r0, r1): one pass over each row of B
   (contiguous in r, so the inner loop is a vector multiply-add) */
static void gd_lora_b(const gd_lin *L, const float *t, float *y, int64_t r0, int64_t r1) {
    for (int64_t j = 0; j < L->r; j++) {
        const float c = L->scale * t[j], *b = L->b + j * L->rows;
        for (int64_t r = r0; r < r1; r++) y[r] += c * b[r];
    }
}

/* y[r] (+)= W[r] . x (+ scale * t B[:, r]) for this thread's share of rows (no barrier),
   with integer dots against xq (x quantized) where it holds what L's type reads; a DoRA
   linear (col) scales its rows before the bias and never accumulates (acc = 0:
   gd_residual adds it) */
static void gd_linear(const gd_lin *L, const float *x, const gq_row *xq, const float *t,
                      float *y, int acc) {
    int64_t r0 = 0, r1 = L->rows;
#ifdef _OPENMP
    gv_share(L->rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
#endif
    if (gq_ready(xq, L->type, L->k))
        gq_rows(L->type, L->w, L->row_bytes, L->k, r0, r1, xq, y, acc);
    else
        gv_rows(L->type, L->w, L->row_bytes, L->k, r0, r1, x, 1, L->k, y, L->rows, acc);
    if (L->at) gd_lora_b(L, t, y, r0, r1);
    if (L->col)
        for (int64_t r = r0; r < r1; r++) y[r] *= L->col[r];
    if (L->bias)
        for (int64_t r = r0; r < r1; r++) y[r] += L->bias[r];
}

static void gd_rope(float *v, int64_t nheads, int64_t hd, const float *c, const float *s) {
    const int64_t h2 = hd / 2;
    for (int64_t h = 0; h < nheads; h++) {
        float *p = v + h * hd;
        for (int64_t j = 0; j < h2; j++) {
            float x1 = p[j], x2 = p[j + h2];
            p[j] = x1 * c[j] - x2 * s[j];
            p[j + h2] = x2 * c[j] + x1 * s[j];
        }
    }
}

/* RMSNorm of each of the n heads of v [n * hd] with one weight w [hd] (the q / k norm) */
static void gd_head_norm(float *v, int64_t n, int64_t hd, const float *w, float eps) {
    for (int64_t h = 0; h < n; h++) gd_rmsnorm(v + h * hd, w, v + h * hd, hd, eps);
}

/* The layer's features for a row at position p: its rope rows (cos, sin) and the first
   cached row it sees, lo (window w > 0: key j is seen iff j > p - w) */
static void gd_layer_at(const gd_model *m, int64_t i, int64_t p, const float **c,
                        const float **s, int64_t *lo) {
    const int64_t h2 = m->hd / 2, tab = m->rope_of ? m->rope_of[i] : 0;
    const int64_t w = m->window ? m->window[i] : 0;
    *c = m->cos + (tab * m->cap + p) * h2;
    *s = m->sin + (tab * m->cap + p) * h2;
    *lo = w > 0 && p - w + 1 > 0 ? p - w + 1 : 0;
}

/* float -> IEEE half, rounded to nearest even (as F16C's conversion and NumPy's cast;
   a NaN stays a quiet NaN) */
static inline uint16_t gd_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t s = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu;
    uint32_t m = x & 0x7fffffu, h, rem, half;
    if (e == 255) return (uint16_t)(s | 0x7c00u | (m ? 0x200u | (m >> 13) : 0));
    const int32_t E = (int32_t)e - 112;  /* the half's biased exponent */
    if (E >= 31) return (uint16_t)(s | 0x7c00u);
    if (E <= 0) {  /* a subnormal half (or zero): the significand shifted into place */
        if (E < -10) return (uint16_t)s;
        const int sh = 14 - E;
        m |= 0x800000u;
        h = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
    } else {
        h = ((uint32_t)E << 10) | (m >> 13), rem = m & 0x1fffu, half = 0x1000u;
    }
    if (rem > half || (rem == half && (h & 1))) h++;  /* a carry moves into the exponent */
    return (uint16_t)(s | h);
}

/* n floats as halves */
static void gd_f2h_row(uint16_t *d, const float *x, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__) && !defined(GV_EMULATE)
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(d + j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && !defined(GV_EMULATE)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(d + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) d[j] = gd_f2h(x[j]);
}

/* n floats as the cache's halves (the tests hold its rounding against NumPy's) */
void gd_halves(const float *x, int64_t n, uint16_t *out) { gd_f2h_row(out, x, n); }

/* a row's keys or values [nkv * hd] into a layer's cache c [nkv, cap, hd] at position p */
static void gd_cache_row(void *c, const gd_model *m, int64_t p, const float *row) {
    for (int64_t h = 0; h < m->nkv; h++) {
        void *at = gd_kv(m, c, (h * m->cap + p) * m->hd);
        if (m->kv16)
            gd_f2h_row((uint16_t *)at, row + h * m->hd, m->hd);
        else
            memcpy(at, row + h * m->hd, m->hd * sizeof(float));
    }
}

/* The softmax of the scores s [n] in place (soft-capped first where cap > 0): exp(s - max)
   times 1 / their sum.  The max and the sum in 8 and 4 lanes (vectorized; one chain's
   latency would set the pace): the max is the same whatever the order, the sum in double */
static void gd_softmax(float *s, int64_t n, float cap) {
    float mx = -INFINITY;
    int64_t p;
    if (cap > 0.0f)
        for (p = 0; p < n; p++) s[p] = tanhf(s[p] * (1.0f / cap)) * cap;  /* the graph's softcap */
    float m8[8];
    double d4[4] = {0.0, 0.0, 0.0, 0.0};
    for (int l = 0; l < 8; l++) m8[l] = -INFINITY;
    for (p = 0; p + 8 <= n; p += 8)
        for (int l = 0; l < 8; l++) m8[l] = s[p + l] > m8[l] ? s[p + l] : m8[l];
    for (; p < n; p++) mx = s[p] > mx ? s[p] : mx;
    for (int l = 0; l < 8; l++) mx = m8[l] > mx ? m8[l] : mx;
    for (p = 0; p < n; p++) s[p] = gt_expf(s[p] - mx);  /* vectorized */
    for (p = 0; p + 4 <= n; p += 4)
        for (int l = 0; l < 4; l++) d4[l] += s[p + l];
    double den = (d4[0] + d4[1]) + (d4[2] + d4[3]);
    for (; p < n; p++) den += s[p];
    const float inv = (float)(1.0 / den);
    for (p = 0; p < n; p++) s[p] *= inv;
}

/* The cache holds each key / value head's rows together ([kv head, position, hd]), and
   the query heads that share one are attended at once (at most GD_QH): a cached row is
   read once for all of them.  Each score and each output column is summed in the same
   order as for one head alone.  The rows come from memory (a step's weights pass through
   the caches between two steps): the scores' pass fetches the keys GD_AHEAD positions
   ahead, and the values it will read next.  H16 (a constant at each call, so that each
   cache type gets its own code): the rows are halves, widened exactly as they are read. */
#define GD_QH 4
#define GD_AHEAD 8
#define GD_INLINE static inline __attribute__((always_inline))

#ifdef GV_W
/* GV_W lanes from element e of cache rows c */
GD_INLINE gv_f gd_kv_lanes(const void *c, int64_t e, const int H16) {
    return H16 ? gv_f16((const uint8_t *)c + 2 * e) : gv_load((const float *)c + e);
}

/* s[h * ss + p] = (q_h . k_p) * iscale for the nq heads q [nq, hd] and rows k [n, hd]:
   each dot in GV_W lanes over hd, then gv_sum; P positions at a time (independent sums:
   one sum's FMAs wait on each other) */
GD_INLINE void gd_scores(const float *q, const int nq, const void *k, const void *v,
                         int64_t n, int64_t hd, float iscale, float *s, int64_t ss,
                         const int H16) {
    enum { PMAX = 4 };
    const int P = nq == 1 ? 4 : 2, es = H16 ? 2 : 4;  /* es: bytes an element */
    int64_t p = 0;
    for (; p + P <= n; p += P) {
        const char *kb = (const char *)k + p * hd * es, *vb = (const char *)v + p * hd * es;
        for (int64_t b = 0; b < P * hd * es; b += 64) {
            if (p + GD_AHEAD + P <= n) __builtin_prefetch(kb + GD_AHEAD * hd * es + b);
            __builtin_prefetch(vb + b);
        }
        gv_f a[GD_QH][PMAX];
        for (int h = 0; h < nq; h++)
            for (int r = 0; r < P; r++) a[h][r] = gv_zero();
        for (int64_t j = 0; j < hd; j += GV_W) {
            gv_f x[PMAX];
            for (int r = 0; r < P; r++) x[r] = gd_kv_lanes(k, (p + r) * hd + j, H16);
            for (int h = 0; h < nq; h++) {
                const gv_f qv = gv_load(q + h * hd + j);
                for (int r = 0; r < P; r++) a[h][r] = gv_fma(qv, x[r], a[h][r]);
            }
        }
        for (int h = 0; h < nq; h++)
            for (int r = 0; r < P; r++) s[h * ss + p + r] = gv_sum(a[h][r]) * iscale;
    }
    for (; p < n; p++)
        for (int h = 0; h < nq; h++) {
            gv_f a = gv_zero();
            for (int64_t j = 0; j < hd; j += GV_W)
                a = gv_fma(gv_load(q + h * hd + j), gd_kv_lanes(k, p * hd + j, H16), a);
            s[h * ss + p] = gv_sum(a) * iscale;
        }
}

/* columns j0 .. j0 + C GV_W of o [nq, hd] = sum over p of w[h * ss + p] v_p, rows v [n, hd]:
   those columns of every head in registers a pass over the rows (a fused multiply-add a
   position, in the positions' order) */
GD_INLINE void gd_values_pass(const float *w, int64_t ss, const int nq, const void *v,
                              int64_t n, int64_t hd, int64_t j0, const int C, float *o,
                              const int H16) {
    enum { CMAX = 8 };
    gv_f a[GD_QH][CMAX];
    for (int h = 0; h < nq; h++)
        for (int c = 0; c < C; c++) a[h][c] = gv_zero();
    for (int64_t p = 0; p < n; p++) {
        gv_f x[CMAX];
        for (int c = 0; c < C; c++) x[c] = gd_kv_lanes(v, p * hd + j0 + c * GV_W, H16);
        for (int h = 0; h < nq; h++) {
            const gv_f wp = gv_set1(w[h * ss + p]);
            for (int c = 0; c < C; c++) a[h][c] = gv_fma(wp, x[c], a[h][c]);
        }
    }
    for (int h = 0; h < nq; h++)
        for (int c = 0; c < C; c++) gv_store(o + h * hd + j0 + c * GV_W, a[h][c]);
}

/* o [nq, hd] = sum over p of w[h * ss + p] v_p: passes of 8 vectors of columns for one
   head, 4 for more (each pass loads every row's weights again), then of 2 and 1 */
GD_INLINE void gd_values(const float *w, int64_t ss, const int nq, const void *v, int64_t n,
                         int64_t hd, float *o, const int H16) {
    const int C = nq == 1 ? 8 : 4;
    int64_t j0 = 0;
    for (; j0 + C * GV_W <= hd; j0 += C * GV_W)
        gd_values_pass(w, ss, nq, v, n, hd, j0, C, o, H16);
    for (; j0 + 2 * GV_W <= hd; j0 += 2 * GV_W)
        gd_values_pass(w, ss, nq, v, n, hd, j0, 2, o, H16);
    for (; j0 + GV_W <= hd; j0 += GV_W) gd_values_pass(w, ss, nq, v, n, hd, j0, 1, o, H16);
}
#else
/* element e of cache rows c */
GD_INLINE float gd_kv_at(const void *c, int64_t e, const int H16) {
    return H16 ? gb_h2f_bits((const uint8_t *)c + 2 * e) : ((const float *)c)[e];
}
GD_INLINE void gd_scores(const float *q, const int nq, const void *k, const void *v,
                         int64_t n, int64_t hd, float iscale, float *s, int64_t ss,
                         const int H16) {
    (void)v;
    for (int h = 0; h < nq; h++)
        for (int64_t p = 0; p < n; p++) {
            float a[16] = {0};
            for (int64_t j = 0; j < hd; j += 16)
                for (int l = 0; l < 16; l++)
                    a[l] += q[h * hd + j + l] * gd_kv_at(k, p * hd + j + l, H16);
            s[h * ss + p] = gv_hsum(a) * iscale;
        }
}
GD_INLINE void gd_values(const float *w, int64_t ss, const int nq, const void *v, int64_t n,
                         int64_t hd, float *o, const int H16) {
    for (int h = 0; h < nq; h++) {
        for (int64_t j = 0; j < hd; j++) o[h * hd + j] = 0.0f;
        for (int64_t p = 0; p < n; p++)
            for (int64_t j = 0; j < hd; j++)
                o[h * hd + j] += w[h * ss + p] * gd_kv_at(v, p * hd + j, H16);
    }
}
#endif

/* nq <= GD_QH query heads q [nq, hd] that share one key / value head, over its first n
   cached rows k, v [n, hd]: o [nq, hd] = softmax(q_h k_p * iscale) v_p; s [nq, ss] holds
   the scores.  hd is a multiple of 16. */
GD_INLINE void gd_heads(const float *q, const int nq, const void *k, const void *v,
                        int64_t n, int64_t hd, float iscale, float cap, float *s, int64_t ss,
                        float *o, const int H16) {
    gd_scores(q, nq, k, v, n, hd, iscale, s, ss, H16);
    for (int h = 0; h < nq; h++) gd_softmax(s + h * ss, n, cap);
    gd_values(s, ss, nq, v, n, hd, o, H16);
}

/* gd_heads for any number of heads sharing a key head, GD_QH at a time */
GD_INLINE void gd_attend_as(const float *q, int64_t nq, const void *k, const void *v,
                            int64_t n, int64_t hd, float iscale, float cap, float *s,
                            int64_t ss, float *o, const int H16) {
    for (; nq > GD_QH; nq -= GD_QH, q += GD_QH * hd, s += GD_QH * ss, o += GD_QH * hd)
        gd_heads(q, GD_QH, k, v, n, hd, iscale, cap, s, ss, o, H16);
    switch (nq) {  /* each count its own code: the sums stay in registers */
    case 1: gd_heads(q, 1, k, v, n, hd, iscale, cap, s, ss, o, H16); break;
    case 2: gd_heads(q, 2, k, v, n, hd, iscale, cap, s, ss, o, H16); break;
    case 3: gd_heads(q, 3, k, v, n, hd, iscale, cap, s, ss, o, H16); break;
    default: gd_heads(q, 4, k, v, n, hd, iscale, cap, s, ss, o, H16); break;
    }
}

/* ... over the model's cache rows (float32 or halves) */
static void gd_attend(const gd_model *m, const float *q, int64_t nq, const void *k,
                      const void *v, int64_t n, float *s, int64_t ss, float *o) {
    if (m->kv16)
        gd_attend_as(q, nq, k, v, n, m->hd, m->iscale, m->attn_softcap, s, ss, o, 1);
    else
        gd_attend_as(q, nq, k, v, n, m->hd, m->iscale, m->attn_softcap, s, ss, o, 0);
}

/* silu as ops/ computes it: g * sigmoid(g), sigmoid = 1 / (1 + exp(-g)) */
static inline float gd_silu(float g) { return g * (1.0f / (1.0f + gt_expf(-g))); }

/* the gated activation of mlp[j] (gate) and up[j]: silu, or GeGLU as nn.gelu_tanh
   computes it (tanh approximation, sqrt(2/pi) = 0.7978845608028654) */
static inline float gd_act(const gd_model *m, float g, float u) {
    if (!m->geglu) return gd_silu(g) * u;
    const float inner = (g + g * g * g * 0.044715f) * 0.7978845608028654f;
    return g * 0.5f * (tanhf(inner) + 1.0f) * u;
}

/* x[n] += rmsnorm(a) * w (a post-norm: Gemma's norm of the attention or MLP output) */
static void gd_post_add(float *x, float *a, const float *w, int64_t n, float eps) {
    gd_rmsnorm(a, w, a, n, eps);
    for (int64_t j = 0; j < n; j++) x[j] += a[j];
}

/* in place: x *= embed_scale for n floats (0: no scale) */
static void gd_embed_scale(const gd_model *m, float *x, int64_t n) {
    if (m->embed_scale != 0.0f)
        for (int64_t j = 0; j < n; j++) x[j] *= m->embed_scale;
}

/* x[t, r] += h[t, r] (t < T) for this thread's share of L's rows (gd_linear's split) */
static void gd_add_rows(const gd_lin *L, const float *h, float *x, int64_t T) {
    int64_t r0 = 0, r1 = L->rows;
#ifdef _OPENMP
    gv_share(L->rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
#endif
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = r0; r < r1; r++) x[t * L->rows + r] += h[t * L->rows + r];
}

/* x += y Wout (+ bias), or with a post-norm w (layer i of it; NULL: none) x +=
   rmsnorm(y Wout) * w through h; every member of the team calls it, and it ends with a
   barrier */
static void gd_residual(const gd_team *tm, const gd_model *m, const gd_lin *L, const float *y,
                        const gq_row *yq, const float *t, float *x, float *h,
                        const float *post, int64_t i) {
    if (!post) {
        if (L->col) {  /* DoRA: the scaled rows through h, each thread its own */
            gd_linear(L, y, yq, t, h, 0);
            gd_add_rows(L, h, x, 1);
        } else {
            gd_linear(L, y, yq, t, x, 1);  /* each row of x owned by one thread */
        }
        gd_sync(tm);
        return;
    }
    gd_linear(L, y, yq, t, h, 0);
    gd_sync(tm);
    if (tm->tid == 0) gd_post_add(x, h, post + i * m->dim, m->dim, m->eps);
    gd_sync(tm);
}

/* logits = cap tanh(logits / cap) where the family caps them; every thread calls it */
static void gd_final_cap(const gd_model *m, float *logits) {
    if (!(m->final_softcap > 0.0f)) return;
    GD_BARRIER
    GD_FOR
    for (int64_t r = 0; r < m->vocab; r++)
        logits[r] = tanhf(logits[r] * (1.0f / m->final_softcap)) * m->final_softcap;
}

/* logits[vocab] of `token` at position `pos` (< cap); the caches get row pos. */
void gd_step(const gd_model *m, int64_t token, int64_t pos, float *logits) {
    const int64_t D = m->dim, hd = m->hd, nh = m->nh, nkv = m->nkv, F = m->ffn;
    const int64_t kvw = nkv * hd, g = nh / nkv, n = pos + 1;
    float *x = m->scratch, *h = x + D, *q = h + D, *k = q + nh * hd, *v = k + kvw;
    float *att = v + kvw, *mlp = att + nh * hd, *up = mlp + F, *t = up + F;
    float *sc = t + 256;
    float *tq = t, *tk = t + 64, *tv = t + 128, *tu = t + 192;  /* LoRA t per target */
    /* the 8-bit input row the threads share: each quantization is one thread's, between
       barriers (the products that read the previous one have finished) */
    gq_row xr;
    gq_init(&xr, sc + nh * (m->cap + 1), gd_kmax(m));
    gd_bar bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.gen, 0);
    gv_take_rows(m->embd.type, m->embd.w, D, m->embd.row_bytes, &token, 1, x);
    gd_embed_scale(m, x, D);
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)m->nthreads)
#endif
    {
#ifdef _OPENMP
    const gd_team team = {omp_get_thread_num(), omp_get_num_threads(), &bar}, *tm = &team;
#else
    const gd_team team = {0, 1, &bar}, *tm = &team;
#endif
    const int lead = tm->tid == 0;  /* the member that runs the one-thread parts */
    for (int64_t i = 0; i < m->n_layers; i++) {
        const gd_lin *L = m->lin + i * GD_NLIN;
        void *kc = gd_kv(m, m->kc, i * m->cap * kvw), *vc = gd_kv(m, m->vc, i * m->cap * kvw);
        const float *cs, *sn;
        int64_t lo, a, b;
        gd_layer_at(m, i, pos, &cs, &sn, &lo);
        const int nqkv = gd_need(m, &L[GD_Q], &L[GD_K], &L[GD_V]), no = gd_need(m, &L[GD_O], 0, 0);
        const int nffn = gd_need(m, &L[GD_GATE], &L[GD_UP], 0), nd = gd_need(m, &L[GD_DOWN], 0, 0);
        /* the attention's output quantized head by head where its form has blocks of 32
           that tile a head (no barrier of its own) */
        const int ohead = no == GQ_Q80 && hd % 32 == 0;
        gd_norm_q(tm, x, m->attn_norm + i * D, h, D, m->eps, &xr, nqkv);
        gd_sync(tm);
        gd_lora_ts(tm, &L[GD_Q], &L[GD_K], &L[GD_V], h, tq, tk, tv);
        gd_linear(&L[GD_Q], h, &xr, tq, q, 0);
        gd_linear(&L[GD_K], h, &xr, tk, k, 0);
        gd_linear(&L[GD_V], h, &xr, tv, v, 0);
        gd_sync(tm);
        if (lead) {
            if (m->q_norm) {
                gd_head_norm(q, nh, hd, m->q_norm + i * hd, m->eps);
                gd_head_norm(k, nkv, hd, m->k_norm + i * hd, m->eps);
            }
            gd_rope(q, nh, hd, cs, sn);
            gd_rope(k, nkv, hd, cs, sn);
            gd_cache_row(kc, m, pos, k);
            gd_cache_row(vc, m, pos, v);
            xr.k = nh * hd;  /* filled head by head below */
            xr.have = ohead ? GQ_Q80 : 0;
        }
        gd_sync(tm);
        gd_part(tm, nh, &a, &b);
        for (int64_t qh = a, e; qh < b; qh = e) {  /* the heads of one key head at once */
            const int64_t kh = qh / g, at = (kh * m->cap + lo) * hd;
            e = (kh + 1) * g < b ? (kh + 1) * g : b;
            gd_attend(m, q + qh * hd, e - qh, gd_kv(m, kc, at), gd_kv(m, vc, at), n - lo,
                      sc + qh * (m->cap + 1), m->cap + 1, att + qh * hd);
            for (int64_t h = qh; ohead && h < e; h++) {
                gq_q8_0(att + h * hd, hd, xr.q0 + h * hd, xr.d0 + h * hd / 32,
                        xr.s0 + h * hd / 32, xr.z0 + h * hd / 4);
                gq_q8_0_pairs(&xr, h * hd / 32, (h + 1) * hd / 32);
            }
        }
        gd_sync(tm);
        if (no && !ohead) {
            if (lead) gq_quantize(&xr, att, nh * hd, no);
            gd_sync(tm);
        }
        gd_lora_ts(tm, &L[GD_O], 0, 0, att, tq, 0, 0);
        gd_residual(tm, m, &L[GD_O], att, &xr, tq, x, h, m->post_attn_norm, i);
        gd_norm_q(tm, x, m->ffn_norm + i * D, h, D, m->eps, &xr, nffn);
        gd_sync(tm);
        gd_lora_ts(tm, &L[GD_GATE], &L[GD_UP], 0, h, tk, tu, 0);
        gd_linear(&L[GD_GATE], h, &xr, tk, mlp, 0);
        gd_linear(&L[GD_UP], h, &xr, tu, up, 0);
        gd_sync(tm);
        gd_span(tm, F, nd, &a, &b);  /* the activation and its 8-bit row, in shares */
        for (int64_t j = a; j < b; j++) mlp[j] = gd_act(m, mlp[j], up[j]);
        gq_quantize_span(&xr, mlp, F, nd, a, b);
        if (lead) {
            xr.k = F;
            xr.have = gq_forms(F, nd);
        }
        gd_sync(tm);
        gd_lora_ts(tm, &L[GD_DOWN], 0, 0, mlp, tv, 0, 0);
        gd_residual(tm, m, &L[GD_DOWN], mlp, &xr, tv, x, h, m->post_ffn_norm, i);
    }
    gd_norm_q(tm, x, m->norm, h, D, m->eps, &xr, gd_need(m, &m->head, 0, 0));
    gd_sync(tm);
    gd_linear(&m->head, h, &xr, 0, logits, 0);
    if (m->final_softcap > 0.0f) {  /* logits = cap tanh(logits / cap) */
        int64_t a, b;
        gd_sync(tm);
        gd_part(tm, m->vocab, &a, &b);
        for (int64_t r = a; r < b; r++)
            logits[r] = tanhf(logits[r] * (1.0f / m->final_softcap)) * m->final_softcap;
    }
    }
}

/* --- prefill: T new rows at positions start .. start+T-1 in one call -------------------
   The same layer math as gd_step on T rows at once: the linears are GEMMs from the
   blocks (gv_gemm_rows: GV_PANEL weight rows dequantized once per call and used by all T
   rows), row operations split over rows, attention (causal: row t sees positions
   <= start + t) split over rows and key heads, each row's query heads of a key head at
   once.  Only the last row's logits are computed.
   With m->q8, the products whose weight type an integer GEMM takes here (gq_gemm_type:
   the AMX types where AMX-INT8 runs, the K-quants elsewhere on x86 and the 32-element
   types at the AVX2 class, IQ2_XXS to IQ4_XS wherever AVX2 runs) read their input rows quantized to 8 bits instead (Q8_0 or Q8_K),
   as the steps do (q8_gemm.c: the same scheme as q8_dots.c's dots); the other types keep
   float32 rows. */

/* the 8-bit rows [Tp, k] of a linear's input (Tp: T up to a multiple of 16, zero rows
   past T): Q8_0's d and s [Tp, k/32], or Q8_K's d [Tp, k/256] with s holding the int16
   sums the GEMM reads (gq_gemm_sums); the GEMM's per-thread scratch; q NULL: not used */
typedef struct {
    int8_t *q;
    float *d, *s;
    uint8_t *scratch;
    int64_t scratch_bytes;
} gd_x8;

static int64_t gd_pad16(int64_t T) { return (T + 15) / 16 * 16; }

/* the attention's scores: g = nh / nkv rows of cap + 1 for each thread */
static int64_t gd_prefill_scores(const gd_model *m) {
    return m->nthreads * (m->nh / m->nkv) * (m->cap + 1);
}

int64_t gd_prefill_floats(const gd_model *m, int64_t T) {
    const int64_t qw = m->nh * m->hd, kw = m->nkv * m->hd, kmax = gd_kmax(m);
    const int64_t tp = gd_pad16(T);
    const int64_t x8 = tp * kmax + 8 * tp * (kmax / 32) + 64   /* the Q8_0 rows (bytes) */
                       + m->nthreads * ((gq_gemm_scratch_bytes(kmax) + 63) / 64 * 64);
    return T * (2 * m->dim + 2 * qw + 2 * kw + 2 * m->ffn + 256) + gd_prefill_scores(m)
           + m->nthreads * GV_TILE(kmax) + (x8 + 3) / 4;
}

/* whether L's product runs on the quantized rows of form f (GQ_Q80, GQ_Q8K; 0: none):
   the integer GEMM takes its type, against rows of that form */
static int gd_int8(const gd_x8 *x8, const gd_lin *L, int f) {
    return x8->q && f && gq_gemm_type(L->type) == f;
}

/* the form of the quantized rows the linears a, b, c (one input) read: the first's that
   the integer GEMM takes (the others of another form keep float32 rows); 0: none */
static int gd_form(const gd_x8 *x8, const gd_lin *a, const gd_lin *b, const gd_lin *c) {
    if (!x8->q) return 0;
    return gq_gemm_type(a->type) ? gq_gemm_type(a->type)
           : gq_gemm_type(b->type) ? gq_gemm_type(b->type) : gq_gemm_type(c->type);
}

/* X [T, k]'s rows in form f into x8 (zero rows T .. Tp), split over the threads */
static void gd_quantize_T(const gd_x8 *x8, const float *X, int64_t T, int64_t k, int f) {
    const int k8 = f == GQ_Q8K, per = gq_gemm_sums();
    const int64_t nd = k8 ? k / 256 : k / 32, ns = k8 ? k / per * 2 : k / 32 * 4;  /* d, s bytes */
    GD_FOR
    for (int64_t t = 0; t < gd_pad16(T); t++) {
        if (t < T && k8) {
            gq_q8_k_rows(X, t, t + 1, k, x8->q, x8->d, (int16_t *)(void *)x8->s, per);
        } else if (t < T) {
            gq_q8_0_rows(X, t, t + 1, k, x8->q, x8->d, x8->s);
        } else {
            memset(x8->q + t * k, 0, k);
            memset(x8->d + t * nd, 0, nd * sizeof(float));
            memset((uint8_t *)x8->s + t * ns, 0, ns);
        }
    }
}

/* Y[T, rows] (+)= X W^T (+ scale * (X A) B, with X A given per row in lt + slot*64);
   the base product from x8's quantized rows where gd_int8 says so. */
static void gd_linear_T(const gd_lin *L, const float *X, int64_t T, const float *lt,
                        int slot, float *Y, int acc, float *tile, const gd_x8 *x8, int f) {
    int64_t r0 = 0, r1 = L->rows;
    int tid = 0;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    gv_share(L->rows, tid, omp_get_num_threads(), &r0, &r1);
#endif
    if (gd_int8(x8, L, f)) {
        if (r0 < r1)
            gq_gemm_rows(L->type, L->w, L->row_bytes, L->k, r0, r1, x8->q, x8->d, x8->s,
                         T, Y, L->rows, acc, x8->scratch + tid * x8->scratch_bytes);
    } else {
        gv_gemm_rows(L->type, L->w, L->row_bytes, L->k, r0, r1, X, T, Y, L->rows, acc, tile);
    }
    if (L->at)
        for (int64_t t = 0; t < T; t++) gd_lora_b(L, lt + t * 256 + slot * 64, Y + t * L->rows, r0, r1);
    if (L->col)  /* DoRA (acc = 0: gd_residual_T adds it) */
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = r0; r < r1; r++) Y[t * L->rows + r] *= L->col[r];
    if (L->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = r0; r < r1; r++) Y[t * L->rows + r] += L->bias[r];
}

/* gd_residual on T rows: X += Y Wout, or X += rmsnorm(Y Wout) * w row by row through H */
static void gd_residual_T(const gd_model *m, const gd_lin *L, const float *Y, int64_t T,
                          const float *lt, int slot, float *X, float *H, const float *post,
                          int64_t i, float *tile, const gd_x8 *x8, int f) {
    if (!post) {
        if (L->col) {  /* DoRA: the scaled rows through H, each thread its own */
            gd_linear_T(L, Y, T, lt, slot, H, 0, tile, x8, f);
            gd_add_rows(L, H, X, T);
        } else {
            gd_linear_T(L, Y, T, lt, slot, X, 1, tile, x8, f);
        }
        GD_BARRIER
        return;
    }
    gd_linear_T(L, Y, T, lt, slot, H, 0, tile, x8, f);
    GD_BARRIER
    GD_FOR
    for (int64_t t = 0; t < T; t++)
        gd_post_add(X + t * m->dim, H + t * m->dim, post + i * m->dim, m->dim, m->eps);
}

/* logits[vocab] of the last of `tokens[T]` placed at positions start .. (logits NULL:
   none); the caches get rows start .. start + T - 1.  `buf` holds gd_prefill_floats(m, T) floats. */
void gd_prefill(const gd_model *m, const int64_t *tokens, int64_t T, int64_t start,
                float *logits, float *buf) {
    const int64_t D = m->dim, hd = m->hd, nh = m->nh, nkv = m->nkv, F = m->ffn;
    const int64_t qw = nh * hd, kvw = nkv * hd, g = nh / nkv;
    float *x = buf, *h = x + T * D, *q = h + T * D, *k = q + T * qw, *v = k + T * kvw;
    float *att = v + T * kvw, *mlp = att + T * qw, *up = mlp + T * F, *lt = up + T * F;
    float *sc = lt + T * 256, *tiles = sc + gd_prefill_scores(m);
    const int64_t kmax = gd_kmax(m), tp = gd_pad16(T);
    gd_x8 x8 = {0};
    if (m->q8) {  /* the 8-bit rows after the float32 tiles */
        uint8_t *b8 = (uint8_t *)(((uintptr_t)(tiles + m->nthreads * GV_TILE(kmax)) + 63)
                                  & ~(uintptr_t)63);
        x8.q = (int8_t *)b8;
        x8.d = (float *)(b8 + tp * kmax);
        x8.s = x8.d + tp * (kmax / 32);
        x8.scratch = (uint8_t *)(x8.s + tp * (kmax / 32));
        x8.scratch_bytes = (gq_gemm_scratch_bytes(kmax) + 63) / 64 * 64;
    }
#define GD_FORM(a, b, c) gd_form(&x8, &L[a], &L[b], &L[c])
    gv_take_rows(m->embd.type, m->embd.w, D, m->embd.row_bytes, tokens, T, x);
    gd_embed_scale(m, x, T * D);
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)m->nthreads)
#endif
    {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
#else
    const int tid = 0;
#endif
    float *tile = tiles + tid * GV_TILE(kmax), *scores = sc + tid * g * (m->cap + 1);
    for (int64_t i = 0; i < m->n_layers; i++) {
        const gd_lin *L = m->lin + i * GD_NLIN;
        void *kc = gd_kv(m, m->kc, i * m->cap * kvw), *vc = gd_kv(m, m->vc, i * m->cap * kvw);
        GD_FOR
        for (int64_t t = 0; t < T; t++) {
            gd_rmsnorm(x + t * D, m->attn_norm + i * D, h + t * D, D, m->eps);
            if (L[GD_Q].at) gd_lora_t(&L[GD_Q], h + t * D, lt + t * 256);
            if (L[GD_K].at) gd_lora_t(&L[GD_K], h + t * D, lt + t * 256 + 64);
            if (L[GD_V].at) gd_lora_t(&L[GD_V], h + t * D, lt + t * 256 + 128);
        }
        int f = GD_FORM(GD_Q, GD_K, GD_V);
        if (f) gd_quantize_T(&x8, h, T, D, f);
        gd_linear_T(&L[GD_Q], h, T, lt, 0, q, 0, tile, &x8, f);
        gd_linear_T(&L[GD_K], h, T, lt, 1, k, 0, tile, &x8, f);
        gd_linear_T(&L[GD_V], h, T, lt, 2, v, 0, tile, &x8, f);
        GD_BARRIER
        GD_FOR
        for (int64_t t = 0; t < T; t++) {
            const int64_t p = start + t;
            const float *cs, *sn;
            int64_t lo;
            gd_layer_at(m, i, p, &cs, &sn, &lo);
            if (m->q_norm) {
                gd_head_norm(q + t * qw, nh, hd, m->q_norm + i * hd, m->eps);
                gd_head_norm(k + t * kvw, nkv, hd, m->k_norm + i * hd, m->eps);
            }
            gd_rope(q + t * qw, nh, hd, cs, sn);
            gd_rope(k + t * kvw, nkv, hd, cs, sn);
            gd_cache_row(kc, m, p, k + t * kvw);
            gd_cache_row(vc, m, p, v + t * kvw);
        }
        /* a row's query heads that share a key head at once (each cached row read once for
           them); rows dealt round-robin, as their cost grows with t */
        GD_FOR_DEALT
        for (int64_t u = 0; u < nkv * T; u++) {
            const int64_t kh = u / T, t = u % T;  /* causal: row t sees lo .. start + t */
            const float *cs, *sn;
            int64_t lo;
            gd_layer_at(m, i, start + t, &cs, &sn, &lo);
            const int64_t at = (kh * m->cap + lo) * hd, o = t * qw + kh * g * hd;
            gd_attend(m, q + o, g, gd_kv(m, kc, at), gd_kv(m, vc, at), start + t + 1 - lo,
                      scores, m->cap + 1, att + o);
        }
        if (L[GD_O].at) {
            GD_FOR
            for (int64_t t = 0; t < T; t++) gd_lora_t(&L[GD_O], att + t * qw, lt + t * 256);
        }
        f = GD_FORM(GD_O, GD_O, GD_O);
        if (f) gd_quantize_T(&x8, att, T, qw, f);
        gd_residual_T(m, &L[GD_O], att, T, lt, 0, x, h, m->post_attn_norm, i, tile, &x8, f);
        GD_FOR
        for (int64_t t = 0; t < T; t++) {
            gd_rmsnorm(x + t * D, m->ffn_norm + i * D, h + t * D, D, m->eps);
            if (L[GD_GATE].at) gd_lora_t(&L[GD_GATE], h + t * D, lt + t * 256 + 64);
            if (L[GD_UP].at) gd_lora_t(&L[GD_UP], h + t * D, lt + t * 256 + 192);
        }
        f = GD_FORM(GD_GATE, GD_UP, GD_UP);
        if (f) gd_quantize_T(&x8, h, T, D, f);
        gd_linear_T(&L[GD_GATE], h, T, lt, 1, mlp, 0, tile, &x8, f);
        gd_linear_T(&L[GD_UP], h, T, lt, 3, up, 0, tile, &x8, f);
        GD_BARRIER
        if (m->geglu) {
            GD_FOR
            for (int64_t j = 0; j < T * F; j++) mlp[j] = gd_act(m, mlp[j], up[j]);
        } else {  /* silu's loop apart, without the branch: vectorized */
            GD_FOR
            for (int64_t j = 0; j < T * F; j++) mlp[j] = gd_silu(mlp[j]) * up[j];
        }
        if (L[GD_DOWN].at) {
            GD_FOR
            for (int64_t t = 0; t < T; t++) gd_lora_t(&L[GD_DOWN], mlp + t * F, lt + t * 256 + 128);
        }
        f = GD_FORM(GD_DOWN, GD_DOWN, GD_DOWN);
        if (f) gd_quantize_T(&x8, mlp, T, F, f);
        gd_residual_T(m, &L[GD_DOWN], mlp, T, lt, 2, x, h, m->post_ffn_norm, i, tile, &x8, f);
    }
    if (logits) {  /* NULL: a chunk before the prompt's last, whose logits nobody reads */
        GD_SINGLE
        gd_rmsnorm(x + (T - 1) * D, m->norm, h, D, m->eps);
        gd_linear(&m->head, h, 0, 0, logits, 0);
        gd_final_cap(m, logits);
    }
    }
}
