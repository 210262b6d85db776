/* Linear layers for x86 CPUs with AVX2 and FMA, float32 activations, weights in int8 (one
 * scale per output column: weight-only quantization), in float32, or in GGUF's Q4_1 and Q8_0
 * block formats where those give back the float32 weights bit for bit:
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
 * with zero columns that are never written out; threads split blocks of BLOCK columns. The
 * block formats keep, in a strip, each block of QK values of k as its 8 columns' scales (and
 * minima) followed by their quantized values (strip_bytes). float32 weights stream at memory
 * speed where MKL's GEMM, on an AVX2-only AMD CPU, took twice as long at one row and ~4x at
 * 2-16 rows (benchmarks/cpu_linear.py). Where the CPU has AVX-512F the block formats run
 * with 16 columns a vector (tile_q_wide, block_rows_wide; chosen at run time): the same bits,
 * since lanes still hold columns.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 64 /* columns per block: 8 vectors of 8 floats */
#define BUFFER_ROWS 13 /* the block formats' AVX2 direct tiles: 1 to 12 rows */

static inline __m256 widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The accumulators of an R x C tile out to y: scaled (scale NULL: not), then the bias added
 * (NULL: zero), two roundings, the same for every row and every weight format. */
static inline __attribute__((always_inline)) void store_tile(
        int R, int C, __m256 acc[12][8], int c0, const float *scale, const float *bias, int64_t n0,
        int64_t N, float *y, int64_t ldy) {
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        int64_t n = n0 + 8 * (c0 + c);
        if (n >= N) continue;
        if (N - n >= 8) {
            __m256 bv = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
            if (scale) {
                __m256 sv = _mm256_loadu_ps(scale + n);
#pragma GCC unroll 12
                for (int r = 0; r < R; r++) acc[r][c] = _mm256_mul_ps(acc[r][c], sv);
            }
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy + n, _mm256_add_ps(acc[r][c], bv));
        } else { /* the last, partial vector of columns */
            float out[8], s[8] = {1, 1, 1, 1, 1, 1, 1, 1}, b[8] = {0};
            int valid = (int)(N - n);
            if (scale) memcpy(s, scale + n, valid * sizeof(float));
            if (bias) memcpy(b, bias + n, valid * sizeof(float));
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) {
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(acc[r][c], _mm256_loadu_ps(s)),
                                                    _mm256_loadu_ps(b)));
                memcpy(y + r * ldy + n, out, valid * sizeof(float));
            }
        }
    }
}

/* Bytes of one strip (8 columns, all of K) in weight format Q: float32, int8, or per block of
 * QK values along k, Q4_1 (8 fp16 scales d, 8 fp16 minima m, then 16 k-pairs of 8 bytes, low
 * nibble k, high nibble k + 1) or Q8_0 (8 fp16 scales d, then 32 k of 8 int8). */
enum { F32 = 0, I8 = 1, Q4_1 = 2, Q8_0 = 3, QK = 32 };
#define Q_BLOCK_BYTES(Q) ((Q) == Q4_1 ? 32 + QK / 2 * 8 : 16 + QK * 8)
static inline int64_t strip_bytes(int Q, int64_t K) {
    return Q == F32 ? 32 * K : Q == I8 ? 8 * K : K / QK * Q_BLOCK_BYTES(Q);
}

/* Weights rebuilt from a block: Q4_1's k and k + 1 of 8 columns from their 8 bytes (low and
 * high nibbles), and Q8_0's k of 8 columns from theirs. */
static inline void q4_1_pair(const uint8_t *p, __m256 d, __m256 m, __m256 *w0, __m256 *w1) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d, m);
    *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
}
static inline __m256 q8_0_weight(const uint8_t *p, __m256 d) { return _mm256_mul_ps(widen((const int8_t *)p), d); }

/* R rows x C vectors (8 columns each) of one block, starting at column vector c0, weights in
 * format Q; scale NULL: none. The block formats rebuild each weight as GGUF's dequantization
 * does: d * q is exact in float32 (11 bits of d times 4 or 8 bits of q), so one fused
 * multiply-add d * q + m rounds exactly where GGUF's product-then-sum does, and every weight,
 * every product and every sum is the float32 weight's, bit for bit. */
