// DS4 decode building blocks on CUDA (src/backend/cuda/ds4_*) against the CPU reference model code
// (src/models/deepseek4_moe.cpp: hc_pre, hc_post, moe_route, moe_forward) on fresh random inputs,
// with every device output NaN-poisoned first (an unwritten element makes rel_l2 NaN: fails).
//   CudaDs4Host.*  block decoders vs cpu::dequantize_row, bit-exact (no GPU needed: runs in CI)
//   CudaDs4.*      kernels on the device (skipped without one)
// Benchmarks at the full DS4-Flash expert shapes (bandwidth vs the device copy rate):
// bench/cuda/bench_ds4.cpp (bench_cuda_kernels).
// Tolerances: the CPU reference accumulates dot products in double, the GPU GEMVs in f32 (per lane,
// then a warp tree): relative L2 <= 1e-5 on outputs. The expert GEMVs of iq2_xxs/q2_k/q8_0 quantise
// their activations to q8 blocks (integer dots): they are held to 1e-5 against the CPU applying the
// same quantisation, and to 2e-2 against the f32 reference (the q8 rounding itself); the K-quant
// experts (q3_k .. q6_k) likewise, and with set_moe_q8_activations(false) 1e-5 against the f32
// reference. Router ids must
// be identical; element-wise HC arithmetic is repeated op for op (HC post: exact given the same inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/iq_tables.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_kernels_testing.h"
#include "backend/cuda/ds4_prefill.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "cuda_test_util.h"
#include "models/cuda/ds4_host_util.h"
#include "ds4_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

std::vector<uint64_t> host_grid() {
    std::vector<uint64_t> g(256);
    for (int i = 0; i < 256; ++i) std::memcpy(&g[static_cast<size_t>(i)], cpu::iq2xxs_grid[i], 8);
    return g;
}

// Quantise rows x cols random N(0, sd) values to t with the CPU reference quantiser. IQ2_XXS (whose
// reference quantiser searches the grid, slow for megabytes) gets uniformly random codes instead
// (every grid entry and sign code) with block scales d giving weights of about sd.
std::vector<uint8_t> quant_rows(dtype t, int64_t cols, int64_t rows, std::mt19937 &rng, float sd) {
    if (t == dtype::iq2_xxs) {
        std::vector<uint8_t> q(dtype_row_bytes(t, cols) * static_cast<size_t>(rows));
        for (auto &b : q) b = static_cast<uint8_t>(rng() >> 24);
        std::uniform_real_distribution<float> ud(0.5f, 1.5f);
        for (size_t off = 0; off < q.size(); off += 66) {  // 66-byte blocks: f16 d first
            const uint16_t d = cpu::f32_to_f16(sd / 100.0f * ud(rng));
            std::memcpy(&q[off], &d, 2);
        }
        return q;
    }
    const auto f = randn(static_cast<size_t>(cols * rows), rng, sd);
    const size_t rb = dtype_row_bytes(t, cols);
    std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) cpu::quantize_row(t, f.data() + r * cols, q.data() + rb * r, cols);
    return q;
}

// ---- host: decoders --------------------------------------------------------------------------------

template <dtype T>
void check_units(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)));
    std::mt19937 rng(static_cast<unsigned>(T) + 7);
    const auto q = quant_rows(T, K, 1, rng, 1.0f);
    std::vector<float> ref(static_cast<size_t>(K)), got(static_cast<size_t>(K), std::nanf(""));
    cpu::dequantize_row(T, q.data(), ref.data(), K);
    std::vector<int> hits(static_cast<size_t>(K), 0);
    const auto grid = host_grid();
    for (int64_t u = 0; u < K / 32; ++u) {
        float w[32];
        int64_t base;
        int stride;
        cuda::ds4q::decode32<T>(q.data(), u, w, base, stride, grid.data());
        for (int r = 0; r < 4; ++r)
            for (int i = 0; i < 8; ++i) {
                const int64_t e = base + r * stride + i;
                ASSERT_TRUE(e >= 0 && e < K) << "unit " << u;
                got[static_cast<size_t>(e)] = w[8 * r + i];
                ++hits[static_cast<size_t>(e)];
            }
    }
    for (int64_t i = 0; i < K; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "element " << i;
        ASSERT_EQ(got[static_cast<size_t>(i)], ref[static_cast<size_t>(i)]) << "element " << i;
    }
}

TEST(CudaDs4Host, ExpertUnitsMatchCpuDequantisation) {
    check_units<dtype::iq2_xxs>(4096);
    check_units<dtype::q2_k>(4096);
    check_units<dtype::mxfp4>(4096);
    check_units<dtype::q8_0>(4096);
    check_units<dtype::q3_k>(4096);
    check_units<dtype::q4_k>(4096);
    check_units<dtype::q5_k>(4096);
    check_units<dtype::q6_k>(4096);
}

// K-quant rows of uniformly random bytes (every scale, min, high-bit and quant pattern, negative
// Q6_K / Q3_K scales; quantize_row output only reaches some of them), with the f16 block scales
// replaced by finite values of either sign. The element map and the values must still equal the
// CPU's dequantisation bit for bit (compared as bit patterns, so -0 vs +0 would fail too).
std::vector<uint8_t> random_kquant_row(dtype t, int64_t K, std::mt19937 &rng) {
    std::vector<uint8_t> q(dtype_row_bytes(t, K));
    for (auto &b : q) b = static_cast<uint8_t>(rng() >> 24);
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    auto scale = [&](size_t off) {
        const float v = ud(rng) * 0.01f * ((rng() & 1) ? -1.0f : 1.0f);
        const uint16_t h = cpu::f32_to_f16(v);
        std::memcpy(&q[off], &h, 2);
    };
    const size_t bs = dtype_info(t).type_size;
    for (size_t off = 0; off < q.size(); off += bs) {
        if (t == dtype::q3_k) {
            scale(off + 108);
        } else if (t == dtype::q6_k) {
            scale(off + 208);
        } else {  // q4_k / q5_k: d, dmin
            scale(off);
            scale(off + 2);
        }
    }
    return q;
}
template <dtype T>
void check_units_random_bytes(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)) + " random bytes");
    std::mt19937 rng(static_cast<unsigned>(T) + 101);
    const auto q = random_kquant_row(T, K, rng);
    std::vector<float> ref(static_cast<size_t>(K));
    cpu::dequantize_row(T, q.data(), ref.data(), K);
    std::vector<int> hits(static_cast<size_t>(K), 0);
    for (int64_t u = 0; u < K / 32; ++u) {
        float w[32];
        int64_t base;
        int stride;
        cuda::ds4q::decode32<T>(q.data(), u, w, base, stride, nullptr);
        for (int r = 0; r < 4; ++r)
            for (int i = 0; i < 8; ++i) {
                const int64_t e = base + r * stride + i;
                ASSERT_TRUE(e >= 0 && e < K) << "unit " << u;
                ++hits[static_cast<size_t>(e)];
                uint32_t a, b;
                std::memcpy(&a, &w[8 * r + i], 4);
                std::memcpy(&b, &ref[static_cast<size_t>(e)], 4);
                ASSERT_EQ(a, b) << "element " << e << ": " << w[8 * r + i] << " vs " << ref[static_cast<size_t>(e)];
            }
    }
    for (int64_t i = 0; i < K; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "element " << i;
}

