// The fast DS4 dense GEMV (src/backend/cuda/ds4_gemv.*) against the CPU reference: weights made by
// the CPU quantiser, dequantised with cpu::dequantize_row, dot products in double. Every device output
// is NaN-poisoned first (an unwritten element makes rel_l2 NaN: fails).
//   CudaDs4GemvHost.*   shape / alignment validation (no GPU needed)
//   CudaDs4Gemv.*       kernels on the device (skipped without one): q8_0 repack bytes vs the GGUF
//                       blocks, plain / grouped / multi GEMVs vs the CPU (rel L2 <= 1e-5), bit
//                       reproducibility, PDL ordering in a stream and in a captured graph
// Benchmarks (DS4-Flash shapes, GB/s vs the device copy rate): bench/cuda/bench_ds4_gemv.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_gemv_testing.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_quant.cuh"
#include "backend/cuda/ktrace.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "ds4_gemv_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_gemv_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// ---- host: validation ------------------------------------------------------------------------------

TEST(CudaDs4GemvHost, SupportedShapesAndSizes) {
    EXPECT_TRUE(cd::gemv_fast_supported(dtype::q8_0, 4096));
    EXPECT_TRUE(cd::gemv_fast_supported(dtype::q8_0, 512));
    EXPECT_FALSE(cd::gemv_fast_supported(dtype::q8_0, 544));  // not whole 512-element tiles
    EXPECT_TRUE(cd::gemv_fast_supported(dtype::f16, 516));
    EXPECT_TRUE(cd::gemv_fast_supported(dtype::f32, 4));
    EXPECT_FALSE(cd::gemv_fast_supported(dtype::f16, 514));
    EXPECT_FALSE(cd::gemv_fast_supported(dtype::q4_k, 4096));
    EXPECT_FALSE(cd::gemv_fast_supported(dtype::iq2_xxs, 4096));
    EXPECT_EQ(cd::gemv_prepared_bytes(dtype::q8_0, 3, 1024), size_t{3 * 1024 + 3 * 64});  // int8 + f16 per 32
    EXPECT_EQ(cd::gemv_prepared_bytes(dtype::f16, 3, 1024), size_t{0});
    EXPECT_THROW(cd::gemv_prepared_bytes(dtype::q8_0, 3, 1000), error);
}

