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
 * rows see is read once per task; a request whose rows see more than PARTITION keys is split
 * into one task per PARTITION keys of the rows' key lists (a fixed size: never chosen by the
 * batch), whose (max, sum, weighted values) merge in partition order (merge_partitions):
 *     1. scores s[r][j] = scale * (q_r . k_j), 8 lanes over D, lanes summed in a fixed order;
 *     2. p[r][j] = exp(s[r][j] - max_j s[r]), summed over j in key order;
 *     3. out_r = (sum_j p[r][j] v_j) / sum_j p[r][j], accumulated in key order.
 * Every sum runs in an order fixed by the token's own keys, so a row's result does not depend
 * on the batch around it, on the thread that runs it or on the number of threads. Passes 1 and
 * 3 also run with AVX-512 (paged_attention_wide): the same chains and lane sums, two rows'
 * 8-lane chains side by side in one vector for the scores, 16 lanes of D for the values, so
 * the same bits.
 *
 * Memory: a token's keys (and values) of all KV heads lie together ([Hkv, D]), so a task reads
 * one head's D floats of every Hkv * D: a strided stream the hardware prefetchers serve poorly
 * (a decode row over thousands of keys read the cache at under half the machine's bandwidth).
 * Where there are tasks enough for every thread, a thread takes a partition's KV heads in turn
 * (scheduling only: no sum changes order), and the first head's passes ask for the whole
 * tokens' rows into L2 ahead of use (prefetch_token), so the cache is read in order and the
 * other heads find their rows there; every pass also asks for its own head's rows PREFETCH_KEYS
 * keys ahead (prefetch_row). Not where a request's last partition holds under half a partition
 * and there are fewer than two partitions a thread: one thread would take the full partition's
 * heads while another had the few keys of the last.
 *
 * exp is a polynomial (exp_ps below): relative error ~2e-7 on the range softmax uses.
 */
#include <immintrin.h>
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_ROWS 16 /* query tokens per request */
#ifndef PARTITION
#define PARTITION 256 /* keys of a task: a context of more is split, its partitions merged (one
                         * request of 257-512 keys: six tasks for the threads, not three) */
#endif
#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 32 /* how far ahead (keys) the passes ask for their key and value rows */
#endif

/* Asks for the cache lines of one head's key or value row (`bytes` from p) ahead of use, into L1. */
static inline void prefetch_row(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* The same for a token's row of every KV head, into L2 (for the heads a thread runs next). */
static inline void prefetch_token(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}

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

/* p[j] = exp(s[j] - max s) for j < n, in place; returns their sum (8 lanes, then the lanes) and
 * sets *max_out to max s (n = 0: 0 and -inf). */
static float softmax_numerators(float *s, int64_t n, float *max_out) {
    if (n <= 0) {
        *max_out = -INFINITY;
        return 0.0f;
    }
    float m = s[0]; /* the largest score, 8 lanes at a time (a maximum is exact in any order) */
    int64_t j = 0;
    if (n >= 8) {
        __m256 mx = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
        m = hmax(mx);
    }
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    *max_out = m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
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

/* [hsum(a[0]), ..., hsum(a[7])]: eight vectors' lanes summed at once, in hsum's order (halves,
 * then pairs, then the last two), so every score has the bits hsum would give it. */
static inline __m256 hsum8(const __m256 *a) {
    __m256 s[4];
    for (int i = 0; i < 4; i++) /* [lo + hi of a[2i] | lo + hi of a[2i + 1]] */
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    /* per key (b0 + b2, b1 + b3), keys 0 2 | 1 3 and 4 6 | 5 7 */
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(w, z, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(w, z, _MM_SHUFFLE(3, 1, 3, 1))); /* keys 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Scores of rows 0 .. R - 1 (row r: query row qrows[r]) against the nk <= 8 keys k[0 .. nk - 1],
 * to s[r * stride + i]: each an FMA chain over D in 8 lanes (eight chains in flight), lanes
 * summed as hsum does. */
static inline void score_keys(const float *const *qrows, int64_t R, const float *const *k, int64_t nk,
                              int64_t vecs, float scale, float *s, int64_t stride) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t r = 0; r < R; r++) {
        const float *q = qrows[r];
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t v = 0; v < vecs; v++) {
            const __m256 qv = _mm256_loadu_ps(q + 8 * v);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + 8 * v), a[i]);
        }
        const __m256 out = _mm256_mul_ps(hsum8(a), sc);
        if (nk == 8) {
            _mm256_storeu_ps(s + r * stride, out);
        } else {
            float buf[8];
            _mm256_storeu_ps(buf, out);
            memcpy(s + r * stride, buf, sizeof(float) * (size_t)nk);
        }
    }
}

