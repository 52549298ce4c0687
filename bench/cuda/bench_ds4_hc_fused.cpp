// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): one DS4-Flash token's 86 HC sublayers,
// unfused vs fused; the kernels' tests: tests/backend/cuda/test_cuda_ds4_hc_fused.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"

#include "backend/cuda/ds4_hc_fused_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_hc_fused_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

// One DS4-Flash token's 86 HC sublayers (43 layers x attention / FFN; n_hc 4, D 4096, f32 and f16
// mixers, 86 distinct weight sets so they stream from HBM) captured into a graph: unfused
// (post + pre (mixer, apply) + rms_norm: 4 launches, 3 for the first) vs fused (1 launch): the
// row-block kernel (hc_fused_kernel, no partial scratch) and the split kernel at several block
// counts (hc_split_kernel; 0 = its default, 128). HC only: in the real step other kernels sit between
// them (PDL then also overlaps the fused kernels' weight loads with the previous kernel's tail).
TEST_F(CudaDs4HcFused, BenchSublayersFusedVsUnfused) {
    const int n = 4, n_mix = (2 + n) * n, L = 86, reps = 21;
    const int64_t D = 4096, S = n * D;
    for (dtype ft : {dtype::f32, dtype::f16}) {
        const geom g{n, D, ft, 0, true};
        const cd::hc_params p = params(g);
        const hc_dev h0 = make_hc(g, n_mix);
        const size_t fn_bytes = h0.row_bytes * n_mix;
        std::vector<hc_dev> hs(L, h0);
        for (int i = 1; i < L; ++i) {
            void *f = raw(fn_bytes);
            CK(cudaMemcpy(f, h0.fn, fn_bytes, cudaMemcpyDeviceToDevice));
            hs[static_cast<size_t>(i)].fn = f;
        }
        const auto x0 = randn(static_cast<size_t>(S), rng_);
        float *x[2] = {up(x0), dev<float>(S)}, *y = up(randn(static_cast<size_t>(D), rng_, 0.1f));
        float *post = dev<float>(n), *comb = dev<float>(n * n), *mix = dev<float>(n_mix + 1), *xn = dev<float>(D);
        uint32_t *sync = dev<uint32_t>(1);
        double *part = dev<double>(cd::hc_fused_part_count(n));
        // mode 0: unfused; 1: row-block fused; 2: split fused with part_blocks = blocks
        auto capture = [&](int mode, int blocks) {
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            EXPECT_EQ(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            int cur = 0;
            for (int i = 0; i < L; ++i) {
                const hc_dev &h = hs[static_cast<size_t>(i)];
                if (mode > 0) {
                    cd::hc_fused_io io;
                    io.y = i > 0 ? y : nullptr;
                    io.x = x[cur];
                    io.x_new = i > 0 ? x[1 - cur] : nullptr;
                    io.post = post, io.comb = comb, io.mix = mix, io.sync = sync, io.norm = h.norm, io.out = xn;
                    io.part = mode == 2 ? part : nullptr, io.part_blocks = blocks;
                    cd::launch_hc_pre_fused(p, ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
                } else {
                    if (i > 0) cd::launch_hc_post(n, D, y, x[cur], post, comb, x[1 - cur], s_);
                    const float *xin = i > 0 ? x[1 - cur] : x[cur];
                    cd::launch_hc_pre(p, ft, h.fn, h.row_bytes, h.base, h.scale, xin, mix, xn, post, comb, s_);
                    cuda::launch_rms_norm(xn, D, h.norm, p.rms_eps, D, 1, xn, D, s_);
                }
                if (i > 0) cur = 1 - cur;
            }
            EXPECT_EQ(cudaStreamEndCapture(s_, &graph), cudaSuccess);
            EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            cudaGraphDestroy(graph);
            return exec;
        };
        auto timed = [&](int mode, int blocks) {
            cudaGraphExec_t e = capture(mode, blocks);
            put(x[0], x0);
            const float ms = time_graph(e, s_, reps);
            cudaGraphExecDestroy(e);
            EXPECT_EQ(down(sync, 1)[0], 0u);
            return ms;
        };
        const std::string t = std::string(dtype_name(ft));
        const float tu = timed(0, 0), tf = timed(1, 0);
        std::printf("  hc %s, %d sublayers per token: unfused %.3f ms (%.2f us/sublayer), row-block fused %.3f ms "
                    "(%.2f us/sublayer, %.2fx)\n",
                    t.c_str(), L, tu, 1e3 * tu / L, tf, 1e3 * tf / L, tu / tf);
        for (int blocks : {0, 32, 64, 96, 112}) {
            const float ts = timed(2, blocks);
            std::printf("  hc %s: split fused, part_blocks %3d: %.3f ms (%.2f us/sublayer), %.2fx the row-block "
                        "fused\n",
                        t.c_str(), blocks, ts, 1e3 * ts / L, tf / ts);
        }
    }
}

}  // namespace
}  // namespace fathom
