// DS4 decode sparse sink attention on tensor cores (src/backend/cuda/ds4_attn.cu attn_split_mma_kernel,
// which launch_sparse_sink_attention picks when every row is f16 and pair-aligned) against the f32 split
// kernel (sparse_attn_args::tensor_cores = false, same partition, partials and combine) head by head,
// and against the CPU reference (attend_with_sink, then the inverse rope_apply of each head's last n_rot
// dims). Rows a token must not see (never-written ring slots, compressed rows not visible or not
// selected) are NaN and the outputs and partials are NaN-poisoned first, so a wrong row, a missed
// store or a read of an idle split shows. Cases cover window-only, all compressed rows (ratio 128 up to
// the 1M row count 128 + 8192, ratio 4), selected rows (0 .. 512 of them, sorted, unsorted with
// duplicates: the CPU takes any list), candidate counts 1 .. 640 around the 16/32-row tile and split
// edges, positions before and after the ring wraps, 16 / 64 / 96 heads (a partial head group), d 64 /
// 192 / 512, rows 16-byte aligned (vector staging), 4-byte aligned (pair staging) and 2-byte aligned
// (the f32 kernel runs: both paths agree trivially). Then a captured graph replayed at many positions
// (list mode, the selection changing) against eager launches, and determinism (graph == eager new
// kernel, bit for bit). The folded combine (sparse_attn_args::fused_combine: one launch whose busy blocks
// meet at a barrier and combine among themselves) must give the tensor-core two-launch path's bits in
// every case (1 busy split at short context, several, all n_split busy at full window / 512 selected
// rows, partial and multiple head groups), leave its counters zero after every call, and replay in a
// graph of three launches sharing one partial buffer (CudaDs4AttnMmaGraph). CudaDs4AttnMma.BenchOldVsNew
// (bench/cuda/bench_ds4_attn_mma.cpp) times the f32, two-launch and fused paths at the shapes of
// CudaDs4AttnBench.SparseSinkAttention.
//
// Tolerances: relative L2 <= 1e-5 per head against the f32 kernel and over all heads against the CPU
// (both accumulate in f32; the tensor-core path splits q and p into f16 hi + lo: ~1e-6 expected). The
// largest per-head value seen is printed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"
#include "cuda_test_util.h"
#include "ds4_attn_mma_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_attn_mma_suite;

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

TEST_F(CudaDs4AttnMma, WindowOnlyMatchesF32KernelAndCpu) {
    for (int64_t p : {0, 1, 14, 15, 16, 31, 32, 33, 63, 64, 100, 127, 128, 129, 1000, 1048575}) {
        mma_case c{"window"};
        c.pos = p;
        run(c);
    }
    mma_case c{"window, pairs (4-byte rows)"};
    c.pos = 777;
    c.pad = 4;
    run(c);
    c = mma_case{"window, 2-byte rows (f32 kernel)"};
    c.pos = 300;
    c.pad = 2;
    run(c);
    c = mma_case{"window, 16-byte padded rows"};
    c.pos = 200;
    c.pad = 16;
    run(c);
    std::printf("  largest per-head rel L2 vs the f32 kernel: %.3g\n", worst_);
}

TEST_F(CudaDs4AttnMma, AllCompressedRowsMatchF32KernelAndCpu) {
    const struct {
        int ratio;
        int64_t rows, max_comp, pos;
    } cs[] = {{128, 8193, 8193, 100},  {128, 8193, 8193, 127},    {128, 8193, 8193, 5000},
              {128, 8193, 8193, 8191}, {128, 8193, 8193, 1048575}, {4, 1024, 1024, 2050},
              {4, 1024, 512, 4095},    {4, 64, 64, 20}};
    for (const auto &x : cs) {
        mma_case c{"all compressed rows"};
        c.mode = cd::comp_mode::all;
        c.ratio = x.ratio;
        c.n_comp_rows = x.rows;
        c.max_comp = x.max_comp;
        c.pos = x.pos;
        run(c);
    }
    std::printf("  largest per-head rel L2 vs the f32 kernel: %.3g\n", worst_);
}

