// AVX2 + FMA + F16C versions of the vector kernels in vec.h. Compiled with -mavx2 -mfma -mf16c;
// vec_avx2() (vec.cpp, baseline ISA) checks CPUID before handing them out.
#include <immintrin.h>

#include "backend/cpu/vec.h"

namespace fathom::cpu {

namespace {

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

float dot_f32(int64_t n, const float *a, const float *b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float r = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

float dot_f16(int64_t n, const uint16_t *a, const float *b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(load_f16(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(load_f16(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load_f16(a + i), _mm256_loadu_ps(b + i), s0);
    float r = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) r += _cvtsh_ss(a[i]) * b[i];
    return r;
}

void axpy_f32(int64_t n, float a, const float *x, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

void axpy_f16(int64_t n, float a, const uint16_t *x, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_f16(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * _cvtsh_ss(x[i]);
}

void f16_to_f32_row(int64_t n, const uint16_t *x, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_f16(x + i));
    for (; i < n; ++i) y[i] = _cvtsh_ss(x[i]);
}

void f32_to_f16_row(int64_t n, const float *x, uint16_t *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

const vec_kernels kAvx2{dot_f32, dot_f16, axpy_f32, axpy_f16, f16_to_f32_row, f32_to_f16_row};

}  // namespace

const vec_kernels *vec_avx2_table() { return &kAvx2; }

}  // namespace fathom::cpu
