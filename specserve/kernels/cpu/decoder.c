/* A Llama-family model's decoder layers over one step's rows, float32, in one call.
 *
 * A decode step of the default model at one row spends about 40% of its time outside the
 * products when each layer's ten calls go through Python: module calls, the checks and
 * pointers of each kernel's wrapper, views and allocations, ~6 ms of a 15 ms step on a 2-core
 * Zen 4. Here the layers' loop runs in C and calls the same kernels the Python path calls,
 * in the same order on the same inputs, through pointers the caller takes from their
 * libraries (cpu_linear.c / a8_linear.c, layer_ops.c, paged_attention.c): so a row gets
 * exactly the bits the layer-by-layer path gives it, and every kernel stays the one place
 * its arithmetic lives. Per layer l, with r the residual stream (the embeddings before the
 * first layer) and y the previous layer's output:
 *
 *     h, r = rms_norm(y + r)                  (layer 0: h = rms_norm(r), no sum)
 *     qkv = h W_qkv; rotary on q and k         (in place)
 *     a = attention(q, write k, v to the cache) (paged_attention: one call, this layer's cache)
 *     h, r = rms_norm(a W_o + r)
 *     y = silu_mul(h W_gate_up) W_down
 *     [an aux layer: y + r copied out beside the final hidden states]
 *
 * then out = rms_norm(y + r) (the final norm). The products' kernels return a status (the
 * int8-activation ones, -1 when out of memory) or nothing (Proj.status says which).
 * Returns 0; -1 when a kernel could not allocate its scratch memory; -2 when attention was
 * given a request with more rows than it takes (the caller cuts them into runs). On an error
 * the layers before the failing one have written this step's K/V, as the Python path leaves
 * them when a kernel raises.
 */
#include <stdint.h>
#include <string.h>

typedef void (*linear_void_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const void *packed, int64_t N,
                               const float *scale, const float *bias, float *y, int64_t ldy, int threads);
typedef int (*linear_int_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const void *packed, int64_t N,
                             const float *scale, const float *bias, float *y, int64_t ldy, int threads);
typedef void (*rms_norm_fn)(const float *x, const float *res, const float *w, int64_t rows, int64_t dim, float eps,
                            float *sum, float *out, int threads);
typedef void (*rotary_fn)(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                          const float *cos, const float *sin, int threads);
typedef void (*silu_mul_fn)(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads);
typedef int (*attention_fn)(const float *q, int64_t q_stride, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            float *k_cache, float *v_cache, int64_t block_size, const int64_t *block_tables,
                            int64_t max_blocks, const int64_t *query_start, const int64_t *dense,
                            const int64_t *extra_ptr, const int64_t *extra_pos, int64_t max_keys, float scale,
                            const float *k_new, const float *v_new, int64_t new_stride,
                            const int64_t *slot_mapping, float *out, int threads);

/* A projection: its kernel (and whether that returns a status), packed weights, output
 * columns, scales (or NULL) and bias (or NULL). */
typedef struct {
    const void *fn;
    int64_t status;
    const void *packed;
    int64_t n;
    const float *scale, *bias;
} Proj;

typedef struct {
    Proj qkv, o, gate_up, down;
    const float *in_norm, *post_norm;
    float *k_cache, *v_cache; /* this layer's [num_blocks, block_size, Hkv, D] */
} Layer;

typedef struct {
    const void *rms_norm, *rotary, *silu_mul, *attention;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *final_norm;
} Model;

typedef struct { /* one step: its rows, their rotary tables and the attention's metadata */
    int64_t rows, runs, block_size, max_blocks, max_keys;
    const int64_t *block_tables, *query_start, *dense, *extra_ptr, *extra_pos, *slot_mapping;
    const float *cos, *sin; /* [rows, head_dim / 2] */
} Step;

static int project(const Proj *p, const float *x, int64_t M, int64_t K, float *y, int threads) {
    if (p->status)
        return ((linear_int_fn)p->fn)(x, M, K, K, p->packed, p->n, p->scale, p->bias, y, p->n, threads);
    ((linear_void_fn)p->fn)(x, M, K, K, p->packed, p->n, p->scale, p->bias, y, p->n, threads);
    return 0;
}

