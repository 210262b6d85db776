/* Paged attention for decode and verify rows on x86 CPUs with AVX2 and FMA, float32.
 *
 * Each query token reads its request's keys and values where they lie in the paged cache
 * ([num_blocks, block_size, Hkv, D] per layer), through the block table: nothing is gathered
 * or copied first. The copy is what the SDPA path pays per layer (gather the context into a
 * padded batch, then attend), and at tens of requests it costs more than the attention.
 *
 * Visible keys of token t: positions 0 .. dense[t] - 1 (its causal context), then the
 * positions extra_pos[extra_ptr[t] .. extra_ptr[t + 1] - 1] (a tree node's ancestors and
 * itself, in depth order). One task per (request, KV head) computes all the request's rows
 * (at most 16) and their G = Hq / Hkv query heads together, so a key or value row that several
 * rows see is read once per task:
 *     1. scores s[r][j] = scale * (q_r . k_j), 8 lanes over D, lanes summed in a fixed order;
 *     2. p[r][j] = exp(s[r][j] - max_j s[r]), summed over j in key order;
 *     3. out_r = (sum_j p[r][j] v_j) / sum_j p[r][j], accumulated in key order.
 * Every sum runs in an order fixed by the token's own keys, so a row's result does not depend
 * on the batch around it, on the thread that runs it or on the number of threads.
 *
 * exp is a polynomial (exp_ps below): relative error ~2e-7 on the range softmax uses.
 */
#include <immintrin.h>
#include "simd.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_ROWS 16 /* query tokens per request */

/* exp(x) for x <= 0 (softmax arguments): 2^n * 2^f, n = round(x / ln 2), f in [-1/2, 1/2],
 * 2^f by its Taylor series in f * ln 2 to the 7th power; below -87 the result is 0. */
static inline __m256 exp_ps(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2 = _mm256_set1_ps(0.693147180559945309f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2, x); /* x - n ln 2, |r| <= ln2 / 2 */
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float dot(const float *a, const float *b, int64_t vecs) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < vecs; c++)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * c), _mm256_loadu_ps(b + 8 * c), acc);
    return hsum(acc);
}

/* p[j] = exp(s[j] - max s) for j < n, in place; returns their sum (8 lanes, then the lanes). */
static float softmax_numerators(float *s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    if (j < n) { /* the last n % 8 keys, padded with exp(-inf) = 0 */
        float buf[8];
        for (int64_t i = 0; i < 8; i++) buf[i] = j + i < n ? s[j + i] - m : -1e30f;
        __m256 p = exp_ps(_mm256_loadu_ps(buf));
        _mm256_storeu_ps(buf, p);
        for (int64_t i = 0; j + i < n; i++) s[j + i] = buf[i];
        sum = _mm256_add_ps(sum, p);
    }
    return hsum(sum);
}

/* One request's rows t0 .. t1 - 1 and KV head h, each with its G query heads. The keys every
 * row sees (positions below `shared`) are read once for all of them; each row's own further
 * keys after. Row (t, g) has n_t = dense[t] + extras keys, indexed j in position-list order,
 * and every sum over them runs in that order, so its bits do not depend on the other rows. */
