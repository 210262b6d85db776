/* Linear layers with 8-bit activations against GGUF's Q4_1 and Q8_0 blocks, the way GGUF
 * runtimes multiply them (`--quantization gguf`):
 *     y[m, n] = sum over blocks b of 32 k:  dx[m, b] * dw[n, b] * sum_k xq[m, k] q[n, k]
 *                                         (+ mw[n, b] * sum_k x[m, k], Q4_1)     (+ bias[n])
 * Each row of x is quantized per block of 32 values to int8 with one float32 scale
 * (dx = max |x| / 127), so a block's dot product is one integer sum, exact, computed 64
 * multiply-adds an instruction with AVX512-VNNI (vpdpbusd) or 32 with AVX2 (vpmaddubsw).
 * That is 2-4x fewer instructions a row than float32 multiply-adds, and a weight needs no
 * rebuilding into float32: a verify row and a decode step cost less. The result is close
 * to, not the same as, the float32 product (the activations are rounded to 8 bits).
 *
 * Batch invariance by construction, as in cpu_linear.c: a row's quantization reads only
 * that row; its integer sums are exact whatever their order; the lanes of a vector hold
 * columns, and each output's float32 part is one fixed chain over the blocks (the scale
 * product, a fused multiply-add of the integer sum, one of the minimum's term), the same
 * operations in the AVX2 and the AVX-512 code. So a row gets the same bits whatever else is
 * in the batch, whichever path and thread computes it.
 *
 * Weights come packed (specserve.kernels.cpu.cpu_linear.pack_a8) in strips of 16 columns;
 * each strip holds, per block of 32 k, its columns' float16 scales (Q4_1: and minima), then
 * the quantized values four k a column side by side, the layout vpdpbusd reads (a 32-bit
 * lane: one column, four consecutive k):
 *   Q4_1: d[16], m[16], 4 groups of 64 bytes: byte 4c + j of group g holds k = 8g + j of
 *         column c in its low nibble and k = 8g + 4 + j in its high one;
 *   Q8_0: d[16], 8 groups of 64 bytes: byte 4c + j of group g holds q + 128 (q in
 *         -127..127) of k = 4g + j of column c.
 * N is padded to a multiple of BLOCK with zero columns that are never written out; threads
 * split blocks of BLOCK columns.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define QK 32     /* values of k per block */
#define BLOCK 64  /* columns per block the threads split: 4 strips of 16 */
enum { Q4_1 = 0, Q8_0 = 1 };
#define BLOCK_BYTES(Q) ((Q) == Q4_1 ? 64 + 4 * 64 : 32 + 8 * 64)
static inline int64_t strip_bytes(int Q, int64_t K) { return K / QK * BLOCK_BYTES(Q); }

/* A row's block of 32 activations: its scale, the float32 sum of its values (Q4_1's minimum
 * multiplies it) and the sum of its int8 values (Q8_0 with VNNI, whose weights carry +128). */
typedef struct {
    float d, sum;
    int32_t qsum, pad;
} XBlock;

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* x [K] -> q [K] int8 and a block record per 32 values: q = round(x * 127 / max|x|) (ties to
 * even), d = max|x| / 127, sum = the values summed in a fixed order. */
static void quantize_row(const float *x, int64_t K, int8_t *q, XBlock *xb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *p = x + b * QK;
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(p + 8 * i);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        float amax = hmax(a);
        __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
        __m256i s8 = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(s8, order));
        __m256i qs = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        xb[b].d = amax / 127.0f;
        xb[b].sum = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        xb[b].qsum = _mm_cvtsi128_si32(h);
        xb[b].pad = 0;
    }
}

/* ---- AVX2: 8 columns a vector ------------------------------------------------------------ */

/* R rows x C vectors of 8 columns of one block, from vector v0 (0..7) of the block's 64
 * columns; w: the block's first strip. The R x C sums of a block run side by side, each
 * activation broadcast once for the C vectors (as in tile_vnni). */