static inline __attribute__((always_inline)) void tile(
        int R, int C, int Q, const float *x, int64_t ldx, int64_t K, const void *wb, int c0,
        const float *scale, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy,
        const float *acc_in, float *acc_out) {
    __m256 acc[12][8];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++)
            acc[r][c] = acc_in ? _mm256_loadu_ps(acc_in + r * BLOCK + 8 * (c0 + c)) : _mm256_setzero_ps();
    const int64_t sb = strip_bytes(Q, K);
    const uint8_t *w = (const uint8_t *)wb + c0 * sb;
    if (Q == F32 || Q == I8) {
        for (int64_t k = 0; k < K; k++) {
            __m256 wv[8];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
                wv[c] = Q == I8 ? widen((const int8_t *)(w + c * sb) + 8 * k)
                                : _mm256_loadu_ps((const float *)(w + c * sb) + 8 * k);
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
    } else {
        for (int64_t kb = 0; kb < K / QK; kb++) {
            const uint8_t *blk = w + kb * Q_BLOCK_BYTES(Q);
            const float *xb = x + kb * QK;
            __m256 d[8], m[8];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) {
                d[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + c * sb)));
                m[c] = Q == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + c * sb + 16)))
                                 : _mm256_setzero_ps();
            }
            if (Q == Q4_1) {
                for (int kp = 0; kp < QK / 2; kp++) {
                    __m256 w0[8], w1[8];
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) q4_1_pair(blk + c * sb + 32 + 8 * kp, d[c], m[c], &w0[c], &w1[c]);
#pragma GCC unroll 12
                    for (int r = 0; r < R; r++) {
                        __m256 x0 = _mm256_broadcast_ss(xb + r * ldx + 2 * kp);
                        __m256 x1 = _mm256_broadcast_ss(xb + r * ldx + 2 * kp + 1);
#pragma GCC unroll 8
                        for (int c = 0; c < C; c++)
                            acc[r][c] = _mm256_fmadd_ps(x1, w1[c], _mm256_fmadd_ps(x0, w0[c], acc[r][c]));
                    }
                }
            } else {
                for (int k = 0; k < QK; k++) {
                    __m256 wv[8];
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++)
                        wv[c] = q8_0_weight(blk + c * sb + 16 + 8 * k, d[c]);
#pragma GCC unroll 12
                    for (int r = 0; r < R; r++) {
                        __m256 xv = _mm256_broadcast_ss(xb + r * ldx + k);
#pragma GCC unroll 8
                        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                    }
                }
            }
        }
    }
    if (acc_out) { /* a partial sum over part of K, continued by the next call (see linear_buffered) */
#pragma GCC unroll 12
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) _mm256_storeu_ps(acc_out + r * BLOCK + 8 * (c0 + c), acc[r][c]);
        return;
    }
    store_tile(R, C, acc, c0, scale, bias, n0, N, y, ldy);
}

/* Each tile shape its own function, so that the compiler keeps every shape's accumulators
 * in registers (inlined into one function, some shapes spilled them to the stack). */
#define TILE_FN(R, C, Q)                                                                     \
    static __attribute__((noinline)) void tile_##R##x##C##_##Q(                              \
            const float *x, int64_t ldx, int64_t K, const void *wb, int c0,                  \
            const float *scale, const float *bias, int64_t n0, int64_t N, float *y,          \
            int64_t ldy, const float *acc_in, float *acc_out) {                              \
        tile(R, C, Q, x, ldx, K, wb, c0, scale, bias, n0, N, y, ldy, acc_in, acc_out);       \
    }
#define TILES(Q) TILE_FN(6, 2, Q) TILE_FN(4, 2, Q) TILE_FN(2, 4, Q) TILE_FN(1, 8, Q)
TILES(F32)
TILES(I8)
/* The block formats under BUFFER_ROWS rows: one tile of exactly M rows, so that every weight
 * is rebuilt once whatever M is (a 2 + 1 split of 3 rows rebuilt it twice); from 5 rows one
 * strip at a time (measured: 4 rows x 2 strips took 30% longer than 4 x 4, 5-7 x 2 longer
 * than 5-7 x 1). */
#define Q_TILES(Q) TILE_FN(1, 8, Q) TILE_FN(2, 4, Q) TILE_FN(3, 4, Q) TILE_FN(4, 4, Q) \
                   TILE_FN(5, 1, Q) TILE_FN(6, 1, Q) TILE_FN(7, 1, Q) TILE_FN(8, 1, Q) \
                   TILE_FN(9, 1, Q) TILE_FN(10, 1, Q) TILE_FN(11, 1, Q) TILE_FN(12, 1, Q)
Q_TILES(Q4_1)
Q_TILES(Q8_0)

/* One block of BLOCK columns for all M rows: groups of 6 rows (2 vectors at a time), then
 * the rest with tiles that keep 8 accumulators busy. acc_in / acc_out (NULL: none): partial
 * sums, BLOCK floats a row (see tile). */