// Every rejection happens before anything touches the device (fake, well-aligned addresses); the
// message names the reason, so a check that did not fire cannot pass as a later device failure.
template <class F>
void expect_rejected(F &&f, const char *reason) {
    try {
        f();
        ADD_FAILURE() << "not rejected (" << reason << ")";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
}

TEST(CudaDs4GemvHost, RejectsBadArguments) {
    auto *p = reinterpret_cast<void *>(uintptr_t{1} << 20);
    auto *y = reinterpret_cast<float *>(uintptr_t{2} << 20);
    const auto *x = reinterpret_cast<const float *>(uintptr_t{3} << 20);
    cd::gemv_weight w;
    w.type = dtype::f16;
    w.q = p;
    w.q_stride = 8192;
    w.rows = 16;
    w.cols = 4096;
    expect_rejected([&] { cd::launch_gemv_fast(w, x + 1, y, nullptr); }, "x must be 16-byte aligned");
    cd::gemv_weight bad = w;
    bad.q_stride = 8200;
    expect_rejected([&] { cd::launch_gemv_fast(bad, x, y, nullptr); }, "16-byte aligned");
    bad.q_stride = 4096;  // shorter than a row
    expect_rejected([&] { cd::launch_gemv_fast(bad, x, y, nullptr); }, "16-byte aligned");
    bad = w;
    bad.type = dtype::q8_0;  // q8_0 without scales (not prepared)
    expect_rejected([&] { cd::launch_gemv_fast(bad, x, y, nullptr); }, "prepare it");
    bad = w;
    bad.cols = 4098;
    expect_rejected([&] { cd::launch_gemv_fast(bad, x, y, nullptr); }, "unsupported weight");
    expect_rejected([&] { cd::launch_gemv_fast(w, x, nullptr, nullptr); }, "null output");
    expect_rejected([&] { cd::launch_gemv_fast_grouped(w, 0, x, y, nullptr); }, "rows_per_group");
    std::vector<cd::gemv_segment> segs(9, cd::gemv_segment{w, y});
    expect_rejected([&] { cd::launch_gemv_multi(segs.data(), 9, x, nullptr); }, "1..8 segments");
    expect_rejected([&] { cd::launch_gemv_multi(segs.data(), 0, x, nullptr); }, "1..8 segments");
    segs[1].w.cols = 2048;
    segs[1].w.q_stride = 4096;
    expect_rejected([&] { cd::launch_gemv_multi(segs.data(), 2, x, nullptr); }, "differ in cols");
    expect_rejected([&] { cd::gemv_prepare(dtype::q8_0, p, 34 * 32, 4, 1000, p, nullptr); },
                    "unsupported weight");
    expect_rejected([&] { cd::gemv_prepare(dtype::q8_0, p, 34 * 31, 4, 1024, p, nullptr); }, "whole");
    expect_rejected(
        [&] { cd::gemv_prepare(dtype::q8_0, p, 34 * 32, 4, 1024, static_cast<char *>(p) + 8, nullptr); },
        "dst must be 16-byte aligned");
    expect_rejected([&] { cd::gemv_prepare(dtype::f32, p, 4 * 1024 + 4, 4, 1024, nullptr, nullptr); },
                    "16-byte aligned");
    expect_rejected([&] { cd::gemv_prepare(dtype::q2_k, p, 84 * 4, 4, 1024, p, nullptr); },
                    "unsupported weight");
}

// ---- device -------------------------------------------------------------------------------------------

// The repack moves bytes only: every quant and scale of the GGUF blocks appears, bit for bit, where
// the layout in ds4_gemv.h says (checked from the formula, on strided 2-byte aligned source rows).
TEST_F(CudaDs4Gemv, Q8RepackIsALayoutChange) {
    const int64_t rows = 5, cols = 1536;
    const host_weight w = make_weight(dtype::q8_0, rows, cols, 6, rng_);  // stride 1638: rows 2-byte aligned
    const cd::gemv_weight g = prepare(w);
    ASSERT_EQ(g.q_stride, static_cast<size_t>(cols));
    ASSERT_EQ(g.s_stride, static_cast<size_t>(cols / 16));
    const auto q = down(static_cast<const uint8_t *>(g.q), static_cast<size_t>(rows * cols));
    const auto sc = down(static_cast<const uint8_t *>(g.scales), static_cast<size_t>(rows * cols / 16));
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *row = w.bytes.data() + w.stride * static_cast<size_t>(r);
        for (int64_t e = 0; e < cols; ++e) {  // element order: the quants of block e / 32 end to end
            const uint8_t got = q[static_cast<size_t>(r * cols + e)];
            ASSERT_EQ(got, row[34 * (e / 32) + 2 + e % 32]) << "row " << r << " element " << e;
        }
        for (int64_t b = 0; b < cols / 32; ++b) {  // block order
            const size_t at = static_cast<size_t>(r * (cols / 16) + 2 * b);
            ASSERT_EQ(sc[at], row[34 * b]) << "row " << r << " block " << b;
            ASSERT_EQ(sc[at + 1], row[34 * b + 1]) << "row " << r << " block " << b;
        }
    }
}

