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
// kernel, bit for bit). CudaDs4AttnMmaBench (FATHOM_DS4_BENCH=1) times both kernels at the shapes of
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

namespace fathom {
namespace {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// Rows [n, width] as f16 bits, stride bytes apart (padding bytes 0xFF).
std::vector<uint8_t> pack_f16(const std::vector<float> &v, int64_t width, size_t stride) {
    const int64_t n = static_cast<int64_t>(v.size()) / width;
    std::vector<uint8_t> b(static_cast<size_t>(n) * stride + 16, 0xFF);
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < width; ++i) {
            const uint16_t h = cpu::f32_to_f16(v[static_cast<size_t>(r * width + i)]);
            std::memcpy(b.data() + static_cast<size_t>(r) * stride + 2 * i, &h, 2);
        }
    return b;
}

std::vector<float> f16_rounded(std::vector<float> v) {
    for (float &x : v) x = cpu::f16_to_f32(cpu::f32_to_f16(x));
    return v;
}

struct mma_case {
    const char *what;
    cd::comp_mode mode = cd::comp_mode::none;
    int64_t pos = 0;
    int ratio = 0;
    int64_t n_comp_rows = 0, max_comp = 0;
    int64_t n_sel = -1;  // list: rows chosen (-1: min(visible, max_comp))
    bool dup = false;    // list: unsorted, with repeats
    int n_head = 64, d = 512;
    size_t pad = 0;  // bytes past each ring and compressed row (0 / 16: 16-byte aligned; 4: pairs; 2: f32 path)
    float q_sd = 1.0f;
};

// One call's device arguments and the CPU reference output [n_head, d].
struct mma_setup {
    cd::sparse_attn_args a;
    float *q = nullptr;
    int32_t *sel = nullptr, *n_sel = nullptr;
    std::vector<float> ref;
    int64_t n_rows = 0;
};

class CudaDs4AttnMma : public cuda_test::cuda_fixture {
  protected:
    static constexpr int kWindow = 128, kRot = 64;
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        pos_ = dev<int64_t>(1);
        tab_ = ds4::rope_yarn(160000.0f, kRot, 16.0f, 65536, 32.0f, 1.0f);
        rope_.freq = up(tab_.freq);
        rope_.n_rot = kRot;
    }
    void set_pos(int64_t p) { cudaMemcpy(pos_, &p, sizeof(p), cudaMemcpyHostToDevice); }

    // A list of `count` compressed rows out of `vis` visible: sorted distinct (as the indexer gives), or
    // unsorted with repeats.
    std::vector<int32_t> make_sel(int64_t vis, int64_t count, bool dup) {
        std::vector<int32_t> sel;
        if (vis <= 0 || count <= 0) return sel;
        if (dup) {
            std::uniform_int_distribution<int32_t> u(0, static_cast<int32_t>(vis - 1));
            for (int64_t i = 0; i < count; ++i) sel.push_back(u(rng_));
            if (count >= 2) sel[1] = sel[0];  // at least one repeat
            return sel;
        }
        std::vector<int32_t> all(static_cast<size_t>(vis));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        all.resize(static_cast<size_t>(std::min(vis, count)));
        std::sort(all.begin(), all.end());
        return all;
    }

