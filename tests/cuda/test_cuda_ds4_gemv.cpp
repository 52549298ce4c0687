// The fast DS4 dense GEMV (src/backend/cuda/ds4_gemv.*) against the CPU reference: weights made by
// the CPU quantiser, dequantised with cpu::dequantize_row, dot products in double. Every device output
// is NaN-poisoned first (an unwritten element makes rel_l2 NaN: fails).
//   CudaDs4GemvHost.*   shape / alignment validation (no GPU needed)
//   CudaDs4Gemv.*       kernels on the device (skipped without one): q8_0 repack bytes vs the GGUF
//                       blocks, plain / grouped / multi GEMVs vs the CPU (rel L2 <= 1e-5), bit
//                       reproducibility, PDL ordering in a stream and in a captured graph
//   CudaDs4GemvBench.*  DS4-Flash shapes, GB/s vs the device copy rate; only with FATHOM_DS4_BENCH=1
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

namespace fathom {
namespace {

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// A weight in GGUF form on the host: rows of dtype_row_bytes(t, cols) bytes placed `stride` bytes
// apart (stride >= the row bytes; the gap bytes are random), and its dequantised values.
struct host_weight {
    dtype t;
    int64_t rows, cols;
    size_t stride;
    std::vector<uint8_t> bytes;
    std::vector<float> deq;  // [rows, cols]
};
host_weight make_weight(dtype t, int64_t rows, int64_t cols, size_t pad, std::mt19937 &rng) {
    host_weight w{t, rows, cols, dtype_row_bytes(t, cols) + pad, {}, {}};
    w.bytes.resize(w.stride * static_cast<size_t>(rows));
    for (auto &b : w.bytes) b = static_cast<uint8_t>(rng() >> 24);
    const auto f = randn(static_cast<size_t>(rows * cols), rng, 0.5f);
    w.deq.resize(f.size());
    for (int64_t r = 0; r < rows; ++r) {
        uint8_t *row = w.bytes.data() + w.stride * static_cast<size_t>(r);
        cpu::quantize_row(t, f.data() + r * cols, row, cols);
        cpu::dequantize_row(t, row, w.deq.data() + r * cols, cols);
    }
    return w;
}
// ref[r] = deq row r . x[r / rpg], in double.
std::vector<double> reference(const host_weight &w, const std::vector<float> &x, int64_t rpg) {
    std::vector<double> y(static_cast<size_t>(w.rows));
    for (int64_t r = 0; r < w.rows; ++r) {
        const float *a = w.deq.data() + r * w.cols, *b = x.data() + (r / rpg) * w.cols;
        double s = 0;
        for (int64_t k = 0; k < w.cols; ++k) s += static_cast<double>(a[k]) * b[k];
        y[static_cast<size_t>(r)] = s;
    }
    return y;
}

// The int8-activation result: x group by group in 32-element q8 blocks (ds4q::quantize_q8_block, the
// rounding the kernel and the MoE staging use), then deq_w . q_x * d_x per block in double (deq_w =
// d_w * q_w is exact in f32, so this is d_w * d_x * the integer sum, exactly). f16 / f32 weights keep
// f32 x (reference()).
std::vector<double> reference_q8x(const host_weight &w, const std::vector<float> &x, int64_t rpg) {
    if (w.t != dtype::q8_0) return reference(w, x, rpg);
    const int64_t nb = w.cols / 32, groups = static_cast<int64_t>(x.size()) / w.cols;
    std::vector<cuda::ds4q::q8_blk> xb(static_cast<size_t>(groups * nb));
    for (int64_t b = 0; b < groups * nb; ++b)
        cuda::ds4q::quantize_q8_block(x.data() + 32 * b, xb[static_cast<size_t>(b)]);
    std::vector<double> y(static_cast<size_t>(w.rows));
    for (int64_t r = 0; r < w.rows; ++r) {
        const float *a = w.deq.data() + r * w.cols;
        const cuda::ds4q::q8_blk *xg = xb.data() + (r / rpg) * nb;
        double s = 0;
        for (int64_t b = 0; b < nb; ++b) {
            double t = 0;
            for (int j = 0; j < 32; ++j)
                t += static_cast<double>(a[32 * b + j]) *
                     static_cast<int8_t>(static_cast<uint32_t>(xg[b].qs[j / 4]) >> (8 * (j % 4)));
            s += t * static_cast<double>(xg[b].d);
        }
        y[static_cast<size_t>(r)] = s;
    }
    return y;
}

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

// cuda_fixture's stream and buffers (16 spare bytes after every buffer; contents 0 unless uploaded).
class CudaDs4Gemv : public cuda_test::cuda_fixture {
  protected:
    // Uploads w's GGUF rows and prepares them (synchronised: see the PDL note in ds4_gemv.h).
    cd::gemv_weight prepare(const host_weight &w) {
        const void *src = up(w.bytes);
        const size_t n = cd::gemv_prepared_bytes(w.t, w.rows, w.cols);
        void *dst = n ? raw(n) : nullptr;
        const cd::gemv_weight g = cd::gemv_prepare(w.t, src, w.stride, w.rows, w.cols, dst, s_);
        EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        return g;
    }