// Plain GEMV for every type over small / odd / tile-straddling row counts and cols 1024 / 4096 /
// 8192 (plus cols that are not whole warps for the float types and padded source strides); a
// second run must give the same bits.
TEST_F(CudaDs4Gemv, MatchesCpuReference) {
    struct shape {
        dtype t;
        int64_t rows, cols;
        size_t pad;
    };
    std::vector<shape> shapes;
    for (dtype t : {dtype::q8_0, dtype::f16, dtype::f32})
        for (int64_t cols : {1024, 4096, 8192})
            for (int64_t rows : {1, 7, 33, 257, 1000})
                shapes.push_back({t, rows, cols, t == dtype::q8_0 ? size_t{2} : 16});
    shapes.push_back({dtype::q8_0, 2, 512, 0});
    shapes.push_back({dtype::q8_0, 4099, 1024, 0});  // many 8-row blocks plus a partial one
    shapes.push_back({dtype::f16, 3, 516, 8});       // cols not a multiple of 128: partial warps
    shapes.push_back({dtype::f32, 65, 132, 0});
    shapes.push_back({dtype::f16, 64, 4096, 0});  // DS4 indexer projection
    shapes.push_back({dtype::f32, 3, 4, 16});
    // Tall matrices with short rows get sub-warp groups (ds4_gemv.cu pick_group; on devices of up to
    // ~300 SMs): G = 8 (4 rows per warp, like q_b [32768, 1024]) and G = 16, a partial last block.
    shapes.push_back({dtype::q8_0, 40000, 1024, 0});
    shapes.push_back({dtype::q8_0, 20001, 2048, 2});
    shapes.push_back({dtype::f16, 40000, 256, 16});
    shapes.push_back({dtype::f16, 40000, 260, 8});  // cols % 8 != 0: 8-byte register chunks, G = 16
    shapes.push_back({dtype::f32, 20000, 128, 0});
    // Long rows: several batches per thread (q8_0: staging slots refilled; 512-thread blocks stage 4).
    shapes.push_back({dtype::q8_0, 3, 65536, 0});
    shapes.push_back({dtype::f16, 3, 65536, 0});
    for (const shape &sh : shapes) {
        SCOPED_TRACE(std::string(dtype_name(sh.t)) + " [" + std::to_string(sh.rows) + ", " +
                     std::to_string(sh.cols) + "] pad " + std::to_string(sh.pad));
        const host_weight w = make_weight(sh.t, sh.rows, sh.cols, sh.pad, rng_);
        const auto x = randn(static_cast<size_t>(sh.cols), rng_);
        const cd::gemv_weight g = prepare(w);
        const float *xd = up(x);
        for (bool q8x : {true, false}) {  // both kernels (f32-activation when off or not eligible)
            SCOPED_TRACE(q8x ? "int8 activations allowed" : "f32 activations");
            cd::set_gemv_q8_activations(q8x);
            const auto ref = expected(w, g, x, sh.rows);
            float *y = poisoned(static_cast<size_t>(sh.rows));
            cd::launch_gemv_fast(g, xd, y, s_);
            const auto got = down(y, static_cast<size_t>(sh.rows));
            EXPECT_LE(rel_l2(got, ref), 1e-5);
            float *y2 = poisoned(static_cast<size_t>(sh.rows));
            cd::launch_gemv_fast(g, xd, y2, s_);
            const auto got2 = down(y2, static_cast<size_t>(sh.rows));
            EXPECT_EQ(std::memcmp(got.data(), got2.data(), got.size() * 4), 0) << "not reproducible";
        }
    }
}

// Grouped: DS4 output projection A (8 groups of 1024 q8_0 rows over 4096 inputs each) and small odd
// group shapes for every type, including a last group with fewer rows, and a tall q8_0 one whose
// 4-row warps (G = 8) straddle group boundaries.
TEST_F(CudaDs4Gemv, GroupedMatchesCpuReference) {
    struct shape {
        dtype t;
        int64_t rows, rpg, cols;
    };
    const shape shapes[] = {{dtype::q8_0, 8 * 1024, 1024, 4096},
                            {dtype::q8_0, 3 * 37, 37, 1024},
                            {dtype::q8_0, 4 * 9999, 9999, 1024},  // sub-warp groups; warps straddle groups
                            {dtype::f16, 5 * 13 + 4, 13, 1024},
                            {dtype::f32, 4 * 3, 3, 4096}};
    for (const shape &sh : shapes) {
        SCOPED_TRACE(std::string(dtype_name(sh.t)) + " rows " + std::to_string(sh.rows) + " per group " +
                     std::to_string(sh.rpg));
        const host_weight w = make_weight(sh.t, sh.rows, sh.cols, 0, rng_);
        const int64_t groups = (sh.rows + sh.rpg - 1) / sh.rpg;
        const auto x = randn(static_cast<size_t>(groups * sh.cols), rng_);
        const cd::gemv_weight g = prepare(w);
        const float *xd = up(x);
        for (bool q8x : {true, false}) {
            SCOPED_TRACE(q8x ? "int8 activations allowed" : "f32 activations");
            cd::set_gemv_q8_activations(q8x);
            float *y = poisoned(static_cast<size_t>(sh.rows));
            cd::launch_gemv_fast_grouped(g, sh.rpg, xd, y, s_);
            EXPECT_LE(rel_l2(down(y, static_cast<size_t>(sh.rows)), expected(w, g, x, sh.rpg)), 1e-5);
        }
    }
}

