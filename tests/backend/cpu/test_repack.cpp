// Repacked Q4_K (src/backend/cpu/repack.h): bit-exact round trip of the layout; the GEMV/GEMM
// kernels (scalar and AVX2) against (a) an f64 dot of independently dequantised values and (b) a
// test-side spelling of llama.cpp's float order (ggml_gemv/gemm_q4_K_8x8_q8_K on AVX2) computed
// from the ORIGINAL q4_K blocks; the 4-row q8_K quantiser's sign rule on a hand-made tie; and the
// CPU backend's repack hook (batch invariance by default, llama.cpp's GEMM/GEMV split otherwise).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/repack.h"
#include "core/error.h"

using namespace fathom;
using namespace fathom::cpu;

namespace {

constexpr size_t kQ4k = 144, kQ8k = 292;

std::vector<uint8_t> random_q4k(int64_t K, int64_t N, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> f(static_cast<size_t>(K));
    std::vector<uint8_t> w(static_cast<size_t>(N) * (K / 256) * kQ4k);
    for (int64_t r = 0; r < N; ++r) {
        for (auto &v : f) v = nd(rng) * (1.0f + 0.1f * static_cast<float>(r % 5));
        quantize_row(dtype::q4_k, f.data(), w.data() + r * (K / 256) * kQ4k, K);
    }
    return w;
}

std::vector<uint8_t> random_q8k(int64_t K, int64_t M, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::vector<float> f(static_cast<size_t>(K));
    std::vector<uint8_t> x(static_cast<size_t>(M) * (K / 256) * kQ8k);
    for (int64_t m = 0; m < M; ++m) {
        for (auto &v : f) v = nd(rng);
        quantize_row(dtype::q8_k, f.data(), x.data() + m * (K / 256) * kQ8k, K);
    }
    return x;
}

// get_scale_min_k4, spelled out independently of repack.cpp.
void scale_min(const uint8_t *s, int j, int &sc, int &m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// llama.cpp's per-output float order from the original blocks: GEMV = one fma per super-block,
// GEMM = one fma per 64 elements; acc - acc_min at the end.
float spec_dot(int64_t K, const uint8_t *w, const uint8_t *x, bool gemm) {
    float acc = 0, accm = 0;
    for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t *wb = w + b * kQ4k, *xb = x + b * kQ8k;
        uint16_t dh, mh;
        std::memcpy(&dh, wb, 2);
        std::memcpy(&mh, wb + 2, 2);
        float da;
        std::memcpy(&da, xb, 4);
        const auto *q8 = reinterpret_cast<const int8_t *>(xb + 4);
        int16_t bs[16];
        std::memcpy(bs, xb + 260, 32);
        int tot = 0, totm = 0;
        for (int sb = 0; sb < 4; ++sb) {
            int part = 0, partm = 0;
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * sb + h;
                int sc, m;
                scale_min(wb + 4, j, sc, m);
                int dot = 0;
                for (int l = 0; l < 32; ++l) {
                    const uint8_t byte = wb[16 + 32 * sb + l];
                    dot += (h ? byte >> 4 : byte & 0xF) * q8[32 * j + l];
                }
                part += sc * dot;
                partm += m * (bs[2 * j] + bs[2 * j + 1]);
            }
            if (gemm) {
                acc = std::fma(float(part), f16_to_f32(dh) * da, acc);
                accm = std::fma(float(partm), f16_to_f32(mh) * da, accm);
            }
            tot += part;
            totm += partm;
        }
        if (!gemm) {
            acc = std::fma(float(tot), f16_to_f32(dh) * da, acc);
            accm = std::fma(float(totm), f16_to_f32(mh) * da, accm);
        }
    }
    return acc - accm;
}

