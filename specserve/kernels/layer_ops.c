/* A decoder layer's small float32 ops on x86 CPUs with AVX2: one call where PyTorch takes
 * several, each of which costs a dispatch of several microseconds at a few rows.
 *
 * rms_norm: sum = x (+ residual); out = sum * (1 / sqrt(mean(sum^2) + eps)) * weight, per row.
 *     The residual add is the same IEEE addition PyTorch makes; the mean of squares is summed
 *     in 8 lanes over the row, the lanes then added in a fixed order, so a row's result does
 *     not depend on the batch around it, on the thread that runs it or on the thread count.
 * rotary: rotate-half rotary embedding, in place, on the first `heads` heads of each row:
 *     x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin (two products then one sum, each
 *     rounded, exactly PyTorch's expression: the same bits).
 * Compiled with -ffp-contract=off (cbuild.FLAGS): no product is fused into a sum.
 */
#include <immintrin.h>
#include "simd.h"
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN 32768 /* elements below which one thread does it all (no team wake-up) */

static void norm_row(const float *x, const float *res, const float *w, int64_t dim, float eps,
                     float *sum, float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (res) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(res + i));
            _mm256_storeu_ps(sum + i, v);
        }
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum(acc);
    for (; i < dim; i++) {
        float v = res ? x[i] + res[i] : x[i];
        if (res) sum[i] = v;
        ss += v * v;
    }
    const float *h = res ? sum : x;
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + i), vinv),
                                                _mm256_loadu_ps(w + i)));
    for (; i < dim; i++) out[i] = (h[i] * inv) * w[i];
}

/* x, res (or NULL), sum (written when res is given), out: [rows, dim] contiguous; w: [dim]. */
void rms_norm(const float *x, const float *res, const float *w, int64_t rows, int64_t dim, float eps,
              float *sum, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * dim, res ? res + r * dim : 0, w, dim, eps, res ? sum + r * dim : 0, out + r * dim);
}

/* x: rows of `row_stride` floats, each starting with `heads` heads of head_dim floats; cos, sin:
 * [rows, head_dim / 2] contiguous. In place. */
void rotary(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
            const float *cos, const float *sin, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(x1 + i, _mm256_sub_ps(_mm256_mul_ps(a, vc), _mm256_mul_ps(b, vs)));
                _mm256_storeu_ps(x2 + i, _mm256_add_ps(_mm256_mul_ps(b, vc), _mm256_mul_ps(a, vs)));
            }
            for (; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