// Multi: the DS4 ratio-4 input projections (q8_0 and f16 segments, 7 of them), an 8-segment mix
// of all three types with odd row counts and an f16 / f32 set with cols % 8 != 0 (register and
// staged chunks in one launch); each segment vs its own CPU reference, and a second launch must
// give the same bits (the reduction order depends on the launch's group sizes, so the multi result
// is compared with another multi launch, not with single-weight launches).
TEST_F(CudaDs4Gemv, MultiMatchesCpuReference) {
    struct seg_shape {
        dtype t;
        int64_t rows;
    };
    const std::vector<seg_shape> ds4 = {{dtype::q8_0, 1024}, {dtype::q8_0, 512}, {dtype::f16, 1024},
                                        {dtype::f16, 1024},  {dtype::f16, 64},   {dtype::f16, 256},
                                        {dtype::f16, 256}};
    const std::vector<seg_shape> mix = {{dtype::f32, 1},    {dtype::q8_0, 33}, {dtype::f16, 7},
                                        {dtype::q8_0, 300}, {dtype::f32, 65},  {dtype::f16, 1},
                                        {dtype::q8_0, 1},   {dtype::f16, 513}};
    // cols % 8 != 0: f16 rows loaded into registers next to staged f32 rows in one launch
    const std::vector<seg_shape> odd = {{dtype::f16, 300}, {dtype::f32, 65}, {dtype::f16, 1}};
    for (const auto &[set, cols] :
         {std::pair{ds4, int64_t{4096}}, std::pair{mix, int64_t{1024}}, std::pair{odd, int64_t{516}}}) {
        SCOPED_TRACE(std::to_string(set.size()) + " segments, cols " + std::to_string(cols));
        const auto x = randn(static_cast<size_t>(cols), rng_);
        std::vector<host_weight> hw;
        std::vector<cd::gemv_segment> segs, segs2;
        for (const seg_shape &ss : set) {
            // rows padded to 16 bytes (f16 at cols 516; the other sets' rows are whole 16 bytes: pad 0)
            const size_t pad = (16 - dtype_row_bytes(ss.t, cols) % 16) % 16;
            hw.push_back(make_weight(ss.t, ss.rows, cols, pad, rng_));
            const cd::gemv_weight g = prepare(hw.back());
            segs.push_back({g, poisoned(static_cast<size_t>(ss.rows))});
            segs2.push_back({g, poisoned(static_cast<size_t>(ss.rows))});
        }
        const float *xd = up(x);
        std::vector<int64_t> rpg;
        for (const auto &h : hw) rpg.push_back(h.rows);
        for (bool q8x : {true, false}) {
            SCOPED_TRACE(q8x ? "int8 activations allowed" : "f32 activations");
            cd::set_gemv_q8_activations(q8x);
            const int n = static_cast<int>(segs.size());
            const bool used = cd::gemv_q8_activations_used(segs.data(), rpg.data(), n);
            // the DS4 set (q8_0 + f16, cols 4096) must take the int8 kernel when allowed
            if (q8x && set.size() == 7) {
                EXPECT_TRUE(used);
            }
            for (auto *ss : {&segs, &segs2})
                for (auto &sg : *ss) CK(cudaMemsetAsync(sg.y, 0xff, static_cast<size_t>(sg.w.rows) * 4, s_));
            cd::launch_gemv_multi(segs.data(), n, xd, s_);
            cd::launch_gemv_multi(segs2.data(), n, xd, s_);
            for (size_t i = 0; i < segs.size(); ++i) {
                SCOPED_TRACE("segment " + std::to_string(i) + " " + std::string(dtype_name(hw[i].t)) +
                             " rows " + std::to_string(hw[i].rows));
                const auto got = down(segs[i].y, static_cast<size_t>(hw[i].rows));
                const auto got2 = down(segs2[i].y, static_cast<size_t>(hw[i].rows));
                const auto ref = used ? reference_q8x(hw[i], x, hw[i].rows) : reference(hw[i], x, hw[i].rows);
                EXPECT_LE(rel_l2(got, ref), 1e-5);
                EXPECT_EQ(std::memcmp(got.data(), got2.data(), got.size() * 4), 0) << "not reproducible";
            }
        }
    }
}

