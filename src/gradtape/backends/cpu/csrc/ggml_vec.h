/* ggml_vec.c's functions that the decode step (llama_decode.c) calls. */
#ifndef GT_GGML_VEC_H
#define GT_GGML_VEC_H
#include <stdint.h>

/* the 16 lane accumulators of a row summed pairwise in a fixed order, independent of
   the CPU: (((a0+a8)+(a4+a12)) + ...) */
static inline float gv_hsum(const float *a) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

void gv_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
             int64_t r0, int64_t r1, const float *x, int64_t T, int64_t ldx,
             float *y, int64_t ldy, int accumulate);
void gv_share(int64_t rows, int64_t tid, int64_t nt, int64_t *r0, int64_t *r1);
/* weight rows gv_gemm_rows dequantizes at a time: its `tile` holds GV_TILE(k) floats
   (ggml_vec.py's PANEL and TILE_EXTRA are the same numbers) */
#define GV_PANEL 16
#define GV_TILE(k) (GV_PANEL * (k) + 2048)
#define GV_PANEL_FLOATS 8192  /* at most this many floats a panel (32 KB: L1 with X) */
void gv_gemm_rows(int64_t type, const uint8_t *W, int64_t row_bytes, int64_t k,
                  int64_t r0, int64_t r1, const float *X, int64_t T, float *Y,
                  int64_t ldy, int accumulate, float *tile);
void gv_take_rows(int64_t type, const uint8_t *W, int64_t k, int64_t row_bytes,
                  const int64_t *ids, int64_t n, float *out);
#endif