#define BLOCK_ROWS(Q)                                                                        \
    static void block_rows_##Q(const float *x, int64_t M, int64_t ldx, int64_t K, const void *wb,  \
                               const float *scale, const float *bias, int64_t n0, int64_t N,       \
                               float *y, int64_t ldy, const float *acc_in, float *acc_out) {      \
        int64_t m = 0;                                                                       \
        for (; m + 6 <= M; m += 6)                                                           \
            for (int c0 = 0; c0 < 8; c0 += 2)                                                \
                tile_6x2_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy, \
                             ACC(acc_in, m), ACC(acc_out, m));                               \
        if (m + 4 <= M) {                                                                    \
            for (int c0 = 0; c0 < 8; c0 += 2)                                                \
                tile_4x2_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy, \
                             ACC(acc_in, m), ACC(acc_out, m));                               \
            m += 4;                                                                          \
        }                                                                                    \
        if (m + 2 <= M) {                                                                    \
            for (int c0 = 0; c0 < 8; c0 += 4)                                                \
                tile_2x4_##Q(x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy, \
                             ACC(acc_in, m), ACC(acc_out, m));                               \
            m += 2;                                                                          \
        }                                                                                    \
        if (m < M)                                                                           \
            tile_1x8_##Q(x + m * ldx, ldx, K, wb, 0, scale, bias, n0, N, y + m * ldy, ldy,   \
                         ACC(acc_in, m), ACC(acc_out, m));                                   \
    }
#define ACC(p, m) ((p) ? (p) + (m) * BLOCK : NULL)
BLOCK_ROWS(F32)
BLOCK_ROWS(I8)

/* One block of BLOCK columns for M < BUFFER_ROWS rows in a block format: one tile shape (AVX2). */
#define Q_BLOCK_ROWS(Q)                                                                      \
    static void block_rows_narrow_##Q(const float *x, int64_t M, int64_t ldx, int64_t K, const void *wb, \
                               const float *scale, const float *bias, int64_t n0, int64_t N,       \
                               float *y, int64_t ldy) {                                      \
        static void (*const tiles[])(const float *, int64_t, int64_t, const void *, int,     \
                                     const float *, const float *, int64_t, int64_t, float *, \
                                     int64_t, const float *, float *) = {                    \
            tile_1x8_##Q, tile_2x4_##Q, tile_3x4_##Q, tile_4x4_##Q, tile_5x1_##Q, tile_6x1_##Q, \
            tile_7x1_##Q, tile_8x1_##Q, tile_9x1_##Q, tile_10x1_##Q, tile_11x1_##Q, tile_12x1_##Q}; \
        static const int vectors[] = {8, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1};                                  \
        for (int c0 = 0; c0 < 8; c0 += vectors[M - 1])                                       \
            tiles[M - 1](x, ldx, K, wb, c0, scale, bias, n0, N, y, ldy, NULL, NULL);        \
    }
Q_BLOCK_ROWS(Q4_1)
Q_BLOCK_ROWS(Q8_0)

/* The block formats past cpu_linear_direct_rows() rows: a chunk of KC values of k of one block's 8 strips is
 * rebuilt into float32 once (BLOCK x KC floats, in the float32 strip layout), then every row
 * multiplies it with the float32 tiles; the sums carry from chunk to chunk through acc
 * (BLOCK floats a row), and the last chunk stores them with the bias. Each output is the same
 * chain of multiply-adds in the same order as in the direct tiles: the same bits. */
#define KC 128
/* wide: the AVX-512 layout, 16 columns a vector (two strips side by side, k-major); else the
 * float32 strip layout of 8. */
static void rebuild(int Q, const uint8_t *wb, int64_t K, int64_t k0, int64_t kc, float *buf, int wide) {
    const int64_t sb = strip_bytes(Q, K), step = wide ? 16 : 8; /* floats from one k to the next */
    for (int c = 0; c < 8; c++)
        for (int64_t kb = k0 / QK; kb < (k0 + kc) / QK; kb++) {
            const uint8_t *blk = wb + c * sb + kb * Q_BLOCK_BYTES(Q);
            float *out = buf + (wide ? 16 * ((c >> 1) * kc + kb * QK - k0) + 8 * (c & 1) : 8 * (c * kc + kb * QK - k0));
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)), w0, w1;
            if (Q == Q4_1) {
                __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
                for (int kp = 0; kp < QK / 2; kp++) {
                    q4_1_pair(blk + 32 + 8 * kp, d, m, &w0, &w1);
                    _mm256_storeu_ps(out + step * 2 * kp, w0);
                    _mm256_storeu_ps(out + step * (2 * kp + 1), w1);
                }
            } else {
                for (int k = 0; k < QK; k++) _mm256_storeu_ps(out + step * k, q8_0_weight(blk + 16 + 8 * k, d));
            }
        }
}