// The host-side type gates (no device needed): the MoE, the generic dense kernels and the prefill
// GEMM take the K-quants (a q4 / Q4_K_M file is not refused), with the alignments their decoders
// need; types without decoders stay refused.
TEST(CudaDs4Host, KquantTypesAcceptedByEveryPath) {
    for (dtype t : {dtype::q3_k, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
        SCOPED_TRACE(std::string(dtype_name(t)));
        EXPECT_TRUE(cd::expert_type_supported(t));
        EXPECT_EQ(cd::expert_alignment(t), t == dtype::q3_k || t == dtype::q6_k ? 2 : 4);
        EXPECT_TRUE(cuda::mm_supported(t));
        alignas(16) static uint8_t rows[4 * 210 * 2 + 16];
        cd::gemm_weight w;
        w.type = t;
        w.p = rows;
        w.rows = 4;
        w.cols = 512;
        w.row_bytes = dtype_row_bytes(t, 512);
        EXPECT_TRUE(cd::gemm_runner::supported(w));
        w.cols = 288;  // not whole 256-blocks
        w.row_bytes = dtype_row_bytes(t, 256) * 2;
        EXPECT_FALSE(cd::gemm_runner::supported(w));
    }
    EXPECT_TRUE(cuda::mm_supported(dtype::q2_k));
    for (dtype t : {dtype::iq4_xs, dtype::iq3_xxs, dtype::iq2_xs}) {
        EXPECT_FALSE(cd::expert_type_supported(t)) << dtype_name(t);
        EXPECT_FALSE(cuda::mm_supported(t)) << dtype_name(t);
    }
}

TEST(CudaDs4Host, KquantUnitsOfRandomBytesMatchCpuDequantisation) {
    check_units_random_bytes<dtype::q3_k>(4096);
    check_units_random_bytes<dtype::q4_k>(4096);
    check_units_random_bytes<dtype::q5_k>(4096);
    check_units_random_bytes<dtype::q6_k>(4096);
}

// The GEMV inner loop's fused unit dots (raw bytes -> sum w x without materialising w) vs the dot of
// the CPU-dequantised row with x in double: the same sum up to f32 rounding.
struct host_x {
    const float *x;
    float4 operator()(int64_t e) const { return make_float4(x[e], x[e + 1], x[e + 2], x[e + 3]); }
};
template <dtype T>
void check_unit_dots(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)));
    std::mt19937 rng(static_cast<unsigned>(T) + 11);
    const auto q = quant_rows(T, K, 1, rng, 1.0f);
    std::vector<float> w(static_cast<size_t>(K));
    cpu::dequantize_row(T, q.data(), w.data(), K);
    const auto x = randn(static_cast<size_t>(K), rng);
    const auto grid = host_grid();
    for (int64_t u = 0; u < K / 32; ++u) {
        cuda::ds4q::unit_dot<T> ud;
        ud.load(q.data(), u);
        const double got = ud.dot(host_x{x.data()}, grid.data());
        // the unit's 32 elements, from decode32's map (checked against dequantize_row above)
        float tmp[32];
        int64_t base;
        int stride;
        cuda::ds4q::decode32<T>(q.data(), u, tmp, base, stride, grid.data());
        double ref = 0, mag = 0;
        for (int r = 0; r < 4; ++r)
            for (int i = 0; i < 8; ++i) {
                const size_t e = static_cast<size_t>(base + r * stride + i);
                ref += static_cast<double>(w[e]) * x[e];
                mag += std::fabs(static_cast<double>(w[e]) * x[e]);
            }
        ASSERT_LE(std::fabs(got - ref), 1e-6 * mag + 1e-30) << "unit " << u << " got " << got << " ref " << ref;
    }
}

TEST(CudaDs4Host, FusedUnitDotsMatchDequantisedDot) {
    check_unit_dots<dtype::iq2_xxs>(4096);
    check_unit_dots<dtype::q2_k>(4096);
    check_unit_dots<dtype::q8_0>(4096);
    check_unit_dots<dtype::mxfp4>(4096);
    check_unit_dots<dtype::f16>(4096);
    check_unit_dots<dtype::f32>(4096);
    check_unit_dots<dtype::q3_k>(4096);
    check_unit_dots<dtype::q4_k>(4096);
    check_unit_dots<dtype::q5_k>(4096);
    check_unit_dots<dtype::q6_k>(4096);
}

// The IQ2_XXS sign bits are computed (7-bit code + parity bit), not looked up: equal to ksigns_iq2xs.
TEST(CudaDs4Host, Iq2xxsSignParityMatchesTable) {
    for (uint32_t c = 0; c < 128; ++c)
        EXPECT_EQ(c | (static_cast<uint32_t>(__builtin_popcount(c) & 1) << 7), cpu::ksigns_iq2xs[c]) << c;
}

// ---- host: integer dots against q8 activations ------------------------------------------------------
// The q8 activation rule of ggml's q8_1 (quantize_row_q8_1_ref), written out here as the test's own
// truth: per block of 32, d = amax / 127, q = roundf(x * (1 / d)) (half away from zero), q = 0 when
// amax = 0.
// xb gets the blocks in the kernels' layout, xd the dequantised values d * q (exact in double).
void q8_reference(const float *x, int64_t n, cuda::ds4q::q8_blk *xb, double *xd) {
    for (int64_t b = 0; b < n / 32; ++b) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t q[32];
        for (int i = 0; i < 32; ++i) {
            q[i] = static_cast<int8_t>(std::round(x[32 * b + i] * id));
            if (xd) xd[32 * b + i] = static_cast<double>(d) * q[i];
        }
        if (xb) {
            std::memcpy(xb[b].qs, q, 32);
            xb[b].d = d;
            xb[b].pad = 0.0f;
        }
    }
}
std::vector<double> q8_dequantised(const float *x, int64_t n) {
    std::vector<double> xd(static_cast<size_t>(n));
    q8_reference(x, n, nullptr, xd.data());
    return xd;
}

// ds4q::dot_q8 (dp4a of the weight codes with the int8 activations, scales per run / unit) vs the dot
// of the CPU-dequantised weights with the dequantised q8 activation in double: the same real number,
// up to f32 rounding of the scale products and the few per-unit sums. dot_q8 reads the unit's x words
// into registers (ds4q::x_q8, what the gate/up kernel reuses across rows) and calls dot_q8x.
template <dtype T>
void check_q8_unit_dots(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)));
    std::mt19937 rng(static_cast<unsigned>(T) + 13);
    const auto q = quant_rows(T, K, 1, rng, 1.0f);
    std::vector<float> w(static_cast<size_t>(K));
    cpu::dequantize_row(T, q.data(), w.data(), K);
    auto x = randn(static_cast<size_t>(K), rng);
    std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero block: d = 0
    std::vector<cuda::ds4q::q8_blk> xb(static_cast<size_t>(K / 32));
    std::vector<double> xd(static_cast<size_t>(K));
    q8_reference(x.data(), K, xb.data(), xd.data());
    const auto grid = host_grid();
    for (int64_t u = 0; u < K / 32; ++u) {
        cuda::ds4q::unit_dot<T> ud;
        ud.load(q.data(), u);
        const double got = cuda::ds4q::dot_q8<T>(ud, u, xb.data(), grid.data());
        float tmp[32];
        int64_t base;
        int stride;
        cuda::ds4q::decode32<T>(q.data(), u, tmp, base, stride, grid.data());
        double ref = 0, mag = 0;
        for (int r = 0; r < 4; ++r)
            for (int i = 0; i < 8; ++i) {
                const size_t e = static_cast<size_t>(base + r * stride + i);
                ref += static_cast<double>(w[e]) * xd[e];
                mag += std::fabs(static_cast<double>(w[e]) * xd[e]);
            }
        ASSERT_LE(std::fabs(got - ref), 2e-6 * mag + 1e-30) << "unit " << u << " got " << got << " ref " << ref;
    }
}

