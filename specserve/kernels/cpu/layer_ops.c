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
 * argmax: per row, the index of the largest value, the first one on ties, the first NaN if
 *     any (exactly torch.argmax's answer; a row's answer depends on that row alone). PyTorch's
 *     CPU argmax over a 49k vocabulary takes ~50 us a row here; this reads the row twice
 *     (its max, then where the max first is) at memory speed.
 * top_logprobs: per row, the k largest values (descending, the lower index first on ties) as
 *     log-softmax values, x - (max + log(sum(exp(x - max)))), exp by a degree-6 polynomial
 *     (relative error ~1e-7): one read for the max and the top k, one for the sum. For drafting
 *     (EAGLE, Medusa), where PyTorch's log_softmax then topk cost ~25 us per 8k-wide row here.
 * silu_mul: per row of [gate | up], silu(gate) * up = gate / (1 + exp(-gate)) * up, exp by the
 *     same polynomial (over the whole float range here): a decode step's MLP in one call where
 *     PyTorch's silu then mul cost ~20 us at one row here (a thread team woken for 1.5k floats).
 *     Elementwise: a row's result depends on that row alone.
 * copy_slots: KV cache slots moved within every layer's K and V (accepted draft paths moving
 *     next to their roots): one call where PyTorch takes an index tensor, then a gather and a
 *     scatter per cache, ~20 us warm and 3-4x that between a step's other work. Bytes only.
 * greedy_walk: greedy verification of every request's draft tree: from its root row, the argmax
 *     (as argmax above) of each row on the way picks the child that matches it, so only the rows
 *     of the accepted path are read, where an argmax of every row reads them all.
 * Compiled with -ffp-contract=off (cbuild.FLAGS): no product is fused into a sum.
 */
#include <immintrin.h>
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static int64_t argmax_row(const float *x, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b);
        m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        m0 = _mm256_max_ps(m0, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    float m = hmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    int has_nan = _mm256_movemask_ps(nan);
    for (; i < n; i++) {
        if (x[i] != x[i]) has_nan = 1;
        else if (x[i] > m) m = x[i];
    }
    if (has_nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    const __m256 vm = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;
}

/* Greedy verification. x: `rows` rows of n floats (row r at x + r * row_stride); B requests,
 * M nodes in all. in: root[B], start[B + 1], tok[M], par[M], one after the other: request b's
 * tree has nodes start[b] .. start[b + 1] - 1 of tok and par (its own indices: par -1 for a
 * child of the root, siblings distinct), its root at row root[b] and node i at row
 * root[b] + 1 + i. From the root, the child whose token is the row's argmax is accepted and its
 * row read next (children are looked for after their parent only: a malformed tree cannot
 * loop). out: path[M], len[B], final[B]: the accepted nodes go to path[start[b]..], their
 * count to len[b], the argmax of the last row read (the token after them) to final[b].
 * Returns -1, having read nothing, when a tree's rows run past x. */
int greedy_walk(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t B, int64_t M,
                const int64_t *in, int64_t *out, int threads) {
    const int64_t *root = in, *start = in + B, *tok = in + 2 * B + 1, *par = tok + M;
    int64_t *path = out, *len = out + M, *final = out + M + B;
    for (int64_t b = 0; b < B; b++)
        if (root[b] < 0 || root[b] + start[b + 1] - start[b] >= rows) return -1;
#pragma omp parallel for num_threads(threads) if (B > 1 && B * n >= 4 * PARALLEL_MIN) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const int64_t s = start[b], e = start[b + 1];
        int64_t row = root[b], at = -1, m = 0;
        for (;;) {
            const int64_t best = argmax_row(x + row * row_stride, n);
            int64_t next = -1;
            for (int64_t i = s + at + 1; i < e && next < 0; i++) /* children come after their parent */
                if (par[i] == at && tok[i] == best) next = i - s;
            if (next < 0) {
                final[b] = best;
                break;
            }
            path[s + m++] = next;
            at = next;
            row = root[b] + 1 + next;
        }
        len[b] = m;
    }
    return 0;
}

/* x: rows of n floats, row r at x + r * row_stride; out: [rows] int64. */
void argmax(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * n >= 4 * PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, n);
}

/* exp(x) in 8 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2; x clamped to [-87, 88] (below -87
 * it is ~0; above 88 it would overflow). */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                             _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Insert (v, i) among the best `len` so far (val descending; after the equal ones), the last
 * slot giving way. */
static inline void keep_top(float *val, int64_t *idx, int64_t len, float v, int64_t i) {
    int64_t j = len - 1;
    while (j > 0 && val[j - 1] < v) {
        val[j] = val[j - 1], idx[j] = idx[j - 1];
        j--;
    }
    val[j] = v, idx[j] = i;
}

static void top_row(const float *x, int64_t n, int64_t k, float *val, int64_t *idx) {
    int64_t i = 0;
    for (; i < k; i++) keep_top(val, idx, i + 1, x[i], i);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(mx, v);
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(val[k - 1]), _CMP_GT_OQ));
        for (; hit; hit &= hit - 1) {
            int64_t at = i + __builtin_ctz(hit);
            if (x[at] > val[k - 1]) keep_top(val, idx, k, x[at], at);
        }
    }
    for (; i < n; i++)
        if (x[i] > val[k - 1]) keep_top(val, idx, k, x[i], i);
    const float m = val[0] > hmax(mx) ? val[0] : hmax(mx); /* the row's max */
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8)
        acc = _mm256_add_ps(acc, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
    float sum = hsum(acc);
    for (; i < n; i++) sum += expf(x[i] - m);
    const float lse = m + logf(sum);
    for (int64_t j = 0; j < k; j++) val[j] -= lse;
}

/* x: rows of n floats, row r at x + r * row_stride; 1 <= k <= n; val, idx: [rows, k]; the
 * columns mapped through d2t [n] when it is not NULL (a draft vocabulary's ids in the target's). */
void top_logprobs(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t k, const int64_t *d2t,
                  float *val, int64_t *idx, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * n >= 4 * PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        top_row(x + r * row_stride, n, k, val + r * k, idx + r * k);
        if (d2t)
            for (int64_t j = 0; j < k; j++) idx[r * k + j] = d2t[idx[r * k + j]];
    }
}

/* gate_up: [rows, 2 * inter] contiguous, each row gate then up; out: [rows, inter] contiguous. */
void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            __m256 vg = _mm256_loadu_ps(g + i);
            __m256 e = exp_ps(_mm256_sub_ps(zero, vg));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* k, v: caches of `layers` layers, slot s of layer l at base + l * layer_stride + s * slot_stride
 * (bytes), each slot `row_bytes` bytes; slot src[i] is copied to dst[i], i < n, in every layer of
 * both, every source read before any slot is written (as if gathered first: paths may overlap).
 * Returns 0, or -1 when out of memory (nothing copied). */
int copy_slots(char *k, char *v, int64_t layers, int64_t layer_stride, int64_t slot_stride, int64_t row_bytes,
               const int64_t *src, const int64_t *dst, int64_t n) {
    char *buf = malloc((size_t)(n * row_bytes));
    if (!buf) return -1;
    for (int c = 0; c < 2; c++)
        for (int64_t l = 0; l < layers; l++) {
            char *base = (c ? v : k) + l * layer_stride;
            for (int64_t i = 0; i < n; i++) memcpy(buf + i * row_bytes, base + src[i] * slot_stride, row_bytes);
            for (int64_t i = 0; i < n; i++) memcpy(base + dst[i] * slot_stride, buf + i * row_bytes, row_bytes);
        }
    free(buf);
    return 0;
}
