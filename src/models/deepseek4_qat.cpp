// FP8 / FP4 / Hadamard round trips of DS4's QAT simulation (see deepseek4_qat.h).
#include "models/deepseek4_qat.h"

#include <algorithm>
#include <cmath>

namespace fathom::ds4 {

// Round |x| to the grid whose step is 2^(floor(log2|x|) - mbits), the exponent floored at emin
// (subnormals share the step of the smallest binade). nearbyint rounds ties to even, and an even
// multiple of the step is exactly an even mantissa code in a binary float format.
static float round_minifloat(float x, int mbits, int emin, float maxv) {
    float a = std::fabs(x);
    if (!(a > 0.0f)) return x;  // 0, -0 and NaN pass through
    a = std::min(a, maxv);
    int e = 0;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1) -> floor(log2 a) = e - 1
    const int ex = std::max(e - 1, emin);
    const float step = std::ldexp(1.0f, ex - mbits);
    const float r = std::min(std::nearbyint(a / step) * step, maxv);
    return std::copysign(r, x);
}

float fp8_e4m3_round(float x) {
    return round_minifloat(x, 3, -6, 448.0f);
}
float fp4_e2m1_round(float x) {
    return round_minifloat(x, 1, 0, 6.0f);
}

float pow2_ceil(float v) {
    int e = 0;
    const float m = std::frexp(v, &e);  // v = m * 2^e
    return m == 0.5f ? std::ldexp(1.0f, e - 1) : std::ldexp(1.0f, e);
}

static void block_round_trip(float *x, int64_t n, int64_t block, float fmt_max, float amax_floor,
                             float (*round_fn)(float)) {
    for (int64_t b = 0; b < n; b += block) {
        const int64_t e = std::min(n, b + block);
        float amax = 0.0f;
        for (int64_t i = b; i < e; ++i) amax = std::max(amax, std::fabs(x[i]));
        amax = std::max(amax, amax_floor);
        const float s = pow2_ceil(amax / fmt_max);
        for (int64_t i = b; i < e; ++i) x[i] = s * round_fn(std::clamp(x[i] / s, -fmt_max, fmt_max));
    }
}

void fp8_round_trip(float *x, int64_t n, int64_t block) {
    block_round_trip(x, n, block, 448.0f, 1e-4f, fp8_e4m3_round);
}

void fp4_round_trip(float *x, int64_t n, int64_t block) {
    block_round_trip(x, n, block, 6.0f, 6.0f * std::ldexp(1.0f, -126), fp4_e2m1_round);
}

void hadamard_normalised(float *x, int64_t n) {
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; ++j) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace fathom::ds4
