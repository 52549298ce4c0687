// Scalar reference vector kernels and the run-time choice of the best set (see vec.h).
#include "backend/cpu/vec.h"

#include <cmath>

#include "backend/cpu/quants.h"

namespace fathom::cpu {

const vec_kernels *vec_avx2_table();  // vec_avx2.cpp; only call after the CPUID check

namespace {

float dot_f32_generic(int64_t n, const float *a, const float *b) {
    // Eight partial sums (same association as the 8-lane SIMD version, and faster scalar code).
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

float dot_f16_generic(int64_t n, const uint16_t *a, const float *b) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += f16_to_f32(a[i + j]) * b[i + j];
    float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; ++i) r += f16_to_f32(a[i]) * b[i];
    return r;
}

void axpy_f32_generic(int64_t n, float a, const float *x, float *y) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void axpy_f16_generic(int64_t n, float a, const uint16_t *x, float *y) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * f16_to_f32(x[i]);
}

void f16_to_f32_row_generic(int64_t n, const uint16_t *x, float *y) {
    for (int64_t i = 0; i < n; ++i) y[i] = f16_to_f32(x[i]);
}

void f32_to_f16_row_generic(int64_t n, const float *x, uint16_t *y) {
    for (int64_t i = 0; i < n; ++i) y[i] = f32_to_f16(x[i]);
}

// The mirroring kernels' scalar versions keep the association (lanes, group sums) with libm expf;
// only the AVX2 versions are bit-exact with ggml-cpu's x86 build.
float dot_f16_lanes_generic(int64_t n, const uint16_t *a, const float *b) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] = std::fma(f16_to_f32(a[i + j]), b[i + j], s[j]);
    float r = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for (; i < n; ++i) r += f16_to_f32(a[i]) * b[i];
    return r;
}

float dot_f16_ggml_generic(int64_t n, const uint16_t *a, const float *b) {
    float s[32] = {};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; ++j) s[j] = std::fma(f16_to_f32(a[i + j]), b[i + j], s[j]);
    float x[8], t[4];
    for (int l = 0; l < 8; ++l) x[l] = (s[l] + s[16 + l]) + (s[8 + l] + s[24 + l]);
    for (int l = 0; l < 4; ++l) t[l] = x[l] + x[4 + l];
    double r = static_cast<double>((t[0] + t[1]) + (t[2] + t[3]));
    for (; i < n; ++i) r += static_cast<double>(f16_to_f32(a[i]) * b[i]);
    return static_cast<float>(r);
}

double softmax_exp_generic(int64_t n, const float *x, float mx, float *y) {
    double sum = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        float e[8];
        for (int j = 0; j < 8; ++j) y[i + j] = e[j] = std::exp(x[i + j] - mx);
        sum += static_cast<double>(((e[0] + e[4]) + (e[2] + e[6])) + ((e[1] + e[5]) + (e[3] + e[7])));
    }
    for (; i < n; ++i) sum += static_cast<double>(y[i] = std::exp(x[i] - mx));
    return sum;
}

void swiglu_generic(int64_t n, const float *g, const float *u, float *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void round_f16_generic(int64_t n, const float *x, float s, float *y) {
    for (int64_t i = 0; i < n; ++i) y[i] = f16_to_f32(f32_to_f16(x[i] * s));
}

void dot_f16_lanes_multi_generic(int64_t n, const uint16_t *a, const float *const *b, int nq, float *out) {
    for (int q = 0; q < nq; ++q) out[q] = dot_f16_lanes_generic(n, a, b[q]);
}

void axpy_f16_multi_generic(int64_t n, const float *c, const uint16_t *x, float *const *y, int nq) {
    for (int q = 0; q < nq; ++q) axpy_f16_generic(n, c[q], x, y[q]);
}

void kqv_lanes_f16_generic(int64_t hd, int64_t j0, int64_t j1, const uint16_t *v, int64_t v_stride,
                           const float *const *p, int nq, float *const *lanes) {
    for (int64_t j = j0; j <= j1; ++j)
        for (int q = 0; q < nq; ++q) axpy_f16_generic(hd, p[q][j], v + j * v_stride, lanes[q] + (j & 7) * hd);
}

void dot_f16_lanes_rows_generic(int64_t n, const uint16_t *a, int64_t a_stride, int64_t nr, const float *b,
                                float *out) {
    for (int64_t r = 0; r < nr; ++r) out[r] = dot_f16_lanes_generic(n, a + r * a_stride, b);
}

const vec_kernels kGeneric{dot_f32_generic,        dot_f16_generic,        axpy_f32_generic,
                           axpy_f16_generic,       f16_to_f32_row_generic, f32_to_f16_row_generic,
                           dot_f16_lanes_generic,  dot_f16_ggml_generic,   softmax_exp_generic,
                           swiglu_generic,         round_f16_generic,      dot_f16_lanes_multi_generic,
                           axpy_f16_multi_generic, kqv_lanes_f16_generic,  dot_f16_lanes_rows_generic};

const vec_kernels &choose() {
    if (const vec_kernels *k = vec_avx2()) return *k;
    return kGeneric;
}

}  // namespace

const vec_kernels &vec_generic() { return kGeneric; }

const vec_kernels *vec_avx2() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    return ok ? vec_avx2_table() : nullptr;
#else
    return nullptr;
#endif
}

const vec_kernels &vec() {
    static const vec_kernels &k = choose();
    return k;
}

}  // namespace fathom::cpu