/* The block formats with AVX-512 where the CPU has it (chosen at run time, use_avx512: the
 * chunk path below and the direct tiles further down). Lanes still hold columns, never k:
 * each output is the same chain of fused multiply-adds over k as in the AVX2 tiles, so the
 * same bits, at twice the columns per instruction (at 64 rows the AVX2 chunk path ran at the
 * FMA peak of 2 cores, docs/benchmarks.md). */
#define AVX512 __attribute__((target("avx512f")))
static int use_avx512 = -1; /* -1: not decided yet */
#define WIDE_ROWS 14          /* the most rows of one of the block formats' AVX-512 tiles */

/* store_tile for R x C vectors of 16 columns from column vector c0 (scale NULL: not scaled,
 * bias NULL: zero); the columns past N masked off. */
static inline AVX512 __attribute__((always_inline)) void store_tile_wide(
        int R, int C, __m512 acc[][4], int c0, const float *scale, const float *bias, int64_t n0, int64_t N,
        float *y, int64_t ldy) {
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
        int64_t n = n0 + 16 * (c0 + c);
        if (n >= N) continue;
        __mmask16 valid = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(valid, bias + n) : _mm512_setzero_ps();
        __m512 sv = scale ? _mm512_maskz_loadu_ps(valid, scale + n) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 14
        for (int r = 0; r < R; r++) {
            __m512 v = scale ? _mm512_mul_ps(acc[r][c], sv) : acc[r][c];
            _mm512_mask_storeu_ps(y + r * ldy + n, valid, _mm512_add_ps(v, bv));
        }
    }
}

/* The chunk's products: R rows x the block's 64 columns as 4 vectors of 16. */

static inline AVX512 __attribute__((always_inline)) void tile_wide(
        int R, const float *x, int64_t ldx, int64_t kc, const float *buf, const float *bias, int64_t n0,
        int64_t N, float *y, int64_t ldy, const float *acc_in, float *acc_out) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            acc[r][c] = acc_in ? _mm512_loadu_ps(acc_in + r * BLOCK + 16 * c) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 wv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) wv[c] = _mm512_loadu_ps(buf + 16 * (c * kc + k));
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    if (acc_out) { /* a partial sum, continued by the next chunk */
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_out + r * BLOCK + 16 * c, acc[r][c]);
        return;
    }
    store_tile_wide(R, 4, acc, 0, NULL, bias, n0, N, y, ldy);
}

#define TILE_WIDE(R)                                                                                  \
    static AVX512 void tile_wide_##R(const float *x, int64_t ldx, int64_t kc, const float *buf,      \
                                     const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy, \
                                     const float *acc_in, float *acc_out) {                          \
        tile_wide(R, x, ldx, kc, buf, bias, n0, N, y, ldy, acc_in, acc_out);                         \
    }
TILE_WIDE(1) TILE_WIDE(2) TILE_WIDE(3) TILE_WIDE(4) TILE_WIDE(5) TILE_WIDE(6)

static void block_rows_wide(const float *x, int64_t M, int64_t ldx, int64_t kc, const float *buf,
                            const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy,
                            const float *acc_in, float *acc_out) {
    static void (*const tiles[])(const float *, int64_t, int64_t, const float *, const float *, int64_t,
                                 int64_t, float *, int64_t, const float *, float *) = {
        tile_wide_1, tile_wide_2, tile_wide_3, tile_wide_4, tile_wide_5, tile_wide_6};
    for (int64_t m = 0; m < M; m += 6) {
        int r = M - m < 6 ? (int)(M - m) : 6;
        tiles[r - 1](x + m * ldx, ldx, kc, buf, bias, n0, N, y + m * ldy, ldy, ACC(acc_in, m), ACC(acc_out, m));
    }
}

/* Whether the block formats run with AVX-512: on = -1 asks (the CPU's answer at first
 * use), 0 / 1 set it (off always works; on only where the CPU has AVX-512F). */
int cpu_linear_wide(int on) {
    if (on == 0)
        use_avx512 = 0;
    else if (on > 0 || use_avx512 < 0)
        use_avx512 = __builtin_cpu_supports("avx512f") != 0;
    return use_avx512;
}