    // Random f16 rows (those the token must not see: NaN), the CPU reference, device arguments.
    mma_setup build(const mma_case &c) {
        const int H = c.n_head, d = c.d, W = kWindow;
        mma_setup u;
        const int64_t first = std::max<int64_t>(0, c.pos - W + 1);
        auto ring = f16_rounded(randn(static_cast<size_t>(W) * d, rng_));
        for (int64_t slot = c.pos + 1; slot < W; ++slot) std::fill_n(ring.begin() + slot * d, d, std::nanf(""));
        std::vector<float> rows;  // the candidate list in the CPU's order
        for (int64_t p = first; p <= c.pos; ++p)
            rows.insert(rows.end(), ring.begin() + (p % W) * d, ring.begin() + (p % W + 1) * d);
        std::vector<float> comp;
        std::vector<int32_t> sel;
        if (c.mode != cd::comp_mode::none) {
            comp = f16_rounded(randn(static_cast<size_t>(c.n_comp_rows) * d, rng_));
            std::vector<char> used(static_cast<size_t>(c.n_comp_rows), 0);
            const int64_t vis = (c.pos + 1) / c.ratio;
            if (c.mode == cd::comp_mode::all) {
                for (int64_t r = 0; r < std::min(vis, c.max_comp); ++r) sel.push_back(static_cast<int32_t>(r));
            } else {
                sel = make_sel(vis, c.n_sel < 0 ? std::min(vis, c.max_comp) : c.n_sel, c.dup);
            }
            for (int32_t r : sel) used[static_cast<size_t>(r)] = 1;
            for (int64_t r = 0; r < c.n_comp_rows; ++r)
                if (!used[static_cast<size_t>(r)]) std::fill_n(comp.begin() + r * d, d, std::nanf(""));
            for (int32_t r : sel) rows.insert(rows.end(), comp.begin() + r * d, comp.begin() + (r + 1) * d);
        }
        u.n_rows = static_cast<int64_t>(rows.size()) / d;
        const auto q = randn(static_cast<size_t>(H) * d, rng_, c.q_sd);
        auto sinks = randn(static_cast<size_t>(H), rng_);
        sinks[0] = 6.0f;  // a sink that dominates its head
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        u.ref.assign(static_cast<size_t>(H) * d, 0.0f);
        ds4::attend_with_sink(q.data(), rows.data(), u.n_rows, sinks.data(), H, d, scale, u.ref.data());
        for (int h = 0; h < H; ++h) ds4::rope_apply(u.ref.data() + static_cast<size_t>(h) * d + d - kRot, tab_, c.pos, true);

        cd::sparse_attn_args &a = u.a;
        a.n_head = H;
        a.d = d;
        a.scale = scale;
        a.sinks = up(sinks);
        a.ring_stride = static_cast<size_t>(d) * 2 + c.pad;
        a.ring = up(pack_f16(ring, d, a.ring_stride));
        a.window = W;
        a.mode = c.mode;
        if (c.mode != cd::comp_mode::none) {
            a.comp_stride = static_cast<size_t>(d) * 2 + c.pad;
            a.comp = up(pack_f16(comp, d, a.comp_stride));
            a.ratio = c.ratio;
            a.max_comp = c.max_comp;
        }
        if (c.mode == cd::comp_mode::list) {
            std::vector<int32_t> buf(static_cast<size_t>(std::max<int64_t>(c.max_comp, 1)), -1);  // -1: never read
            std::copy(sel.begin(), sel.end(), buf.begin());
            u.sel = up(buf);
            u.n_sel = up(std::vector<int32_t>{static_cast<int32_t>(sel.size())});
            a.sel = u.sel;
            a.n_sel = u.n_sel;
        }
        a.rope = rope_;
        u.q = up(q);
        return u;
    }

    // One launch at c.pos with the tensor-core flag `tc` into a fresh poisoned output (partials
    // poisoned too); returns o [n_head, d].
    std::vector<float> launch(const mma_setup &u, int64_t pos, bool tc) {
        cd::sparse_attn_args a = u.a;
        a.tensor_cores = tc;
        const size_t n = static_cast<size_t>(a.n_head) * a.d;
        float *part = poisoned(cd::attn_part_floats(a)), *o = poisoned(n);
        set_pos(pos);
        cd::launch_sparse_sink_attention(a, u.q, pos_, part, o, s_);
        return down(o, n);
    }

    // Largest per-head relative L2 of got against ref (NaN: +inf).
    static double worst_head(const std::vector<float> &got, const std::vector<float> &ref, int H, int d) {
        double w = 0;
        for (int h = 0; h < H; ++h) {
            const double e = rel_l2(got.data() + static_cast<size_t>(h) * d, ref.data() + static_cast<size_t>(h) * d,
                                    static_cast<size_t>(d));
            w = std::max(w, std::isnan(e) ? INFINITY : e);
        }
        return w;
    }

    void run(const mma_case &c) {
        SCOPED_TRACE(std::string(c.what) + " pos " + std::to_string(c.pos));
        const mma_setup u = build(c);
        const auto o_new = launch(u, c.pos, true), o_old = launch(u, c.pos, false);
        const auto o_again = launch(u, c.pos, true);
        for (float v : o_new) ASSERT_TRUE(std::isfinite(v)) << "non-finite output";
        const double vs_old = worst_head(o_new, o_old, c.n_head, c.d);
        const double vs_cpu = rel_l2(o_new.data(), u.ref.data(), o_new.size());
        const double old_cpu = rel_l2(o_old.data(), u.ref.data(), o_old.size());
        EXPECT_LE(vs_old, 1e-5);
        EXPECT_LE(vs_cpu, 1e-5);
        EXPECT_EQ(std::memcmp(o_new.data(), o_again.data(), o_new.size() * 4), 0) << "not deterministic";
        worst_ = std::max(worst_, vs_old);
        std::printf("  %-34s pos %8lld: %5lld rows, per-head vs f32 kernel %.3g, vs CPU %.3g (f32 kernel %.3g)\n",
                    c.what, static_cast<long long>(c.pos), static_cast<long long>(u.n_rows), vs_old, vs_cpu,
                    old_cpu);
    }