TEST(CudaDs4Host, Q8UnitDotsMatchDequantisedDot) {
    check_q8_unit_dots<dtype::iq2_xxs>(4096);
    check_q8_unit_dots<dtype::q2_k>(4096);
    check_q8_unit_dots<dtype::q8_0>(4096);
    check_q8_unit_dots<dtype::q3_k>(4096);
    check_q8_unit_dots<dtype::q4_k>(4096);
    check_q8_unit_dots<dtype::q5_k>(4096);
    check_q8_unit_dots<dtype::q6_k>(4096);
}

// ds4q::step_q8 / dot_step_q8 (the q8 down kernel's 64-column lane unit) vs the dot of the
// CPU-dequantised weights with the dequantised q8 activation over the step's columns, in double.
// The columns of step U are taken from the format description (q2_k and the K-quants: block U / 4, half
// (U / 2) % 2, elements 256 b + 128 c + 32 j + 16 (U % 2) + l; the others: 64 U .. 64 U + 64), and
// every column must belong to exactly one step. K = 4096 + 32 for q8_0: an odd unit count (the last
// step has one unit).
template <dtype T>
void check_q8_step_dots(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)));
    std::mt19937 rng(static_cast<unsigned>(T) + 29);
    const auto q = quant_rows(T, K, 1, rng, 1.0f);
    std::vector<float> w(static_cast<size_t>(K));
    cpu::dequantize_row(T, q.data(), w.data(), K);
    auto x = randn(static_cast<size_t>(K), rng);
    std::fill(x.begin() + 128, x.begin() + 160, 0.0f);  // an all-zero block: d = 0
    const int units = static_cast<int>(K / 32), steps = (units + 1) / 2;
    std::vector<cuda::ds4q::q8_blk> xb(static_cast<size_t>(units));
    std::vector<double> xd(static_cast<size_t>(K));
    q8_reference(x.data(), K, xb.data(), xd.data());
    const auto grid = host_grid();
    std::vector<int> hits(static_cast<size_t>(K), 0);
    for (int U = 0; U < steps; ++U) {
        std::vector<int64_t> cols;
        if (T == dtype::q2_k || cuda::ds4q::is_kquant<T>()) {  // the K-quants share Q2_K's unit
            const int64_t b = U / 4, c = (U / 2) % 2, h = U % 2;
            for (int64_t j = 0; j < 4; ++j)
                for (int64_t l = 0; l < 16; ++l) cols.push_back(256 * b + 128 * c + 32 * j + 16 * h + l);
        } else {
            for (int64_t e = 64 * int64_t{U}; e < std::min<int64_t>(K, 64 * int64_t{U} + 64); ++e) cols.push_back(e);
        }
        double ref = 0, mag = 0;
        for (int64_t e : cols) {
            ++hits[static_cast<size_t>(e)];
            ref += static_cast<double>(w[static_cast<size_t>(e)]) * xd[static_cast<size_t>(e)];
            mag += std::fabs(static_cast<double>(w[static_cast<size_t>(e)]) * xd[static_cast<size_t>(e)]);
        }
        cuda::ds4q::step_q8<T> st;
        st.load(q.data(), U, units);
        cuda::ds4q::xs_q8<T> xs;
        xs.load(xb.data(), U, units);
        const double got = cuda::ds4q::dot_step_q8<T>(st, xs, grid.data());
        ASSERT_LE(std::fabs(got - ref), 2e-6 * mag + 1e-30) << "step " << U << " got " << got << " ref " << ref;
    }
    for (int64_t e = 0; e < K; ++e) ASSERT_EQ(hits[static_cast<size_t>(e)], 1) << "column " << e;
}

TEST(CudaDs4Host, Q8StepDotsMatchDequantisedDot) {
    check_q8_step_dots<dtype::q2_k>(4096);
    check_q8_step_dots<dtype::iq2_xxs>(4096);
    check_q8_step_dots<dtype::q8_0>(4096 + 32);
    check_q8_step_dots<dtype::q3_k>(4096);
    check_q8_step_dots<dtype::q4_k>(4096);
    check_q8_step_dots<dtype::q5_k>(4096);
    check_q8_step_dots<dtype::q6_k>(4096);
}

// The header's q8 quantiser (the rule the device staging implements) vs the test's, and the IQ2_XXS
// sign application (computed from the 7-bit code, no table) vs ksigns_iq2xs: for every code and
// several grid entries, the 8 int8 values are +-grid byte with the table's signs.
TEST(CudaDs4Host, Q8QuantiserAndIq2Signs) {
    std::mt19937 rng(5);
    auto x = randn(256, rng, 3.0f);
    x[40] = 0.5f * x[41];  // not a tie in general; ties are checked below
    std::vector<cuda::ds4q::q8_blk> want(8), got(8);
    q8_reference(x.data(), 256, want.data(), nullptr);
    for (int b = 0; b < 8; ++b) cuda::ds4q::quantize_q8_block(x.data() + 32 * b, got[static_cast<size_t>(b)]);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), sizeof(cuda::ds4q::q8_blk) * 8), 0);
    // x / d = k + 0.5 exactly: rounds away from zero (amax 127 -> d 1)
    std::vector<float> t(32, 0.0f);
    t[0] = 127.0f;
    t[1] = 2.5f;
    t[2] = -2.5f;
    cuda::ds4q::q8_blk tb;
    cuda::ds4q::quantize_q8_block(t.data(), tb);
    EXPECT_EQ(tb.d, 1.0f);
    EXPECT_EQ(static_cast<uint32_t>(tb.qs[0]) & 0xFFFFFFu, 0xFD037Fu);  // 127, 3, -3
    for (uint32_t c = 0; c < 128; ++c) {
        const uint32_t signs = cuda::ds4q::iq2_signs(c);
        EXPECT_EQ(signs, static_cast<uint32_t>(cpu::ksigns_iq2xs[c])) << c;
        for (int gi : {0, 1, 77, 140, 255}) {
            const uint8_t *g = cpu::iq2xxs_grid[gi];
            uint32_t glo, ghi;
            std::memcpy(&glo, g, 4);
            std::memcpy(&ghi, g + 4, 4);
            const int lo = cuda::ds4q::iq2_signed4(glo, signs & 0xFu), hi = cuda::ds4q::iq2_signed4(ghi, signs >> 4);
            for (int j = 0; j < 8; ++j) {
                const int v = static_cast<int8_t>(static_cast<uint32_t>(j < 4 ? lo : hi) >> (8 * (j & 3)));
                const int want_v = ((cpu::ksigns_iq2xs[c] >> j) & 1) ? -static_cast<int>(g[j]) : static_cast<int>(g[j]);
                EXPECT_EQ(v, want_v) << "code " << c << " grid " << gi << " element " << j;
            }
        }
    }
}

// ---- device -------------------------------------------------------------------------------------------

// A DS4 MoE layer in host memory (CPU reference view) and on the device.
struct moe_fixture {
    ds4::hparams hp;
    ds4::layer_weights l;
    std::vector<uint8_t> gate, up, down, gsh, ush, dsh;
    std::vector<float> gate_inp, bias;
    std::vector<int32_t> tid2eid;
    cd::moe_layer d;
};

using cuda_test::host_bank;
using cuda_test::host_matrix;