/* The floats of `work` a step of `rows` rows needs (decoder_layers' scratch). */
int64_t decoder_work(const Model *m, int64_t rows) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return rows * (2 * m->hidden + qkv + m->heads * m->head_dim + 3 * m->inter);
}

/* x: [rows, hidden] the step's embeddings, then the residual stream (overwritten); work: decoder_work(m, rows) floats;
 * aux: n_aux increasing layer indices whose output (the residual stream after them) goes to
 * out beside the final hidden states; out: [rows, out_stride], out_stride = hidden * (1 + n_aux). */
int decoder_layers(const Model *m, const Layer *layers, int64_t num_layers, const Step *s, float *x,
                   float *work, const int64_t *aux, int64_t n_aux, float *out, int64_t out_stride, int threads) {
    const int64_t T = s->rows, H = m->hidden, Hq = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t nq = Hq * D, nqkv = (Hq + 2 * Hkv) * D;
    float *res = x, *h = work, *y = h + T * H, *qkv = y + T * H, *attn = qkv + T * nqkv, *gu = attn + T * nq,
          *act = gu + T * 2 * I;
    const rms_norm_fn norm = (rms_norm_fn)m->rms_norm;
    const rotary_fn rotary = (rotary_fn)m->rotary;
    const silu_mul_fn silu_mul = (silu_mul_fn)m->silu_mul;
    const attention_fn attention = (attention_fn)m->attention;
    int64_t next_aux = 0;
    int rc;
    if (!T) return 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        if (l == 0)
            norm(res, NULL, L->in_norm, T, H, m->eps, NULL, h, threads);
        else
            norm(y, res, L->in_norm, T, H, m->eps, res, h, threads);
        if ((rc = project(&L->qkv, h, T, H, qkv, threads))) return rc;
        rotary(qkv, T, nqkv, Hq + Hkv, D, s->cos, s->sin, threads);
        rc = attention(qkv, nqkv, s->runs, Hq, Hkv, D, L->k_cache, L->v_cache, s->block_size, s->block_tables,
                       s->max_blocks, s->query_start, s->dense, s->extra_ptr, s->extra_pos, s->max_keys, m->scale,
                       qkv + nq, qkv + nq + Hkv * D, nqkv, s->slot_mapping, attn, threads);
        if (rc) return rc;
        if ((rc = project(&L->o, attn, T, nq, y, threads))) return rc;
        norm(y, res, L->post_norm, T, H, m->eps, res, h, threads);
        if ((rc = project(&L->gate_up, h, T, H, gu, threads))) return rc;
        silu_mul(gu, T, I, act, threads);
        if ((rc = project(&L->down, act, T, I, y, threads))) return rc;
        if (next_aux < n_aux && aux[next_aux] == l) {
            next_aux++;
            for (int64_t t = 0; t < T; t++) {
                float *dst = out + t * out_stride + next_aux * H;
                const float *a = y + t * H, *b = res + t * H;
                for (int64_t i = 0; i < H; i++) dst[i] = a[i] + b[i];
            }
        }
    }
    if (out_stride == H) {
        norm(y, res, m->final_norm, T, H, m->eps, res, out, threads);
    } else {
        norm(y, res, m->final_norm, T, H, m->eps, res, h, threads);
        for (int64_t t = 0; t < T; t++) memcpy(out + t * out_stride, h + t * H, sizeof(float) * (size_t)H);
    }
    return 0;
}

/* An EAGLE draft head's pass (specserve.spec_decode.eagle_head: DraftPass) over the rows of
 * several requests, its K/V in a paged pool of the attention kernel's layout (HeadKVPool):
 *
 *     x = [embed(id), feature] W_fc + b_fc
 *     qkv = (in_norm ? rms_norm(x) : x) W_qkv; rotary on q and k
 *     a = attention(q, write k, v to the pool)
 *     h, x = rms_norm(a W_o + x)
 *     out = x + silu_mul(h W_gate_up) W_down
 *
 * the same kernels as the Python path, in its order (so the same bits but the attention's:
 * SDPA there, the paged kernel here). Step's cos and sin are unused: the rows' come from the
 * head's tables by position. Returns 0; -1 (no scratch memory) or -2 (a run of too many rows)
 * as decoder_layers; -3 when a token id or a position is out of its table's range (nothing
 * written). */