    int64_t *pos_ = nullptr;
    ds4::rope_table tab_;
    cd::rope_args rope_;
    std::mt19937 rng_{20261201};
    double worst_ = 0;
};

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
// before every replay.
TEST_F(CudaDs4AttnMma, GraphReplayAtManyPositions) {
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
    const size_t n = static_cast<size_t>(H) * d;
    float *part = poisoned(cd::attn_part_floats(u.a)), *o = poisoned(n);
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    cd::launch_sparse_sink_attention(u.a, u.q, pos_, part, o, s_);
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
        poison(o, n);
        poison(part, cd::attn_part_floats(u.a));
        set_pos(p);
        CK(cudaGraphLaunch(exec, s_));
        const auto og = down(o, n);
        const auto oe = launch(u, p, true), oo = launch(u, p, false);
        for (float v : og) ASSERT_TRUE(std::isfinite(v)) << "pos " << p;
        ASSERT_EQ(std::memcmp(og.data(), oe.data(), n * 4), 0) << "graph differs from eager at pos " << p;
        const double e = worst_head(og, oo, H, d);
        EXPECT_LE(e, 1e-5) << "pos " << p << " n_sel " << sel.size();
        worst = std::max(worst, e);
        ++replays;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    std::printf("  graph replay at %d positions: identical to eager, per-head vs f32 kernel <= %.3g\n", replays,
                worst);
}

// ---- benchmark (FATHOM_DS4_BENCH=1) ---------------------------------------------------------------------

// f32 kernel vs tensor cores at the shapes of CudaDs4AttnBench.SparseSinkAttention: 16 launches captured
// in one graph (buffer sets cycled at 1M so rows come from HBM), microseconds per call.
TEST_F(CudaDs4AttnMma, BenchOldVsNew) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
    const int H = 64, d = 512, W = kWindow, calls = 16;
    const struct {
        const char *what;
        cd::comp_mode mode;
        int ratio;
        int64_t n_comp_rows, max_comp, pos;
        int sets;
    } cfgs[] = {{"ratio 0: 128 rows", cd::comp_mode::none, 0, 0, 0, 8191, 1},
                {"ratio 4: 128 + 512 selected rows", cd::comp_mode::list, 4, 2048, 512, 8191, 1},
                {"ratio 128 at 8K: 128 + 64 rows", cd::comp_mode::all, 128, 8192, 8192, 8191, 1},
                {"ratio 128 at 1M: 128 + 8192 rows", cd::comp_mode::all, 128, 8192, 8192, 1048575, 16}};
    const float *q = up(randn(static_cast<size_t>(H) * d, rng_)), *sinks = up(randn(H, rng_));
    float *o = dev<float>(static_cast<size_t>(H) * d);
    std::vector<int32_t> sel(512);
    for (int i = 0; i < 512; ++i) sel[static_cast<size_t>(i)] = 4 * i + 1;
    const int32_t *sel_d = up(sel), *n_sel = up(std::vector<int32_t>{512});
    const auto ring_h = pack_f16(randn(static_cast<size_t>(W) * d, rng_), d, static_cast<size_t>(d) * 2);
    for (const auto &c : cfgs) {
        std::vector<cd::sparse_attn_args> as(static_cast<size_t>(c.sets));
        std::vector<float *> parts;
        for (cd::sparse_attn_args &a : as) {
            a.n_head = H;
            a.d = d;
            a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
            a.sinks = sinks;
            a.ring = up(ring_h);
            a.ring_stride = static_cast<size_t>(d) * 2;
            a.window = W;
            a.mode = c.mode;
            if (c.mode != cd::comp_mode::none) {
                a.comp = up(pack_f16(randn(static_cast<size_t>(c.n_comp_rows) * d, rng_), d, static_cast<size_t>(d) * 2));
                a.comp_stride = static_cast<size_t>(d) * 2;
                a.ratio = c.ratio;
                a.max_comp = c.max_comp;
                a.sel = sel_d;
                a.n_sel = n_sel;
            }
            a.rope = rope_;
            parts.push_back(dev<float>(cd::attn_part_floats(a)));
        }
        set_pos(c.pos);
        float us[2] = {0, 0};
        for (int tc = 0; tc < 2; ++tc) {
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            CK(cudaStreamSynchronize(s_));
            CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
            for (int k = 0; k < calls; ++k) {
                cd::sparse_attn_args a = as[static_cast<size_t>(k % c.sets)];
                a.tensor_cores = tc == 1;
                cd::launch_sparse_sink_attention(a, q, pos_, parts[static_cast<size_t>(k % c.sets)], o, s_);
            }
            CK(cudaStreamEndCapture(s_, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            us[tc] = time_graph(exec, s_, 21) * 1e3f / calls;
            CK(cudaStreamSynchronize(s_));
            CK(cudaGetLastError());
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        }
        std::printf("  attention %-36s f32 kernel %7.2f us/call, tensor cores %7.2f us/call\n", c.what, us[0],
                    us[1]);
    }
}

}  // namespace
}  // namespace fathom
