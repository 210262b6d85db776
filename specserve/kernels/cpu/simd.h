/* AVX2 helpers shared by our C kernels (cbuild.py hashes this header with each source). */
#ifndef SPECSERVE_SIMD_H
#define SPECSERVE_SIMD_H
#include <immintrin.h>

/* The 8 lanes of v summed in a fixed order (halves, then pairs, then the last two). */
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* The largest of the 8 lanes (NaN-free input). */
static inline float hmax(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

#endif
