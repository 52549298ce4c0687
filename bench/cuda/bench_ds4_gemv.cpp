// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the fast DS4 dense GEMV at DS4-Flash
// shapes (GB/s vs the device copy rate), the streaming ceiling and a per-block trace; the kernels' tests:
// tests/backend/cuda/test_cuda_ds4_gemv.cpp.
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

#include "backend/cuda/ds4_gemv_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_gemv_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

using CudaDs4GemvBench = CudaDs4Gemv;

// DS4-Flash shapes with random weight bytes. Each timed graph cycles through enough copies of the
// weights (>= 256 MB in all) that they stream from HBM, not the 50 MB L2. Bytes = weight bytes (the
// GGUF size: q8_0 34 bytes per 32). Reports the fast kernel and launch_gemv
// (cuda_mm.cu; launch_gemv_grouped for the grouped shape; one launch per weight for the multi set)
// on the GGUF rows for comparison.
TEST_F(CudaDs4GemvBench, DenseGemvBandwidth) {
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



// What one launch that only streams bytes reaches (launch_read_probe), at the DS4 GEMV sizes, in the
// same back-to-back graph form as DenseGemvBandwidth: the ceiling the GEMVs' us/call compare with.
TEST_F(CudaDs4GemvBench, StreamCeiling) {
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
