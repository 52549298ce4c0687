// f32 helpers of the DS4 reference forward (see deepseek4_ops.h).
#include "models/deepseek4_ops.h"

#include <algorithm>
#include <cstring>
#include <numbers>

#include "backend/cpu/quants.h"

namespace fathom::ds4 {

// Compiled twice (AVX2 and baseline) and picked at load time; no FMA contraction and a fixed lane
// assignment, so both versions return the same bits.
__attribute__((target_clones("avx2", "default"))) float dot_f32(const float *a, const float *b, int64_t n) {
    // Products are exact in double; 16 double lanes, then a fixed pairwise reduction. Accumulating
    // in double keeps the result within about one f32 rounding of the exact dot product, i.e. as
    // close as an f32 evaluation can be to any other correct one (long QAT sequences amplify
    // order-dependent f32 noise, README of the goldens).
    constexpr int L = 16;
    double acc[L] = {};
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; ++l) acc[l] += static_cast<double>(a[i + l]) * static_cast<double>(b[i + l]);
    for (; i < n; ++i) acc[i % L] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    for (int w = L / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return static_cast<float>(acc[0]);
}

void matmul_rows(const matrix &w, int64_t r0, int64_t r1, const float *x, int64_t n, float *y) {
    const int64_t k = w.cols, nr = r1 - r0;
    std::vector<float> scratch;
    for (int64_t r = r0; r < r1; ++r) {
        const float *wr = nullptr;
        const uint8_t *src = w.row(r);
        if (w.type == dtype::f32 && reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
            wr = reinterpret_cast<const float *>(src);
        } else {
            scratch.resize(static_cast<size_t>(k));
            if (w.type == dtype::f32)
                std::memcpy(scratch.data(), src, static_cast<size_t>(k) * sizeof(float));
            else
                cpu::dequantize_row(w.type, src, scratch.data(), k);
            wr = scratch.data();
        }
        for (int64_t i = 0; i < n; ++i) y[i * nr + (r - r0)] = dot_f32(wr, x + i * k, k);
    }
}

void matmul(const matrix &w, const float *x, int64_t n, float *y) {
    matmul_rows(w, 0, w.rows, x, n, y);
}

void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

rope_table rope_plain(float base, int n_rot) {
    rope_table t;
    t.freq.resize(static_cast<size_t>(n_rot / 2));
    for (int i = 0; i < n_rot / 2; ++i) {
        const float e = static_cast<float>(2 * i) / static_cast<float>(n_rot);
        t.freq[static_cast<size_t>(i)] = 1.0f / std::pow(base, e);
    }
    return t;
}

rope_table rope_yarn(float base, int n_rot, float factor, int64_t orig_ctx, float beta_fast,
                     float beta_slow) {
    rope_table t = rope_plain(base, n_rot);
    // Correction dim of a pair rotating `rot` times over the original context (spec 4.2).
    auto corr = [&](double rot) {
        return n_rot * std::log(static_cast<double>(orig_ctx) / (rot * 2 * std::numbers::pi)) /
               (2 * std::log(static_cast<double>(base)));
    };
    const double lo = std::max(std::floor(corr(beta_fast)), 0.0);
    double hi = std::min(std::ceil(corr(beta_slow)), static_cast<double>(n_rot - 1));
    if (lo == hi) hi += 0.001;
    for (size_t i = 0; i < t.freq.size(); ++i) {
        const float ramp =
            std::clamp(static_cast<float>((static_cast<double>(i) - lo) / (hi - lo)), 0.0f, 1.0f);
        const float smooth = 1.0f - ramp;
        const float f = t.freq[i];
        t.freq[i] = f / factor * (1.0f - smooth) + f * smooth;
    }
    return t;
}

void rope_apply(float *x, const rope_table &t, int64_t pos, bool inverse) {
    for (size_t i = 0; i < t.freq.size(); ++i) {
        // The angle is an f32 product, as in the official f32 outer(t, freqs) table.
        const float ang = static_cast<float>(pos) * t.freq[i];
        const float c = static_cast<float>(std::cos(static_cast<double>(ang)));
        float s = static_cast<float>(std::sin(static_cast<double>(ang)));
        if (inverse) s = -s;
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

}  // namespace fathom::ds4
