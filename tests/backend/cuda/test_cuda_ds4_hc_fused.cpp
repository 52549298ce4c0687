// Fused decode hyper-connections (ds4_kernels.h launch_hc_pre_fused / launch_hc_head_fused) against
// the unfused launches they replace in the decode step (launch_hc_post, launch_hc_pre /
// launch_hc_head, launch_rms_norm). Two kernels:
//   hc_fused_kernel (io.part null, one block per mixer row): BIT FOR BIT, it repeats the unfused
//     operations in their order, so every output (normalised u / z, post, comb, mix, new state)
//     must have the same bits;
//   hc_split_kernel (io.part set, column blocks): the new state BIT FOR BIT (hc_post_kernel's
//     element operations); the mixer's double sums are added in another order, so mix may differ
//     where a double sum rounds to another float (essentially never), and out / post / comb
//     through it: those are checked to relative error <= 1e-6 (mix element-wise, the others by
//     relative L2), and any bit difference is printed. Replays of the split kernel must repeat
//     its own bits exactly (its reduction order does not depend on the blocks' arrival order).
// Those unfused kernels are checked against the CPU reference in test_cuda_ds4.cpp
// (HcPreAndPostMatchCpu).
//   CudaDs4HcFused.*       chains of sublayers reusing one arrival counter (it must come back to
//                          zero), the head, graph replay, odd sizes (scalar / tail paths, a last
//                          column block narrower than the others), n_hc 1..5, f16 / f32 mixers,
//                          block counts 1..128, the shared-memory fallback; fused outputs NaN-poisoned
//                          before every launch (the split kernel's partial scratch too)
// The benchmark (86 sublayers of one DS4-Flash token: unfused vs row-block fused vs split fused, block
// count sweep, in captured graphs): bench/cuda/bench_ds4_hc_fused.cpp (bench_cuda_kernels).
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
#include "cuda_test_util.h"
#include "ds4_hc_fused_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_hc_fused_suite;

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

const geom kGeoms[] = {
    {4, 4096, dtype::f32, 0, true},    // DS4-Flash (f32 mixers as in the GGUF)
    {4, 4096, dtype::f16, 0, true},    // f16 mixers
    {4, 6144, dtype::f32, 16, true},   // n > 16384: the mixer's second unit batch per thread
    {4, 1003, dtype::f16, 2, true},    // odd D: scalar state path, n % 8 = 4 tail, unaligned rows
    {3, 1027, dtype::f32, 4, false},   // odd n, no norm weight, scalar weight loads
    {5, 2052, dtype::f32, 16, true},   // n_hc 5, D % 4 == 0 with an n % 8 tail
    {1, 8, dtype::f16, 0, true},       // one unit, 3 blocks
    {2, 300, dtype::f32, 0, true},     // D < the norm's 256 threads x 2
};

// The split kernel's geometries: C = columns per block (a multiple of 4), B blocks, cj = the last
// block's columns (C = ceil(ceil(D / blocks) / 4) * 4 with blocks 0 = 128).
const geom kSplitGeoms[] = {
    {4, 4096, dtype::f32, 0, true},        // DS4-Flash: C 32, B 128
    {4, 4096, dtype::f16, 0, true},        // f16 mixers
    {4, 4096, dtype::f32, 0, true, 64},    // C 64, B 64
    {4, 4096, dtype::f16, 2, true, 100},   // C 44, B 94, cj 4; unaligned f16 rows
    {4, 4096, dtype::f32, 0, true, 16},    // C 256, B 16
    {4, 6144, dtype::f32, 16, true},       // C 48, B 128
    {4, 1003, dtype::f16, 2, true},        // odd D: C 8, B 126, cj 3; scalar (non-float4) state copy
    {3, 1027, dtype::f32, 4, false},       // n_hc 3, no norm weight: C 12, B 86, cj 7
    {5, 2052, dtype::f32, 16, true},       // n_hc 5: 36 sums (two row passes per lane), C 20, B 103, cj 12
    {5, 4100, dtype::f16, 0, true},        // n_hc 5, f16: C 36, B 114, cj 32
    {2, 4100, dtype::f32, 0, true},        // n_hc 2: C 36, B 114, cj 32
    {1, 8, dtype::f16, 0, true},           // n_hc 1: C 4, B 2
    {2, 5, dtype::f16, 0, true},           // D 5: C 4, B 2, cj 1
    {2, 300, dtype::f32, 0, true},         // C 4, B 75
    {3, 200, dtype::f32, 0, true, 1},      // one block: C 200 (it arrives last and runs the tail)
    {3, 200, dtype::f16, 6, true, 128},    // C 4, B 50 (fewer blocks than asked)
};