    // The reference for a one-weight launch (rpg rows per x group): int8 activations when the launch
    // takes that kernel (under the current set_gemv_q8_activations switch).
    static std::vector<double> expected(const host_weight &w, const cd::gemv_weight &g,
                                        const std::vector<float> &x, int64_t rpg) {
        const cd::gemv_segment seg{g, nullptr};
        return cd::gemv_q8_activations_used(&seg, &rpg, 1) ? reference_q8x(w, x, rpg) : reference(w, x, rpg);
    }
    void TearDown() override {
        cd::set_gemv_q8_activations(true);
        cuda_fixture::TearDown();
    }

    std::mt19937 rng_{20261129};
};

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
        for (int64_t e = 0; e < cols; ++e) {  // element e of the row = tile t, k, l, j
            const int64_t t = e / 512, k = (e % 512) / 128, l = (e % 128) / 4, j = e % 4;
            const uint8_t got = q[static_cast<size_t>(r * cols + 512 * t + 16 * l + 4 * k + j)];
            ASSERT_EQ(got, row[34 * (e / 32) + 2 + e % 32]) << "row " << r << " element " << e;
        }
        for (int64_t b = 0; b < cols / 32; ++b) {  // block b = tile t, tile block 4k + g
            const int64_t t = b / 16, k = (b % 16) / 4, gg = b % 4;
            const size_t at = static_cast<size_t>(r * (cols / 16) + 32 * t + 2 * (4 * gg + k));
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
// normed q_b + indexer q_b, grouped out_a, out_b, a 4096-wide head slice), with 1..16 rows, rows strided
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
        {"f32 rows (fallback)", {{dtype::f32, 300}}, 512, 0, false}};
    for (bool q8x : {true, false}) {
        cd::set_gemv_q8_activations(q8x);
        for (const table &tb : tables) {
            SCOPED_TRACE(std::string(tb.name) + (q8x ? ", int8 allowed" : ", f32 activations"));
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

// ---- benchmark (FATHOM_DS4_BENCH=1) -----------------------------------------------------------------

using CudaDs4GemvBench = CudaDs4Gemv;

// DS4-Flash shapes with random weight bytes. Each timed graph cycles through enough copies of the
// weights (>= 256 MB in all) that they stream from HBM, not the 50 MB L2. Bytes = weight bytes (the
// GGUF size: q8_0 34 bytes per 32). Reports the fast kernel and launch_gemv
// (cuda_mm.cu; launch_gemv_grouped for the grouped shape; one launch per weight for the multi set)
// on the GGUF rows for comparison.
TEST_F(CudaDs4GemvBench, DenseGemvBandwidth) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
    int dev_id = 0;
    cudaGetDevice(&dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    std::printf("  device copy bandwidth (D2D 1 GiB, read + write): %.1f GB/s\n", copy_bw / 1e9);
    struct mat {
        dtype t;
        int64_t rows;
    };
    struct bench_case {
        const char *name;
        int64_t cols, rpg;  // rpg: rows per group (0: not grouped)
        std::vector<mat> segs;
    };
    const bench_case cases[] = {
        {"q_b q8_0 [32768,1024]", 1024, 0, {{dtype::q8_0, 32768}}},
        {"out_b q8_0 [4096,8192]", 8192, 0, {{dtype::q8_0, 4096}}},
        {"out_a q8_0 [8x1024,4096] grouped", 4096, 1024, {{dtype::q8_0, 8192}}},
        {"q_a q8_0 [1024,4096]", 4096, 0, {{dtype::q8_0, 1024}}},
        {"comp f16 [1024,4096]", 4096, 0, {{dtype::f16, 1024}}},
        {"idx comp f16 [256,4096]", 4096, 0, {{dtype::f16, 256}}},
        {"multi ratio-4 set (7 weights)",
         4096,
         0,
         {{dtype::q8_0, 1024},
          {dtype::q8_0, 512},
          {dtype::f16, 1024},
          {dtype::f16, 1024},
          {dtype::f16, 64},
          {dtype::f16, 256},
          {dtype::f16, 256}}},
    };
    const int reps = 15;
    std::printf("  %-36s %9s %10s %9s %7s | %s | %s\n", "shape", "MB", "us/call", "GB/s", "%copy",
                "f32-activation kernel", "launch_gemv us, GB/s");
    for (const bench_case &bc : cases) {
        double bytes = 0;
        for (const mat &m : bc.segs) bytes += static_cast<double>(dtype_row_bytes(m.t, bc.cols)) * m.rows;
        const int copies = std::max(2, static_cast<int>(std::ceil(256e6 / bytes)));
        const int calls = std::max(copies, 24);
        // copies x (GGUF rows, prepared form) per segment
        std::vector<std::vector<cd::gemv_segment>> sets(static_cast<size_t>(copies));
        std::vector<std::vector<const void *>> gguf(static_cast<size_t>(copies));
        float *x = up(randn(static_cast<size_t>(bc.cols * 8), rng_));
        for (int c = 0; c < copies; ++c) {
            for (const mat &m : bc.segs) {
                const size_t rb = dtype_row_bytes(m.t, bc.cols), n = rb * static_cast<size_t>(m.rows);
                void *src = raw((n + 7) / 8 * 8);
                cd::launch_fill_random(src, (n + 7) / 8 * 8,
                                       static_cast<uint64_t>(c * 16 + gguf[c].size() + 1), s_);
                const size_t pb = cd::gemv_prepared_bytes(m.t, m.rows, bc.cols);
                void *dst = pb ? raw(pb) : nullptr;
                const cd::gemv_weight g = cd::gemv_prepare(m.t, src, rb, m.rows, bc.cols, dst, s_);
                sets[static_cast<size_t>(c)].push_back(
                    {g, static_cast<float *>(raw(static_cast<size_t>(m.rows) * 4))});
                gguf[static_cast<size_t>(c)].push_back(src);
            }
        }
        CK(cudaStreamSynchronize(s_));
        auto timed = [&](bool fast) {
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            EXPECT_EQ(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            for (int i = 0; i < calls; ++i) {
                const auto &set = sets[static_cast<size_t>(i % copies)];
                if (!fast) {  // the existing kernels, one launch per weight (per group when grouped)
                    const auto &src = gguf[static_cast<size_t>(i % copies)];
                    for (size_t j = 0; j < bc.segs.size(); ++j) {
                        const mat &m = bc.segs[j];
                        const size_t rb = dtype_row_bytes(m.t, bc.cols);
                        if (bc.rpg)
                            cd::launch_gemv_grouped(m.t, src[j], rb, bc.cols, bc.rpg,
                                                    static_cast<int>(m.rows / bc.rpg), x, set[j].y, s_);
                        else
                            cuda::launch_gemv(m.t, src[j], rb, bc.cols, m.rows, x, bc.cols, 1, set[j].y,
                                              m.rows, s_);
                    }
                } else if (set.size() > 1) {
                    cd::launch_gemv_multi(set.data(), static_cast<int>(set.size()), x, s_);
                } else if (bc.rpg) {
                    cd::launch_gemv_fast_grouped(set[0].w, bc.rpg, x, set[0].y, s_);
                } else {
                    cd::launch_gemv_fast(set[0].w, x, set[0].y, s_);
                }
            }
            EXPECT_EQ(cudaStreamEndCapture(s_, &graph), cudaSuccess);
            EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            const float ms = time_graph(exec, s_, reps);
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            return ms * 1e3 / calls;  // us per call
        };
        const double us = timed(true);  // int8 activations where eligible
        const double bw = bytes / (us * 1e-6);
        std::printf("  %-36s %9.2f %10.2f %9.1f %6.1f%%", bc.name, bytes / 1e6, us, bw / 1e9,
                    100.0 * bw / copy_bw);
        cd::set_gemv_q8_activations(false);
        const double us_f32 = timed(true);
        cd::set_gemv_q8_activations(true);
        std::printf(" | f32-x %.2f us %5.1f%%", us_f32, 100.0 * bytes / (us_f32 * 1e-6) / copy_bw);
        const double us_old = timed(false);
        std::printf(" | %.2f us, %.1f GB/s\n", us_old, bytes / (us_old * 1e-6) / 1e9);
        CK(cudaStreamSynchronize(s_));
        for (void *p : bufs_) cudaFree(p);
        bufs_.clear();
    }
}

}  // namespace
}  // namespace fathom

namespace fathom {
namespace {

// What one launch that only streams bytes reaches (launch_read_probe), at the DS4 GEMV sizes, in the
// same back-to-back graph form as DenseGemvBandwidth: the ceiling the GEMVs' us/call compare with.
TEST_F(CudaDs4GemvBench, StreamCeiling) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
    int dev_id = 0, sms = 0;
    cudaGetDevice(&dev_id);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    std::printf("  device copy bandwidth (D2D 1 GiB, read + write): %.1f GB/s, %d SMs\n", copy_bw / 1e9, sms);
    auto *sink = static_cast<uint32_t *>(raw(16));
    struct cfg {
        const char *name;
        int blocks_per_sm, threads, unroll;
        bool contig, pdl;
        int blocks_abs;  // > 0: that many blocks (16 KB per block per pass)
    };
    const cfg cfgs[] = {
        {"4x256 U2 contiguous pdl (GEMV-like)", 4, 256, 2, true, true, 0},
        {"4x256 U4 contiguous pdl", 4, 256, 4, true, true, 0},
        {"4x256 U8 contiguous pdl", 4, 256, 8, true, true, 0},
        {"8x256 U4 contiguous pdl", 8, 256, 4, true, true, 0},
        {"8x256 U4 grid-stride pdl", 8, 256, 4, false, true, 0},
        {"8x256 U4 grid-stride no pdl", 8, 256, 4, false, false, 0},
        {"2x1024 U4 grid-stride pdl", 2, 1024, 4, false, true, 0},
        {"4x256 U2 grid-stride pdl", 4, 256, 2, false, true, 0},
        {"16 KB blocks of 256 U4 pdl", 0, 256, 4, true, true, -1},
    };
    for (const double mb : {35.65, 4.46, 17.8}) {
        const size_t bytes = static_cast<size_t>(mb * 1e6) / 16 * 16;
        const int copies = std::max(2, static_cast<int>(std::ceil(256e6 / static_cast<double>(bytes))));
        std::vector<void *> bufs;
        for (int c = 0; c < copies; ++c) {
            bufs.push_back(raw(bytes));
            cd::launch_fill_random(bufs.back(), bytes, static_cast<uint64_t>(c + 1), s_);
        }
        CK(cudaStreamSynchronize(s_));
        const int calls = std::max(copies, 24);
        for (const cfg &c : cfgs) {
            const int blocks =
                c.blocks_abs < 0 ? static_cast<int>((bytes + 16383) / 16384) : c.blocks_per_sm * sms;
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            EXPECT_EQ(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            for (int i = 0; i < calls; ++i)
                cd::launch_read_probe(bufs[static_cast<size_t>(i % copies)], bytes, blocks, c.threads,
                                      c.unroll, c.contig, c.pdl, sink, s_);
            EXPECT_EQ(cudaStreamEndCapture(s_, &graph), cudaSuccess);
            EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            const double us = time_graph(exec, s_, 15) * 1e3 / calls;
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            const double bw = static_cast<double>(bytes) / (us * 1e-6);
            std::printf("  %6.2f MB  %-38s %8.2f us %8.1f GB/s %6.1f%% copy\n", mb, c.name, us, bw / 1e9,
                        100.0 * bw / copy_bw);
        }
        for (void *p : bufs) cudaFree(p);
        bufs_.erase(
            std::remove_if(bufs_.begin(), bufs_.end(),
                           [&](void *p) { return std::find(bufs.begin(), bufs.end(), p) != bufs.end(); }),
            bufs_.end());
    }
}

// Per-block timeline of one q8x GEMV launch behind another (q_b behind out_b, out_b behind q_b, q_a
// behind out_b) in a replayed graph, from a FATHOM_Q8X_TRACE build (others: skipped): when blocks
// start, have x ready, and end, relative to the launch's first block start.
TEST_F(CudaDs4GemvBench, BlockTrace) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
    const size_t max_blocks = 8192;
    auto *trace = static_cast<uint64_t *>(raw(max_blocks * 6 * sizeof(uint64_t)));
    auto make = [&](int64_t rows, int64_t cols, uint64_t seed) -> cd::gemv_weight {
        const size_t rb = dtype_row_bytes(dtype::q8_0, cols), n = rb * static_cast<size_t>(rows);
        void *src = raw((n + 7) / 8 * 8);
        cd::launch_fill_random(src, (n + 7) / 8 * 8, seed, s_);
        void *dst = raw(cd::gemv_prepared_bytes(dtype::q8_0, rows, cols));
        const cd::gemv_weight g = cd::gemv_prepare(dtype::q8_0, src, rb, rows, cols, dst, s_);
        EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        return g;
    };
    const cd::gemv_weight qb = make(32768, 1024, 1), ob = make(4096, 8192, 2), qa = make(1024, 4096, 3);
    float *x = up(randn(32768, rng_)), *y = static_cast<float *>(raw(32768 * 4));
    struct pair {
        const char *name;
        const cd::gemv_weight *before, *traced;
    };
    for (const pair &p : {pair{"q_b after out_b", &ob, &qb}, pair{"out_b after q_b", &qb, &ob},
                          pair{"q_a after out_b", &ob, &qa}}) {
        CK(cudaMemsetAsync(trace, 0, max_blocks * 6 * sizeof(uint64_t), s_));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cd::set_gemv_trace(trace, max_blocks);
        EXPECT_EQ(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        cd::launch_gemv_fast(*p.before, x, y, s_);
        cd::launch_gemv_fast(*p.traced, x, y, s_);
        EXPECT_EQ(cudaStreamEndCapture(s_, &graph), cudaSuccess);
        const std::vector<int> launches = cd::gemv_trace_launches();
        cd::set_gemv_trace(nullptr, 0);
        EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s_));
        CK(cudaStreamSynchronize(s_));
        std::vector<uint64_t> all(max_blocks * 6);
        CK(cudaMemcpy(all.data(), trace, all.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        ASSERT_EQ(launches.size(), 2u);
        if (all[0] == 0) GTEST_SKIP() << "not a FATHOM_Q8X_TRACE build";
        const size_t nb = static_cast<size_t>(launches[1]);
        const std::vector<uint64_t> t(all.begin() + 6 * launches[0],
                                      all.begin() + 6 * (launches[0] + launches[1]));
        uint64_t t0 = UINT64_MAX;
        for (size_t b = 0; b < nb; ++b) t0 = std::min(t0, t[6 * b]);
        std::vector<double> st, wt, xr, en;
        std::map<uint64_t, std::pair<double, double>> sm;  // SM: first start, last end
        for (size_t b = 0; b < nb; ++b) {
            st.push_back((t[6 * b] - t0) * 1e-3);
            wt.push_back((t[6 * b + 1] - t0) * 1e-3);
            xr.push_back((t[6 * b + 2] - t0) * 1e-3);
            en.push_back((t[6 * b + 3] - t0) * 1e-3);
            auto it = sm.find(t[6 * b + 4]);
            if (it == sm.end())
                sm[t[6 * b + 4]] = {st.back(), en.back()};
            else
                it->second = {std::min(it->second.first, st.back()), std::max(it->second.second, en.back())};
        }
        auto pct = [](std::vector<double> v, double q) {
            std::sort(v.begin(), v.end());
            return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
        };
        std::vector<double> sm_end;
        for (auto &kv : sm) sm_end.push_back(kv.second.second);
        std::printf("  %-16s %zu blocks on %zu SMs (us from the first block's start)\n", p.name, nb,
                    sm.size());
        std::printf("    start   p0 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n", pct(st, 0), pct(st, .5),
                    pct(st, .9), pct(st, 1));
        std::printf("    waited  p0 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n", pct(wt, 0), pct(wt, .5),
                    pct(wt, .9), pct(wt, 1));
        std::printf("    x ready p0 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n", pct(xr, 0), pct(xr, .5),
                    pct(xr, .9), pct(xr, 1));
        std::printf("    end     p0 %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n", pct(en, 0), pct(en, .1),
                    pct(en, .5), pct(en, .9), pct(en, 1));
        std::printf("    SM last end p0 %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n", pct(sm_end, 0),
                    pct(sm_end, .1), pct(sm_end, .5), pct(sm_end, .9), pct(sm_end, 1));
    }
}

}  // namespace
}  // namespace fathom