double f64_dot(int64_t K, const uint8_t *w, const uint8_t *x, double &mag) {
    std::vector<float> wf(static_cast<size_t>(K));
    dequantize_row(dtype::q4_k, w, wf.data(), K);
    double s = 0;
    mag = 0;
    for (int64_t b = 0; b < K / 256; ++b) {
        float da;
        std::memcpy(&da, x + b * kQ8k, 4);
        const auto *q8 = reinterpret_cast<const int8_t *>(x + b * kQ8k + 4);
        for (int l = 0; l < 256; ++l) {
            const double p = double(wf[b * 256 + l]) * double(da) * q8[l];
            s += p;
            mag += std::fabs(p);
        }
    }
    return s;
}

std::vector<isa> isas() {
    std::vector<isa> v = {isa::scalar};
    if (detected_isa() != isa::scalar) v.push_back(isa::avx2);
    return v;
}

}  // namespace

TEST(Repack, RoundTripIsBitExact) {
    const int64_t K = 512, N = 24;
    auto w = random_q4k(K, N, 1);
    // Arbitrary bytes too (all scale bits, odd d values): the layout must carry every bit.
    std::mt19937 rng(7);
    for (size_t i = 0; i < w.size() / 2; ++i) w[i] = static_cast<uint8_t>(rng());
    std::vector<uint8_t> packed(q4k_x8_bytes(K, N)), back(w.size());
    q4k_x8_repack(w.data(), (K / 256) * kQ4k, K, N, packed.data());
    q4k_x8_unpack(packed.data(), K, N, back.data(), (K / 256) * kQ4k);
    EXPECT_EQ(0, std::memcmp(w.data(), back.data(), w.size()));
    EXPECT_EQ(packed.size(), size_t(N / 8) * (K / 256) * 1184);
}

TEST(Repack, BadShapesThrow) {
    std::vector<uint8_t> buf(4096);
    EXPECT_THROW(q4k_x8_bytes(300, 8), error);
    EXPECT_THROW(q4k_x8_bytes(256, 12), error);
    EXPECT_THROW(q4k_x8_repack(buf.data(), kQ4k, 256, 4, buf.data()), error);
    float y[8];
    EXPECT_THROW(q4k_x8_mul(256, buf.data(), 0, 8, buf.data(), kQ8k, 1, 2, y, 8), error);  // gemm_rows % 4
}

TEST(Repack, KernelsMatchLlamaCppOrderAndF64) {
    const int64_t K = 768, N = 32, M = 11;
    const auto w = random_q4k(K, N, 3);
    const auto x = random_q8k(K, M, 4);
    std::vector<uint8_t> packed(q4k_x8_bytes(K, N));
    const size_t wrow = (K / 256) * kQ4k, xrow = (K / 256) * kQ8k;
    q4k_x8_repack(w.data(), wrow, K, N, packed.data());
    for (isa level : isas()) {
        force_isa(level);
        for (int64_t gemm_rows : {int64_t{0}, int64_t{8}}) {
            std::vector<float> y(M * N, NAN);
            // Odd row split (partial groups) on purpose: [0, 5) + [5, 32).
            q4k_x8_mul(K, packed.data(), 0, 5, x.data(), xrow, M, gemm_rows, y.data(), N);
            q4k_x8_mul(K, packed.data(), 5, N, x.data(), xrow, M, gemm_rows, y.data(), N);
            int n_order_differs = 0;
            for (int64_t m = 0; m < M; ++m)
                for (int64_t r = 0; r < N; ++r) {
                    const bool gemm = m < gemm_rows;
                    const float want = spec_dot(K, w.data() + r * wrow, x.data() + m * xrow, gemm);
                    const float got = y[m * N + r];
                    ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << isa_name(level) << " m=" << m << " r=" << r << " gemm="
                                                               << gemm << ": " << got << " vs " << want;
                    n_order_differs += spec_dot(K, w.data() + r * wrow, x.data() + m * xrow, !gemm) != want;
                    double mag;
                    const double ref = f64_dot(K, w.data() + r * wrow, x.data() + m * xrow, mag);
                    EXPECT_NEAR(got, ref, 1e-5 * mag + 1e-6);
                }
            // The two orders really are different sums (else the spec check above proves little).
            EXPECT_GT(n_order_differs, 0);
        }
    }
    force_isa(detected_isa());
}