// Sublayer chains: step 0 has no HCPost (the step's first HCPre), steps 1.. fold in the previous
// sublayer's output y; the weights alternate between two HCs (attention / FFN). After every step the
// fused and unfused normalised u, post, comb, mix and state are compared (kern k's rule: see the file
// banner) and the counter must be zero again. The fused chain keeps its own state; its post / comb
// are reset to the unfused ones after each comparison.
void run_chain(CudaDs4HcFused &t, const geom &g, kern k) {
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = t.params(g);
    const hc_dev hc[2] = {t.make_hc(g, n_mix), t.make_hc(g, n_mix)};
    const auto x0 = randn(static_cast<size_t>(S), t.rng_);
    float *xu[2] = {t.up(x0), t.poisoned(S)}, *xf[2] = {t.up(x0), t.poisoned(S)};
    float *post_u = t.poisoned(n), *comb_u = t.poisoned(n * n), *post_f = t.poisoned(n), *comb_f = t.poisoned(n * n);
    float *mix_u = t.poisoned(n_mix + 1), *mix_f = t.poisoned(n_mix + 1), *xn_u = t.poisoned(D), *xn_f = t.poisoned(D);
    float *y = t.dev<float>(D);
    uint32_t *sync = t.dev<uint32_t>(1);
    double *part = t.part_for(k, n);
    int cu = 0, cf = 0;
    for (int step = 0; step < 5; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        const hc_dev &h = hc[step % 2];
        const bool with_post = step > 0;
        if (with_post) t.put(y, randn(static_cast<size_t>(D), t.rng_));
        // unfused: post, pre, norm
        if (with_post) {
            cd::launch_hc_post(n, D, y, xu[cu], post_u, comb_u, xu[1 - cu], t.s_);
            cu = 1 - cu;
        }
        cd::launch_hc_pre(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xu[cu], mix_u, xn_u, post_u, comb_u, t.s_);
        cuda::launch_rms_norm(xn_u, D, h.norm, p.rms_eps, D, 1, xn_u, D, t.s_);
        // fused, every output poisoned first
        t.poison(xn_f, D);
        t.poison(mix_f, n_mix + 1);
        if (with_post) t.poison(xf[1 - cf], S);
        cd::hc_fused_io io;
        io.y = with_post ? y : nullptr;
        io.x = xf[cf];
        io.x_new = with_post ? xf[1 - cf] : nullptr;
        io.post = post_f, io.comb = comb_f, io.mix = mix_f, io.sync = sync, io.norm = h.norm, io.out = xn_f;
        io.part = part, io.part_blocks = g.blocks;
        cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, t.s_);
        if (with_post) cf = 1 - cf;
        ASSERT_EQ(cudaStreamSynchronize(t.s_), cudaSuccess);
        ASSERT_EQ(cu, cf);
        t.expect_same(xf[cf], xu[cu], S, "state");  // both kernels: bit for bit
        t.expect_outputs(k, xn_f, xn_u, D, "normalised u");
        t.expect_outputs(k, post_f, post_u, n, "post");
        t.expect_outputs(k, comb_f, comb_u, n * n, "comb");
        t.expect_outputs(k, mix_f, mix_u, n_mix + 1, "mix", true);
        t.expect_counter_zero(sync);
        t.expect_split_ran(part, n);
        if (t.HasFailure()) return;
        // the next step's HCPost from the unfused split (a no-op for the row kernel; for the split
        // kernel it keeps the next state's bit-for-bit check independent of a rare mix rounding)
        CK(cudaMemcpy(post_f, post_u, sizeof(float) * n, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(comb_f, comb_u, sizeof(float) * n * n, cudaMemcpyDeviceToDevice));
    }
}

TEST_F(CudaDs4HcFused, SublayerChainMatchesUnfusedBitwise) {
    for (const geom &g : kGeoms) {
        SCOPED_TRACE(name(g));
        run_chain(*this, g, kern::rows);
        if (HasFailure()) return;
    }
}

TEST_F(CudaDs4HcFused, SplitSublayerChainMatchesUnfused) {
    for (const geom &g : kSplitGeoms) {
        SCOPED_TRACE(name(g));
        run_chain(*this, g, kern::split);
        if (HasFailure()) return;
    }
}

