// IQ2_XXS x Q8_K kernels (src/backend/cpu/quants_x86_iq2.h): on every ISA level this CPU has,
//  - a test-side spelling of ggml-cpu's AVX2 ggml_vec_dot_iq2_xxs_q8_K float order, computed from
//    gguf-py's dequantisation of random valid blocks (tests/backend/cpu/data/deq_iq2_xxs.bin) and the raw
//    q8_K bytes, must equal vec_dot and every gemm element bit for bit on the SIMD levels;
//  - gemm == vec_dot bit for bit for every M, row range and tile edge (batch invariance);
//  - scalar and SIMD agree to float-summation accuracy on quantised random rows;
//  - the worst-case magnitudes (largest grid, scale 15, |a| = 127, one sign) do not overflow the i16/i32 lanes;
//  - a flipped weight bit changes the result past the f64 tolerance (the checks can fail).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "isa_levels.h"

using namespace fathom;
using namespace fathom::cpu;

namespace {

constexpr size_t kIq2 = 66, kQ8k = 292;

struct iq2_ref {
    int64_t n = 0;
    std::vector<uint8_t> bytes;  // blocks
    std::vector<float> value;    // gguf-py dequantisation
};

iq2_ref load_iq2_ref(const std::string &name = "deq_iq2_xxs.bin") {
    std::string path = std::string(FATHOM_SOURCE_DIR) + "/tests/backend/cpu/data/" + name;
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        path = "tests/backend/cpu/data/" + name;
        f.open(path, std::ios::binary);
    }
    if (!f) throw std::runtime_error("missing reference file " + path);
    char magic[4];
    uint32_t hdr[3];
    f.read(magic, 4);
    f.read(reinterpret_cast<char *>(hdr), 12);
    if (std::memcmp(magic, "FQRF", 4) != 0 || hdr[0] != 0 || hdr[1] != static_cast<uint32_t>(dtype::iq2_xxs))
        throw std::runtime_error("unexpected header in " + path);
    iq2_ref r;
    r.n = hdr[2];
    r.bytes.resize(static_cast<size_t>(r.n / 256) * kIq2);
    r.value.resize(static_cast<size_t>(r.n));
    f.read(reinterpret_cast<char *>(r.bytes.data()), static_cast<std::streamsize>(r.bytes.size()));
    f.read(reinterpret_cast<char *>(r.value.data()), static_cast<std::streamsize>(r.value.size() * 4));
    if (!f) throw std::runtime_error("truncated reference file " + path);
    return r;
}

using test::isa_guard;
using test::isas;

float f16_at(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// ggml's AVX2 order for one row of nb blocks. Weights enter only through gguf-py's values: each is
// d * (2 ls + 1) / 8 * (+-grid) exactly in f32 (at most 11 + 5 + 6 significant bits), so
// value * 8 / d is the exact integer (2 ls + 1) * (+-grid) that ggml multiplies into its i32 lanes.
float ggml_order_dot(const uint8_t *wblocks, const float *wvalues, int64_t nb, const uint8_t *act) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < nb; ++b) {
        const float dw = f16_at(wblocks + b * kIq2);
        const uint8_t *a = act + b * kQ8k;
        float da;
        std::memcpy(&da, a, 4);
        int64_t lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (dw != 0.0f) {
            for (int k = 0; k < 256; ++k) {
                const double q = static_cast<double>(wvalues[b * 256 + k]) * 8.0 / dw;
                const auto qi = static_cast<int64_t>(std::llround(q));
                EXPECT_EQ(static_cast<double>(qi), q) << "block " << b << " element " << k << " is not d*(2ls+1)*g/8";
                lane[(k % 32) / 4] += qi * static_cast<int8_t>(a[4 + k]);  // lane L: elements 4L..4L+3 of each 32
            }
        }
        const float d = dw * da;
        for (int l = 0; l < 8; ++l) acc[l] = std::fmaf(d, static_cast<float>(lane[l]), acc[l]);
    }
    // hsum_float_8: upper + lower 128-bit half, then the 64-bit halves, then the last pair.
    float h[4];
    for (int i = 0; i < 4; ++i) h[i] = acc[4 + i] + acc[i];
    const float p0 = h[0] + h[2], p1 = h[1] + h[3];
    return 0.125f * (p0 + p1);
}

std::vector<uint8_t> q8k_rows(int64_t K, int64_t M, size_t stride, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.5f);
    std::vector<float> f(static_cast<size_t>(K));
    std::vector<uint8_t> X(stride * static_cast<size_t>(M), 0xA5);
    for (int64_t m = 0; m < M; ++m) {
        for (auto &v : f) v = nd(rng);
        quantize_row(dtype::q8_k, f.data(), X.data() + stride * static_cast<size_t>(m), K);
    }
    return X;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace

// vec_dot and every gemm element equal ggml's AVX2 float order exactly on the SIMD levels (the
// llama.cpp-mirror numerics); the scalar level only has to be close (its own order).
TEST(QuantIq2, MatchesGgmlAvx2OrderBitExact) {
    isa_guard g;
    const iq2_ref w = load_iq2_ref();
    ASSERT_EQ(w.n % 512, 0);
    // (a) the whole reference as one row; (b) rows of K = 512 for gemm tiles.
    const std::vector<uint8_t> a1 = q8k_rows(w.n, 1, dtype_row_bytes(dtype::q8_k, w.n), 3);
    const float want1 = ggml_order_dot(w.bytes.data(), w.value.data(), w.n / 256, a1.data());
    const int64_t K = 512, N = w.n / K, nb = K / 256;
    const size_t ws = dtype_row_bytes(dtype::iq2_xxs, K), xs = dtype_row_bytes(dtype::q8_k, K) + 4;
    const int64_t M = 9;  // up to the rows kernel's 8 and the panel's 9
    const std::vector<uint8_t> X = q8k_rows(K, M, xs, 4);
    std::vector<float> want(static_cast<size_t>(M * N));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < N; ++r)
            want[m * N + r] = ggml_order_dot(w.bytes.data() + r * ws, w.value.data() + r * K, nb, X.data() + m * xs);
    for (isa level : isas()) {
        force_isa(level);
        const float got1 = vec_dot(dtype::iq2_xxs, w.n, w.bytes.data(), a1.data());
        if (level == isa::scalar) {
            EXPECT_NEAR(got1, want1, 1e-5 * std::fabs(want1) + 1e-6);
            continue;
        }
        EXPECT_TRUE(same_bits(got1, want1)) << isa_name(level) << ": " << got1 << " vs " << want1;
        for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{8}, int64_t{9}}) {
            std::vector<float> y(static_cast<size_t>(mm * N), -1.0f);
            gemm(dtype::iq2_xxs, K, w.bytes.data(), ws, 0, N, X.data(), xs, mm, y.data(), N);
            for (int64_t m = 0; m < mm; ++m)
                for (int64_t r = 0; r < N; ++r)
                    ASSERT_TRUE(same_bits(y[m * N + r], want[m * N + r]))
                        << isa_name(level) << " M=" << mm << " m=" << m << " r=" << r << ": " << y[m * N + r]
                        << " vs " << want[m * N + r];
        }
    }
}

// Every grid index, sign code and scale (deq_iq2_xxs_cover.bin: 8 blocks built to use each grid index
// once, each sign code twice and each scale four times; values from gguf-py): vec_dot and gemm at M = 1
// (the decode kernels, which look the grid up in registers on AVX-512) and M = 2, 5 equal ggml's order
// bit for bit on the SIMD levels.
TEST(QuantIq2, EveryGridIndexAndSignCodeBitExact) {
    isa_guard g;
    const iq2_ref w = load_iq2_ref("deq_iq2_xxs_cover.bin");
    ASSERT_EQ(w.n, 8 * 256);
    const int64_t K = 256, N = w.n / K;  // one block per row
    const size_t ws = dtype_row_bytes(dtype::iq2_xxs, K), xs = dtype_row_bytes(dtype::q8_k, K);
    const int64_t M = 5;
    const std::vector<uint8_t> X = q8k_rows(K, M, xs, 31);
    const std::vector<uint8_t> a1 = q8k_rows(w.n, 1, dtype_row_bytes(dtype::q8_k, w.n), 32);
    const float want1 = ggml_order_dot(w.bytes.data(), w.value.data(), w.n / 256, a1.data());
    for (isa level : isas()) {
        if (level == isa::scalar) continue;
        force_isa(level);
        const float got1 = vec_dot(dtype::iq2_xxs, w.n, w.bytes.data(), a1.data());
        EXPECT_TRUE(same_bits(got1, want1)) << isa_name(level) << ": " << got1 << " vs " << want1;
        for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}}) {
            std::vector<float> y(static_cast<size_t>(mm * N), -1.0f);
            gemm(dtype::iq2_xxs, K, w.bytes.data(), ws, 0, N, X.data(), xs, mm, y.data(), N);
            for (int64_t m = 0; m < mm; ++m)
                for (int64_t r = 0; r < N; ++r) {
                    const float want =
                        ggml_order_dot(w.bytes.data() + r * ws, w.value.data() + r * K, 1, X.data() + m * xs);
                    ASSERT_TRUE(same_bits(y[m * N + r], want))
                        << isa_name(level) << " M=" << mm << " m=" << m << " r=" << r << ": " << y[m * N + r] << " vs "
                        << want;
                }
        }
    }
}