static inline __attribute__((always_inline)) void tile_avx2(
        int R, int C, int Q, const int8_t *xq, int64_t K, const XBlock *xb, const uint8_t *w, int v0,
        const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {
    const int64_t sb = strip_bytes(Q, K), nb = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        const int8_t *xk = xq + kb * QK;
        const uint8_t *base[2]; /* vector c's block: strip v >> 1, columns 8 (v & 1) .. of it */
        int half[2];
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) {
            base[c] = w + ((v0 + c) >> 1) * sb + kb * BLOCK_BYTES(Q);
            half[c] = (v0 + c) & 1;
        }
        __m256i isum[4][2];
        if (Q == Q4_1) {
            __m256i s16[4][2];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int c = 0; c < C; c++) s16[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                __m256i lo[2], hi[2];
#pragma GCC unroll 2
                for (int c = 0; c < C; c++) {
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(base[c] + 64 + 64 * g + 32 * half[c]));
                    lo[c] = _mm256_and_si256(wv, low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m256i x0 = _mm256_set1_epi32(load4(xk + r * K + 8 * g));
                    __m256i x1 = _mm256_set1_epi32(load4(xk + r * K + 8 * g + 4));
                    /* pairs of at most 2 x 15 x 127; eight of them a lane stay under 2^15 */
#pragma GCC unroll 2
                    for (int c = 0; c < C; c++)
                        s16[r][c] = _mm256_add_epi16(_mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(lo[c], x0)),
                                                     _mm256_maddubs_epi16(hi[c], x1));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int c = 0; c < C; c++) isum[r][c] = _mm256_madd_epi16(s16[r][c], ones);
        } else {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int c = 0; c < C; c++) isum[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i q[2], a[2];
#pragma GCC unroll 2
                for (int c = 0; c < C; c++) {
                    q[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(base[c] + 32 + 64 * g + 32 * half[c])), flip);
                    a[c] = _mm256_abs_epi8(q[c]);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m256i xv = _mm256_set1_epi32(load4(xk + r * K + 4 * g));
                    /* |q| x (x with q's sign): pairs of at most 2 x 127 x 127 */
#pragma GCC unroll 2
                    for (int c = 0; c < C; c++)
                        isum[r][c] = _mm256_add_epi32(
                            isum[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(a[c], _mm256_sign_epi8(xv, q[c])), ones));
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const XBlock *b = xb + r * nb + kb;
            __m256 dx = _mm256_set1_ps(b->d), sx = _mm256_set1_ps(b->sum);
#pragma GCC unroll 2
            for (int c = 0; c < C; c++) {
                const uint8_t *scales = base[c] + 16 * half[c]; /* d; Q4_1's m 32 bytes on */
                __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales)), dx);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]), scale, acc[r][c]);
                if (Q == Q4_1)
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32))), sx,
                                                acc[r][c]);
            }
        }
    }
#pragma GCC unroll 2
    for (int c = 0; c < C; c++) {
        int64_t n = n0 + 8 * (v0 + c);
        if (n >= N) continue;
        int valid = N - n >= 8 ? 8 : (int)(N - n);
        float b[8] = {0}, out[8];
        if (bias) memcpy(b, bias + n, valid * sizeof(float));
        __m256 bvec = _mm256_loadu_ps(b);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(out, _mm256_add_ps(acc[r][c], bvec));
            memcpy(y + r * ldy + n, out, valid * sizeof(float));
        }
    }
}

#define TILE_AVX2(R, C, Q)                                                                              \
    static __attribute__((noinline)) void avx2_##R##x##C##_##Q(                                        \
            const int8_t *xq, int64_t K, const XBlock *xb, const uint8_t *w, int v0, const float *bias, \
            int64_t n0, int64_t N, float *y, int64_t ldy) {                                            \
        tile_avx2(R, C, Q, xq, K, xb, w, v0, bias, n0, N, y, ldy);                                     \
    }
#define TILES_AVX2(Q) TILE_AVX2(1, 2, Q) TILE_AVX2(2, 2, Q) TILE_AVX2(3, 1, Q) TILE_AVX2(4, 1, Q)
TILES_AVX2(Q4_1)
TILES_AVX2(Q8_0)