TEST(Repack, GemvOrderIsIndependentOfBatchSize) {
    const int64_t K = 512, N = 16, M = 7;
    const auto w = random_q4k(K, N, 5);
    const auto x = random_q8k(K, M, 6);
    std::vector<uint8_t> packed(q4k_x8_bytes(K, N));
    const size_t xrow = (K / 256) * kQ8k;
    q4k_x8_repack(w.data(), (K / 256) * kQ4k, K, N, packed.data());
    std::vector<float> all(M * N), one(N);
    q4k_x8_mul(K, packed.data(), 0, N, x.data(), xrow, M, 0, all.data(), N);
    for (int64_t m = 0; m < M; ++m) {
        q4k_x8_mul(K, packed.data(), 0, N, x.data() + m * xrow, xrow, 1, 0, one.data(), N);
        EXPECT_EQ(0, std::memcmp(one.data(), all.data() + m * N, N * sizeof(float))) << "row " << m;
    }
}

TEST(Repack, Q8kFourRowRuleSign) {
    // Hand-made tie: -2 comes before +2. quantize_row(q8_k) takes the first max-|x| element (-2):
    // iscale = -127 / -2 > 0, d = 2/127. The 4-row rule sees +amax present: iscale = -127/2, d < 0.
    std::vector<float> x(256, 0.5f);
    x[3] = -2.0f;
    x[100] = 2.0f;
    std::vector<uint8_t> a(kQ8k), b(kQ8k);
    quantize_row(dtype::q8_k, x.data(), a.data(), 256);
    quantize_row_q8_k_x4(x.data(), b.data(), 256);
    float da, db;
    std::memcpy(&da, a.data(), 4);
    std::memcpy(&db, b.data(), 4);
    EXPECT_FLOAT_EQ(da, 2.0f / 127.0f);
    EXPECT_FLOAT_EQ(db, -2.0f / 127.0f);
    EXPECT_EQ(static_cast<int8_t>(b[4 + 3]), 127);
    EXPECT_EQ(static_cast<int8_t>(b[4 + 100]), -127);
    EXPECT_EQ(static_cast<int8_t>(b[4 + 0]), -32);  // 0.5 * -63.5 = -31.75 -> -32
    // Without a tie both rules agree byte for byte.
    x[3] = -1.0f;
    quantize_row(dtype::q8_k, x.data(), a.data(), 256);
    quantize_row_q8_k_x4(x.data(), b.data(), 256);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), kQ8k));
}