// The head (n_hc mixer rows, no Sinkhorn), with and without the last sublayer's HCPost folded in;
// post and comb are only read.
void run_head(CudaDs4HcFused &t, const geom &g, kern k) {
    const int n = g.n_hc;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = t.params(g);
    const hc_dev h = t.make_hc(g, n);
    const auto x0 = randn(static_cast<size_t>(S), t.rng_);
    std::vector<float> post(static_cast<size_t>(n)), comb(static_cast<size_t>(n * n));
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (auto &v : post) v = 2.0f * ud(t.rng_);
    for (auto &v : comb) v = ud(t.rng_) / static_cast<float>(n);
    float *x = t.up(x0), *post_d = t.up(post), *comb_d = t.up(comb), *y = t.up(randn(static_cast<size_t>(D), t.rng_));
    float *xn_u = t.poisoned(S), *mix_u = t.poisoned(n + 1), *z_u = t.poisoned(D);
    float *xn_f = t.poisoned(S), *mix_f = t.poisoned(n + 1), *z_f = t.poisoned(D);
    uint32_t *sync = t.dev<uint32_t>(1);
    double *part = t.part_for(k, n);
    for (const bool with_post : {false, true, true}) {
        SCOPED_TRACE(with_post ? "with post" : "no post");
        const float *xin_u = x;
        if (with_post) {
            cd::launch_hc_post(n, D, y, x, post_d, comb_d, xn_u, t.s_);
            xin_u = xn_u;
        }
        cd::launch_hc_head(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xin_u, mix_u, z_u, t.s_);
        cuda::launch_rms_norm(z_u, D, h.norm, p.rms_eps, D, 1, z_u, D, t.s_);
        t.poison(z_f, D);
        t.poison(mix_f, n + 1);
        t.poison(xn_f, S);
        cd::hc_fused_io io;
        io.y = with_post ? y : nullptr;
        io.x = x;
        io.x_new = with_post ? xn_f : nullptr;
        io.post = post_d, io.comb = comb_d, io.mix = mix_f, io.sync = sync, io.norm = h.norm, io.out = z_f;
        io.part = part, io.part_blocks = g.blocks;
        cd::launch_hc_head_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, t.s_);
        ASSERT_EQ(cudaStreamSynchronize(t.s_), cudaSuccess);
        t.expect_outputs(k, z_f, z_u, D, "normalised z");
        t.expect_outputs(k, mix_f, mix_u, n + 1, "mix", true);
        if (with_post) t.expect_same(xn_f, xn_u, S, "state");
        const auto pd = t.down(post_d, n), cdd = t.down(comb_d, n * n);
        t.expect_bits(pd.data(), post.data(), n, "post (read only)");
        t.expect_bits(cdd.data(), comb.data(), n * n, "comb (read only)");
        t.expect_counter_zero(sync);
        t.expect_split_ran(part, n);
        if (t.HasFailure()) return;
    }
}

TEST_F(CudaDs4HcFused, HeadMatchesUnfusedBitwise) {
    for (const geom &g : kGeoms) {
        SCOPED_TRACE(name(g));
        run_head(*this, g, kern::rows);
        if (HasFailure()) return;
    }
}

TEST_F(CudaDs4HcFused, SplitHeadMatchesUnfused) {
    for (const geom &g : kSplitGeoms) {
        SCOPED_TRACE(name(g));
        run_head(*this, g, kern::split);
        if (HasFailure()) return;
    }
}