// The normed multi (RMSNorm folded into the int8 kernel's x staging) gives the bits of the separate
// cuda::launch_rms_norm followed by the plain multi launch, for the DS4 query shapes (q_b q8_0 alone,
// with the indexer's f16 q_b, small odd sets) and with int8 activations off (the fallback path); and
// both are near an independent host reference (norm in double, then the GEMV reference).
TEST_F(CudaDs4Gemv, NormedMultiMatchesSeparateNorm) {
    struct seg_shape {
        dtype t;
        int64_t rows;
    };
    const std::vector<std::vector<seg_shape>> sets = {{{dtype::q8_0, 32768}},
                                                      {{dtype::q8_0, 32768}, {dtype::f16, 8192}},
                                                      {{dtype::q8_0, 7}, {dtype::f16, 33}},
                                                      {{dtype::f16, 300}}};
    const int64_t cols = 1024;
    for (bool q8x : {true, false}) {
        cd::set_gemv_q8_activations(q8x);
        for (const auto &set : sets) {
            SCOPED_TRACE(std::string(q8x ? "int8 allowed, " : "f32 activations, ") +
                         std::to_string(set.size()) + " segments, first rows " + std::to_string(set[0].rows));
            auto x = randn(static_cast<size_t>(cols), rng_);
            for (auto &v : x) v *= 3.0f;  // a scale the norm must undo
            const auto wn = randn(static_cast<size_t>(cols), rng_);
            std::vector<host_weight> hw;
            std::vector<cd::gemv_segment> fused, sep;
            for (const seg_shape &ss : set) {
                hw.push_back(make_weight(ss.t, ss.rows, cols, 0, rng_));
                const cd::gemv_weight g = prepare(hw.back());
                fused.push_back({g, poisoned(static_cast<size_t>(ss.rows))});
                sep.push_back({g, poisoned(static_cast<size_t>(ss.rows))});
            }
            const int n = static_cast<int>(set.size());
            float *x1 = up(x), *x2 = up(x);
            const float *wd = up(wn);
            cd::launch_gemv_multi_normed(fused.data(), n, x1, wd, 1e-6f, s_);
            cuda::launch_rms_norm(x2, cols, wd, 1e-6f, cols, 1, x2, cols, s_);
            cd::launch_gemv_multi(sep.data(), n, x2, s_);
            // host: r in double, x' = (x * r) * w in float
            double ss2 = 0;
            for (float v : x) ss2 += static_cast<double>(v * v);
            const float r = 1.0f / std::sqrt(static_cast<float>(ss2 / static_cast<double>(cols)) + 1e-6f);
            std::vector<float> xn(x.size());
            for (size_t i = 0; i < x.size(); ++i) xn[i] = (x[i] * r) * wn[i];
            std::vector<int64_t> rpg;
            for (const auto &h : hw) rpg.push_back(h.rows);
            const bool used = cd::gemv_q8_activations_used(fused.data(), rpg.data(), n);
            for (int i = 0; i < n; ++i) {
                const size_t rows = static_cast<size_t>(hw[static_cast<size_t>(i)].rows);
                const auto a = down(fused[static_cast<size_t>(i)].y, rows),
                           b = down(sep[static_cast<size_t>(i)].y, rows);
                EXPECT_EQ(std::memcmp(a.data(), b.data(), rows * 4), 0)
                    << "segment " << i << ": not the separate norm's bits";
                const auto &h = hw[static_cast<size_t>(i)];
                const auto ref = used ? reference_q8x(h, xn, h.rows) : reference(h, xn, h.rows);
                // x' may differ from the device's in the last bit (r's double sum order), which can move
                // an int8 rounding: a looser bound than the plain tests'
                EXPECT_LE(rel_l2(a, ref), 1e-3) << "segment " << i;
            }
        }
    }
}