class CudaDs4Moe : public CudaDs4 {
protected:
    // D x F experts (E of them, k used), gate/up of type tgu, down tdn, shared expert tsh.
    void build(moe_fixture &m, int64_t D, int64_t F, int E, int k, dtype tgu, dtype tdn, dtype tsh, bool hash) {
        auto &hp = m.hp;
        hp.n_embd = static_cast<int>(D);
        hp.n_ff_exp = static_cast<int>(F);
        hp.n_expert = E;
        hp.n_expert_used = k;
        hp.n_expert_shared = 1;
        hp.expert_weights_scale = 1.5f;
        hp.n_vocab = 97;
        const float sd_in = 1.0f / std::sqrt(static_cast<float>(D)), sd_f = 1.0f / std::sqrt(static_cast<float>(F));
        m.gate = quant_rows(tgu, D, F * E, rng_, sd_in);
        m.up = quant_rows(tgu, D, F * E, rng_, sd_in);
        m.down = quant_rows(tdn, F, D * E, rng_, sd_f);
        m.gsh = quant_rows(tsh, D, F, rng_, sd_in);
        m.ush = quant_rows(tsh, D, F, rng_, sd_in);
        m.dsh = quant_rows(tsh, F, D, rng_, sd_f);
        m.gate_inp = randn(static_cast<size_t>(E * D), rng_, 2.0f * sd_in);
        m.bias = randn(static_cast<size_t>(E), rng_, 0.3f);
        m.tid2eid.resize(static_cast<size_t>(hp.n_vocab * k));
        for (int t = 0; t < hp.n_vocab; ++t) {  // k distinct experts per token
            std::vector<int32_t> p(static_cast<size_t>(E));
            std::iota(p.begin(), p.end(), 0);
            std::shuffle(p.begin(), p.end(), rng_);
            std::copy(p.begin(), p.begin() + k, m.tid2eid.begin() + t * k);
        }
        auto &l = m.l;
        l.hash = hash;
        l.clamp = 1.0f;  // small clamps so both SwiGLU clamps are exercised (g, v ~ N(0, 1))
        l.clamp_sh = 1.25f;
        l.gate_inp = {dtype::f32, reinterpret_cast<const uint8_t *>(m.gate_inp.data()), E, D,
                      static_cast<size_t>(D) * 4};
        if (!hash) l.exp_bias = m.bias;
        l.tid2eid = m.tid2eid;
        l.gate_exps = host_bank(tgu, m.gate, F, D, E);
        l.up_exps = host_bank(tgu, m.up, F, D, E);
        l.down_exps = host_bank(tdn, m.down, D, F, E);
        l.gate_sh = host_matrix(tsh, m.gsh, F, D);
        l.up_sh = host_matrix(tsh, m.ush, F, D);
        l.down_sh = host_matrix(tsh, m.dsh, D, F);
        auto &d = m.d;
        d.gate_inp_type = dtype::f32;
        d.gate_inp = up(m.gate_inp);
        d.gate_inp_row_bytes = static_cast<size_t>(D) * 4;
        d.exp_bias = hash ? nullptr : up(m.bias);
        d.tid2eid = up(m.tid2eid);
        d.n_vocab = hp.n_vocab;
        d.n_expert = E;
        d.n_used = k;
        d.weights_scale = hp.expert_weights_scale;
        d.clamp = l.clamp;
        d.clamp_sh = l.clamp_sh;
        d.gate = dev_bank(tgu, m.gate, F, D, E);
        d.up = dev_bank(tgu, m.up, F, D, E);
        d.down = dev_bank(tdn, m.down, D, F, E);
        d.gate_sh = dev_bank(tsh, m.gsh, F, D, 1);
        d.up_sh = dev_bank(tsh, m.ush, F, D, 1);
        d.down_sh = dev_bank(tsh, m.dsh, D, F, 1);
    }
};

// Rows of expert e of a host bank (rows x cols each) dequantised by the CPU and dotted with xd in double.
std::vector<double> ref_gemv(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols, int e,
                             const std::vector<double> &xd) {
    const size_t rb = dtype_row_bytes(t, cols);
    std::vector<float> w(static_cast<size_t>(cols));
    std::vector<double> out(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
        cpu::dequantize_row(t, b.data() + (static_cast<size_t>(e) * static_cast<size_t>(rows) + static_cast<size_t>(r)) * rb,
                            w.data(), cols);
        double acc = 0;
        for (int64_t i = 0; i < cols; ++i) acc += static_cast<double>(w[static_cast<size_t>(i)]) * xd[static_cast<size_t>(i)];
        out[static_cast<size_t>(r)] = acc;
    }
    return out;
}
// The q8 gate/up half on the CPU: rows (k + 1) * F, routed slot s = expert ids[s] (times wts[s]), then
// the shared expert (clamp_sh); x quantised per block of 32.
std::vector<float> ref_gate_up_q8(const moe_fixture &m, dtype tgu, dtype tsh, const float *x, const std::vector<int> &ids,
                                  const std::vector<float> &wts) {
    const int64_t D = m.hp.n_embd, F = m.hp.n_ff_exp;
    const auto xd = q8_dequantised(x, D);
    std::vector<float> h;
    for (size_t s = 0; s <= ids.size(); ++s) {
        const bool sh = s == ids.size();
        const auto g = ref_gemv(sh ? tsh : tgu, sh ? m.gsh : m.gate, F, D, sh ? 0 : ids[s], xd);
        const auto v = ref_gemv(sh ? tsh : tgu, sh ? m.ush : m.up, F, D, sh ? 0 : ids[s], xd);
        std::vector<float> gf(g.begin(), g.end()), vf(v.begin(), v.end());
        ds4::swiglu_clamped(gf.data(), vf.data(), F, sh ? m.l.clamp_sh : m.l.clamp);
        if (!sh)
            for (auto &e : gf) e *= wts[s];
        h.insert(h.end(), gf.begin(), gf.end());
    }
    return h;
}
// The q8 down half on the CPU: y [D] = sum_s down_{ids[s]} . q8(h row s) + down_sh . q8(h row k).
std::vector<float> ref_down_q8(const moe_fixture &m, dtype tdn, dtype tsh, const float *h, const std::vector<int> &ids) {
    const int64_t D = m.hp.n_embd, F = m.hp.n_ff_exp;
    std::vector<double> y(static_cast<size_t>(D), 0.0);
    for (size_t s = 0; s <= ids.size(); ++s) {
        const bool sh = s == ids.size();
        const auto hd = q8_dequantised(h + static_cast<int64_t>(s) * F, F);
        const auto part = ref_gemv(sh ? tsh : tdn, sh ? m.dsh : m.down, D, F, sh ? 0 : ids[s], hd);
        for (int64_t r = 0; r < D; ++r) y[static_cast<size_t>(r)] += part[static_cast<size_t>(r)];
    }
    return std::vector<float>(y.begin(), y.end());
}