/* The block formats' direct tiles (1 to 12 rows) with AVX-512: each weight rebuilt as in the
 * AVX2 tiles (one fused multiply-add d * q + m, or d * q), 16 columns a vector (strips 2v and
 * 2v + 1 side by side), so half the instructions for the rebuild that bounds a step of few
 * rows; every output the same chain over k as in tile(): the same bits. */
static inline AVX512 __m512 scales16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
static inline AVX512 __m128i bytes16(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}
/* q4_1_pair and q8_0_weight for the 16 columns of strips a and a + sb. */
static inline AVX512 void q4_1_pair16(const uint8_t *a, int64_t sb, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    __m512i v = _mm512_cvtepu8_epi32(bytes16(a, a + sb));
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
}
static inline AVX512 __m512 q8_0_weight16(const uint8_t *a, int64_t sb, __m512 d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(a, a + sb))), d);
}

static inline AVX512 __attribute__((always_inline)) void tile_q_wide(
        int R, int C, int Q, const float *x, int64_t ldx, int64_t K, const void *wb, int c0,
        const float *scale, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {
    __m512 acc[WIDE_ROWS][4];
#pragma GCC unroll 14
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t sb = strip_bytes(Q, K);
    const uint8_t *w = (const uint8_t *)wb + 2 * c0 * sb; /* vector c: strips 2 (c0 + c) and the next */
    for (int64_t kb = 0; kb < K / QK; kb++) {
        const uint8_t *blk = w + kb * Q_BLOCK_BYTES(Q);
        const float *xb = x + kb * QK;
        __m512 d[4], m[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const uint8_t *a = blk + 2 * c * sb, *b = a + sb;
            d[c] = scales16(a, b);
            m[c] = Q == Q4_1 ? scales16(a + 16, b + 16) : _mm512_setzero_ps();
        }
        if (Q == Q4_1) {
            for (int kp = 0; kp < QK / 2; kp++) {
                __m512 w0[4], w1[4];
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) q4_1_pair16(blk + 2 * c * sb + 32 + 8 * kp, sb, d[c], m[c], &w0[c], &w1[c]);
#pragma GCC unroll 14
                for (int r = 0; r < R; r++) {
                    __m512 x0 = _mm512_set1_ps(xb[r * ldx + 2 * kp]), x1 = _mm512_set1_ps(xb[r * ldx + 2 * kp + 1]);
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++)
                        acc[r][c] = _mm512_fmadd_ps(x1, w1[c], _mm512_fmadd_ps(x0, w0[c], acc[r][c]));
                }
            }
        } else {
            for (int k = 0; k < QK; k++) {
                __m512 wv[4];
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) wv[c] = q8_0_weight16(blk + 2 * c * sb + 16 + 8 * k, sb, d[c]);
#pragma GCC unroll 14
                for (int r = 0; r < R; r++) {
                    __m512 xv = _mm512_set1_ps(xb[r * ldx + k]);
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
        }
    }
    store_tile_wide(R, C, acc, c0, scale, bias, n0, N, y, ldy);
}

#define TILE_Q_WIDE(R, C, Q)                                                                          \
    static AVX512 __attribute__((noinline)) void tile_wide_##R##x##C##_##Q(                           \
            const float *x, int64_t ldx, int64_t K, const void *wb, int c0, const float *scale,       \
            const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {                        \
        tile_q_wide(R, C, Q, x, ldx, K, wb, c0, scale, bias, n0, N, y, ldy);                          \
    }
/* 1-6 rows x the block's 4 vectors, 7-14 rows x 2 (32 registers: measured on an AMX Xeon,
 * a step's products at 2 / 4 / 8 / 12 rows 7.9 / 8.8 / 12.1 / 15.1 ms, against 8.9 / 9.8 /
 * 14.7 / 17.5 with the AVX2 shapes at twice the width; 5 and 6 rows x 4 1.13x faster than x 2,
 * 7 and 8 x 4 no faster (spilling); 15 or 16 rows x 2 spill accumulators, and 13-24 rows x 1
 * vector were 1.1-1.2x slower than 13 or 14 x 2, docs/benchmarks.md). */
#define Q_TILES_WIDE(Q) TILE_Q_WIDE(1, 4, Q) TILE_Q_WIDE(2, 4, Q) TILE_Q_WIDE(3, 4, Q) TILE_Q_WIDE(4, 4, Q)  \
    TILE_Q_WIDE(5, 4, Q) TILE_Q_WIDE(6, 4, Q) TILE_Q_WIDE(7, 2, Q) TILE_Q_WIDE(8, 2, Q) TILE_Q_WIDE(9, 2, Q) \
    TILE_Q_WIDE(10, 2, Q) TILE_Q_WIDE(11, 2, Q) TILE_Q_WIDE(12, 2, Q) TILE_Q_WIDE(13, 2, Q)              \
    TILE_Q_WIDE(14, 2, Q)