// Batch invariance: gemm(any M, any row range) == vec_dot per element, bit for bit, every level.
TEST(QuantIq2, GemmEqualsDotBitwise) {
    isa_guard g;
    std::mt19937 rng(21);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t K = 768, N = 11;  // 3 super-blocks; 11 rows = two 4-row groups and a 3-row tail
    const size_t ws = dtype_row_bytes(dtype::iq2_xxs, K) + 2, xs = dtype_row_bytes(dtype::q8_k, K) + 8;
    std::vector<uint8_t> W(ws * N, 0);
    std::vector<float> f(static_cast<size_t>(K));
    for (int64_t r = 0; r < N; ++r) {
        for (auto &v : f) v = nd(rng) * (1.0f + 0.3f * static_cast<float>(r % 4));
        quantize_row(dtype::iq2_xxs, f.data(), W.data() + r * ws, K);
    }
    const int64_t Mmax = 70;
    const std::vector<uint8_t> X = q8k_rows(K, Mmax, xs, 22);
    for (isa level : isas()) {
        force_isa(level);
        std::vector<float> ref(static_cast<size_t>(Mmax * N));
        for (int64_t m = 0; m < Mmax; ++m)
            for (int64_t r = 0; r < N; ++r)
                ref[m * N + r] = vec_dot(dtype::iq2_xxs, K, W.data() + r * ws, X.data() + m * xs);
        for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 70})
            for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, N}, {1, N}, {2, 3}, {5, 10}}) {
                const int64_t ldy = N + 1;
                std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f);
                gemm(dtype::iq2_xxs, K, W.data(), ws, r0, r1, X.data(), xs, M, y.data(), ldy);
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t r = 0; r < ldy; ++r) {
                        const float got = y[m * ldy + r];
                        if (r < r0 || r >= r1) {
                            ASSERT_EQ(got, -7.0f) << "gemm wrote outside its tile";
                            continue;
                        }
                        ASSERT_TRUE(same_bits(got, ref[m * N + r])) << isa_name(level) << " M=" << M << " [" << r0
                                                                    << "," << r1 << ") m=" << m << " r=" << r;
                    }
            }
    }
}

// Scalar vs SIMD on quantised random rows of several lengths: same exact integers per block, so only
// the float accumulation order differs (relative to sum |w a|).
TEST(QuantIq2, ScalarAndSimdAgree) {
    isa_guard g;
    std::mt19937 rng(31);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t K : {256, 1024, 4096}) {
        std::vector<float> f(static_cast<size_t>(K));
        for (auto &v : f) v = nd(rng);
        std::vector<uint8_t> w(dtype_row_bytes(dtype::iq2_xxs, K));
        quantize_row(dtype::iq2_xxs, f.data(), w.data(), K);
        const std::vector<uint8_t> a = q8k_rows(K, 1, dtype_row_bytes(dtype::q8_k, K), static_cast<uint32_t>(K));
        std::vector<float> wv(static_cast<size_t>(K)), av(static_cast<size_t>(K));
        force_isa(isa::scalar);
        dequantize_row(dtype::iq2_xxs, w.data(), wv.data(), K);  // checked against gguf-py in test_quants
        dequantize_row(dtype::q8_k, a.data(), av.data(), K);
        double mag = 0, exact = 0;
        for (int64_t i = 0; i < K; ++i) {
            mag += std::fabs(static_cast<double>(wv[i]) * av[i]);
            exact += static_cast<double>(wv[i]) * av[i];
        }
        const float scalar = vec_dot(dtype::iq2_xxs, K, w.data(), a.data());
        EXPECT_NEAR(scalar, exact, 2e-6 * mag) << "K=" << K;
        for (isa level : isas()) {
            force_isa(level);
            const float got = vec_dot(dtype::iq2_xxs, K, w.data(), a.data());
            EXPECT_NEAR(got, scalar, 4e-6 * mag) << isa_name(level) << " K=" << K;
            EXPECT_NEAR(got, exact, 2e-6 * mag) << isa_name(level) << " K=" << K;
        }
    }
}