// The whole MoE FFN of one token (router GEMV, routing, routed + shared experts) vs moe_forward.
TEST_F(CudaDs4Moe, FfnMatchesCpuReference) {
    struct cfg {
        dtype gu, dn, sh;
        bool hash, q8;  // q8: every type has integer dots (activations quantised to q8 blocks)
        int E, k;
    };
    // k = 24 of 32: 512 shared + 24 * 256 routed gate/up tasks, more than the resident warps, so
    // warps run several grid-stride rounds (shared rows before the PDL wait, routed pairs after).
    const cfg cfgs[] = {{dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, false, true, 16, 6},
                        {dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, true, true, 16, 6},
                        {dtype::q2_k, dtype::q2_k, dtype::q8_0, false, true, 16, 6},
                        {dtype::mxfp4, dtype::mxfp4, dtype::mxfp4, false, false, 16, 6},
                        {dtype::q8_0, dtype::iq2_xxs, dtype::q2_k, true, true, 16, 6},
                        {dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, false, true, 32, 24},
                        // K-quants (q8 activations, integer dots): routed + shared in one launch
                        // (q4_k / q4_k, q6_k / q8_0) and in separate launches (mixed pairs), every type
                        // as routed gate/up, routed down and shared expert, learned and hash routing,
                        // k = 24 of 32
                        {dtype::q4_k, dtype::q4_k, dtype::q4_k, false, true, 16, 6},
                        {dtype::q4_k, dtype::q6_k, dtype::q8_0, true, true, 16, 6},
                        {dtype::q3_k, dtype::q5_k, dtype::q6_k, false, true, 16, 6},
                        {dtype::q6_k, dtype::q3_k, dtype::q4_k, true, true, 16, 6},
                        {dtype::q5_k, dtype::q6_k, dtype::q3_k, false, true, 32, 24}};
    const int64_t D = 1024, F = 512;
    for (const cfg &c : cfgs) {
        const int E = c.E, k = c.k;
        SCOPED_TRACE(std::string(dtype_name(c.gu)) + "/" + std::string(dtype_name(c.dn)) + "/" + std::string(dtype_name(c.sh)) +
                     (c.hash ? " hash" : " biased") + " k=" + std::to_string(k));
        moe_fixture m;
        build(m, D, F, E, k, c.gu, c.dn, c.sh, c.hash);
        cd::moe_scratch sc;
        sc.logits = poisoned(E);
        sc.ids = dev<int32_t>(k);
        sc.weights = poisoned(k);
        sc.h = poisoned(static_cast<size_t>((k + 1) * F));
        int32_t *tok = dev<int32_t>(1);
        float *y = poisoned(static_cast<size_t>(D));
        for (int trial = 0; trial < 3; ++trial) {
            const int32_t token = static_cast<int32_t>(rng_() % 97);
            const auto xn = randn(static_cast<size_t>(D), rng_);
            float *xd = up(xn);
            cudaMemcpy(tok, &token, 4, cudaMemcpyHostToDevice);
            cudaMemcpy(y, std::vector<float>(static_cast<size_t>(D), std::nanf("")).data(), D * 4,
                       cudaMemcpyHostToDevice);
            cd::launch_moe_ffn(m.d, xd, tok, sc, y, err_, s_);
            std::vector<float> ref(static_cast<size_t>(D));
            ds4::moe_forward(m.hp, m.l, xn.data(), token, ref.data());
            const auto got = down(y, static_cast<size_t>(D));
            const double e = rel_l2(got, ref);
            // the route the CPU takes on its own logits
            std::vector<float> logits(static_cast<size_t>(E));
            ds4::matmul(m.l.gate_inp, xn.data(), 1, logits.data());
            const ds4::route r = ds4::moe_route(m.hp, m.l, logits.data(), token);
            const auto ids = down(sc.ids, static_cast<size_t>(k));
            EXPECT_EQ(std::vector<int>(ids.begin(), ids.end()), r.experts);
            EXPECT_EQ(take_err(), 0u);
            double eq = 0;
            if (c.q8) {
                // q8 path: x and h are quantised per block of 32 (rounding error ~ amax / 127 / sqrt(12)
                // ~ 0.5% of each activation's rms, twice), so vs the f32 reference ~1e-2; vs the same
                // quantisation on the CPU, f32 rounding plus the rare h element that lands on the other
                // side of a rounding boundary (one step ~ 1% of its block's amax: ~3e-4 of y each).
                EXPECT_LE(e, 2e-2);
                const auto hq = ref_gate_up_q8(m, c.gu, c.sh, xn.data(), r.experts, r.weights);
                eq = rel_l2(got, ref_down_q8(m, c.dn, c.sh, hq.data(), r.experts));
                EXPECT_LE(eq, 1e-3);
            } else {
                EXPECT_LE(e, 1e-5);
            }
            if (trial == 0)
                std::printf("  moe ffn %s k=%d: rel L2 %.3g vs f32 reference, %.3g vs q8 CPU chain\n", dtype_name(c.gu).data(),
                            k, e, eq);
        }
    }
}

// The public gate/up and down launchers on the q8 path (routed slots with routing weights, then the
// shared expert as its own launch), each half against the CPU doing the same q8 quantisation of its
// input (x, or a given h): the integer dots are exact, so only f32 rounding of scales and sums
// differs (<= 1e-5, the tolerance of the f32 path). Inputs include all-zero activation blocks (d = 0).
TEST_F(CudaDs4Moe, Q8GemvsMatchQuantisedCpu) {
    struct cfg {
        dtype gu, dn, sh;
    };
    const cfg cfgs[] = {{dtype::iq2_xxs, dtype::q2_k, dtype::q8_0},
                        {dtype::q2_k, dtype::q2_k, dtype::q8_0},
                        {dtype::q8_0, dtype::iq2_xxs, dtype::q8_0}};
    const int64_t D = 2048, F = 1024;
    const int E = 7, k = 6;
    for (const cfg &c : cfgs) {
        SCOPED_TRACE(std::string(dtype_name(c.gu)) + "/" + std::string(dtype_name(c.dn)) + "/" + std::string(dtype_name(c.sh)));
        moe_fixture m;
        build(m, D, F, E, k, c.gu, c.dn, c.sh, false);
        std::vector<int> ids(static_cast<size_t>(E));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng_);
        ids.resize(k);
        std::vector<float> wts = randn(k, rng_, 0.5f);
        int32_t *ids_d = up(std::vector<int32_t>(ids.begin(), ids.end()));
        float *w_d = up(wts);
        auto x = randn(static_cast<size_t>(D), rng_);
        std::fill(x.begin() + 256, x.begin() + 288, 0.0f);
        float *h_d = poisoned(static_cast<size_t>((k + 1) * F));
        cd::launch_moe_gate_up(m.d.gate, m.d.up, ids_d, w_d, k, 0, up(x), m.l.clamp, h_d, err_, s_);
        cd::launch_moe_gate_up(m.d.gate_sh, m.d.up_sh, nullptr, nullptr, 1, k, up(x), m.l.clamp_sh, h_d, err_, s_);
        const auto h = down(h_d, static_cast<size_t>((k + 1) * F));
        const double eh = rel_l2(h, ref_gate_up_q8(m, c.gu, c.sh, x.data(), ids, wts));
        EXPECT_LE(eh, 1e-5);
        // down from a given h (N(0, 1), one zero block per row): its quantisation is the same on both sides
        auto hin = randn(static_cast<size_t>((k + 1) * F), rng_);
        for (int s = 0; s <= k; ++s) std::fill_n(hin.begin() + s * F + 32 * s, 32, 0.0f);
        float *hin_d = up(hin);
        float *y_d = poisoned(static_cast<size_t>(D));
        cd::launch_moe_down(m.d.down, ids_d, k, 0, hin_d, false, y_d, err_, s_);
        cd::launch_moe_down(m.d.down_sh, nullptr, 1, k, hin_d, true, y_d, err_, s_);
        const auto y = down(y_d, static_cast<size_t>(D));
        const double ey = rel_l2(y, ref_down_q8(m, c.dn, c.sh, hin.data(), ids));
        EXPECT_LE(ey, 1e-5);
        EXPECT_EQ(take_err(), 0u);
        std::printf("  q8 gemvs %s/%s/%s: gate/up rel L2 %.3g, down %.3g\n", dtype_name(c.gu).data(),
                    dtype_name(c.dn).data(), dtype_name(c.sh).data(), eh, ey);
    }
}