// A captured graph (first HCPre, a sublayer with HCPost, the head with HCPost: the programmatic
// launches and the shared counter inside one graph) replayed several times gives the eager bits.
// split[i]: launch i takes the split kernel (the kernels share the counter when mixed). The split
// kernel's replays must repeat its eager bits too: its reductions do not depend on arrival order.
void run_graph(CudaDs4HcFused &t, const bool (&split)[3], int reps) {
    const geom g{4, 4096, dtype::f16, 0, true};
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = t.params(g);
    const hc_dev a = t.make_hc(g, n_mix), b = t.make_hc(g, n_mix), head = t.make_hc(g, n);
    float *xa = t.up(randn(static_cast<size_t>(S), t.rng_)), *xb = t.poisoned(S), *xc = t.poisoned(S);
    float *y1 = t.up(randn(static_cast<size_t>(D), t.rng_)), *y2 = t.up(randn(static_cast<size_t>(D), t.rng_));
    float *post = t.poisoned(n), *comb = t.poisoned(n * n), *mix = t.poisoned(n_mix + 1);
    float *o1 = t.poisoned(D), *o2 = t.poisoned(D), *z = t.poisoned(D);
    uint32_t *sync = t.dev<uint32_t>(1);
    double *part = t.part_for(kern::split, n);
    auto enqueue = [&] {
        cd::hc_fused_io io;
        io.x = xa, io.post = post, io.comb = comb, io.mix = mix, io.sync = sync, io.norm = a.norm, io.out = o1;
        io.part = split[0] ? part : nullptr;
        cd::launch_hc_pre_fused(p, g.ft, a.fn, a.row_bytes, a.base, a.scale, io, t.s_);
        io.y = y1, io.x_new = xb, io.norm = b.norm, io.out = o2, io.part = split[1] ? part : nullptr;
        cd::launch_hc_pre_fused(p, g.ft, b.fn, b.row_bytes, b.base, b.scale, io, t.s_);
        io.y = y2, io.x = xb, io.x_new = xc, io.norm = head.norm, io.out = z, io.part = split[2] ? part : nullptr;
        cd::launch_hc_head_fused(p, g.ft, head.fn, head.row_bytes, head.base, head.scale, io, t.s_);
    };
    enqueue();
    float *outs[] = {o1, o2, z, xb, xc, post, comb};
    const size_t sizes[] = {static_cast<size_t>(D), static_cast<size_t>(D), static_cast<size_t>(D),
                            static_cast<size_t>(S), static_cast<size_t>(S), static_cast<size_t>(n),
                            static_cast<size_t>(n * n)};
    std::vector<std::vector<float>> eager;
    for (int i = 0; i < 7; ++i) eager.push_back(t.down(outs[i], sizes[i]));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(t.s_, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CK(cudaStreamEndCapture(t.s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < reps; ++rep) {
        SCOPED_TRACE("replay " + std::to_string(rep));
        for (int i = 0; i < 7; ++i) t.poison(outs[i], sizes[i]);
        CK(cudaGraphLaunch(exec, t.s_));
        ASSERT_EQ(cudaStreamSynchronize(t.s_), cudaSuccess);
        const char *what[] = {"o1", "o2", "z", "xb", "xc", "post", "comb"};
        for (int i = 0; i < 7; ++i) {
            const auto got = t.down(outs[i], sizes[i]);
            t.expect_bits(got.data(), eager[static_cast<size_t>(i)].data(), sizes[i], what[i]);
        }
        t.expect_counter_zero(sync);
        if (t.HasFailure()) break;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

TEST_F(CudaDs4HcFused, GraphReplayMatchesEager) {
    run_graph(*this, {false, false, false}, 3);
}

TEST_F(CudaDs4HcFused, SplitGraphReplayMatchesEager) {
    run_graph(*this, {true, true, true}, 20);
}

// Row and split kernels alternating on one counter (a model that mixes them must keep working).
TEST_F(CudaDs4HcFused, MixedKernelsShareTheCounter) {
    run_graph(*this, {false, true, false}, 3);
    if (HasFailure()) return;
    run_graph(*this, {true, false, true}, 3);
}

// The split kernel against itself: 50 eager launches of one DS4-Flash sublayer (f32 mixers, with
// HCPost) give the same bits every time, whatever order the 128 blocks arrive in.
TEST_F(CudaDs4HcFused, SplitIsDeterministic) {
    const geom g{4, 4096, dtype::f32, 0, true};
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = params(g);
    const hc_dev h = make_hc(g, n_mix);
    std::vector<float> post0(static_cast<size_t>(n), 0.7f), comb0(static_cast<size_t>(n * n), 0.25f);
    float *x = up(randn(static_cast<size_t>(S), rng_)), *y = up(randn(static_cast<size_t>(D), rng_));
    float *post = poisoned(n), *comb = poisoned(n * n), *mix = poisoned(n_mix + 1), *out = poisoned(D);
    float *xn = poisoned(S);
    uint32_t *sync = dev<uint32_t>(1);
    double *part = part_for(kern::split, n);
    std::vector<float> first[5];
    for (int it = 0; it < 50; ++it) {
        put(post, post0);  // the kernel rewrites post / comb in place
        put(comb, comb0);
        poison(out, D);
        poison(mix, n_mix + 1);
        poison(xn, S);
        cd::hc_fused_io io;
        io.y = y, io.x = x, io.x_new = xn, io.post = post, io.comb = comb, io.mix = mix, io.sync = sync;
        io.norm = h.norm, io.out = out, io.part = part;
        cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
        const std::vector<float> got[5] = {down(out, D), down(mix, n_mix + 1), down(post, n), down(comb, n * n),
                                           down(xn, S)};
        const char *what[] = {"out", "mix", "post", "comb", "state"};
        for (int i = 0; i < 5; ++i) {
            if (it == 0) first[i] = got[i];
            else expect_bits(got[i].data(), first[i].data(), got[i].size(), what[i]);
        }
        expect_counter_zero(sync);
        if (HasFailure()) return;
    }
}

// Beyond one block's shared memory (n_hc 5 x D 12000 floats = 240 KB) the launcher falls back to the
// unfused kernels, with or without the split kernel's scratch (left untouched): the same bits, the
// counter untouched.
TEST_F(CudaDs4HcFused, LargeStateFallsBackToUnfused) {
    const geom g{5, 12000, dtype::f16, 0, true};
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = params(g);
    const hc_dev h = make_hc(g, n_mix);
    float *x = up(randn(static_cast<size_t>(S), rng_)), *y = up(randn(static_cast<size_t>(D), rng_));
    std::vector<float> post(static_cast<size_t>(n), 0.7f), comb(static_cast<size_t>(n * n), 0.2f);
    float *pu = up(post), *cu = up(comb), *pf = up(post), *cf = up(comb);
    float *xn_u = poisoned(S), *mix_u = poisoned(n_mix + 1), *o_u = poisoned(D);
    float *xn_f = poisoned(S), *mix_f = poisoned(n_mix + 1), *o_f = poisoned(D);
    uint32_t *sync = dev<uint32_t>(1);
    double *part = part_for(kern::split, n);
    cd::launch_hc_post(n, D, y, x, pu, cu, xn_u, s_);
    cd::launch_hc_pre(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xn_u, mix_u, o_u, pu, cu, s_);
    cuda::launch_rms_norm(o_u, D, h.norm, p.rms_eps, D, 1, o_u, D, s_);
    cd::hc_fused_io io;
    io.y = y, io.x = x, io.x_new = xn_f, io.post = pf, io.comb = cf, io.mix = mix_f, io.sync = sync;
    io.norm = h.norm, io.out = o_f;
    for (double *pt : {static_cast<double *>(nullptr), part}) {
        SCOPED_TRACE(pt ? "with the split scratch" : "without the split scratch");
        put(pf, post);  // in place: back to the unfused chain's input split
        put(cf, comb);
        poison(o_f, D);
        poison(xn_f, S);
        io.part = pt;
        cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
        ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        expect_same(o_f, o_u, D, "normalised u");
        expect_same(xn_f, xn_u, S, "state");
        expect_same(pf, pu, n, "post");
        expect_same(cf, cu, n * n, "comb");
        expect_counter_zero(sync);
        EXPECT_TRUE(std::isnan(down(part, 1)[0])) << "the split kernel ran beyond its shared memory";
    }
}

TEST_F(CudaDs4HcFused, BadArgumentsAreRejected) {
    const geom g{4, 64, dtype::f32, 0, true};
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const cd::hc_params p = params(g);
    const hc_dev h = make_hc(g, n_mix);
    float *x = dev<float>(n * 64), *y = dev<float>(64), *post = dev<float>(n), *comb = dev<float>(n * n);
    float *mix = dev<float>(n_mix + 1), *out = dev<float>(64);
    cd::hc_fused_io io;
    io.y = y, io.x = x, io.x_new = x, io.post = post, io.comb = comb, io.mix = mix, io.sync = dev<uint32_t>(1);
    io.out = out;
    EXPECT_THROW(cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);  // x_new == x
    io.x_new = nullptr;
    EXPECT_THROW(cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    io.y = nullptr;
    io.sync = nullptr;
    EXPECT_THROW(cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    io.sync = dev<uint32_t>(1);
    cd::hc_params bad = p;
    bad.n_hc = 6;
    EXPECT_THROW(cd::launch_hc_head_fused(bad, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    EXPECT_THROW(cd::launch_hc_pre_fused(p, dtype::q8_0, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    double *part = dev<double>(cd::hc_fused_part_count(n) + 1);
    io.part = reinterpret_cast<double *>(reinterpret_cast<char *>(part) + 4);  // not 8-byte aligned
    EXPECT_THROW(cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    io.part = part;
    io.part_blocks = cd::kHcFusedMaxBlocks + 1;
    EXPECT_THROW(cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
    io.part_blocks = -1;
    EXPECT_THROW(cd::launch_hc_head_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_), error);
}

// launch_hc_pre_fused_rows / launch_hc_head_fused_rows (every row of a multi-row step in one launch)
// against the one-row launch on each row's own buffers: out, mix, post, comb and the new state bit for
// bit, every row's counter zero again. With and without the HCPost input, the split kernel (part set: 2
// rows over gridDim.y; 5 and 16 rows through hc_split_rows_kernel + hc_split_tail_kernel, 5 leaving its
// second block of rows short) and the row kernel (part null: the rows run one launch each).
TEST_F(CudaDs4HcFused, RowsEqualEachRowAlone) {
    const geom geoms[] = {{4, 4096, dtype::f32, 0, true}, {4, 4096, dtype::f16, 0, true}, {3, 1027, dtype::f32, 4, false}};
    for (const int R : {2, 5, 16})
    for (const geom &g : geoms)
        for (bool head : {false, true})
            for (bool with_y : {false, true})
                for (bool split : {true, false}) {
                    SCOPED_TRACE(name(g) + (head ? " head" : " pre") + (with_y ? " with y" : "") + (split ? " split" : " rows") +
                                 ", " + std::to_string(R) + " rows");
                    const int n = g.n_hc, n_mix = head ? n : (2 + n) * n;
                    const int64_t D = g.D, S = n * D, M = static_cast<int64_t>(cd::hc_rows_mix_floats(n));
                    const size_t P = cd::hc_fused_part_count(n);
                    const cd::hc_params p = params(g);
                    const hc_dev h = make_hc(g, n_mix);
                    const auto x0 = randn(static_cast<size_t>(R * S), rng_), y0 = randn(static_cast<size_t>(R * D), rng_);
                    std::vector<float> pc0(static_cast<size_t>(R * (n + n * n)));
                    for (auto &v : pc0) v = 0.1f + 0.8f * std::uniform_real_distribution<float>()(rng_);
                    const std::vector<float> post0(pc0.begin(), pc0.begin() + R * n), comb0(pc0.begin() + R * n, pc0.end());
                    float *x = up(x0), *y = up(y0);
                    // [0]: the rows launch, [1]: one launch per row
                    float *xn[2], *post[2], *comb[2], *mix[2], *out[2];
                    uint32_t *sync[2];
                    double *part[2];
                    for (int k = 0; k < 2; ++k) {
                        xn[k] = poisoned(R * S), mix[k] = poisoned(R * M), out[k] = poisoned(R * D);
                        post[k] = up(post0), comb[k] = up(comb0);
                        sync[k] = dev<uint32_t>(R);
                        part[k] = split ? dev<double>(R * P) : nullptr;
                    }
                    auto io_of = [&](int k, int r) {
                        cd::hc_fused_io io;
                        io.y = with_y ? y + r * D : nullptr;
                        io.x = x + r * S;
                        io.x_new = with_y ? xn[k] + r * S : nullptr;
                        io.post = post[k] + r * n, io.comb = comb[k] + r * n * n, io.mix = mix[k] + r * M;
                        io.sync = sync[k] + r, io.norm = h.norm, io.out = out[k] + r * D;
                        io.part = split ? part[k] + r * static_cast<int64_t>(P) : nullptr;
                        return io;
                    };
                    if (head) cd::launch_hc_head_fused_rows(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io_of(0, 0), R, s_);
                    else cd::launch_hc_pre_fused_rows(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io_of(0, 0), R, s_);
                    for (int r = 0; r < R; ++r) {
                        if (head) cd::launch_hc_head_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io_of(1, r), s_);
                        else cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io_of(1, r), s_);
                    }
                    ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
                    expect_bits(down(out[0], R * D).data(), down(out[1], R * D).data(), static_cast<size_t>(R * D), "out");
                    for (int r = 0; r < R; ++r)
                        expect_bits(down(mix[0] + r * M, n_mix + 1).data(), down(mix[1] + r * M, n_mix + 1).data(),
                                    static_cast<size_t>(n_mix + 1), "mix");
                    expect_bits(down(post[0], R * n).data(), down(post[1], R * n).data(), static_cast<size_t>(R * n), "post");
                    expect_bits(down(comb[0], R * n * n).data(), down(comb[1], R * n * n).data(), static_cast<size_t>(R * n * n),
                                "comb");
                    if (with_y)
                        expect_bits(down(xn[0], R * S).data(), down(xn[1], R * S).data(), static_cast<size_t>(R * S), "state");
                    for (int r = 0; r < R; ++r) expect_counter_zero(sync[0] + r);
                    if (HasFailure()) return;
                }
}

}  // namespace
}  // namespace fathom