/* The value pass at two widths (attention_values.h): AVX2, and AVX-512 where the CPU has it and
 * it is chosen (use_avx512); the same bits either way. */
static int use_avx512 = -1; /* -1: not decided yet */

#define VP_ATTR
#define VP_VEC __m256
#define VP_LANES 8
#define VP_ZERO() _mm256_setzero_ps()
#define VP_BCAST(x) _mm256_broadcast_ss(x)
#define VP_LOAD(x) _mm256_loadu_ps(x)
#define VP_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VP_STORE(x, v) _mm256_storeu_ps(x, v)
#define VP_ROWS 2
#define VP_SUMS value_sums8
#define VP_NAME value_pass8
#include "attention_values.h"
#undef VP_ATTR
#undef VP_VEC
#undef VP_LANES
#undef VP_ZERO
#undef VP_BCAST
#undef VP_LOAD
#undef VP_FMA
#undef VP_STORE
#undef VP_ROWS
#undef VP_SUMS
#undef VP_NAME

#define VP_ATTR __attribute__((target("avx512f")))
#define VP_VEC __m512
#define VP_LANES 16
#define VP_ZERO() _mm512_setzero_ps()
#define VP_BCAST(x) _mm512_set1_ps(*(x))
#define VP_LOAD(x) _mm512_loadu_ps(x)
#define VP_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VP_STORE(x, v) _mm512_storeu_ps(x, v)
#define VP_ROWS 4
#define VP_SUMS value_sums16
#define VP_NAME value_pass16
#include "attention_values.h"

/* Whether the value pass runs with AVX-512: on = -1 asks (the CPU's answer at first use), 0 / 1
 * set it (off always works; on only where the CPU has AVX-512F). */
int paged_attention_wide(int on) {
    if (on == 0)
        use_avx512 = 0;
    else if (on > 0 || use_avx512 < 0)
        use_avx512 = __builtin_cpu_supports("avx512f") != 0;
    return use_avx512;
}

/* The scores of rows 0 .. R - 1 against the shared keys 0 .. shared - 1 with AVX-512: two rows
 * in one vector (row 2i's 8 lanes low, row 2i + 1's high, packed once into `pairs`, (R + 1) / 2
 * * 2D floats), each key's 8 lanes loaded once for both halves; the chains and the lane sums
 * are score_keys', so are the bits. */
__attribute__((target("avx512f"))) static void score_shared16(
        const float *const *qrows, int64_t R, const float *k_cache, const int64_t *slots, int64_t shared,
        int64_t vecs, float scale, float *scores, int64_t max_keys, float *pairs, int64_t token_bytes) {
    const int64_t P = (R + 1) / 2;
    for (int64_t i = 0; i < P; i++) {
        const float *qa = qrows[2 * i], *qb = qrows[2 * i + 1 < R ? 2 * i + 1 : 2 * i];
        for (int64_t v = 0; v < vecs; v++) {
            memcpy(pairs + (i * vecs + v) * 16, qa + 8 * v, 8 * sizeof(float));
            memcpy(pairs + (i * vecs + v) * 16 + 8, qb + 8 * v, 8 * sizeof(float));
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < shared; j += 8) {
        const int64_t nk = shared - j < 8 ? shared - j : 8;
        const float *k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = k_cache + slots[j + (i < nk ? i : 0)];
        for (int64_t i = j + PREFETCH_KEYS; i < j + PREFETCH_KEYS + 8 && i < shared; i++)
            if (token_bytes) prefetch_token(k_cache + slots[i], token_bytes);
            else prefetch_row(k_cache + slots[i], vecs * 32);
        for (int64_t i = 0; i < P; i++) {
            const float *qq = pairs + i * vecs * 16;
            __m512 a[8];
            for (int c = 0; c < 8; c++) a[c] = _mm512_setzero_ps();
            for (int64_t v = 0; v < vecs; v++) {
                const __m512 qv = _mm512_loadu_ps(qq + 16 * v);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    a[c] = _mm512_fmadd_ps(qv, _mm512_castpd_ps(_mm512_broadcast_f64x4(
                                                   _mm256_castps_pd(_mm256_loadu_ps(k[c] + 8 * v)))), a[c]);
            }
            __m256 lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                lo[c] = _mm512_castps512_ps256(a[c]);
                hi[c] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[c]), 1));
            }
            float out[16];
            _mm256_storeu_ps(out, _mm256_mul_ps(hsum8(lo), sc));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(hsum8(hi), sc));
            memcpy(scores + 2 * i * max_keys + j, out, sizeof(float) * (size_t)nk);
            if (2 * i + 1 < R) memcpy(scores + (2 * i + 1) * max_keys + j, out + 8, sizeof(float) * (size_t)nk);
        }
    }
}