Q_TILES_WIDE(Q4_1)
Q_TILES_WIDE(Q8_0)

/* One block of BLOCK columns for the block formats' direct path (up to cpu_linear_direct_rows()
 * rows): AVX2 (use_avx512 off), one tile of all M rows; AVX-512, past WIDE_ROWS rows, the rows
 * in as few groups as there must be, as even as they can be, each weight rebuilt once per group
 * (from the cache: a block's strips are a few tens of KB). */
#define Q_BLOCK_ROWS_ANY(Q)                                                                            \
    static void block_rows_##Q(const float *x, int64_t M, int64_t ldx, int64_t K, const void *wb,     \
                               const float *scale, const float *bias, int64_t n0, int64_t N,          \
                               float *y, int64_t ldy) {                                               \
        static void (*const tiles[])(const float *, int64_t, int64_t, const void *, int, const float *, \
                                     const float *, int64_t, int64_t, float *, int64_t) = {            \
            tile_wide_1x4_##Q, tile_wide_2x4_##Q, tile_wide_3x4_##Q, tile_wide_4x4_##Q,                 \
            tile_wide_5x4_##Q, tile_wide_6x4_##Q, tile_wide_7x2_##Q, tile_wide_8x2_##Q,                 \
            tile_wide_9x2_##Q, tile_wide_10x2_##Q, tile_wide_11x2_##Q, tile_wide_12x2_##Q,              \
            tile_wide_13x2_##Q, tile_wide_14x2_##Q};                                                    \
        static const int vectors[] = {4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2};                        \
        if (use_avx512 <= 0) {                                                                         \
            block_rows_narrow_##Q(x, M, ldx, K, wb, scale, bias, n0, N, y, ldy);                        \
            return;                                                                                    \
        }                                                                                              \
        int64_t groups = (M + WIDE_ROWS - 1) / WIDE_ROWS;                                              \
        for (int64_t g = 0, m = 0; g < groups; g++) {                                                  \
            int64_t rows = (M - m) / (groups - g);                                                     \
            for (int c0 = 0; c0 < 4; c0 += vectors[rows - 1])                                          \
                tiles[rows - 1](x + m * ldx, ldx, K, wb, c0, scale, bias, n0, N, y + m * ldy, ldy);    \
            m += rows;                                                                                 \
        }                                                                                              \
    }
Q_BLOCK_ROWS_ANY(Q4_1)
Q_BLOCK_ROWS_ANY(Q8_0)

static void linear_buffered(int Q, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                            int64_t N, const float *bias, float *y, int64_t ldy, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    const int wide = use_avx512 < 0 ? cpu_linear_wide(-1) : use_avx512;
#pragma omp parallel num_threads(threads)
    {
        float buf[BLOCK * KC] __attribute__((aligned(64)));
        float *acc = (float *)_mm_malloc(sizeof(float) * BLOCK * M, 64);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *wb = packed + b * (BLOCK / 8) * strip_bytes(Q, K);
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC;
                rebuild(Q, wb, K, k0, kc, buf, wide);
                if (wide)
                    block_rows_wide(x + k0, M, ldx, kc, buf, bias, b * BLOCK, N, y, ldy,
                                    k0 ? acc : NULL, k0 + kc < K ? acc : NULL);
                else
                    block_rows_F32(x + k0, M, ldx, kc, buf, NULL, bias, b * BLOCK, N, y, ldy,
                                   k0 ? acc : NULL, k0 + kc < K ? acc : NULL);
            }
        }
        _mm_free(acc);
    }
}

/* The most rows the block formats take through their direct tiles before linear_buffered:
 * n < 0 asks; else set, up to the most there are (12 with AVX2, DIRECT_ROWS_WIDE with AVX-512),
 * 0 meaning as many as there are (the default). Every path gives the same bits. */