/* ---- AVX512-VNNI: 16 columns a vector ---------------------------------------------------- */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* R rows x C strips of one block, from strip s0 (0..3). The same float32 operations per
 * column as tile_avx2; Q8_0's weights carry +128 (vpdpbusd multiplies unsigned by signed
 * bytes), taken off the exact integer sum again with 128 x the activations' sum. The R x C
 * integer sums of a block run side by side (independent chains: one vpdpbusd waits for the
 * last only every R x C instructions), each activation broadcast once for the C strips. */
static inline VNNI __attribute__((always_inline)) void tile_vnni(
        int R, int C, int Q, const int8_t *xq, int64_t K, const XBlock *xb, const uint8_t *w, int s0,
        const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {
    const int64_t sb = strip_bytes(Q, K), nb = K / QK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t *ws = w + s0 * sb;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        const uint8_t *blk = ws + kb * BLOCK_BYTES(Q);
        const int8_t *xk = xq + kb * QK;
        __m512i isum[8][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) isum[r][c] = _mm512_setzero_si512();
        if (Q == Q4_1) {
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                __m512i lo[4], hi[4];
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    __m512i wv = _mm512_loadu_si512((const void *)(blk + c * sb + 64 + 64 * g));
                    lo[c] = _mm512_and_si512(wv, low);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    __m512i x0 = _mm512_set1_epi32(load4(xk + r * K + 8 * g));
                    __m512i x1 = _mm512_set1_epi32(load4(xk + r * K + 8 * g + 4));
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo[c], x0);
                        isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], hi[c], x1);
                    }
                }
            }
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m512i wv[4];
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512((const void *)(blk + c * sb + 32 + 64 * g));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    __m512i xv = _mm512_set1_epi32(load4(xk + r * K + 4 * g));
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], wv[c], xv);
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const XBlock *b = xb + r * nb + kb;
            __m512 dx = _mm512_set1_ps(b->d), sx = _mm512_set1_ps(b->sum);
            __m512i corr = _mm512_set1_epi32(128 * b->qsum);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                const uint8_t *bc = blk + c * sb;
                __m512i is = Q == Q8_0 ? _mm512_sub_epi32(isum[r][c], corr) : isum[r][c];
                __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)bc)), dx);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), scale, acc[r][c]);
                if (Q == Q4_1)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bc + 32))), sx,
                                                acc[r][c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
        int64_t n = n0 + 16 * (s0 + c);
        if (n >= N) continue;
        __mmask16 valid = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(valid, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy + n, valid, _mm512_add_ps(acc[r][c], bv));
    }
}

#define TILE_VNNI(R, C, Q)                                                                              \
    static VNNI __attribute__((noinline)) void vnni_##R##x##C##_##Q(                                   \
            const int8_t *xq, int64_t K, const XBlock *xb, const uint8_t *w, int s0, const float *bias, \
            int64_t n0, int64_t N, float *y, int64_t ldy) {                                            \
        tile_vnni(R, C, Q, xq, K, xb, w, s0, bias, n0, N, y, ldy);                                     \
    }
#define TILES_VNNI(Q) TILE_VNNI(1, 1, Q) TILE_VNNI(2, 4, Q) TILE_VNNI(3, 2, Q) TILE_VNNI(4, 2, Q) \
    TILE_VNNI(5, 2, Q) TILE_VNNI(6, 2, Q) TILE_VNNI(7, 1, Q) TILE_VNNI(8, 1, Q)
TILES_VNNI(Q4_1)
TILES_VNNI(Q8_0)

static int use_vnni = -1; /* -1: not decided yet */

/* Whether the products run with AVX512-VNNI: on = -1 asks (the CPU's answer at first use),
 * 0 / 1 set it (off always works; on only where the CPU has it). The same bits either way. */
int a8_linear_vnni(int on) {
    if (on == 0)
        use_vnni = 0;
    else if (on > 0 || use_vnni < 0)
        use_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    return use_vnni;
}

