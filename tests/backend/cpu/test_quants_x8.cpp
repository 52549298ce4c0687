// Row-interleaved q4_1 / q8_0 kernels (backend/cpu/quants_x8.h) against a scalar re-statement of
// ggml-cpu's AVX2 vec_dot float order (written here from the ggml source's description: per block
// acc[L] = fma(d_w * d_x, float(sum of elements 4L..4L+3), acc[L]); q4_1 also summs = fma(m, s,
// summs); result = hsum_float_8 tree + summs). The comparison is bit-exact: the x8 path must give
// the same bits as llama.cpp, which is what Smollm2.MatchesLlamaCppGolden relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cpu/quants_x8.h"
#include "core/error.h"
#include "isa_levels.h"

using namespace fathom;
using namespace fathom::cpu;

namespace {

float h2f(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// Weight element e (0..31) of one block, as the integer ggml multiplies (q4_1: 0..15, q8_0: s8,
// q5_0: (nibble | high bit << 4) - 16, what ggml's AVX2 q5_0 dot builds with its andnot/or trick).
int weight_q(dtype t, const uint8_t *blk, int e) {
    if (t == dtype::q4_1) return e < 16 ? blk[4 + e] & 0x0F : blk[4 + e - 16] >> 4;
    if (t == dtype::q5_0) {
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        const int nib = e < 16 ? blk[6 + e] & 0x0F : blk[6 + e - 16] >> 4;
        return (nib | static_cast<int>((qh >> e) & 1u) << 4) - 16;
    }
    return static_cast<int8_t>(blk[2 + e]);
}

float ggml_order_dot(dtype t, int64_t K, const uint8_t *w, const uint8_t *x) {
    const int wsz = t == dtype::q4_1 ? 20 : t == dtype::q5_0 ? 22 : 34, xsz = t == dtype::q4_1 ? 36 : 34,
              xqs = t == dtype::q4_1 ? 4 : 2;
    float acc[8] = {}, summs = 0.0f;
    for (int64_t b = 0; b < K / 32; ++b, w += wsz, x += xsz) {
        const float sc = h2f(w) * h2f(x);
        for (int L = 0; L < 8; ++L) {
            int s = 0;
            for (int j = 0; j < 4; ++j) s += weight_q(t, w, 4 * L + j) * static_cast<int8_t>(x[xqs + 4 * L + j]);
            acc[L] = std::fma(sc, static_cast<float>(s), acc[L]);
        }
        if (t == dtype::q4_1) summs = std::fma(h2f(w + 2), h2f(x + 2), summs);
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + summs;
}

// N rows of random blocks: scales of varied magnitude (f16), quants uniformly random (q8_0 includes -128).
std::vector<uint8_t> random_weights(dtype t, int64_t N, int64_t K, std::mt19937 &rng) {
    const size_t rb = dtype_row_bytes(t, K);
    std::vector<uint8_t> w(rb * static_cast<size_t>(N));
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> mag(-4.0f, 0.0f);
    for (auto &v : w) v = static_cast<uint8_t>(byte(rng));
    const int bsz = t == dtype::q4_1 ? 20 : t == dtype::q5_0 ? 22 : 34;
    for (size_t off = 0; off < w.size(); off += static_cast<size_t>(bsz)) {
        const uint16_t d = f32_to_f16(std::pow(10.0f, mag(rng)) * (byte(rng) & 1 ? 1.0f : -1.0f));
        const uint16_t m = f32_to_f16(-std::pow(10.0f, mag(rng)));
        std::memcpy(&w[off], &d, 2);
        if (t == dtype::q4_1) std::memcpy(&w[off + 2], &m, 2);
    }
    return w;
}

// Every ISA level with x8 kernels (AVX2; AVX-512 VNNI, whose M >= 2 path pairs groups into 16-row
// panels, so odd group ranges and ranges starting at an odd group are covered), activation row counts
// of the decode (1), small-batch and serving-batch (16, 17) shapes, and group ranges that leave the
// first / last group out. Poisoned outputs outside the range must stay untouched.
void check_matches_ggml_order() {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (dtype t : {dtype::q4_1, dtype::q8_0, dtype::q5_0}) {
        for (int64_t K : {32, 96, 576}) {
            const int64_t N = 43, G = N / 8;  // 5 groups and 3 rows the layout does not cover
            const std::vector<uint8_t> w = random_weights(t, N, K, rng);
            const size_t rb = dtype_row_bytes(t, K);
            std::vector<uint8_t> packed(x8_bytes(t, K, G));
            x8_pack(t, K, w.data(), rb, 0, G, packed.data());
            const dtype at = vec_dot_type(t);
            const size_t x_stride = dtype_row_bytes(at, K) + 4;  // padded: stride != row size
            for (int64_t M : {1, 2, 5, 16, 17}) {
                std::vector<uint8_t> X(x_stride * static_cast<size_t>(M));
                for (int64_t m = 0; m < M; ++m) {
                    std::vector<float> xf(static_cast<size_t>(K));
                    for (auto &v : xf) v = nd(rng) * (m + 1);
                    quantize_row_act(at, xf.data(), X.data() + m * x_stride, K);
                }
                for (auto [g0, g1] :
                     {std::pair<int64_t, int64_t>{0, G}, {1, 2}, {2, 2}, {1, G}, {0, 4}, {1, 4}}) {
                    const int64_t ldy = N + 1;
                    std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f), ref(y.size(), -7.0f);
                    x8_gemm(t, K, packed.data(), g0, g1, X.data(), x_stride, M, y.data(), ldy);
                    gemm(t, K, w.data(), rb, 8 * g0, 8 * g1, X.data(), x_stride, M, ref.data(), ldy);
                    for (int64_t m = 0; m < M; ++m)
                        for (int64_t r = 0; r < ldy; ++r) {
                            const float got = y[m * ldy + r];
                            if (r < 8 * g0 || r >= 8 * g1) {
                                ASSERT_EQ(got, -7.0f) << "x8_gemm wrote outside its groups";
                                continue;
                            }
                            const float want = ggml_order_dot(t, K, w.data() + r * rb, X.data() + m * x_stride);
                            ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << dtype_name(t) << " K=" << K << " M=" << M
                                                                      << " r=" << r << ": " << got << " vs " << want;
                            // The row-by-row kernel follows the same order: the two paths are interchangeable.
                            ASSERT_EQ(std::memcmp(&got, &ref[m * ldy + r], 4), 0) << dtype_name(t) << " r=" << r;
                        }
                }
            }
        }
    }
}

}  // namespace

TEST(QuantX8, MatchesGgmlOrderBitExact) {
    if (!x8_supported(dtype::q4_1)) GTEST_SKIP() << "no AVX2";
    test::isa_guard guard;
    for (isa level : test::isas()) {
        if (level == isa::scalar) continue;
        force_isa(level);
        SCOPED_TRACE(isa_name(level));
        check_matches_ggml_order();
        if (::testing::Test::HasFatalFailure()) return;
    }
}

TEST(QuantX8, BadArgumentsThrow) {
    std::vector<uint8_t> b(4096);
    std::vector<float> y(64);
    EXPECT_THROW(x8_bytes(dtype::q4_0, 32, 1), fathom::error);
    EXPECT_THROW(x8_bytes(dtype::q4_1, 33, 1), fathom::error);
    EXPECT_THROW(x8_pack(dtype::q8_0, 32, b.data(), 34, 2, 1, b.data()), fathom::error);
    if (x8_supported(dtype::q8_0)) {
        EXPECT_THROW(x8_gemm(dtype::q8_0, 32, b.data(), 0, 2, b.data(), 34, 2, y.data(), 8), fathom::error);  // ldy < rows
        EXPECT_THROW(x8_gemm(dtype::q4_k, 256, b.data(), 0, 1, b.data(), 292, 1, y.data(), 8), fathom::error);
    }
}

TEST(QuantX8, SimdPackMatchesScalarPack) {
    if (!x8_supported(dtype::q4_1)) GTEST_SKIP() << "no AVX2";
    std::mt19937 rng(11);
    for (dtype t : {dtype::q4_1, dtype::q8_0, dtype::q5_0}) {
        const int64_t K = 96, N = 24, G = 3;
        const std::vector<uint8_t> w = random_weights(t, N, K, rng);
        std::vector<uint8_t> simd(x8_bytes(t, K, G), 0xAB), scalar(simd.size(), 0xCD);
        x8_pack(t, K, w.data(), dtype_row_bytes(t, K), 0, G, simd.data());
        force_isa(isa::scalar);  // x8_pack falls back to its scalar definition of the layout
        x8_pack(t, K, w.data(), dtype_row_bytes(t, K), 0, G, scalar.data());
        force_isa(detected_isa());
        EXPECT_EQ(simd, scalar) << dtype_name(t);
    }
}

// The activation conversions the x8 kernels consume (quantize_row_act q8_0 / q8_1): every ISA must
// write the scalar definition's bytes, including the f16 block scales at the edges of the f16 range
// (subnormal scales, scales that overflow to inf, all-zero blocks) and the q8_1 block sums.
TEST(QuantX8, ActivationConversionAllIsasMatchScalar) {
    test::isa_guard guard;
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t K = 32 * 12;
    std::vector<float> x(static_cast<size_t>(K));
    const float mags[] = {1.0f, 1e-3f, 3e-6f, 1e-7f, 2e-9f, 1e5f, 7e6f, 1e30f, 0.0f, 65504.0f * 127.0f, 1e-30f, 40.0f};
    for (int64_t b = 0; b < K / 32; ++b)
        for (int e = 0; e < 32; ++e) x[static_cast<size_t>(32 * b + e)] = nd(rng) * mags[b];
    for (dtype t : {dtype::q8_0, dtype::q8_1}) {
        const size_t rb = dtype_row_bytes(t, K);
        force_isa(isa::scalar);
        std::vector<uint8_t> want(rb);
        quantize_row_act(t, x.data(), want.data(), K);
        for (isa level : test::isas()) {
            force_isa(level);
            std::vector<uint8_t> got(rb, 0xCD);
            quantize_row_act(t, x.data(), got.data(), K);
            for (size_t i = 0; i < rb; ++i)
                ASSERT_EQ(got[i], want[i]) << dtype_name(t) << " [" << isa_name(level) << "] byte " << i;
        }
    }
}