// Worst case for the integer lanes: every group uses the grid point with the largest magnitudes,
// scale 15 (factor 31), no signs, and activations all +-127 alike, so every product has the same sign and
// maddubs sees its largest pair sums. Expected value from the format rule, in f64.
TEST(QuantIq2, ExtremeMagnitudesDoNotOverflow) {
    isa_guard g;
    // The grid point with the largest sum, found through dequantisation of a probe block (d = 1,
    // scale 0 -> factor 1/8, no signs): element j of group 0 is grid[idx][j] / 8.
    int best = 0;
    double best_sum = -1;
    std::vector<uint8_t> blk(kIq2, 0);
    std::vector<float> deq(256);
    const uint16_t one = f32_to_f16(1.0f);
    for (int idx = 0; idx < 256; ++idx) {
        std::fill(blk.begin(), blk.end(), 0);
        std::memcpy(blk.data(), &one, 2);
        blk[2] = static_cast<uint8_t>(idx);
        dequantize_row(dtype::iq2_xxs, blk.data(), deq.data(), 256);
        double s = 0;
        for (int j = 0; j < 8; ++j) s += deq[j] * 8.0;
        if (s > best_sum) best_sum = s, best = idx;
    }
    ASSERT_GE(best_sum, 8 * 25.0);  // grid values are 8, 25 or 43
    const int64_t K = 1024;
    std::vector<uint8_t> w(dtype_row_bytes(dtype::iq2_xxs, K), 0);
    for (int64_t b = 0; b < K / 256; ++b) {
        uint8_t *p = w.data() + b * kIq2;
        std::memcpy(p, &one, 2);
        for (int gi = 0; gi < 8; ++gi) {
            const uint32_t idx = 0x01010101u * static_cast<uint32_t>(best), sg = 15u << 28;  // codes 0: all +
            std::memcpy(p + 2 + 8 * gi, &idx, 4);
            std::memcpy(p + 6 + 8 * gi, &sg, 4);
        }
    }
    const std::vector<float> x(static_cast<size_t>(K), 1.0f);
    std::vector<uint8_t> a(dtype_row_bytes(dtype::q8_k, K));
    quantize_row(dtype::q8_k, x.data(), a.data(), K);
    // ggml's q8_K scales by -127 / (signed max): all ones become q = -127 with a negative d.
    const int q0 = static_cast<int8_t>(a[4]);
    ASSERT_EQ(std::abs(q0), 127);
    for (int64_t b = 0; b < K / 256; ++b)
        for (int k = 0; k < 256; ++k) ASSERT_EQ(static_cast<int8_t>(a[b * kQ8k + 4 + k]), q0);
    float da;
    std::memcpy(&da, a.data(), 4);
    // Per block: 32 grid points, each best_sum * 31 / 8 * q0 * da.
    const double want = static_cast<double>(K / 256) * 32 * best_sum * 31.0 / 8.0 * q0 * da;
    ASSERT_GT(want, 0.0);
    for (isa level : isas()) {
        force_isa(level);
        const float got = vec_dot(dtype::iq2_xxs, K, w.data(), a.data());
        EXPECT_NEAR(got, want, 1e-6 * want) << isa_name(level);
        const size_t ws = w.size();
        std::vector<uint8_t> W3(3 * ws), X3(3 * a.size());
        for (int i = 0; i < 3; ++i) {
            std::memcpy(W3.data() + i * ws, w.data(), ws);
            std::memcpy(X3.data() + i * a.size(), a.data(), a.size());
        }
        std::vector<float> y9(9);
        gemm(dtype::iq2_xxs, K, W3.data(), ws, 0, 3, X3.data(), a.size(), 3, y9.data(), 3);
        for (float v : y9) EXPECT_NEAR(v, want, 1e-6 * want) << isa_name(level);
    }
}

// The comparisons above must be able to fail: flipping one grid-index bit or one sign bit moves
// the result by more than the f64 tolerance on every level.
TEST(QuantIq2, CorruptedWeightBitIsDetected) {
    isa_guard g;
    const iq2_ref w = load_iq2_ref();
    const int64_t K = 512;
    const std::vector<uint8_t> a = q8k_rows(K, 1, dtype_row_bytes(dtype::q8_k, K), 9);
    std::vector<float> av(static_cast<size_t>(K));
    dequantize_row(dtype::q8_k, a.data(), av.data(), K);
    double exact = 0, mag = 0;
    for (int64_t i = 0; i < K; ++i) {
        exact += static_cast<double>(w.value[i]) * av[i];
        mag += std::fabs(static_cast<double>(w.value[i]) * av[i]);
    }
    for (size_t byte : {size_t{2}, size_t{6}, size_t{66 + 10}}) {  // grid index, sign code, next block
        std::vector<uint8_t> bad(w.bytes.begin(), w.bytes.begin() + 2 * kIq2);
        bad[byte] ^= 0x01;
        for (isa level : isas()) {
            force_isa(level);
            EXPECT_NEAR(vec_dot(dtype::iq2_xxs, K, w.bytes.data(), a.data()), exact, 2e-6 * mag) << isa_name(level);
            EXPECT_GT(std::fabs(vec_dot(dtype::iq2_xxs, K, bad.data(), a.data()) - exact), 2e-6 * mag)
                << isa_name(level) << " byte " << byte;
        }
    }
}
