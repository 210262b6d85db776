/* The value pass of paged_attention.c, written once for a vector width: included there once
 * with 8-lane AVX2 vectors and once with 16-lane AVX-512 vectors. Each output lane is one FMA
 * chain over the keys in key order (the shared keys, then the row's own), the same operations
 * on the same operands at either width, so both give a row the same bits.
 *
 * Defined by the includer: VP_NAME (the pass's name), VP_ATTR (a target attribute or empty),
 * VP_VEC, VP_LANES, VP_ZERO(), VP_BCAST(ptr), VP_LOAD(ptr), VP_FMA(a, b, c), VP_STORE(ptr, v),
 * VP_ROWS (rows per value load, at most 4). */

/* RG rows over CN vectors of D from vector c0 (RG, CN constants where inlined: registers), over
 * the keys lo .. of each row's key list: the shared ones below shared_hi, then the row's own
 * from max(lo, shared) below n[i]. */
static inline VP_ATTR __attribute__((always_inline)) void VP_SUMS(
        const int RG, const int CN, const float *const *p, const int64_t *n, int64_t lo, int64_t shared,
        int64_t shared_hi, const int64_t *slots, const float *v_cache, const int64_t *const *own, int64_t c0,
        float *const *acc, int64_t token_bytes) {
    VP_VEC a[4][4];
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < CN; c++) a[i][c] = VP_ZERO();
    for (int64_t j = lo; j < shared_hi; j++) {
        const float *v = v_cache + slots[j] + VP_LANES * c0;
        if (j + PREFETCH_KEYS < shared_hi) {
            if (token_bytes && c0 == 0) prefetch_token(v_cache + slots[j + PREFETCH_KEYS], token_bytes);
            else if (!token_bytes) prefetch_row(v_cache + slots[j + PREFETCH_KEYS] + VP_LANES * c0, CN * VP_LANES * 4);
        }
        VP_VEC pj[4];
        for (int i = 0; i < RG; i++) pj[i] = VP_BCAST(p[i] + j);
        for (int c = 0; c < CN; c++) {
            const VP_VEC vv = VP_LOAD(v + VP_LANES * c);
            for (int i = 0; i < RG; i++) a[i][c] = VP_FMA(pj[i], vv, a[i][c]);
        }
    }
    for (int i = 0; i < RG; i++) {
        for (int64_t j = lo > shared ? lo : shared; j < n[i]; j++) {
            const float *v = v_cache + own[i][j - shared] + VP_LANES * c0;
            const VP_VEC pj = VP_BCAST(p[i] + j);
            for (int c = 0; c < CN; c++) a[i][c] = VP_FMA(pj, VP_LOAD(v + VP_LANES * c), a[i][c]);
        }
        for (int c = 0; c < CN; c++) VP_STORE(acc[i] + VP_LANES * (c0 + c), a[i][c]);
    }
}

#define VP_CHUNK(rg) switch (cn) { \
    case 4: VP_SUMS(rg, 4, p, n, lo, shared, shared_hi, slots, v_cache, own, c0, accs, token_bytes); break; \
    case 3: VP_SUMS(rg, 3, p, n, lo, shared, shared_hi, slots, v_cache, own, c0, accs, token_bytes); break; \
    case 2: VP_SUMS(rg, 2, p, n, lo, shared, shared_hi, slots, v_cache, own, c0, accs, token_bytes); break; \
    default: VP_SUMS(rg, 1, p, n, lo, shared, shared_hi, slots, v_cache, own, c0, accs, token_bytes); }

/* acc[r * D ..] = sum_j p_r[j] v_j for rows r = 0 .. R - 1 of one task (row r: token t0 + r / G,
 * probabilities scores[r * max_keys ..], own keys' slots from slots + own_at[r / G]) over the
 * keys lo .. hi - 1 of each row's key list. */
static VP_ATTR void VP_NAME(int64_t R, int64_t G, int64_t t0, int64_t D, const float *scores, int64_t max_keys,
                            const int64_t *dense, const int64_t *extra_ptr, const int64_t *slots,
                            const int64_t *own_at, int64_t shared, int64_t lo, int64_t hi,
                            const float *v_cache, float *acc, int64_t token_bytes) {
    const int64_t vecs = D / VP_LANES, shared_hi = shared < hi ? shared : hi;
    for (int64_t r0 = 0; r0 < R; r0 += VP_ROWS) {
        const int64_t rg = R - r0 < VP_ROWS ? R - r0 : VP_ROWS;
        const float *p[VP_ROWS];
        int64_t n[VP_ROWS];
        const int64_t *own[VP_ROWS];
        float *accs[VP_ROWS];
        for (int64_t i = 0; i < rg; i++) {
            const int64_t r = r0 + i, t = t0 + r / G;
            p[i] = scores + r * max_keys;
            n[i] = dense[t] + extra_ptr[t + 1] - extra_ptr[t];
            n[i] = n[i] < hi ? n[i] : hi;
            own[i] = slots + own_at[t - t0];
            accs[i] = acc + r * D;
        }
        for (int64_t c0 = 0; c0 < vecs; c0 += 4) {
            const int64_t cn = vecs - c0 < 4 ? vecs - c0 : 4;
            switch (rg) {
            case 4: VP_CHUNK(4) break;
            case 3: VP_CHUNK(3) break;
            case 2: VP_CHUNK(2) break;
            default: VP_CHUNK(1)
            }
        }
    }
}
#undef VP_CHUNK
