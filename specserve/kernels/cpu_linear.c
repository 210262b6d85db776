/* Linear layers for x86 CPUs with AVX2 and FMA, float32 activations, weights in int8 (one
 * scale per output column: weight-only quantization) or in float32:
 *     y[m, n] = (scale[n] *) sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * Batch invariance by construction: every output is one sequential chain of fused
 * multiply-adds over k = 0 .. K-1, started from zero, then scaled. The lanes of a vector hold
 * different columns (never different k), so neither the number of rows, nor the tile a row
 * lands in, nor the thread that computes it changes a single bit of the result: a token gets
 * the same logits in a one-row decode step, a verification batch or a prefill chunk.
 *
 * Weights come packed (specserve.kernels.cpu_linear) in strips of 8 columns, k-major inside a
 * strip ([N / 8][K][8]): a tile of C vectors reads C sequential streams and uses every byte of
 * every cache line it pulls, whatever its number of rows. N is padded to a multiple of BLOCK
 * with zero columns that are never written out; threads split blocks of BLOCK columns.
 * float32 weights stream at memory speed where MKL's GEMM, on an AVX2-only AMD CPU, took
 * twice as long at one row and ~4x at 2-16 rows (benchmarks/cpu_linear.py).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64 /* columns per block: 8 vectors of 8 floats */

static inline __m256 widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* R rows x C vectors (8 columns each) of one block, starting at column vector c0; weights int8
 * (Q) or float32; scale NULL: none. */
static inline __attribute__((always_inline)) void tile(
        int R, int C, int Q, const float *x, int64_t ldx, int64_t K, const void *wb, int c0,
        const float *scale, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {
    __m256 acc[6][8];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int8_t *wq = (const int8_t *)wb + (int64_t)c0 * 8 * K;
    const float *wf = (const float *)wb + (int64_t)c0 * 8 * K;
    for (int64_t k = 0; k < K; k++, wq += 8, wf += 8) {
        __m256 wv[8];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) wv[c] = Q ? widen(wq + c * 8 * K) : _mm256_loadu_ps(wf + c * 8 * K);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    /* scale, then add the bias: two roundings, the same for every row */
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        int64_t n = n0 + 8 * (c0 + c);
        if (n >= N) continue;
        if (N - n >= 8) {
            __m256 bv = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
            if (scale) {
                __m256 sv = _mm256_loadu_ps(scale + n);
#pragma GCC unroll 6
                for (int r = 0; r < R; r++) acc[r][c] = _mm256_mul_ps(acc[r][c], sv);
            }
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy + n, _mm256_add_ps(acc[r][c], bv));
        } else { /* the last, partial vector of columns */
            float out[8], s[8] = {1, 1, 1, 1, 1, 1, 1, 1}, b[8] = {0};
            int valid = (int)(N - n);
            if (scale) memcpy(s, scale + n, valid * sizeof(float));
            if (bias) memcpy(b, bias + n, valid * sizeof(float));
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(acc[r][c], _mm256_loadu_ps(s)),
                                                    _mm256_loadu_ps(b)));
                memcpy(y + r * ldy + n, out, valid * sizeof(float));
            }
        }
    }
}

/* Each tile shape its own function, so that the compiler keeps every shape's accumulators
 * in registers (inlined into one function, some shapes spilled them to the stack). */
#define TILE_FN(R, C, Q)                                                                     \
    static __attribute__((noinline)) void tile_##R##x##C##_##Q(                              \
            const float *x, int64_t ldx, int64_t K, const void *wb, int c0,                  \
            const float *scale, const float *bias, int64_t n0, int64_t N, float *y,          \
            int64_t ldy) {                                                                   \
        tile(R, C, Q, x, ldx, K, wb, c0, scale, bias, n0, N, y, ldy);                        \
    }
#define TILES(Q) TILE_FN(6, 2, Q) TILE_FN(4, 2, Q) TILE_FN(2, 4, Q) TILE_FN(1, 8, Q)
TILES(0)
TILES(1)

/* One block of BLOCK columns for all M rows: groups of 6 rows (2 vectors at a time), then
 * the rest with tiles that keep 8 accumulators busy. */
#define BLOCK_ROWS(Q)                                                                        \
    static void block_rows_##Q(const float *x, int64_t M, int64_t ldx, int64_t K, const void *wb,  \
                               const float *scale, const float *bias, int64_t n0, int64_t N,       \
                               float *y, int64_t ldy) {                                      \
        int64_t m = 0;                                                                       \
        for (; m + 6 <= M; m += 6)                                                           \
            for (int c0 = 0; c0 < 8; c0 += 2)                                                \
                tile_6x2_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy); \
        if (m + 4 <= M) {                                                                    \
            for (int c0 = 0; c0 < 8; c0 += 2)                                                \
                tile_4x2_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy); \
            m += 4;                                                                          \
        }                                                                                    \
        if (m + 2 <= M) {                                                                    \
            for (int c0 = 0; c0 < 8; c0 += 4)                                                \
                tile_2x4_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy); \
            m += 2;                                                                          \
        }                                                                                    \
        if (m < M)                                                                           \
            tile_1x8_##Q(x + m * ldx, ldx, K, wb, 0, scale, bias, n0, N, y + m * ldy, ldy);  \
    }
BLOCK_ROWS(0)
BLOCK_ROWS(1)

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weights, scaled by
 * `scale` (NULL: none), plus `bias` (NULL: none). The two entry points differ in weight type. */
#define LINEAR(NAME, WT, Q)                                                                      \
    void NAME(const float *x, int64_t M, int64_t K, int64_t ldx, const WT *packed, int64_t N,     \
              const float *scale, const float *bias, float *y, int64_t ldy, int threads) {        \
        int64_t blocks = (N + BLOCK - 1) / BLOCK;                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
        for (int64_t b = 0; b < blocks; b++)                                                      \
            block_rows_##Q(x, M, ldx, K, packed + b * K * BLOCK, scale, bias, b * BLOCK, N, y, ldy); \
    }
LINEAR(int8_linear, int8_t, 1)
LINEAR(f32_linear, float, 0)
