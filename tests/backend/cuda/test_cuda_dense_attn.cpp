// The dense families' CUDA prefill attention (tensor-core kernel of src/backend/cuda/cuda_attn_mma.cu,
// reached through cuda_backend::attention for f16 caches and >= 16 query tokens) against the CPU
// backend in exact mode (f32 dots against the f16 keys, f32 probabilities), on random caches:
// head_dim 64 / 128 / 256, GQA 1 / 2 / 8, windows 0 / 1 / 7 / 512, softcap on / off, first chunks and
// later chunks (n_past > 0, not tile-aligned), token counts around the 64-query tile (and below the
// dispatch threshold, which must keep the scalar kernel), caches larger than the span, and key splits
// (few query tiles over a long cache). Every GPU output is NaN-poisoned first, and cache rows that no
// query may read (past the last query; before the first window) hold f16 NaNs, so an unwritten output
// or a read outside the span fails.
// Tolerance: relative L2 <= 1e-4 per (token, head) row. The kernel splits q and p into f16 hi + lo
// pairs (~2^-22 relative each), so the expected error is ~1e-6 (the f32 reference's own rounding);
// 1e-4 leaves a wide margin yet fails a plain-f16 P (~3e-4 per row) or any indexing error (O(1)).
// Its benchmark at the PFlash drafter's shapes: bench/cuda/bench_dense_attn.cpp (bench_cuda_kernels).
// Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "cuda_test_util.h"
#include "dense_attn_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::dense_attn_suite;

using cuda_test::randn;
using cuda_test::rel_l2;

std::string name_of(const attn_case &c) {
    return "hd=" + std::to_string(c.hd) + " H=" + std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) +
           " n_ctx=" + std::to_string(c.n_ctx) + " n_past=" + std::to_string(c.n_past) + " n_tok=" +
           std::to_string(c.n_tok) + " cap=" + std::to_string(c.softcap) + " window=" + std::to_string(c.window) +
           (c.f16 ? " f16" : " f32");
}

constexpr double kTol = 1e-4;

// Every head_dim x GQA x window; softcap on every third case (each window meets it); a later chunk
// (n_past 37: not tile-aligned) of 100 tokens (one full and one partial query tile) in a cache larger
// than the span (n_ctx 500: one key split, the block writes the output itself).
TEST_F(CudaDenseAttn, GeometrySweep) {
    int idx = 0;
    double worst = 0;
    for (int32_t hd : {64, 128, 256})
        for (int32_t gqa : {1, 2, 8})
            for (int32_t window : {0, 1, 7, 512}) {
                const attn_case c{hd, 8, 8 / gqa, 500, 37, 100, (idx++ % 3 == 0) ? 5.0f : 0.0f, window};
                SCOPED_TRACE(name_of(c));
                EXPECT_EQ(cuda::attention_splits(c.n_tok, c.n_head, c.n_ctx), 1);
                const double e = run(c);
                EXPECT_LE(e, kTol);
                worst = std::isnan(e) ? e : std::max(worst, e);
            }
    std::printf("[dense attn] GeometrySweep worst row rel L2 %.3e\n", worst);
}

// Enough query tiles for one split over a long cache (17 tiles x 16 heads = 272 blocks): the block
// writes the output itself; later chunk, full causal and windowed.
TEST_F(CudaDenseAttn, LargeBatchOneSplit) {
    for (int32_t window : {0, 512}) {
        const attn_case c{64, 16, 2, 2048, 500, 1060, 0.0f, window};
        SCOPED_TRACE(name_of(c));
        EXPECT_EQ(cuda::attention_splits(c.n_tok, c.n_head, c.n_ctx), 1);
        EXPECT_LE(run(c), kTol);
    }
}

// Token counts around the 64-query tile and the dispatch threshold (1: scalar kernel; 2 and up: tensor
// cores, 8 = PFlash's scoring queries), for a first chunk and a second chunk, full causal and windowed.
TEST_F(CudaDenseAttn, TokenCountsAndChunks) {
    for (int64_t n_tok : {1, 2, 5, 8, 15, 16, 17, 63, 64, 65, 100, 300})
        for (int64_t n_past : {0, 300})
            for (int32_t window : {0, 512}) {
                const attn_case c{128, 16, 8, 2048, n_past, n_tok, 0.0f, window};
                SCOPED_TRACE(name_of(c));
                EXPECT_LE(run(c), kTol);
            }
}

