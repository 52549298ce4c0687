// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the DS4 prefill indexer and attention on
// one 4096-token chunk; the kernels' tests: tests/backend/cuda/test_cuda_ds4_prefill_attn.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

#include "backend/cuda/ds4_prefill_attn_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_prefill_attn_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// Milliseconds of one call of f on s_ (median of 5 after a warm-up).
template <class F>
float time_ms(cudaStream_t s, F &&f) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    f();
    std::vector<float> ms;
    for (int i = 0; i < 5; ++i) {
        cudaEventRecord(a, s);
        f();
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float t = 0;
        cudaEventElapsedTime(&t, a, b);
        ms.push_back(t);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[2];
}

// DS4-Flash chunk of 4096 tokens at the end of a 32K prefill: indexer over ~8192 rows per token, and
// attention (window 128 + 512 selected rows; window + ~256 rows of a ratio-128 layer).
TEST_F(CudaDs4PrefillAttn, BenchDs4Chunk) {
    const int64_t n_tok = 4096, p0 = 32768 - n_tok, max_n = 8192;
    {
        const int H = 64, Dh = 128, topk = 512;
        const uint8_t *rd = up(pack_rows(randn(static_cast<size_t>(max_n * Dh), rng_), Dh, true, Dh * 2));
        const float *q = up(randn(static_cast<size_t>(n_tok * H * Dh), rng_));
        const float *w = up(randn(static_cast<size_t>(n_tok * H), rng_));
        const size_t sf = static_cast<size_t>(n_tok * max_n);
        float *score = dev<float>(sf);
        int32_t *sel = dev<int32_t>(static_cast<size_t>(n_tok * topk)), *nsel = dev<int32_t>(n_tok);
        const int64_t *pos = positions(p0, 1);
        const float ms = time_ms(s_, [&] {
            cd::launch_indexer_topk_batch(q, w, 0.01f, rd, true, Dh * 2, 4, max_n, H, Dh, topk, n_tok, pos, score, sf,
                                          sel, nsel, s_);
        });
        const double dfma = static_cast<double>(n_tok) * (p0 + n_tok / 2) / 4 * H * Dh;
        std::printf("  indexer batch 4096 tokens x ~%lld rows: %.2f ms (%.1f TDFMA/s)\n",
                    static_cast<long long>((p0 + n_tok / 2) / 4), ms, dfma / ms / 1e9);
    }
    for (cd::comp_mode mode : {cd::comp_mode::list, cd::comp_mode::all}) {
        const int H = 64, d = 512, W = 128;
        const int64_t n_comp = mode == cd::comp_mode::list ? 8192 : 256, max_comp = mode == cd::comp_mode::list ? 512 : 8192;
        cd::sparse_attn_args a;
        a.n_head = H;
        a.d = d;
        a.scale = 0.044f;
        a.sinks = up(randn(H, rng_));
        a.ring = up(pack_rows(randn(static_cast<size_t>(W * d), rng_), d, true, d * 2));
        a.ring_stride = d * 2;
        a.window = W;
        a.mode = mode;
        a.comp = up(pack_rows(randn(static_cast<size_t>(n_comp * d), rng_), d, true, d * 2));
        a.comp_stride = d * 2;
        a.ratio = mode == cd::comp_mode::list ? 4 : 128;
        a.max_comp = max_comp;
        std::vector<int32_t> sel(static_cast<size_t>(n_tok * 512)), n_sel(static_cast<size_t>(n_tok), 512);
        for (size_t i = 0; i < sel.size(); ++i) sel[i] = static_cast<int32_t>((i % 512) * 16 + (i / 512) % 16);
        a.sel = up(sel);
        a.n_sel = up(n_sel);
        a.rope = rope(64);
        const uint8_t *chunk = up(pack_rows(randn(static_cast<size_t>(n_tok * d), rng_), d, true, d * 2));
        const float *q = up(randn(static_cast<size_t>(n_tok * H * d), rng_));
        float *o = dev<float>(static_cast<size_t>(n_tok * H * d));
        const int64_t *pos = positions(p0, 1);
        const size_t pn = cd::attn_batch_part_floats(a, n_tok);
        float *part = pn ? dev<float>(pn) : nullptr;
        const float ms = time_ms(s_, [&] {
            cd::launch_sparse_sink_attention_batch(a, chunk, d * 2, n_tok, 512, q, pos, part, o, s_);
        });
        const int64_t rows = W + (mode == cd::comp_mode::list ? 512 : (p0 + n_tok / 2) / 128);
        const double fma = 2.0 * n_tok * rows * H * d;
        std::printf("  attention batch %s 4096 tokens x %lld rows: %.2f ms (%.1f TFMA/s)\n",
                    mode == cd::comp_mode::list ? "list" : "all", static_cast<long long>(rows), ms, fma / ms / 1e9);
    }
}

}  // namespace
}  // namespace fathom