static void one_task(int64_t t0, int64_t t1, int64_t h, const float *q, int64_t q_stride, int64_t Hq, int64_t Hkv,
                     int64_t D, const float *k_cache, const float *v_cache, int64_t block_size,
                     const int64_t *table, const int64_t *dense, const int64_t *extra_ptr,
                     const int64_t *extra_pos, int64_t max_keys, float scale, float *out,
                     float *scores, float *acc, int64_t *slots) {
    const int64_t G = Hq / Hkv, vecs = D / 8, R = (t1 - t0) * G;
    int64_t shared = dense[t0];
    for (int64_t t = t0 + 1; t < t1; t++) shared = dense[t] < shared ? dense[t] : shared;
    for (int64_t j = 0; j < shared; j++)
        slots[j] = ((table[j / block_size] * block_size + j % block_size) * Hkv + h) * D;
#define SLOT(pos) (((table[(pos) / block_size] * block_size + (pos) % block_size) * Hkv + h) * D)
#define POS(t, j) ((j) < dense[t] ? (j) : extra_pos[extra_ptr[t] + (j) - dense[t]])
    /* 1. scores: row r = (t - t0) * G + g at scores[r * max_keys + j] */
    for (int64_t j = 0; j < shared; j++) {
        const float *k = k_cache + slots[j];
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) { /* four rows' chains side by side */
            const float *q0 = q + t0 * q_stride + h * G * D;
#define QROW(x) (q0 + ((x) / G) * q_stride + ((x) % G) * D)
            const float *a = QROW(r), *b = QROW(r + 1), *c = QROW(r + 2), *d = QROW(r + 3);
#undef QROW
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t v = 0; v < vecs; v++) {
                const __m256 kv = _mm256_loadu_ps(k + 8 * v);
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * v), kv, s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(b + 8 * v), kv, s1);
                s2 = _mm256_fmadd_ps(_mm256_loadu_ps(c + 8 * v), kv, s2);
                s3 = _mm256_fmadd_ps(_mm256_loadu_ps(d + 8 * v), kv, s3);
            }
            scores[r * max_keys + j] = hsum(s0) * scale;
            scores[(r + 1) * max_keys + j] = hsum(s1) * scale;
            scores[(r + 2) * max_keys + j] = hsum(s2) * scale;
            scores[(r + 3) * max_keys + j] = hsum(s3) * scale;
        }
        for (; r < R; r++) {
            const int64_t t = t0 + r / G, g = r % G;
            scores[r * max_keys + j] = dot(q + t * q_stride + (h * G + g) * D, k, vecs) * scale;
        }
    }
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = dense[t] + extra_ptr[t + 1] - extra_ptr[t];
        for (int64_t j = shared; j < n; j++) {
            const float *k = k_cache + SLOT(POS(t, j));
            for (int64_t g = 0; g < G; g++)
                scores[((t - t0) * G + g) * max_keys + j] = dot(q + t * q_stride + (h * G + g) * D, k, vecs) * scale;
        }
    }
    /* 2. probabilities (unnormalised) and their sums */
    float total[MAX_ROWS * MAX_GROUP];
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++)
            total[(t - t0) * G + g] = softmax_numerators(scores + ((t - t0) * G + g) * max_keys,
                                                         dense[t] + extra_ptr[t + 1] - extra_ptr[t]);
    /* 3. weighted values, one row at a time with up to 8 vectors of accumulators in registers
     * (V rows of this task stay in cache between rows) */
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = dense[t] + extra_ptr[t + 1] - extra_ptr[t];
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = (t - t0) * G + g;
            const float *p = scores + r * max_keys;
            for (int64_t c0 = 0; c0 < vecs; c0 += 8) {
                const int64_t cn = vecs - c0 < 8 ? vecs - c0 : 8;
                __m256 a[8];
                for (int64_t c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
                for (int64_t j = 0; j < n; j++) {
                    const float *v = v_cache + (j < shared ? slots[j] : SLOT(POS(t, j))) + 8 * c0;
                    const __m256 pj = _mm256_set1_ps(p[j]);
                    if (cn == 8) {
#pragma GCC unroll 8
                        for (int64_t c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), a[c]);
                    } else {
                        for (int64_t c = 0; c < cn; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), a[c]);
                    }
                }
                for (int64_t c = 0; c < cn; c++) _mm256_storeu_ps(acc + r * D + 8 * (c0 + c), a[c]);
            }
        }
    }
#undef SLOT
#undef POS
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = (t - t0) * G + g;
            const __m256 inv = _mm256_set1_ps(1.0f / total[r]);
            float *o = out + (t * Hq + h * G + g) * D;
            for (int64_t c = 0; c < vecs; c++)
                _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * c), inv));
        }
}

/* q: T rows of q_stride floats, each starting with [Hq, D]; out: [T, Hq, D]; caches: [num_blocks,
 * block_size, Hkv, D]; block_tables: [B, max_blocks];
 * query_start: [B + 1] (request b's tokens are query_start[b] .. query_start[b + 1] - 1, at most
 * MAX_ROWS); dense: [T]; extra_ptr: [T + 1]; extra_pos: [extra_ptr[T]]. D % 8 == 0,
 * Hq / Hkv <= MAX_GROUP, max_keys >= every token's dense + extras (checked by the caller).
 * k_new, v_new (or NULL): the step's new keys and values, T rows of new_stride floats, each
 * starting with [Hkv, D], written first to the cache slots slot_mapping[t] (the step's own rows
 * then read them there): the write and the attention in one call.
 * Returns 0; -1 when scratch memory could not be allocated; -2 (before any work) when a request
 * has more than MAX_ROWS tokens. */
int paged_attention(const float *q, int64_t q_stride, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                    float *k_cache, float *v_cache, int64_t block_size,
                    const int64_t *block_tables, int64_t max_blocks, const int64_t *query_start,
                    const int64_t *dense, const int64_t *extra_ptr, const int64_t *extra_pos,
                    int64_t max_keys, float scale, const float *k_new, const float *v_new,
                    int64_t new_stride, const int64_t *slot_mapping, float *out, int threads) {
    const int64_t G = Hq / Hkv, tasks = B * Hkv, rows = MAX_ROWS * G;
    for (int64_t b = 0; b < B; b++)
        if (query_start[b + 1] - query_start[b] > MAX_ROWS) return -2;
    if (k_new)
        for (int64_t t = 0; t < query_start[B]; t++) {
            memcpy(k_cache + slot_mapping[t] * Hkv * D, k_new + t * new_stride, sizeof(float) * (size_t)(Hkv * D));
            memcpy(v_cache + slot_mapping[t] * Hkv * D, v_new + t * new_stride, sizeof(float) * (size_t)(Hkv * D));
        }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * max_keys + 8));
        float *acc = malloc(sizeof(float) * (size_t)(rows * D));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)(max_keys + 1));
        if (!scores || !acc || !slots) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            if (!scores || !acc || !slots) continue;
            const int64_t b = i / Hkv, h = i % Hkv;
            if (query_start[b + 1] > query_start[b])
                one_task(query_start[b], query_start[b + 1], h, q, q_stride, Hq, Hkv, D, k_cache, v_cache,
                         block_size, block_tables + b * max_blocks, dense, extra_ptr, extra_pos,
                         max_keys, scale, out, scores, acc, slots);
        }
        free(scores);
        free(acc);
        free(slots);
    }
    return failed ? -1 : 0;
}