// Softcap (Gemma) with large scores, so tanh saturates for some keys, on every head_dim.
TEST_F(CudaDenseAttn, SoftcapSaturates) {
    for (int32_t hd : {64, 128, 256}) {
        const attn_case c{hd, 4, 1, 300, 20, 70, 3.0f, 0};
        SCOPED_TRACE(name_of(c));
        EXPECT_LE(run(c, 6.0f), kTol);
    }
}

// Few query tiles over a long cache: the launch splits the keys (grid z) and the combine pass merges
// the partials; with a window most splits hold no key (they must still write m = -inf). The f32 cache
// takes the scalar kernel with the same split count.
TEST_F(CudaDenseAttn, KeySplits) {
    for (bool f16 : {true, false})
        for (int64_t n_tok : {16, 17, 40, 130})
            for (int32_t window : {0, 512}) {
                attn_case c{128, 8, 2, 8192, 3000, n_tok, 0.0f, window};
                c.f16 = f16;
                SCOPED_TRACE(name_of(c) + " splits=" + std::to_string(cuda::attention_splits(n_tok, 8, 8192)));
                EXPECT_GT(cuda::attention_splits(n_tok, 8, 8192), 1);
                EXPECT_LE(run(c), kTol);
            }
}

// Positions outside [0, n_ctx) (device positions, as in graph replay) set the error flag; rows with
// positions inside the cache are still right, rows outside are not written (stay NaN). With and
// without key splits (n_ctx 2048: 8 splits for 32 tokens of 4 heads), past the end and below 0.
TEST_F(CudaDenseAttn, BadPositionSetsErrorFlag) {
    struct bad {
        int64_t n_ctx, step_pos;
    };
    for (const bad b : {bad{200, 190}, bad{2048, 2040}, bad{200, -5}, bad{2048, -70}}) {
        SCOPED_TRACE("n_ctx=" + std::to_string(b.n_ctx) + " pos=" + std::to_string(b.step_pos));
        const int64_t n_tok = 80;
        const int64_t first = std::max<int64_t>(0, -b.step_pos);             // first row inside the cache
        const int64_t last = std::min<int64_t>(n_tok, b.n_ctx - b.step_pos);  // one past the last
        const attn_case c{64, 4, 2, b.n_ctx, 0, b.n_ctx, 0.0f, 0};              // cache fully readable
        auto kc = cache(c), vc = cache(c);
        const int64_t qw = 4 * 64;
        auto q = make_f32(qw, n_tok, randn(static_cast<size_t>(qw * n_tok), rng_, 2.0f));
        auto o = out_f32(qw, n_tok);
        attn_params p = params(c);
        p.n_past = 0;
        gpu_->set_device_positions(true);
        gpu_->set_step_pos(b.step_pos);
        gpu_->attention(q.d, kc.d, vc.d, p, o.d);
        gpu_->set_device_positions(false);
        EXPECT_THROW(gpu_->synchronize(), error);
        gpu_->synchronize();  // the error word was cleared
        const std::vector<float> got = down(o.d);
        // Reference for the valid rows [first, last): positions step_pos + first ...
        auto oref = out_f32(qw, last - first);
        p.n_past = b.step_pos + first;
        exact_->attention(view_rows(q.h, first, last - first), kc.h, vc.h, p, oref.h);
        const std::vector<float> ref = hostv(oref);
        EXPECT_LE(worst_row(std::vector<float>(got.begin() + first * qw, got.begin() + last * qw), ref, last - first, 4,
                            64),
                  kTol);
        size_t written = 0;
        for (int64_t r = 0; r < n_tok; ++r)
            if (r < first || r >= last)
                for (int64_t i = 0; i < qw; ++i) written += !std::isnan(got[static_cast<size_t>(r * qw + i)]);
        EXPECT_EQ(written, 0u) << "rows outside the cache were written";
    }
}

}  // namespace
}  // namespace fathom