/* One request's rows t0 .. t1 - 1 and KV head h, each with its G query heads. The keys every
 * row sees (positions below `shared`) are read once for all of them; each row's own further
 * keys after. Row (t, g) has n_t = dense[t] + extras keys, indexed j in position-list order,
 * and every sum over them runs in that order, so its bits do not depend on the other rows.
 * Scores take 8 keys at a time (8 chains in flight, their lanes summed together); value sums
 * take 2 rows at a time (4 with AVX-512) over 4 vectors of D (each value vector loaded once for
 * them). Only the keys lo .. hi - 1 of each row's key list (its partition); with part_m, the
 * rows' (max, sum, weighted values) go to the partition buffers instead of out. heads_in_turn:
 * this thread runs the partition's KV heads one after another (head 0 then asks for every
 * head's rows). */
static void one_task(int64_t t0, int64_t t1, int64_t h, const float *q, int64_t q_stride, int64_t Hq, int64_t Hkv,
                     int64_t D, const float *k_cache, const float *v_cache, int64_t block_size,
                     const int64_t *table, const int64_t *dense, const int64_t *extra_ptr,
                     const int64_t *extra_pos, int64_t max_keys, float scale, float *out,
                     float *scores, float *acc, int64_t *slots, float *pairs, int64_t lo, int64_t hi,
                     float *part_m, float *part_l, float *part_acc, int64_t part, int64_t NP, int heads_in_turn) {
    const int64_t G = Hq / Hkv, vecs = D / 8, R = (t1 - t0) * G;
    const int64_t token_bytes = heads_in_turn && h == 0 ? Hkv * D * (int64_t)sizeof(float) : 0;
    int64_t shared = dense[t0];
    for (int64_t t = t0 + 1; t < t1; t++) shared = dense[t] < shared ? dense[t] : shared;
    const int64_t shared_hi = shared < hi ? shared : hi;
    /* slots[0 .. shared - 1]: the shared keys; then, per token, the slots of its own keys */
    int64_t own_at[MAX_ROWS + 1];
    own_at[0] = shared;
    for (int64_t j = lo; j < shared_hi;) { /* block by block: no division per key */
        const int64_t blk = j / block_size, end = (blk + 1) * block_size < shared_hi ? (blk + 1) * block_size : shared_hi;
        for (int64_t at = (table[blk] * block_size + j - blk * block_size) * Hkv + h; j < end; j++, at += Hkv)
            slots[j] = at * D;
    }
#define SLOT(pos) (((table[(pos) / block_size] * block_size + (pos) % block_size) * Hkv + h) * D)
#define POS(t, j) ((j) < dense[t] ? (j) : extra_pos[extra_ptr[t] + (j) - dense[t]])
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = dense[t] + extra_ptr[t + 1] - extra_ptr[t], at = own_at[t - t0];
        for (int64_t j = shared; j < n; j++) slots[at + j - shared] = SLOT(POS(t, j));
        own_at[t - t0 + 1] = at + n - shared;
    }