typedef struct {
    Proj fc, qkv, o, gate_up, down;
    const float *in_norm, *post_norm; /* in_norm NULL: none */
    const float *embed;               /* [vocab, hidden] */
    int64_t vocab;
    const float *cos, *sin;           /* [max_positions, head_dim / 2] */
    int64_t max_positions;
} Head;

/* The floats of `work` a head pass of `rows` rows needs. */
int64_t head_work(const Model *m, int64_t rows) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return rows * (5 * m->hidden + qkv + m->heads * m->head_dim + 3 * m->inter + m->head_dim);
}

/* feats: [rows] feature rows at feats + t * feat_stride; ids, positions: [rows]; k_cache,
 * v_cache: the pool's [blocks, block_size, Hkv, D]; work: head_work(m, rows) floats; out:
 * [rows, hidden]. */
int head_pass(const Model *m, const Head *hd, const Step *s, float *k_cache, float *v_cache, const float *feats,
              int64_t feat_stride, const int64_t *ids, const int64_t *positions, float *work, float *out,
              int threads) {
    const int64_t T = s->rows, H = m->hidden, Hq = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t nq = Hq * D, nqkv = (Hq + 2 * Hkv) * D, half = D / 2;
    float *xin = work, *x = xin + T * 2 * H, *h = x + T * H, *qkv = h + T * H, *attn = qkv + T * nqkv,
          *a = attn + T * nq, *gu = a + T * H, *act = gu + T * 2 * I, *cos = act + T * I, *sin = cos + T * half;
    const rms_norm_fn norm = (rms_norm_fn)m->rms_norm;
    int rc;
    if (!T) return 0;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= hd->vocab || positions[t] < 0 || positions[t] >= hd->max_positions) return -3;
    for (int64_t t = 0; t < T; t++) {
        memcpy(xin + t * 2 * H, hd->embed + ids[t] * H, sizeof(float) * (size_t)H);
        memcpy(xin + t * 2 * H + H, feats + t * feat_stride, sizeof(float) * (size_t)H);
        memcpy(cos + t * half, hd->cos + positions[t] * half, sizeof(float) * (size_t)half);
        memcpy(sin + t * half, hd->sin + positions[t] * half, sizeof(float) * (size_t)half);
    }
    if ((rc = project(&hd->fc, xin, T, 2 * H, x, threads))) return rc;
    const float *q_in = x;
    if (hd->in_norm) {
        norm(x, NULL, hd->in_norm, T, H, m->eps, NULL, h, threads);
        q_in = h;
    }
    if ((rc = project(&hd->qkv, q_in, T, H, qkv, threads))) return rc;
    ((rotary_fn)m->rotary)(qkv, T, nqkv, Hq + Hkv, D, cos, sin, threads);
    rc = ((attention_fn)m->attention)(qkv, nqkv, s->runs, Hq, Hkv, D, k_cache, v_cache, s->block_size,
                                      s->block_tables, s->max_blocks, s->query_start, s->dense, s->extra_ptr,
                                      s->extra_pos, s->max_keys, m->scale, qkv + nq, qkv + nq + Hkv * D, nqkv,
                                      s->slot_mapping, attn, threads);
    if (rc) return rc;
    if ((rc = project(&hd->o, attn, T, nq, a, threads))) return rc;
    norm(a, x, hd->post_norm, T, H, m->eps, x, h, threads);
    if ((rc = project(&hd->gate_up, h, T, H, gu, threads))) return rc;
    ((silu_mul_fn)m->silu_mul)(gu, T, I, act, threads);
    if ((rc = project(&hd->down, act, T, I, a, threads))) return rc;
    for (int64_t i = 0; i < T * H; i++) out[i] = x[i] + a[i];
    return 0;
}