// The q8 gate/up kernel's task tail and grid-stride rounds: F odd (the last routed task of each slot
// is a single row), 40 routed slots (repeated experts; 40 * 167 tasks, more than the resident warps),
// against the CPU doing the same q8 quantisation of x. The h row after the last slot must stay
// untouched (poison kept).
TEST_F(CudaDs4Moe, Q8GateUpOddRowsManyRounds) {
    const int64_t D = 512, F = 333;
    const int E = 5, n_slot = 40;
    for (dtype t : {dtype::iq2_xxs, dtype::q2_k, dtype::q8_0}) {
        SCOPED_TRACE(std::string(dtype_name(t)));
        const float sd = 1.0f / std::sqrt(static_cast<float>(D));
        const auto g = quant_rows(t, D, F * E, rng_, sd), u = quant_rows(t, D, F * E, rng_, sd);
        std::vector<int32_t> ids(static_cast<size_t>(n_slot));
        for (auto &e : ids) e = static_cast<int32_t>(rng_() % E);
        const auto wts = randn(static_cast<size_t>(n_slot), rng_, 0.5f);
        const auto x = randn(static_cast<size_t>(D), rng_);
        float *h_d = poisoned(static_cast<size_t>((n_slot + 1) * F));
        cd::launch_moe_gate_up(dev_bank(t, g, F, D, E), dev_bank(t, u, F, D, E), up(ids), up(wts), n_slot, 0, up(x), 1.0f,
                               h_d, err_, s_);
        const auto h = down(h_d, static_cast<size_t>((n_slot + 1) * F));
        EXPECT_EQ(take_err(), 0u);
        const auto xd = q8_dequantised(x.data(), D);
        std::vector<float> ref;
        for (int s = 0; s < n_slot; ++s) {
            const auto gv = ref_gemv(t, g, F, D, ids[static_cast<size_t>(s)], xd);
            const auto uv = ref_gemv(t, u, F, D, ids[static_cast<size_t>(s)], xd);
            std::vector<float> gf(gv.begin(), gv.end()), uf(uv.begin(), uv.end());
            ds4::swiglu_clamped(gf.data(), uf.data(), F, 1.0f);
            for (auto &v : gf) ref.push_back(v * wts[static_cast<size_t>(s)]);
        }
        const double eh = rel_l2(h.data(), ref.data(), ref.size());
        EXPECT_LE(eh, 1e-5);
        for (int64_t r = 0; r < F; ++r) ASSERT_TRUE(std::isnan(h[static_cast<size_t>(n_slot * F + r)])) << r;
        std::printf("  q8 gate/up %s, F = %lld, %d slots: rel L2 %.3g\n", dtype_name(t).data(), static_cast<long long>(F),
                    n_slot, eh);
    }
}

// The q8 down kernel's edges: D = 333 rows (the last block's last warp has one row, the last block
// some warps with none), F with more than 32 64-column steps per row (lanes loop twice) and, for
// q8_0, an odd unit count (the last step has one unit); 7 routed slots (not a multiple of the slot
// groups of 3 / 2 / 1, expert 1 repeated) accumulated onto a given y, then the shared expert as its
// own launch (one slot: the other slots of its group absent). Against the CPU doing the same q8
// quantisation of h; y[D] (past the last row) must keep its poison.
TEST_F(CudaDs4Moe, Q8DownOddShapesAccumulate) {
    const int64_t D = 333;
    const int E = 5, n_slot = 7;
    struct cfg {
        dtype dn, sh;
        int64_t F;
    };
    const cfg cfgs[] = {{dtype::q2_k, dtype::q8_0, 2304}, {dtype::iq2_xxs, dtype::q8_0, 2304},
                        {dtype::q8_0, dtype::q8_0, 2144}};
    for (const cfg &c : cfgs) {
        const int64_t F = c.F;
        SCOPED_TRACE(std::string(dtype_name(c.dn)) + " F " + std::to_string(F));
        const float sd = 1.0f / std::sqrt(static_cast<float>(F));
        const auto dn = quant_rows(c.dn, F, D * E, rng_, sd), dsh = quant_rows(c.sh, F, D, rng_, sd);
        std::vector<int32_t> ids = {1, 3, 0, 1, 4, 2, 1};
        auto h = randn(static_cast<size_t>((n_slot + 1) * F), rng_);
        for (int s = 0; s <= n_slot; ++s) std::fill_n(h.begin() + s * F + 64 * s, 32, 0.0f);  // d = 0 blocks
        auto y0 = randn(static_cast<size_t>(D), rng_);
        std::vector<float> yin(y0);
        yin.push_back(std::nanf(""));
        float *y_d = up(yin), *h_d = up(h);
        cd::launch_moe_down(dev_bank(c.dn, dn, D, F, E), up(ids), n_slot, 0, h_d, true, y_d, err_, s_);
        cd::launch_moe_down(dev_bank(c.sh, dsh, D, F, 1), nullptr, 1, n_slot, h_d, true, y_d, err_, s_);
        const auto y = down(y_d, static_cast<size_t>(D + 1));
        EXPECT_EQ(take_err(), 0u);
        std::vector<double> ref(y0.begin(), y0.end());
        for (int s = 0; s <= n_slot; ++s) {
            const auto hd = q8_dequantised(h.data() + s * F, F);
            const auto part = s < n_slot ? ref_gemv(c.dn, dn, D, F, ids[static_cast<size_t>(s)], hd)
                                         : ref_gemv(c.sh, dsh, D, F, 0, hd);
            for (int64_t r = 0; r < D; ++r) ref[static_cast<size_t>(r)] += part[static_cast<size_t>(r)];
        }
        const std::vector<float> reff(ref.begin(), ref.end());
        const double ey = rel_l2(y.data(), reff.data(), static_cast<size_t>(D));
        EXPECT_LE(ey, 1e-5);
        EXPECT_TRUE(std::isnan(y[static_cast<size_t>(D)]));
        std::printf("  q8 down %s, D = %lld, F = %lld, %d slots + shared, accumulate: rel L2 %.3g\n",
                    dtype_name(c.dn).data(), static_cast<long long>(D), static_cast<long long>(F), n_slot, ey);
    }
}