#undef SLOT
#undef POS
    const float *qrows[MAX_ROWS * MAX_GROUP];
    for (int64_t r = 0; r < R; r++) qrows[r] = q + (t0 + r / G) * q_stride + (h * G + r % G) * D;
    /* 1. scores: row r = (t - t0) * G + g at scores[r * max_keys + j] */
    if (use_avx512 > 0 && R > 1 && shared_hi > lo)
        score_shared16(qrows, R, k_cache, slots + lo, shared_hi - lo, vecs, scale, scores + lo, max_keys, pairs,
                       token_bytes);
    else for (int64_t j = lo; j < shared_hi; j += 8) {
        const int64_t nk = shared_hi - j < 8 ? shared_hi - j : 8;
        const float *k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = k_cache + slots[j + (i < nk ? i : 0)];
        for (int64_t i = j + PREFETCH_KEYS; i < j + PREFETCH_KEYS + 8 && i < shared_hi; i++)
            if (token_bytes) prefetch_token(k_cache + slots[i], token_bytes);
            else prefetch_row(k_cache + slots[i], vecs * 32);
        score_keys(qrows, R, k, nk, vecs, scale, scores + j, max_keys);
    }
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n_all = dense[t] + extra_ptr[t + 1] - extra_ptr[t], at = own_at[t - t0];
        const int64_t n = n_all < hi ? n_all : hi;
        for (int64_t j = lo > shared ? lo : shared; j < n; j += 8) {
            const int64_t nk = n - j < 8 ? n - j : 8;
            const float *k[8];
            for (int64_t i = 0; i < 8; i++) k[i] = k_cache + slots[at + j - shared + (i < nk ? i : 0)];
            score_keys(qrows + (t - t0) * G, G, k, nk, vecs, scale, scores + (t - t0) * G * max_keys + j, max_keys);
        }
    }
    /* 2. probabilities (unnormalised) and their sums, over the window */
    float total[MAX_ROWS * MAX_GROUP], top[MAX_ROWS * MAX_GROUP];
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n_all = dense[t] + extra_ptr[t + 1] - extra_ptr[t], n = (n_all < hi ? n_all : hi) - lo;
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = (t - t0) * G + g;
            total[r] = softmax_numerators(scores + r * max_keys + lo, n, top + r);
        }
    }
    /* 3. weighted values */
    if (use_avx512 > 0 && D % 16 == 0)
        value_pass16(R, G, t0, D, scores, max_keys, dense, extra_ptr, slots, own_at, shared, lo, hi, v_cache, acc,
                     token_bytes);
    else
        value_pass8(R, G, t0, D, scores, max_keys, dense, extra_ptr, slots, own_at, shared, lo, hi, v_cache, acc,
                    token_bytes);
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = (t - t0) * G + g, row = t * Hq + h * G + g;
            if (part_m) { /* one partition of several: merged by merge_partitions */
                part_m[row * NP + part] = top[r];
                part_l[row * NP + part] = total[r];
                memcpy(part_acc + (row * NP + part) * D, acc + r * D, sizeof(float) * (size_t)D);
                continue;
            }
            const __m256 inv = _mm256_set1_ps(1.0f / total[r]);
            float *o = out + row * D;
            for (int64_t c = 0; c < vecs; c++)
                _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * c), inv));
        }
}

/* Row `row`'s output from its NP partitions' (max, sum, weighted values), in partition order,
 * empty ones skipped: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p. A row with one
 * non-empty partition gets exactly the one-partition result (weight e^0 = 1). */