// The rows form (several x at once: a multi-row decode step): every row's outputs bit-identical to the
// single-x launch on that row (batch invariance), for the DS4 decode tables (the projections of xn, the
// normed q_b + indexer q_b, grouped out_a, out_b, a 4096-wide head slice, the f16 MoE router alone), with 1..16 rows, rows strided
// wider than cols, int8 activations on and off (off: row-by-row fallback), and the single-x results near
// the CPU reference (so equal bits are also right ones).
TEST_F(CudaDs4Gemv, RowsFormEqualsSingleLaunchesBitForBit) {
    struct seg_shape {
        dtype t;
        int64_t rows;
    };
    struct table {
        const char *name;
        std::vector<seg_shape> segs;
        int64_t cols, rpg;  // rpg 0: ungrouped
        bool normed;
    };
    const std::vector<table> tables = {
        {"xn projections (ratio 4)", {{dtype::q8_0, 1024}, {dtype::q8_0, 512}, {dtype::f16, 1024}, {dtype::f16, 1024},
                                      {dtype::f16, 64}, {dtype::f16, 256}, {dtype::f16, 256}}, 4096, 0, false},
        {"q_b + indexer q_b (normed)", {{dtype::q8_0, 8192}, {dtype::f16, 2048}}, 1024, 0, true},
        {"q_b alone (normed)", {{dtype::q8_0, 8192}}, 1024, 0, true},
        {"out_a (grouped, 8 groups)", {{dtype::q8_0, 8 * 256}}, 1024, 256, false},
        {"out_b", {{dtype::q8_0, 1024}}, 2048, 0, false},
        {"head slice", {{dtype::q8_0, 3000}}, 4096, 0, false},
        // few rows: several warps per row (W > 1), the tensor-core kernel's running sum of warp parts
        {"tiny q8_0 (several warps a row)", {{dtype::q8_0, 7}, {dtype::q8_0, 40}}, 4096, 0, false},
        {"wide q8_0 (8192 columns)", {{dtype::q8_0, 300}}, 8192, 0, false},
        // more units than blocks, the last block's W = 1 unit waiting for its meeting when a W > 1 unit follows
        {"big + tiny (a meeting before several warps a row)", {{dtype::q8_0, 8192}, {dtype::q8_0, 3}}, 4096, 0, false},
        {"f32 rows (fallback)", {{dtype::f32, 300}}, 512, 0, false},
        // an f16 table alone (the MoE router: x stays f32, nothing staged per column; it divided by zero)
        {"router (f16 alone)", {{dtype::f16, 256}}, 4096, 0, false},
        {"small router (f16 alone)", {{dtype::f16, 16}}, 256, 0, false}};
    // int8 activations with the tensor-core columns kernel (4 units per meeting: the default; 1; 2), with the
    // dp4a one, and f32 activations
    for (int mode : {0, 1, 2, 3, 4}) {
        const bool q8x = mode != 2;
        cd::set_gemv_q8_activations(q8x);
        cd::set_gemv_tensor_cores(mode != 1 && mode != 2);
        cd::set_gemv_mma_slots(mode == 3 ? 1 : mode == 4 ? 2 : 4);
        const char *what[] = {", int8, tensor cores", ", int8, dp4a columns", ", f32 activations",
                              ", int8, tensor cores, a meeting per unit", ", int8, tensor cores, 2 units a meeting"};
        for (const table &tb : tables) {
            SCOPED_TRACE(std::string(tb.name) + what[mode]);
            std::vector<host_weight> hw;
            std::vector<cd::gemv_weight> gw;
            for (const seg_shape &ss : tb.segs) {
                hw.push_back(make_weight(ss.t, ss.rows, tb.cols, 0, rng_));
                gw.push_back(prepare(hw.back()));
            }
            const int n = static_cast<int>(gw.size());
            const int64_t groups = tb.rpg ? (tb.segs[0].rows + tb.rpg - 1) / tb.rpg : 1;
            const int64_t xw = groups * tb.cols, stride = xw + 12;  // rows of x 12 floats wider than read
            const auto wn = randn(static_cast<size_t>(tb.cols), rng_);
            const float *wd = up(wn);
            for (int nx : {1, 2, 3, 5, 8, 16}) {
                SCOPED_TRACE(std::to_string(nx) + " rows");
                const auto x = randn(static_cast<size_t>(nx * stride), rng_);
                float *xr = up(x);
                std::vector<cd::gemv_segment> rows_segs;
                for (int i = 0; i < n; ++i) rows_segs.push_back({gw[i], poisoned(static_cast<size_t>(nx * gw[i].rows))});
                if (tb.normed)
                    cd::launch_gemv_multi_normed_rows(rows_segs.data(), n, nx, xr, stride, wd, 1e-6f, s_);
                else if (tb.rpg)
                    cd::launch_gemv_grouped_rows(gw[0], tb.rpg, nx, xr, stride, rows_segs[0].y, s_);
                else if (n == 1)
                    cd::launch_gemv_rows(gw[0], nx, xr, stride, rows_segs[0].y, s_);
                else
                    cd::launch_gemv_multi_rows(rows_segs.data(), n, nx, xr, stride, s_);
                for (int c = 0; c < nx; ++c) {
                    std::vector<cd::gemv_segment> one;
                    for (int i = 0; i < n; ++i) one.push_back({gw[i], poisoned(static_cast<size_t>(gw[i].rows))});
                    float *x1 = up(std::vector<float>(x.begin() + c * stride, x.begin() + c * stride + xw));
                    if (tb.normed)
                        cd::launch_gemv_multi_normed(one.data(), n, x1, wd, 1e-6f, s_);
                    else if (tb.rpg)
                        cd::launch_gemv_fast_grouped(gw[0], tb.rpg, x1, one[0].y, s_);
                    else if (n == 1)
                        cd::launch_gemv_fast(gw[0], x1, one[0].y, s_);
                    else
                        cd::launch_gemv_multi(one.data(), n, x1, s_);
                    for (int i = 0; i < n; ++i) {
                        const size_t rows = static_cast<size_t>(gw[i].rows);
                        const auto a = down(rows_segs[i].y + c * gw[i].rows, rows), b = down(one[i].y, rows);
                        ASSERT_EQ(std::memcmp(a.data(), b.data(), rows * 4), 0)
                            << "row " << c << " segment " << i << ": not the single launch's bits";
                        if (!tb.normed && c == nx - 1) {  // and right: near the CPU reference
                            const std::vector<float> xc(x.begin() + c * stride, x.begin() + c * stride + xw);
                            const int64_t rpg = tb.rpg ? tb.rpg : gw[i].rows;
                            const cd::gemv_segment seg{gw[i], nullptr};
                            const auto ref = cd::gemv_q8_activations_used(&seg, &rpg, 1) ? reference_q8x(hw[i], xc, rpg)
                                                                                        : reference(hw[i], xc, rpg);
                            if (n == 1) {
                                EXPECT_LE(rel_l2(a, ref), 1e-5);
                            }
                        }
                    }
                }
            }
        }
    }
    // bad row counts and strides are refused
    const host_weight h = make_weight(dtype::q8_0, 64, 512, 0, rng_);
    const cd::gemv_weight g = prepare(h);
    float *x = poisoned(512 * 20), *y = poisoned(64 * 20);
    EXPECT_THROW(cd::launch_gemv_rows(g, 0, x, 512, y, s_), error);
    EXPECT_THROW(cd::launch_gemv_rows(g, cd::gemv_max_rows + 1, x, 512, y, s_), error);
    EXPECT_THROW(cd::launch_gemv_rows(g, 2, x, 500, y, s_), error);
}