// Candidate counts 1 .. 640 (raw rows + n_sel) across tile (16, 32) and split edges, sorted and
// duplicated lists, sharper softmax (q sd 4).
TEST_F(CudaDs4AttnMma, SelectedRowsMatchF32KernelAndCpu) {
    for (int64_t ns : {0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 400, 511, 512}) {
        mma_case c{"selected rows"};
        c.mode = cd::comp_mode::list;
        c.ratio = 4;
        c.n_comp_rows = 4096;
        c.max_comp = 512;
        c.pos = 16383;
        c.n_sel = ns;
        run(c);
    }
    for (int64_t p : {0, 3, 10, 40, 127, 130}) {  // raw rows p + 1 (pos < window), a few compressed
        mma_case c{"selected rows, short context"};
        c.mode = cd::comp_mode::list;
        c.ratio = 4;
        c.n_comp_rows = 64;
        c.max_comp = 64;
        c.pos = p;
        run(c);
    }
    mma_case c{"selected rows, unsorted + repeats"};
    c.mode = cd::comp_mode::list;
    c.ratio = 4;
    c.n_comp_rows = 2048;
    c.max_comp = 512;
    c.pos = 8191;
    c.dup = true;
    run(c);
    c.what = "selected rows, q sd 4";
    c.dup = false;
    c.q_sd = 4.0f;
    run(c);
    c.what = "selected rows, pairs (4-byte rows)";
    c.q_sd = 1.0f;
    c.pad = 4;
    run(c);
    std::printf("  largest per-head rel L2 vs the f32 kernel: %.3g\n", worst_);
}

// Head counts other than 64 (heads past n_head in the last group are computed on q = 0 and dropped)
// and head dims other than 512 (d / 4 output dims per warp: 16 .. 128).
TEST_F(CudaDs4AttnMma, OtherHeadCountsAndDimsMatch) {
    const struct {
        int n_head, d;
    } gs[] = {{16, 512}, {96, 512}, {64, 64}, {64, 192}, {8, 128}};
    for (const auto &x : gs) {
        mma_case c{"list, other geometry"};
        c.mode = cd::comp_mode::list;
        c.ratio = 4;
        c.n_comp_rows = 1024;
        c.max_comp = 300;
        c.pos = 2000;
        c.n_head = x.n_head;
        c.d = x.d;
        SCOPED_TRACE("heads " + std::to_string(x.n_head) + " d " + std::to_string(x.d));
        run(c);
    }
    std::printf("  largest per-head rel L2 vs the f32 kernel: %.3g\n", worst_);
}

// The tensor-core launch captured once (list mode, 64 heads) and replayed at positions before and after
// the ring wraps with a new selection (0 .. 512 rows) each time, against eager f32-kernel launches of
// the same inputs (per head <= 1e-5) and eager tensor-core launches (bit-identical); outputs poisoned
// before every replay. The graph holds three launches sharing one partial buffer, as the model's layers
// do: the fused path (one PDL launch each) in list mode, window-only (another split count: the counters
// sit at a fixed offset), list mode again; or the two-launch path (fused = false). Each launch must
// leave the counters zero for the next one and for the next replay.
class CudaDs4AttnMmaGraph : public CudaDs4AttnMma {
  protected:
    void replay(bool fused);
};

