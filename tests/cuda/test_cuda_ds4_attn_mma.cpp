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
// (FATHOM_DS4_BENCH=1) times the f32, two-launch and fused paths at the shapes of
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
#include "test_cuda_ds4_attn_bench.h"

namespace fathom {
namespace {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

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

    // Which launch: the f32 split kernel + combine, the tensor-core split kernel + the separate combine
    // kernel (two launches), or the tensor-core kernel with the combine folded in (one PDL launch).
    enum class path { f32, tc, fused };
    static void set_path(cd::sparse_attn_args &a, path k) {
        a.tensor_cores = k != path::f32;
        a.fused_combine = k == path::fused;
    }

    // n_floats of partials: NaN-poisoned, the fused combine's counters (the first attn_part_sync_bytes) zero.
    float *fresh_part(size_t n_floats) {
        float *part = poisoned(n_floats);
        EXPECT_EQ(cudaMemset(part, 0, cd::attn_part_sync_bytes()), cudaSuccess);
        return part;
    }
    // Whether the counters are back at zero after the calls on part (every call must leave them so).
    bool sync_zero(const float *part) {
        const auto w = down(reinterpret_cast<const uint32_t *>(part), cd::attn_part_sync_bytes() / 4);
        return std::all_of(w.begin(), w.end(), [](uint32_t x) { return x == 0; });
    }

    // One launch at pos on `k` into a fresh poisoned output (partials poisoned too); returns o [n_head, d].
    std::vector<float> launch(const mma_setup &u, int64_t pos, path k) {
        cd::sparse_attn_args a = u.a;
        set_path(a, k);
        const size_t n = static_cast<size_t>(a.n_head) * a.d;
        float *part = fresh_part(cd::attn_part_floats(a)), *o = poisoned(n);
        set_pos(pos);
        cd::launch_sparse_sink_attention(a, u.q, pos_, part, o, s_);
        auto out = down(o, n);
        EXPECT_TRUE(sync_zero(part)) << "the fused combine's counters are not back at zero";
        return out;
    }

    // Busy splits of a call with n candidate rows (ds4_attn.cu attn_splits / attn_rps), for the log.
    static int64_t busy_splits(const cd::sparse_attn_args &a, int64_t n) {
        const int64_t cap = a.window + (a.mode == cd::comp_mode::none ? 0 : a.max_comp);
        const int64_t n_split = std::min<int64_t>(std::max<int64_t>((cap + 31) / 32, 1), 64);
        int64_t rps = std::max<int64_t>((n + n_split - 1) / n_split, 32);
        rps = (rps + 15) / 16 * 16;
        return (n + rps - 1) / rps;
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
        const auto o_new = launch(u, c.pos, path::tc), o_old = launch(u, c.pos, path::f32);
        const auto o_again = launch(u, c.pos, path::tc);
        const auto o_fused = launch(u, c.pos, path::fused), o_fused2 = launch(u, c.pos, path::fused);
        for (float v : o_new) ASSERT_TRUE(std::isfinite(v)) << "non-finite output";
        const double vs_old = worst_head(o_new, o_old, c.n_head, c.d);
        const double vs_cpu = rel_l2(o_new.data(), u.ref.data(), o_new.size());
        const double old_cpu = rel_l2(o_old.data(), u.ref.data(), o_old.size());
        EXPECT_LE(vs_old, 1e-5);
        EXPECT_LE(vs_cpu, 1e-5);
        EXPECT_EQ(std::memcmp(o_new.data(), o_again.data(), o_new.size() * 4), 0) << "not deterministic";
        // the folded combine runs the combine kernel's code on the same partials: the same bits (NaN
        // included: a missed item stays poisoned and differs)
        EXPECT_EQ(std::memcmp(o_fused.data(), o_new.data(), o_new.size() * 4), 0) << "fused combine differs";
        EXPECT_EQ(std::memcmp(o_fused2.data(), o_new.data(), o_new.size() * 4), 0) << "fused combine, 2nd call";
        worst_ = std::max(worst_, vs_old);
        std::printf("  %-34s pos %8lld: %5lld rows (%2lld busy splits), per-head vs f32 kernel %.3g, vs CPU %.3g "
                    "(f32 kernel %.3g)\n",
                    c.what, static_cast<long long>(c.pos), static_cast<long long>(u.n_rows),
                    static_cast<long long>(busy_splits(u.a, u.n_rows)), vs_old, vs_cpu, old_cpu);
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

// ---- benchmark (FATHOM_DS4_BENCH=1) ---------------------------------------------------------------------

// f32 kernel vs tensor cores (split + separate combine: the old two launches; fused: one PDL launch) at
// the shapes of cuda_test::kAttnBenchCases (as CudaDs4AttnBench.SparseSinkAttention): 16 launches
// captured in one graph (buffer sets cycled at 1M so rows come from HBM), microseconds per call.
TEST_F(CudaDs4AttnMma, BenchOldVsNew) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
    const int calls = 16;
    const cuda_test::attn_bench_inputs in = cuda_test::attn_bench_make_inputs(*this, rng_);
    for (const cuda_test::attn_bench_case &c : cuda_test::kAttnBenchCases) {
        const cuda_test::attn_bench_sets sets = cuda_test::attn_bench_make_sets(*this, rng_, c, in, rope_);
        set_pos(c.pos);
        float us[3] = {0, 0, 0};
        for (int k = 0; k < 3; ++k) {  // path::f32, path::tc, path::fused
            float ms = 0;
            cuda_test::attn_bench_time(s_, calls, [&](int i) {
                cd::sparse_attn_args a = sets.args[static_cast<size_t>(i % c.sets)];
                set_path(a, static_cast<path>(k));
                cd::launch_sparse_sink_attention(a, in.q, pos_, sets.parts[static_cast<size_t>(i % c.sets)], in.o, s_);
            }, ms);
            if (HasFatalFailure()) return;
            us[k] = ms * 1e3f / calls;
        }
        std::printf("  attention %-34s f32 kernel %7.2f us/call, tensor cores: split + combine (old) %7.2f, "
                    "fused (new) %7.2f us/call\n",
                    c.what, us[0], us[1], us[2]);
        for (float *part : sets.parts) EXPECT_TRUE(sync_zero(part));
    }
}

}  // namespace
}  // namespace fathom