#define DIRECT_ROWS_WIDE (2 * WIDE_ROWS) /* two groups; from 29 rows the chunk path was as fast or faster */
static int direct_rows = 0;
int cpu_linear_direct_rows(int n) {
    if (n >= 0) direct_rows = n;
    int most = use_avx512 > 0 ? DIRECT_ROWS_WIDE : BUFFER_ROWS - 1;
    return direct_rows == 0 || direct_rows > most ? most : direct_rows;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weights, scaled by
 * `scale` (NULL: none), plus `bias` (NULL: none). The entry points differ in weight format;
 * the block formats take linear_buffered past cpu_linear_direct_rows() rows. */
#define LINEAR(NAME, Q)                                                                           \
    void NAME(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed, int64_t N,\
              const float *scale, const float *bias, float *y, int64_t ldy, int threads) {        \
        if (use_avx512 < 0) cpu_linear_wide(-1);                                                  \
        if ((Q == Q4_1 || Q == Q8_0) && M > cpu_linear_direct_rows(-1)) {                         \
            linear_buffered(Q, x, M, K, ldx, packed, N, bias, y, ldy, threads);                   \
            return;                                                                               \
        }                                                                                         \
        int64_t blocks = (N + BLOCK - 1) / BLOCK;                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
        for (int64_t b = 0; b < blocks; b++)                                                      \
            block_rows_##Q(x, M, ldx, K, packed + b * (BLOCK / 8) * strip_bytes(Q, K), scale, bias, \
                           b * BLOCK, N, y, ldy ROWS_ACC_##Q);                                    \
    }
#define ROWS_ACC_F32 , NULL, NULL
#define ROWS_ACC_I8 , NULL, NULL
#define ROWS_ACC_Q4_1
#define ROWS_ACC_Q8_0
LINEAR(int8_linear, I8)
LINEAR(f32_linear, F32)
LINEAR(q4_1_linear, Q4_1)
LINEAR(q8_0_linear, Q8_0)

/* Greedy rows of an LM head in Q8_0 blocks, at a fraction of its multiply-adds: `y` [R, N]
 * (row stride ldy) comes in holding a8_linear.c's product of the same blocks (each row of x
 * quantized to int8 per block of QK values, scale dx = max |x| / 127), and leaves with every
 * block of BLOCK columns that may hold a row's largest exact value rewritten with its exact
 * products, as q8_0_linear computes them (the same tiles, one row: the same bits). What is
 * left approximate is strictly below the row's largest exact value, so the row's argmax (the
 * first largest) is the one of q8_0_linear's full product.
 *
 * Why: with w[n, k] = d * q exactly, the exact sum and the approximation differ by at most
 *     E[n] = sum over blocks b of (dx[b] / 2 + rounding) * A[n, b],   A[n, b] = sum_{k in b} |w[n, k]|
 * (the activations' rounding to int8 is at most dx / 2 a value; the float32 roundings of both
 * sums, at most (K + 2 * K / QK + 2) units in the last place of sum |x| |w| <= 127 dx A, come
 * to 0.005 dx A at K = 576: the caller's `coef` multiplies dx A and covers both, ArgmaxHead's
 * with a 2x margin on the roundings: 0.510 at K = 576). So column n can hold the largest exact
 * value only where y[n] + E[n] >= max over m of (y[m] - E[m]). A cheap first test, vectorized,
 * takes every block's scale as the third largest but the two largest blocks' own (L the
 * column's sum of |w|, Ab = A block by block [K / QK, N]); only the columns that pass it get
 * their E (At = A column by column [N, K / QK]). A row with a value that is not finite (in x
 * or y) is computed exactly in full. */
static void argmax_marks(const float *x, int64_t K, int64_t N, const float *L, const float *At, const float *Ab,
                         float coef, const float *y, int32_t *kept, float *dx, uint8_t *mark) {
    const int64_t nb = K / QK, blocks = (N + BLOCK - 1) / BLOCK;
    int finite = 1;
    int64_t b1 = 0, b2 = 0; /* the blocks of the largest and second largest scale */
    float d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int k = 0; k < QK; k++) {
            float v = x[b * QK + k];
            finite &= v - v == 0.0f;
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
        float d = dx[b] = amax / 127.0f; /* the scale a8_linear.c's quantize_row gives the block */
        if (d > d1) {
            d3 = d2, d2 = d1, b2 = b1, d1 = d, b1 = b;
        } else if (d > d2) {
            d3 = d2, d2 = d, b2 = b;
        } else if (d > d3) {
            d3 = d;
        }
    }
    if (nb == 1) b2 = b1; /* (d2 = 0) */
    /* the row's largest value (NaN where one is not finite: v - v), then its first column */
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        __m256 v = _mm256_loadu_ps(y + n);
        vmax = _mm256_max_ps(vmax, v);
        vnan = _mm256_add_ps(vnan, _mm256_sub_ps(v, v));
    }
    float ymax = hmax(vmax), nan = hsum(vnan);
    for (; n < N; n++) {
        ymax = y[n] > ymax ? y[n] : ymax;
        nan += y[n] - y[n];
    }
    finite &= nan == 0.0f;
    int64_t top = 0;
    while (finite && top < N - 1 && y[top] != ymax) top++;
    memset(mark, !finite, blocks);
    if (!finite) return;