void CudaDs4AttnMmaGraph::replay(bool fused) {
    const int H = 64, d = 512, W = kWindow;
    const int64_t n_comp_rows = 4096, max_comp = 512;
    mma_case c{"graph"};
    c.mode = cd::comp_mode::list;
    c.ratio = 4;
    c.n_comp_rows = n_comp_rows;
    c.max_comp = max_comp;
    c.pos = 16383;  // every compressed row visible to the CPU reference build; rows are all finite below
    mma_setup u = build(c);
    // Every ring and compressed row finite: the replays select rows the setup did not mark.
    CK(cudaMemcpy(const_cast<void *>(u.a.ring), pack_f16(f16_rounded(randn(static_cast<size_t>(W) * d, rng_)), d,
                                                          u.a.ring_stride).data(),
                  static_cast<size_t>(W) * u.a.ring_stride, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(const_cast<void *>(u.a.comp),
                  pack_f16(f16_rounded(randn(static_cast<size_t>(n_comp_rows) * d, rng_)), d, u.a.comp_stride).data(),
                  static_cast<size_t>(n_comp_rows) * u.a.comp_stride, cudaMemcpyHostToDevice));
    mma_setup uw = u;  // the same ring and q, window rows only
    uw.a.mode = cd::comp_mode::none;
    uw.a.comp = nullptr;
    uw.a.sel = nullptr;
    uw.a.n_sel = nullptr;
    uw.a.max_comp = 0;
    cd::sparse_attn_args al = u.a, aw = uw.a;
    set_path(al, fused ? path::fused : path::tc);
    set_path(aw, fused ? path::fused : path::tc);
    const size_t n = static_cast<size_t>(H) * d;
    const size_t n_part = std::max(cd::attn_part_floats(al), cd::attn_part_floats(aw));
    float *part = fresh_part(n_part);
    float *o[3] = {poisoned(n), poisoned(n), poisoned(n)};
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    cd::launch_sparse_sink_attention(al, u.q, pos_, part, o[0], s_);
    cd::launch_sparse_sink_attention(aw, u.q, pos_, part, o[1], s_);
    cd::launch_sparse_sink_attention(al, u.q, pos_, part, o[2], s_);
    CK(cudaStreamEndCapture(s_, &g));
    CK(cudaGraphInstantiate(&exec, g, 0));
    double worst = 0;
    int replays = 0;
    for (int64_t p : {0, 1, 5, 31, 32, 100, 127, 128, 129, 255, 1000, 2047, 4095, 9000, 16383, 1048575}) {
        const int64_t vis = std::min<int64_t>((p + 1) / 4, n_comp_rows);
        const int64_t count = std::min<int64_t>(vis, static_cast<int64_t>(replays * 37) % (max_comp + 1));
        std::vector<int32_t> sel = make_sel(vis, count, replays % 3 == 2);
        std::vector<int32_t> buf(static_cast<size_t>(max_comp), -1);
        std::copy(sel.begin(), sel.end(), buf.begin());
        put(u.sel, buf);
        put(u.n_sel, std::vector<int32_t>{static_cast<int32_t>(sel.size())});
        for (float *x : o) poison(x, n);
        poison(part + cd::attn_part_sync_bytes() / 4, n_part - cd::attn_part_sync_bytes() / 4);  // not the counters
        set_pos(p);
        CK(cudaGraphLaunch(exec, s_));
        std::vector<float> og[3] = {down(o[0], n), down(o[1], n), down(o[2], n)};
        EXPECT_TRUE(sync_zero(part)) << "counters not back at zero after replay at pos " << p;
        const auto oe = launch(u, p, path::tc), oo = launch(u, p, path::f32), ow = launch(uw, p, path::tc);
        for (float v : og[0]) ASSERT_TRUE(std::isfinite(v)) << "pos " << p;
        ASSERT_EQ(std::memcmp(og[0].data(), oe.data(), n * 4), 0) << "graph launch 1 differs from eager at pos " << p;
        ASSERT_EQ(std::memcmp(og[1].data(), ow.data(), n * 4), 0) << "graph launch 2 differs from eager at pos " << p;
        ASSERT_EQ(std::memcmp(og[2].data(), oe.data(), n * 4), 0) << "graph launch 3 differs from eager at pos " << p;
        const double e = worst_head(og[0], oo, H, d);
        EXPECT_LE(e, 1e-5) << "pos " << p << " n_sel " << sel.size();
        worst = std::max(worst, e);
        ++replays;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    std::printf("  graph (%s) replay at %d positions: identical to eager, per-head vs f32 kernel <= %.3g\n",
                fused ? "fused combine" : "two launches", replays, worst);
}
TEST_F(CudaDs4AttnMmaGraph, TwoLaunchesAtManyPositions) { replay(false); }
TEST_F(CudaDs4AttnMmaGraph, FusedCombineAtManyPositions) { replay(true); }

}  // namespace
}  // namespace fathom