typedef void (*tile_fn)(const int8_t *, int64_t, const XBlock *, const uint8_t *, int, const float *, int64_t,
                        int64_t, float *, int64_t);

/* One block of BLOCK columns for all M rows: the rows in as few groups as the tiles allow
 * (8 rows with VNNI, 4 with AVX2), as even as they can be, each group reading the block's
 * weights (a few tens of KB, from the cache after the first). */
static void block_rows(int Q, const int8_t *xq, const XBlock *xb, int64_t M, int64_t K, const uint8_t *w,
                       const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) {
    static const tile_fn vnni[2][8] = {
        {vnni_1x1_Q4_1, vnni_2x4_Q4_1, vnni_3x2_Q4_1, vnni_4x2_Q4_1,
         vnni_5x2_Q4_1, vnni_6x2_Q4_1, vnni_7x1_Q4_1, vnni_8x1_Q4_1},
        {vnni_1x1_Q8_0, vnni_2x4_Q8_0, vnni_3x2_Q8_0, vnni_4x2_Q8_0,
         vnni_5x2_Q8_0, vnni_6x2_Q8_0, vnni_7x1_Q8_0, vnni_8x1_Q8_0}};
    static const tile_fn avx2[2][4] = {{avx2_1x2_Q4_1, avx2_2x2_Q4_1, avx2_3x1_Q4_1, avx2_4x1_Q4_1},
                                       {avx2_1x2_Q8_0, avx2_2x2_Q8_0, avx2_3x1_Q8_0, avx2_4x1_Q8_0}};
    const int most = use_vnni > 0 ? 8 : 4;
    const int64_t nb = K / QK, groups = (M + most - 1) / most;
    for (int64_t g = 0, m = 0; g < groups; g++) {
        int rows = (int)((M - m) / (groups - g));
        const int8_t *xg = xq + m * K;
        const XBlock *bg = xb + m * nb;
        if (use_vnni > 0) {
            static const int strips_of[] = {1, 4, 2, 2, 2, 2, 1, 1};
            int strips = strips_of[rows - 1];
            for (int s0 = 0; s0 < 4; s0 += strips)
                vnni[Q][rows - 1](xg, K, bg, w, s0, bias, n0, N, y + m * ldy, ldy);
        } else {
            int vectors = rows <= 2 ? 2 : 1;
            for (int v0 = 0; v0 < 8; v0 += vectors)
                avx2[Q][rows - 1](xg, K, bg, w, v0, bias, n0, N, y + m * ldy, ldy);
        }
        m += rows;
    }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weights, plus `bias`
 * (NULL: none); `scale` is not used (the entry points share cpu_linear.c's signature).
 * Returns 0, or -1 when the activations' buffers could not be allocated (y untouched). */
static int a8_linear(int Q, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                      int64_t N, const float *bias, float *y, int64_t ldy, int threads) {
    if (use_vnni < 0) a8_linear_vnni(-1);
    const int64_t nb = K / QK, blocks = (N + BLOCK - 1) / BLOCK, sb = strip_bytes(Q, K);
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    XBlock *xb = (XBlock *)malloc(sizeof(XBlock) * (size_t)(M * nb));
    if (!xq || !xb) {
        free(xq);
        free(xb);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, xq + m * K, xb + m * nb);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            block_rows(Q, xq, xb, M, K, packed + b * (BLOCK / 16) * sb, bias, b * BLOCK, N, y, ldy);
    }
    free(xq);
    free(xb);
    return 0;
}

int q4_1_a8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed, int64_t N,
                    const float *scale, const float *bias, float *y, int64_t ldy, int threads) {
    (void)scale;
    return a8_linear(Q4_1, x, M, K, ldx, packed, N, bias, y, ldy, threads);
}

int q8_0_a8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed, int64_t N,
                    const float *scale, const float *bias, float *y, int64_t ldy, int threads) {
    (void)scale;
    return a8_linear(Q8_0, x, M, K, ldx, packed, N, bias, y, ldy, threads);
}