// PDL ordering: a chain where each GEMV's x is the previous GEMV's y (poisoned just before by a
// memset in the stream) must see the finished values, in the stream and replayed from a graph.
// x0 [1024] -> y1 = A x0 [4096] -> y2 = B y1 [1024] (grouped: 4 groups of 256 over y1) -> y3 = C y2.
TEST_F(CudaDs4Gemv, ChainedLaunchesWaitForTheirInput) {
    for (bool q8x : {false, true}) {
        SCOPED_TRACE(q8x ? "int8 activations" : "f32 activations");
        cd::set_gemv_q8_activations(q8x);
        // f32 activations: three f32 GEMVs vs double. int8 activations: each stage's x rounding (~1 %
        // relative) compounds; the point here is ordering (a NaN-poisoned input fails at any tolerance).
        const double tol = q8x ? 3e-2 : 1e-5;
        const host_weight a = make_weight(dtype::q8_0, 4096, 1024, 0, rng_);
        const host_weight b = make_weight(dtype::f16, 1024, 1024, 0, rng_);
        const host_weight c = make_weight(dtype::q8_0, 2048, 1024, 0, rng_);
        const auto x0 = randn(1024, rng_);
        const auto r1 = reference(a, x0, 4096);
        const std::vector<float> y1f(r1.begin(), r1.end());
        const auto r2 = reference(b, y1f, 256);
        const std::vector<float> y2f(r2.begin(), r2.end());
        const auto r3 = reference(c, y2f, 2048);
        const cd::gemv_weight ga = prepare(a), gb = prepare(b), gc = prepare(c);
        const float *x0d = up(x0);
        float *y1 = poisoned(4096), *y2 = poisoned(1024), *y3 = poisoned(2048);
        auto enqueue = [&] {
            cudaMemsetAsync(y1, 0xff, 4096 * 4, s_);  // NaN
            cudaMemsetAsync(y2, 0xff, 1024 * 4, s_);
            cudaMemsetAsync(y3, 0xff, 2048 * 4, s_);
            cd::launch_gemv_fast(ga, x0d, y1, s_);
            cd::launch_gemv_fast_grouped(gb, 256, y1, y2, s_);
            cd::launch_gemv_fast(gc, y2, y3, s_);
        };
        // Relative error of y3 compounds the rounding of y1 and y2 (three f32 GEMVs vs double).
        for (int i = 0; i < 3; ++i) {
            enqueue();
            EXPECT_LE(rel_l2(down(y3, 2048), r3), tol);
        }
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
        enqueue();
        CK(cudaStreamEndCapture(s_, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        for (int i = 0; i < 5; ++i) {
            CK(cudaGraphLaunch(exec, s_));
            EXPECT_LE(rel_l2(down(y3, 2048), r3), tol);
            EXPECT_LE(rel_l2(down(y1, 4096), r1), tol);
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
    }
}

// The kernel flight recorder (ktrace.h) in a FATHOM_KTRACE build (others: skipped): one q8x GEMV
// launch records each of its blocks once (ids 0 .. blocks - 1), with start <= end, its kernel id and
// an SM id in range; unbound, nothing more is recorded.
TEST_F(CudaDs4Gemv, KtraceRecordsEveryBlockOnce) {
    namespace kt = cuda::ktrace;
    const uint32_t cap = 1 << 16;
    auto *buf = static_cast<kt::record *>(raw(cap * sizeof(kt::record)));
    auto *n = static_cast<uint32_t *>(raw(sizeof(uint32_t)));
    CK(cudaMemset(n, 0, sizeof(uint32_t)));
    if (!kt::bind_all(buf, n, cap)) GTEST_SKIP() << "not a FATHOM_KTRACE build";
    const host_weight hw = make_weight(dtype::q8_0, 4096, 1024, 0, rng_);
    const cd::gemv_weight g = prepare(hw);
    const float *x = up(randn(1024, rng_));
    float *y = poisoned(4096);
    cd::launch_gemv_fast(g, x, y, s_);
    CK(cudaStreamSynchronize(s_));
    kt::bind_all(nullptr, nullptr, 0);
    cd::launch_gemv_fast(g, x, y, s_);  // unbound: not recorded
    CK(cudaStreamSynchronize(s_));
    uint32_t count = 0;
    CK(cudaMemcpy(&count, n, sizeof count, cudaMemcpyDeviceToHost));
    ASSERT_GT(count, 0u);
    ASSERT_LE(count, cap);
    std::vector<kt::record> r(count);
    CK(cudaMemcpy(r.data(), buf, count * sizeof(kt::record), cudaMemcpyDeviceToHost));
    std::vector<int> seen(count, 0);
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    for (const kt::record &e : r) {
        EXPECT_EQ(e.kernel, static_cast<uint32_t>(kt::k_gemv_q8x));
        EXPECT_STREQ(kt::name(e.kernel), "gemv_q8x");
        EXPECT_LE(e.start, e.end);
        EXPECT_LT(e.sm, static_cast<uint32_t>(sms));
        EXPECT_EQ(e.grid, r[0].grid) << "one launch, one grid id";
        ASSERT_LT(e.block, count);
        ++seen[e.block];
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<long>(count)) << "a block recorded twice or not at all";
}

}  // namespace
}  // namespace fathom