// The K-quant expert GEMVs at awkward shapes, in both activation modes (q8 blocks + integer dots,
// the default; f32 with set_moe_q8_activations(false)), each half against the CPU's dequantised rows
// dotted in double with the same activations (q8: quantised per block of 32 as the kernels do;
// f32: as given): <= 1e-5, f32 accumulation only.
// gate/up: F = 333 rows (not a multiple of the routed pairs or the 8-warp blocks), 40 routed slots
// over 5 experts (repeated ids; 40 * 333 rows, several grid-stride rounds), then the shared expert of
// another K-quant as its own launch (h row 40, no routing weight, its own clamp); the h row after it
// must keep its poison. down: D = 333 rows (the last block partly empty), F = 768 (3 K-quant blocks
// per row: 12 64-column steps, 24 units), 7 routed slots (expert 1 three times) accumulated onto a
// given y, then the shared expert; y[D] must keep its poison.
TEST_F(CudaDs4Moe, KquantGemvsOddShapesMatchCpu) {
    struct cfg {
        dtype t, tsh;
    };
    const cfg cfgs[] = {{dtype::q3_k, dtype::q6_k}, {dtype::q4_k, dtype::q5_k}, {dtype::q5_k, dtype::q4_k},
                        {dtype::q6_k, dtype::q3_k}};
    struct q8_scope {  // the process-wide switch is restored even when a check throws
        ~q8_scope() { cd::set_moe_q8_activations(true); }
    } restore;
    const int E = 5;
    for (const bool q8 : {true, false}) {
        cd::set_moe_q8_activations(q8);
        auto acts = [&](const float *v, int64_t n) {
            return q8 ? q8_dequantised(v, n) : std::vector<double>(v, v + n);
        };
        for (const cfg &c : cfgs) {
            SCOPED_TRACE(std::string(dtype_name(c.t)) + " routed, " + std::string(dtype_name(c.tsh)) + " shared, " +
                         (q8 ? "q8" : "f32") + " activations");
            {  // gate/up
                const int64_t D = 512, F = 333;
                const int n_slot = 40;
                const float sd = 1.0f / std::sqrt(static_cast<float>(D));
                const auto g = quant_rows(c.t, D, F * E, rng_, sd), u = quant_rows(c.t, D, F * E, rng_, sd);
                const auto gs = quant_rows(c.tsh, D, F, rng_, sd), us = quant_rows(c.tsh, D, F, rng_, sd);
                std::vector<int32_t> ids(static_cast<size_t>(n_slot));
                for (auto &e : ids) e = static_cast<int32_t>(rng_() % E);
                const auto wts = randn(static_cast<size_t>(n_slot), rng_, 0.5f);
                auto x = randn(static_cast<size_t>(D), rng_);
                std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero q8 block (d = 0)
                float *h_d = poisoned(static_cast<size_t>((n_slot + 2) * F)), *x_d = up(x);
                cd::launch_moe_gate_up(dev_bank(c.t, g, F, D, E), dev_bank(c.t, u, F, D, E), up(ids), up(wts), n_slot, 0,
                                       x_d, 1.0f, h_d, err_, s_);
                cd::launch_moe_gate_up(dev_bank(c.tsh, gs, F, D, 1), dev_bank(c.tsh, us, F, D, 1), nullptr, nullptr, 1,
                                       n_slot, x_d, 1.25f, h_d, err_, s_);
                const auto h = down(h_d, static_cast<size_t>((n_slot + 2) * F));
                EXPECT_EQ(take_err(), 0u);
                const auto xd = acts(x.data(), D);
                std::vector<float> ref;
                for (int s = 0; s <= n_slot; ++s) {
                    const bool sh = s == n_slot;
                    const int e = sh ? 0 : ids[static_cast<size_t>(s)];
                    const auto gv = ref_gemv(sh ? c.tsh : c.t, sh ? gs : g, F, D, e, xd);
                    const auto uv = ref_gemv(sh ? c.tsh : c.t, sh ? us : u, F, D, e, xd);
                    std::vector<float> gf(gv.begin(), gv.end()), uf(uv.begin(), uv.end());
                    ds4::swiglu_clamped(gf.data(), uf.data(), F, sh ? 1.25f : 1.0f);
                    for (auto &v : gf) ref.push_back(sh ? v : v * wts[static_cast<size_t>(s)]);
                }
                const double eh = rel_l2(h.data(), ref.data(), ref.size());
                EXPECT_LE(eh, 1e-5);
                for (int64_t r = 0; r < F; ++r)
                    ASSERT_TRUE(std::isnan(h[static_cast<size_t>((n_slot + 1) * F + r)])) << r;
                std::printf("  k-quant gate/up %s (+ %s shared), %s activations, F = %lld, %d slots: rel L2 %.3g\n",
                            dtype_name(c.t).data(), dtype_name(c.tsh).data(), q8 ? "q8" : "f32",
                            static_cast<long long>(F), n_slot, eh);
            }
            {  // down
                const int64_t D = 333, F = 768;
                const int n_slot = 7;
                const float sd = 1.0f / std::sqrt(static_cast<float>(F));
                const auto dn = quant_rows(c.t, F, D * E, rng_, sd), dsh = quant_rows(c.tsh, F, D, rng_, sd);
                const std::vector<int32_t> ids = {1, 3, 0, 1, 4, 2, 1};
                auto h = randn(static_cast<size_t>((n_slot + 1) * F), rng_);
                for (int s = 0; s <= n_slot; ++s) std::fill_n(h.begin() + s * F + 64 * s, 32, 0.0f);  // d = 0 blocks
                const auto y0 = randn(static_cast<size_t>(D), rng_);
                std::vector<float> yin(y0);
                yin.push_back(std::nanf(""));
                float *y_d = up(yin), *h_d = up(h);
                cd::launch_moe_down(dev_bank(c.t, dn, D, F, E), up(ids), n_slot, 0, h_d, true, y_d, err_, s_);
                cd::launch_moe_down(dev_bank(c.tsh, dsh, D, F, 1), nullptr, 1, n_slot, h_d, true, y_d, err_, s_);
                const auto y = down(y_d, static_cast<size_t>(D + 1));
                EXPECT_EQ(take_err(), 0u);
                std::vector<double> ref(y0.begin(), y0.end());
                for (int s = 0; s <= n_slot; ++s) {
                    const auto hd = acts(h.data() + s * F, F);
                    const auto part = s < n_slot ? ref_gemv(c.t, dn, D, F, ids[static_cast<size_t>(s)], hd)
                                                 : ref_gemv(c.tsh, dsh, D, F, 0, hd);
                    for (int64_t r = 0; r < D; ++r) ref[static_cast<size_t>(r)] += part[static_cast<size_t>(r)];
                }
                const std::vector<float> reff(ref.begin(), ref.end());
                const double ey = rel_l2(y.data(), reff.data(), static_cast<size_t>(D));
                EXPECT_LE(ey, 1e-5);
                EXPECT_TRUE(std::isnan(y[static_cast<size_t>(D)]));
                std::printf("  k-quant down %s (+ %s shared), %s activations, D = %lld, F = %lld, %d slots, "
                            "accumulate: rel L2 %.3g\n",
                            dtype_name(c.t).data(), dtype_name(c.tsh).data(), q8 ? "q8" : "f32",
                            static_cast<long long>(D), static_cast<long long>(F), n_slot, ey);
            }
        }
    }
}