static void merge_partitions(int64_t row, int64_t NP, int64_t D, const float *part_m, const float *part_l,
                             const float *part_acc, float *out) {
    float M = -INFINITY;
    for (int64_t p = 0; p < NP; p++)
        M = part_m[row * NP + p] > M ? part_m[row * NP + p] : M;
    float l = 0.0f, *o = out + row * D;
    const int64_t vecs = D / 8;
    for (int64_t c = 0; c < vecs; c++) _mm256_storeu_ps(o + 8 * c, _mm256_setzero_ps());
    for (int64_t p = 0; p < NP; p++) {
        if (part_l[row * NP + p] == 0.0f) continue; /* no key of this row in the partition */
        const float w = expf(part_m[row * NP + p] - M);
        l = fmaf(w, part_l[row * NP + p], l);
        const __m256 wv = _mm256_set1_ps(w);
        const float *a = part_acc + (row * NP + p) * D;
        for (int64_t c = 0; c < vecs; c++)
            _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(a + 8 * c), _mm256_loadu_ps(o + 8 * c)));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / l);
    for (int64_t c = 0; c < vecs; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), inv));
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
    const int64_t G = Hq / Hkv, rows = MAX_ROWS * G;
    for (int64_t b = 0; b < B; b++)
        if (query_start[b + 1] - query_start[b] > MAX_ROWS) return -2;
    if (k_new)
        for (int64_t t = 0; t < query_start[B]; t++) {
            memcpy(k_cache + slot_mapping[t] * Hkv * D, k_new + t * new_stride, sizeof(float) * (size_t)(Hkv * D));
            memcpy(v_cache + slot_mapping[t] * Hkv * D, v_new + t * new_stride, sizeof(float) * (size_t)(Hkv * D));
        }
    /* tasks: (request, KV head, partition of PARTITION keys of its rows' key lists); a request
     * whose rows all have at most PARTITION keys is one partition, written straight to out */
    int64_t NP = 1, num_tasks = 0, short_tail = 0;
    int64_t *parts = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!parts) return -1;
    parts[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t most = 0;
        for (int64_t t = query_start[b]; t < query_start[b + 1]; t++) {
            const int64_t n = dense[t] + extra_ptr[t + 1] - extra_ptr[t];
            most = n > most ? n : most;
        }
        const int64_t np = most > PARTITION ? (most + PARTITION - 1) / PARTITION : 1;
        NP = np > NP ? np : NP;
        short_tail |= np > 1 && most - (np - 1) * PARTITION < PARTITION / 2; /* a last partition of few keys */
        parts[b + 1] = parts[b] + np;
    }
    num_tasks = parts[B] * Hkv;
    float *part_m = NULL, *part_l = NULL, *part_acc = NULL;
    const int64_t T = query_start[B];
    if (NP > 1) {
        part_m = malloc(sizeof(float) * (size_t)(T * Hq * NP));
        part_l = malloc(sizeof(float) * (size_t)(T * Hq * NP));
        part_acc = malloc(sizeof(float) * (size_t)(T * Hq * NP * D));
        if (!part_m || !part_l || !part_acc) {
            free(parts), free(part_m), free(part_l), free(part_acc);
            return -1;
        }
        for (int64_t i = 0; i < T * Hq * NP; i++) part_m[i] = -INFINITY, part_l[i] = 0.0f;
    }
    int failed = 0;
    const int64_t chunk = Hkv > 1 && num_tasks >= (int64_t)threads * Hkv
                          && (!short_tail || parts[B] >= 2 * (int64_t)threads) ? Hkv : 1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * max_keys + 8));
        float *acc = malloc(sizeof(float) * (size_t)(rows * D));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)((MAX_ROWS + 1) * max_keys + 1)); /* shared + own keys */
        float *pairs = malloc(sizeof(float) * (size_t)((rows + 1) * D)); /* score_shared16's row pairs */
        if (!scores || !acc || !slots || !pairs) {
#pragma omp atomic write
            failed = 1;
        }
        /* a thread takes a partition's KV heads in turn where there are tasks enough for every
         * thread (the cache then read in order); each head a task of its own otherwise */
#pragma omp for schedule(dynamic, chunk)
        for (int64_t i = 0; i < num_tasks; i++) {
            if (!scores || !acc || !slots || !pairs) continue;
            const int64_t h = i % Hkv, slot = i / Hkv;
            int64_t b = 0;
            while (parts[b + 1] <= slot) b++;
            const int64_t part = slot - parts[b], np = parts[b + 1] - parts[b];
            if (query_start[b + 1] > query_start[b])
                one_task(query_start[b], query_start[b + 1], h, q, q_stride, Hq, Hkv, D, k_cache, v_cache,
                         block_size, block_tables + b * max_blocks, dense, extra_ptr, extra_pos,
                         max_keys, scale, out, scores, acc, slots, pairs,
                         np > 1 ? part * PARTITION : 0, np > 1 ? (part + 1) * PARTITION : INT64_MAX,
                         np > 1 ? part_m : NULL, part_l, part_acc, part, NP, chunk > 1);
        }
        free(scores);
        free(acc);
        free(slots);
        free(pairs);
        if (NP > 1) { /* the rows of requests of several partitions, merged in partition order */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                if (parts[b + 1] - parts[b] < 2) continue;
                for (int64_t row = query_start[b] * Hq; row < query_start[b + 1] * Hq; row++)
                    merge_partitions(row, NP, D, part_m, part_l, part_acc, out);
            }
        }
    }
    free(parts);
    free(part_m);
    free(part_l);
    free(part_acc);
    return failed ? -1 : 0;
}