// The backend hook: a Q4_K weight handed to map_weights is repacked on first use; by default every
// activation row gets the GEMV order (same bits at any M); with batch_invariant off rows
// [0, M - M % 4) get the GEMM order, like llama.cpp.
TEST(Repack, BackendUsesRepackedOrder) {
    if (detected_isa() == isa::scalar) GTEST_SKIP() << "no AVX2: weights are not repacked";
    const int64_t K = 512, N = 64, M = 6;  // 18 KiB of weights: whole pages get reclaimed
    const auto w = random_q4k(K, N, 8);
    const auto w_copy = w;
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xf(M * K);
    for (auto &v : xf) v = nd(rng);
    const size_t wrow = (K / 256) * kQ4k, xrow = (K / 256) * kQ8k;
    std::vector<uint8_t> xq(M * xrow);
    for (int64_t m = 0; m < M; ++m) quantize_row(dtype::q8_k, xf.data() + m * K, xq.data() + m * xrow, K);
    for (bool inv : {true, false}) {
        cpu_options o;
        o.n_threads = 2;
        o.batch_invariant = inv;
        auto be = make_cpu_backend(o);
        tensor W = make_tensor(dtype::q4_k, K, N, be->map_weights(w.data(), w.size()));
        std::vector<float> y(M * N), y1(N);
        tensor X = make_tensor(dtype::f32, K, M, xf.data()), Y = make_tensor(dtype::f32, N, M, y.data());
        const tensor *ws[1] = {&W}, *ys[1] = {&Y};
        be->mul_mat(X, 1, ws, ys);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < N; ++r) {
                // Rows 0..3 of M = 6 are a GEMM tile in llama.cpp mode (their q8_K equals the plain
                // one here: no +-amax ties in Gaussian data); rows 4, 5 are GEMV leftovers.
                const bool gemm = !inv && m < 4;
                const float want = spec_dot(K, w.data() + r * wrow, xq.data() + m * xrow, gemm);
                EXPECT_EQ(want, y[m * N + r]) << "inv=" << inv << " m=" << m << " r=" << r;
            }
        // One row alone gives the GEMV result in both modes.
        tensor X1 = make_tensor(dtype::f32, K, 1, xf.data()), Y1 = make_tensor(dtype::f32, N, 1, y1.data());
        const tensor *ys1[1] = {&Y1};
        be->mul_mat(X1, 1, ws, ys1);
        for (int64_t r = 0; r < N; ++r) {
            EXPECT_EQ(spec_dot(K, w.data() + r * wrow, xq.data(), false), y1[r]);
            if (inv) {
                EXPECT_EQ(y[r], y1[r]);
            }
        }
        // Reclaiming the source pages must never lose the caller's bytes (anonymous memory here).
        EXPECT_EQ(0, std::memcmp(w.data(), w_copy.data(), w.size()));
    }
}

// q6_K in llama.cpp's tiled-matmul order (ggml-cpu/tiled, batches >= 8 rows): per super-block the
// exact integer sum, res = d_w * float(s1), acc = fma(res, d_a, acc). The expected values are
// computed here from dequantize_row's output (w / d recovers the integer sc * (q - 32)); AVX2 and
// scalar must both reproduce them bit for bit.
TEST(Repack, Q6kTiledOrder) {
    const int64_t K = 512, N = 12, M = 9;
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> f(static_cast<size_t>(K));
    const size_t wrow = (K / 256) * 210, xrow = (K / 256) * kQ8k;
    std::vector<uint8_t> w(N * wrow);
    for (int64_t r = 0; r < N; ++r) {
        for (auto &v : f) v = nd(rng);
        quantize_row(dtype::q6_k, f.data(), w.data() + r * wrow, K);
    }
    const auto x = random_q8k(K, M, 12);
    // Spec from dequantised weights: w = d * sc * (q - 32) exactly, so sc * (q - 32) = w / d is an
    // integer; sum it against the q8 values per super-block.
    std::vector<float> wf(static_cast<size_t>(K));
    std::vector<float> want(M * N);
    for (int64_t r = 0; r < N; ++r) {
        dequantize_row(dtype::q6_k, w.data() + r * wrow, wf.data(), K);
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0;
            for (int64_t b = 0; b < K / 256; ++b) {
                uint16_t dh;
                std::memcpy(&dh, w.data() + r * wrow + b * 210 + 208, 2);
                const float d = f16_to_f32(dh);
                float da;
                std::memcpy(&da, x.data() + m * xrow + b * kQ8k, 4);
                const auto *q8 = reinterpret_cast<const int8_t *>(x.data() + m * xrow + b * kQ8k + 4);
                int64_t s1 = 0;
                for (int l = 0; l < 256; ++l) s1 += std::llround(double(wf[b * 256 + l]) / double(d)) * q8[l];
                acc = std::fma(d * float(s1), da, acc);
            }
            want[m * N + r] = acc;
        }
    }
    for (isa level : isas()) {
        force_isa(level);
        std::vector<float> y(M * N, NAN);
        q6k_mul_tiled(K, w.data(), wrow, 0, N, x.data(), xrow, M, y.data(), N);
        for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(want[i], y[i]) << isa_name(level) << " element " << i;
    }
    force_isa(detected_isa());
    EXPECT_EQ(kTiledMinRows, 8);
}