// Router alone, fed the CPU's logits: identical ids (including ties, broken towards the lower id)
// and weights.
TEST_F(CudaDs4Moe, RouterIdsExactAndWeights) {
    const int E = 256, k = 6;
    moe_fixture m;
    build(m, 256, 256, E, k, dtype::q8_0, dtype::q8_0, dtype::q8_0, false);
    float *logits_d = dev<float>(E);
    int32_t *ids_d = dev<int32_t>(k);
    float *w_d = poisoned(k);
    int32_t *tok = dev<int32_t>(1);
    int checked = 0;
    double worst_w = 0;
    for (int trial = 0; trial < 300; ++trial) {
        const bool hash = trial % 3 == 2;
        m.l.hash = hash;
        auto logits = randn(static_cast<size_t>(E), rng_, 3.0f);
        if (trial % 5 == 0)  // exact ties: equal logits and zero bias on a run of experts
            for (int e = 10; e < 30; ++e) logits[static_cast<size_t>(e)] = 7.0f;
        if (trial % 5 == 0) std::fill(m.l.exp_bias.begin(), m.l.exp_bias.end(), 0.0f);
        else m.l.exp_bias = randn(static_cast<size_t>(E), rng_, 0.5f);
        const float *bias_d = hash ? nullptr : up(m.l.exp_bias);
        const int32_t token = static_cast<int32_t>(rng_() % 97);
        cudaMemcpy(logits_d, logits.data(), E * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(tok, &token, 4, cudaMemcpyHostToDevice);
        cudaMemset(ids_d, 0xff, k * 4);
        cd::launch_moe_route(logits_d, E, bias_d, m.d.tid2eid, 97, tok, k, 1.5f, ids_d, w_d, err_, s_);
        const ds4::route r = ds4::moe_route(m.hp, m.l, logits.data(), token);
        const auto ids = down(ids_d, k);
        const auto w = down(w_d, k);
        ASSERT_EQ(std::vector<int>(ids.begin(), ids.end()), r.experts) << "trial " << trial;
        for (int j = 0; j < k; ++j)
            worst_w = std::max(worst_w, std::fabs(static_cast<double>(w[j]) - r.weights[static_cast<size_t>(j)]) /
                                            std::fabs(r.weights[static_cast<size_t>(j)]));
        ++checked;
    }
    EXPECT_LE(worst_w, 1e-6);
    EXPECT_EQ(take_err(), 0u);
    std::printf("  router: %d routes, ids identical, worst weight rel error %.3g\n", checked, worst_w);
    // A hash-routed token outside the table: error bit, ids -1, nothing read out of bounds.
    const int32_t bad = 97;
    cudaMemcpy(tok, &bad, 4, cudaMemcpyHostToDevice);
    cd::launch_moe_route(logits_d, E, nullptr, m.d.tid2eid, 97, tok, k, 1.5f, ids_d, w_d, err_, s_);
    EXPECT_EQ(take_err(), static_cast<uint32_t>(cd::err_token_id));
    EXPECT_EQ(down(ids_d, 1)[0], -1);
    // An expert id outside the bank: the GEMVs skip the slot and report it.
    const std::vector<int32_t> bad_ids = {0, 1, 2, 3, 4, 300};
    int32_t *bid = up(bad_ids);
    float *h = poisoned(static_cast<size_t>(7 * 256));
    std::vector<float> x(256, 1.0f);
    cd::launch_moe_gate_up(m.d.gate, m.d.up, bid, nullptr, 6, 0, up(x), 1.0f, h, err_, s_);
    EXPECT_EQ(take_err(), static_cast<uint32_t>(cd::err_expert_id));
    EXPECT_THROW(cd::launch_moe_route(logits_d, 2000, nullptr, nullptr, 0, nullptr, 6, 1.0f, ids_d, w_d, err_, s_),
                 error);
    cd::expert_bank wrong = m.d.gate;
    wrong.type = dtype::iq4_xs;  // no expert decoder for it
    EXPECT_THROW(cd::launch_moe_gate_up(wrong, wrong, bid, nullptr, 6, 0, up(x), 1.0f, h, err_, s_), error);
}

// HC pre (mixer, Sinkhorn, weighted sum) and HC post at the full Flash width, f32 and f16 mixers.
TEST_F(CudaDs4, HcPreAndPostMatchCpu) {
    ds4::hparams hp;
    hp.n_hc = 4;
    hp.n_embd = 4096;
    hp.sinkhorn_iters = 20;
    hp.hc_eps = 1e-6f;
    hp.rms_eps = 1e-6f;
    const int n = hp.n_hc, n_mix = (2 + n) * n;
    const int64_t D = hp.n_embd, S = n * D;
    for (dtype ft : {dtype::f32, dtype::f16}) {
        SCOPED_TRACE(std::string(dtype_name(ft)));
        for (int trial = 0; trial < 3; ++trial) {
            auto fn = randn(static_cast<size_t>(n_mix * S), rng_, 1.0f / std::sqrt(static_cast<float>(S)) * 4.0f);
            std::vector<uint8_t> fnb(dtype_row_bytes(ft, S) * n_mix);
            for (int r = 0; r < n_mix; ++r)
                cpu::quantize_row(ft, fn.data() + r * S, fnb.data() + r * dtype_row_bytes(ft, S), S);
            ds4::hc_weights w;
            w.fn = {ft, fnb.data(), n_mix, S, dtype_row_bytes(ft, S)};
            w.base = randn(static_cast<size_t>(n_mix), rng_, 0.5f);
            w.scale = randn(3, rng_, 1.0f);
            const auto x = randn(static_cast<size_t>(S), rng_, 2.0f);
            std::vector<float> u(static_cast<size_t>(D)), post(n), comb(static_cast<size_t>(n * n));
            ds4::hc_pre(hp, w, x.data(), u.data(), post.data(), comb.data());

            float *xd = up(x), *mix = poisoned(static_cast<size_t>(n_mix + 1)), *ud = poisoned(D),
                  *pd = poisoned(n), *cdv = poisoned(static_cast<size_t>(n * n));
            cd::hc_params p{n, D, hp.sinkhorn_iters, hp.hc_eps, hp.rms_eps};
            cd::launch_hc_pre(p, ft, up(fnb), dtype_row_bytes(ft, S), up(w.base), up(w.scale), xd, mix, ud, pd, cdv,
                              s_);
            const double eu = rel_l2(down(ud, D), u), ep = rel_l2(down(pd, n), post),
                         ec = rel_l2(down(cdv, static_cast<size_t>(n * n)), comb);
            EXPECT_LE(eu, 1e-5);
            EXPECT_LE(ep, 1e-5);
            EXPECT_LE(ec, 1e-5);

            // HC post from the CPU's post/comb: the same f32 operations in the same order.
            const auto y = randn(static_cast<size_t>(D), rng_);
            std::vector<float> xn(static_cast<size_t>(S));
            ds4::hc_post(n, D, y.data(), x.data(), post.data(), comb.data(), xn.data());
            float *xnd = poisoned(static_cast<size_t>(S));
            cd::launch_hc_post(n, D, up(y), xd, up(post), up(comb), xnd, s_);
            const double ex = rel_l2(down(xnd, static_cast<size_t>(S)), xn);
            EXPECT_EQ(ex, 0.0);
            if (trial == 0)
                std::printf("  hc %s: pre u %.3g post %.3g comb %.3g; hc_post %.3g\n", std::string(dtype_name(ft)).c_str(), eu, ep, ec, ex);
        }
    }
}

// Indexer scoring + exact top-k vs indexer_select: identical row sets (ascending), f32 and f16 rows,
// with duplicated rows (equal scores: the lower row wins) and n <= top-k (every row).
TEST_F(CudaDs4, IndexerSelectMatchesCpu) {
    const int H = 64, Dh = 128, topk = 512;
    for (kv_precision prec : {kv_precision::f32, kv_precision::f16}) {
        for (int64_t n : {int64_t{300}, int64_t{3000}, int64_t{20000}}) {
            SCOPED_TRACE((prec == kv_precision::f16 ? "f16 n=" : "f32 n=") + std::to_string(n));
            const auto q = randn(static_cast<size_t>(H * Dh), rng_);
            auto w = randn(static_cast<size_t>(H), rng_, 1.0f / 90.5f);
            auto rows = randn(static_cast<size_t>(n * Dh), rng_);
            for (int64_t c = 1; c < n; c += 7)  // duplicates of earlier rows: exact score ties
                std::copy_n(rows.begin() + (c - 1) * Dh, Dh, rows.begin() + c * Dh);
            ds4::row_store rs(Dh, prec);
            rs.resize(n);
            for (int64_t c = 0; c < n; ++c) rs.set(c, rows.data() + c * Dh);
            const auto ref = ds4::indexer_select(q.data(), w.data(), rs, n, H, Dh, topk);
            const void *rd;
            size_t stride;
            if (prec == kv_precision::f16) {
                std::vector<uint16_t> h(rows.size());
                for (size_t i = 0; i < rows.size(); ++i) h[i] = cpu::f32_to_f16(rows[i]);
                rd = up(h);
                stride = Dh * 2;
            } else {
                rd = up(rows);
                stride = Dh * 4;
            }
            const size_t m = static_cast<size_t>(std::min<int64_t>(n, topk));
            int32_t *out = up(std::vector<int32_t>(m, -7));
            float *sc = poisoned(static_cast<size_t>(n));
            cd::launch_indexer_select(up(q), up(w), rd, prec == kv_precision::f16, stride, n, H, Dh, topk, sc, out, s_);
            const auto got = down(out, m);
            ASSERT_EQ(std::vector<int64_t>(got.begin(), got.end()), ref);
        }
    }
    std::printf("  indexer: n = 300 / 3000 / 20000, f32 and f16 rows: selections identical\n");
}

}  // namespace
}  // namespace fathom