#define E_OF(n) ({ float e_ = 0.0f; const float *a_ = At + (n) * nb; \
                   for (int64_t b_ = 0; b_ < nb; b_++) e_ += dx[b_] * a_[b_]; coef * e_; })
    float best = y[top] - E_OF(top); /* a lower bound of the row's largest exact value */
    /* the first test: every block's scale at most d3 but the two largest', so
     * E <= c3 L + (c1 - c3) A[b1] + (c2 - c3) A[b2] (a hair more, for its own roundings) */
    const float c3 = coef * d3 * 1.0001f, c1 = coef * d1 * 1.0001f - c3, c2 = coef * d2 * 1.0001f - c3;
    const float *a1 = Ab + b1 * N, *a2 = Ab + b2 * N;
    int64_t count = 0;
    const __m256 vbest = _mm256_set1_ps(best), v1 = _mm256_set1_ps(c1), v2 = _mm256_set1_ps(c2),
                 v3 = _mm256_set1_ps(c3);
    for (int64_t n0 = 0; n0 < N; n0 += 8) {
        int bits = 0xFF;
        if (n0 + 8 <= N) {
            __m256 ub = _mm256_fmadd_ps(v3, _mm256_loadu_ps(L + n0), _mm256_loadu_ps(y + n0));
            ub = _mm256_fmadd_ps(v1, _mm256_loadu_ps(a1 + n0), ub);
            ub = _mm256_fmadd_ps(v2, _mm256_loadu_ps(a2 + n0), ub);
            bits = _mm256_movemask_ps(_mm256_cmp_ps(ub, vbest, _CMP_GE_OQ));
        }
        for (; bits; bits &= bits - 1) {
            int64_t n = n0 + __builtin_ctz(bits);
            if (n >= N || y[n] + c3 * L[n] + c1 * a1[n] + c2 * a2[n] < best) continue;
            float e = E_OF(n);
            if (y[n] + e < best) continue;
            if (y[n] - e > best) best = y[n] - e;
            kept[count++] = (int32_t)n;
        }
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t n = kept[i];
        if (y[n] + E_OF(n) >= best) mark[n / BLOCK] = 1;
    }
#undef E_OF
}

/* A thread's scratch for argmax_marks, kept between calls (a head's N and K do not change). */
static __thread int32_t *kept_buf;
static __thread float *dx_buf;
static __thread int64_t kept_cap, dx_cap;
static int grow(void **buf, int64_t *cap, int64_t want, size_t size) {
    if (*cap >= want) return 1;
    void *p = realloc(*buf, want * size);
    if (!p) return 0;
    *buf = p;
    *cap = want;
    return 1;
}

/* For R rows of x (row stride ldx) and y (row stride ldy): every row's blocks to compute
 * exactly (argmax_marks), then those (row, block) pairs, split over the threads; returns the
 * number of blocks computed exactly (-1: out of memory). */
int64_t q8_0_argmax_head(const float *x, int64_t R, int64_t K, int64_t ldx, const uint8_t *packed, int64_t N,
                         const float *L, const float *At, const float *Ab, float coef, float *y, int64_t ldy,
                         int threads) {
    if (use_avx512 < 0) cpu_linear_wide(-1);
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, sb = strip_bytes(Q8_0, K);
    uint8_t *mark = (uint8_t *)calloc(R * blocks, 1); /* (a row a thread could not mark: none exact) */
    if (!mark) return -1;
    int64_t exact = 0, failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : exact, failed)
    {
        int ok = grow((void **)&kept_buf, &kept_cap, N, sizeof(int32_t)) &&
                 grow((void **)&dx_buf, &dx_cap, K / QK, sizeof(float));
        failed += !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++)
            if (ok) argmax_marks(x + r * ldx, K, N, L, At, Ab, coef, y + r * ldy, kept_buf, dx_buf, mark + r * blocks);
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < R * blocks; i++) {
            if (failed || !mark[i]) continue;
            int64_t r = i / blocks, b = i % blocks;
            block_rows_Q8_0(x + r * ldx, 1, K, K, packed + b * (BLOCK / 8) * sb, NULL, NULL, b * BLOCK, N,
                            y + r * ldy, N);
            exact++;
        }
    }
    free(mark);
    return failed ? -1 : exact;
}
