// Fused decode hyper-connections (ds4_kernels.h launch_hc_pre_fused / launch_hc_head_fused,
// ds4_hc.cu hc_fused_kernel) against the unfused launches they replace in the decode step
// (launch_hc_post, launch_hc_pre / launch_hc_head, launch_rms_norm), BIT FOR BIT: the fused kernel
// repeats their operations in their order, so every output (normalised u / z, post, comb, the mix,
// the new state) must have the same bits. Those unfused kernels are checked against the CPU
// reference in test_cuda_ds4.cpp (HcPreAndPostMatchCpu).
//   CudaDs4HcFused.*       chains of sublayers reusing one arrival counter (it must come back to
//                          zero), the head, graph replay, odd sizes (scalar / tail paths), the
//                          shared-memory fallback; fused outputs NaN-poisoned before every launch
//   CudaDs4HcFused.Bench*  86 sublayers (one DS4-Flash token) fused vs unfused in a captured graph;
//                          only with FATHOM_DS4_BENCH=1 in the environment
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

namespace fathom {
namespace {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

// A test geometry: n_hc streams of D, mixer rows of type ft padded by pad bytes (pad % 16 != 0 takes
// the scalar weight loads), with or without an RMSNorm weight.
struct geom {
    int n_hc;
    int64_t D;
    dtype ft;
    size_t pad;
    bool norm;
};
std::string name(const geom &g) {
    return "n_hc " + std::to_string(g.n_hc) + " D " + std::to_string(g.D) + " " + std::string(dtype_name(g.ft)) + " pad " +
           std::to_string(g.pad) + (g.norm ? "" : " no-norm");
}

// One HC's weights on the device: fn [rows, n_hc * D] (rows row_bytes apart), base [rows], scale [3],
// norm [D] (or null).
struct hc_dev {
    const void *fn = nullptr;
    size_t row_bytes = 0;
    const float *base = nullptr, *scale = nullptr, *norm = nullptr;
};

class CudaDs4HcFused : public cuda_test::cuda_fixture {
  protected:
    hc_dev make_hc(const geom &g, int rows) {
        const int64_t S = g.n_hc * g.D;
        const auto f = randn(static_cast<size_t>(rows * S), rng_, 4.0f / std::sqrt(static_cast<float>(S)));
        hc_dev h;
        h.row_bytes = dtype_row_bytes(g.ft, S) + g.pad;
        std::vector<uint8_t> b(h.row_bytes * static_cast<size_t>(rows), 0);
        for (int r = 0; r < rows; ++r) cpu::quantize_row(g.ft, f.data() + r * S, b.data() + r * h.row_bytes, S);
        h.fn = up(b);
        h.base = up(randn(static_cast<size_t>(rows), rng_, 0.5f));
        h.scale = up(randn(3, rng_, 1.0f));
        h.norm = g.norm ? up(randn(static_cast<size_t>(g.D), rng_, 0.3f, 1.0f)) : nullptr;
        return h;
    }
    cd::hc_params params(const geom &g) const { return {g.n_hc, g.D, 20, 1e-6f, 1e-6f}; }
    // Bitwise equality of n floats; reports the count and the first differing index.
    void expect_bits(const float *a, const float *b, size_t n, const char *what) {
        size_t bad = 0, first = n;
        for (size_t i = 0; i < n; ++i)
            if (std::memcmp(a + i, b + i, sizeof(float)) != 0 && bad++ == 0) first = i;
        EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " differ, first at " << first << " (fused "
                           << (first < n ? a[first] : 0.0f) << ", unfused " << (first < n ? b[first] : 0.0f) << ")";
    }
    void expect_same(const float *fused, const float *unfused, size_t n, const char *what) {
        const auto a = down(fused, n), b = down(unfused, n);
        expect_bits(a.data(), b.data(), n, what);
    }
    void expect_counter_zero(const uint32_t *sync) { EXPECT_EQ(down(sync, 1)[0], 0u) << "arrival counter not reset"; }

    std::mt19937 rng_{20261201};
};

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

// Sublayer chains: step 0 has no HCPost (the step's first HCPre), steps 1.. fold in the previous
// sublayer's output y; the weights alternate between two HCs (attention / FFN). After every step the
// fused and unfused normalised u, post, comb, mix and state are compared bitwise and the counter must
// be zero again.
TEST_F(CudaDs4HcFused, SublayerChainMatchesUnfusedBitwise) {
    for (const geom &g : kGeoms) {
        SCOPED_TRACE(name(g));
        const int n = g.n_hc, n_mix = (2 + n) * n;
        const int64_t D = g.D, S = n * D;
        const cd::hc_params p = params(g);
        const hc_dev hc[2] = {make_hc(g, n_mix), make_hc(g, n_mix)};
        const auto x0 = randn(static_cast<size_t>(S), rng_);
        float *xu[2] = {up(x0), poisoned(S)}, *xf[2] = {up(x0), poisoned(S)};
        float *post_u = poisoned(n), *comb_u = poisoned(n * n), *post_f = poisoned(n), *comb_f = poisoned(n * n);
        float *mix_u = poisoned(n_mix + 1), *mix_f = poisoned(n_mix + 1), *xn_u = poisoned(D), *xn_f = poisoned(D);
        float *y = dev<float>(D);
        uint32_t *sync = dev<uint32_t>(1);
        int cu = 0, cf = 0;
        for (int step = 0; step < 5; ++step) {
            SCOPED_TRACE("step " + std::to_string(step));
            const hc_dev &h = hc[step % 2];
            const bool with_post = step > 0;
            if (with_post) put(y, randn(static_cast<size_t>(D), rng_));
            // unfused: post, pre, norm
            if (with_post) {
                cd::launch_hc_post(n, D, y, xu[cu], post_u, comb_u, xu[1 - cu], s_);
                cu = 1 - cu;
            }
            cd::launch_hc_pre(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xu[cu], mix_u, xn_u, post_u, comb_u, s_);
            cuda::launch_rms_norm(xn_u, D, h.norm, p.rms_eps, D, 1, xn_u, D, s_);
            // fused, every output poisoned first
            poison(xn_f, D);
            poison(mix_f, n_mix + 1);
            if (with_post) poison(xf[1 - cf], S);
            cd::hc_fused_io io;
            io.y = with_post ? y : nullptr;
            io.x = xf[cf];
            io.x_new = with_post ? xf[1 - cf] : nullptr;
            io.post = post_f, io.comb = comb_f, io.mix = mix_f, io.sync = sync, io.norm = h.norm, io.out = xn_f;
            cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
            if (with_post) cf = 1 - cf;
            ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
            ASSERT_EQ(cu, cf);
            expect_same(xf[cf], xu[cu], S, "state");
            expect_same(xn_f, xn_u, D, "normalised u");
            expect_same(post_f, post_u, n, "post");
            expect_same(comb_f, comb_u, n * n, "comb");
            expect_same(mix_f, mix_u, n_mix + 1, "mix");
            expect_counter_zero(sync);
            if (HasFailure()) return;
        }
    }
}

// The head (n_hc mixer rows, no Sinkhorn), with and without the last sublayer's HCPost folded in;
// post and comb are only read.
TEST_F(CudaDs4HcFused, HeadMatchesUnfusedBitwise) {
    for (const geom &g : kGeoms) {
        SCOPED_TRACE(name(g));
        const int n = g.n_hc;
        const int64_t D = g.D, S = n * D;
        const cd::hc_params p = params(g);
        const hc_dev h = make_hc(g, n);
        const auto x0 = randn(static_cast<size_t>(S), rng_);
        std::vector<float> post(static_cast<size_t>(n)), comb(static_cast<size_t>(n * n));
        std::uniform_real_distribution<float> ud(0.0f, 1.0f);
        for (auto &v : post) v = 2.0f * ud(rng_);
        for (auto &v : comb) v = ud(rng_) / static_cast<float>(n);
        float *x = up(x0), *post_d = up(post), *comb_d = up(comb), *y = up(randn(static_cast<size_t>(D), rng_));
        float *xn_u = poisoned(S), *mix_u = poisoned(n + 1), *z_u = poisoned(D);
        float *xn_f = poisoned(S), *mix_f = poisoned(n + 1), *z_f = poisoned(D);
        uint32_t *sync = dev<uint32_t>(1);
        for (const bool with_post : {false, true, true}) {
            SCOPED_TRACE(with_post ? "with post" : "no post");
            const float *xin_u = x;
            if (with_post) {
                cd::launch_hc_post(n, D, y, x, post_d, comb_d, xn_u, s_);
                xin_u = xn_u;
            }
            cd::launch_hc_head(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xin_u, mix_u, z_u, s_);
            cuda::launch_rms_norm(z_u, D, h.norm, p.rms_eps, D, 1, z_u, D, s_);
            poison(z_f, D);
            poison(mix_f, n + 1);
            poison(xn_f, S);
            cd::hc_fused_io io;
            io.y = with_post ? y : nullptr;
            io.x = x;
            io.x_new = with_post ? xn_f : nullptr;
            io.post = post_d, io.comb = comb_d, io.mix = mix_f, io.sync = sync, io.norm = h.norm, io.out = z_f;
            cd::launch_hc_head_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
            ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
            expect_same(z_f, z_u, D, "normalised z");
            expect_same(mix_f, mix_u, n + 1, "mix");
            if (with_post) expect_same(xn_f, xn_u, S, "state");
            const auto pd = down(post_d, n), cdd = down(comb_d, n * n);
            expect_bits(pd.data(), post.data(), n, "post (read only)");
            expect_bits(cdd.data(), comb.data(), n * n, "comb (read only)");
            expect_counter_zero(sync);
            if (HasFailure()) return;
        }
    }
}

// A captured graph (first HCPre, a sublayer with HCPost, the head with HCPost: the programmatic
// launches and the shared counter inside one graph) replayed several times gives the eager bits.
TEST_F(CudaDs4HcFused, GraphReplayMatchesEager) {
    const geom g{4, 4096, dtype::f16, 0, true};
    const int n = g.n_hc, n_mix = (2 + n) * n;
    const int64_t D = g.D, S = n * D;
    const cd::hc_params p = params(g);
    const hc_dev a = make_hc(g, n_mix), b = make_hc(g, n_mix), head = make_hc(g, n);
    float *xa = up(randn(static_cast<size_t>(S), rng_)), *xb = poisoned(S), *xc = poisoned(S);
    float *y1 = up(randn(static_cast<size_t>(D), rng_)), *y2 = up(randn(static_cast<size_t>(D), rng_));
    float *post = poisoned(n), *comb = poisoned(n * n), *mix = poisoned(n_mix + 1);
    float *o1 = poisoned(D), *o2 = poisoned(D), *z = poisoned(D);
    uint32_t *sync = dev<uint32_t>(1);
    auto enqueue = [&] {
        cd::hc_fused_io io;
        io.x = xa, io.post = post, io.comb = comb, io.mix = mix, io.sync = sync, io.norm = a.norm, io.out = o1;
        cd::launch_hc_pre_fused(p, g.ft, a.fn, a.row_bytes, a.base, a.scale, io, s_);
        io.y = y1, io.x_new = xb, io.norm = b.norm, io.out = o2;
        cd::launch_hc_pre_fused(p, g.ft, b.fn, b.row_bytes, b.base, b.scale, io, s_);
        io.y = y2, io.x = xb, io.x_new = xc, io.norm = head.norm, io.out = z;
        cd::launch_hc_head_fused(p, g.ft, head.fn, head.row_bytes, head.base, head.scale, io, s_);
    };
    enqueue();
    float *outs[] = {o1, o2, z, xb, xc, post, comb};
    const size_t sizes[] = {static_cast<size_t>(D), static_cast<size_t>(D), static_cast<size_t>(D),
                            static_cast<size_t>(S), static_cast<size_t>(S), static_cast<size_t>(n),
                            static_cast<size_t>(n * n)};
    std::vector<std::vector<float>> eager;
    for (int i = 0; i < 7; ++i) eager.push_back(down(outs[i], sizes[i]));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
        SCOPED_TRACE("replay " + std::to_string(rep));
        for (int i = 0; i < 7; ++i) poison(outs[i], sizes[i]);
        CK(cudaGraphLaunch(exec, s_));
        ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        const char *what[] = {"o1", "o2", "z", "xb", "xc", "post", "comb"};
        for (int i = 0; i < 7; ++i) {
            const auto got = down(outs[i], sizes[i]);
            expect_bits(got.data(), eager[static_cast<size_t>(i)].data(), sizes[i], what[i]);
        }
        expect_counter_zero(sync);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

// Beyond one block's shared memory (n_hc 5 x D 12000 floats = 240 KB) the launcher falls back to the
// unfused kernels: the same bits, the counter untouched.
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
    cd::launch_hc_post(n, D, y, x, pu, cu, xn_u, s_);
    cd::launch_hc_pre(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, xn_u, mix_u, o_u, pu, cu, s_);
    cuda::launch_rms_norm(o_u, D, h.norm, p.rms_eps, D, 1, o_u, D, s_);
    cd::hc_fused_io io;
    io.y = y, io.x = x, io.x_new = xn_f, io.post = pf, io.comb = cf, io.mix = mix_f, io.sync = sync;
    io.norm = h.norm, io.out = o_f;
    cd::launch_hc_pre_fused(p, g.ft, h.fn, h.row_bytes, h.base, h.scale, io, s_);
    ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
    expect_same(o_f, o_u, D, "normalised u");
    expect_same(xn_f, xn_u, S, "state");
    expect_same(pf, pu, n, "post");
    expect_same(cf, cu, n * n, "comb");
    expect_counter_zero(sync);
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
}

// ---- benchmark (FATHOM_DS4_BENCH=1) -----------------------------------------------------------------

// One DS4-Flash token's 86 HC sublayers (43 layers x attention / FFN; n_hc 4, D 4096, f32 and f16
// mixers, 86 distinct weight sets so they stream from HBM) captured into a graph: unfused
// (post + pre (mixer, apply) + rms_norm: 4 launches, 3 for the first) vs fused (1 launch). HC only:
// in the real step other kernels sit between them (PDL then also overlaps the fused kernel's weight
// prefetch with the previous kernel's tail).
TEST_F(CudaDs4HcFused, BenchSublayersFusedVsUnfused) {
    if (!std::getenv("FATHOM_DS4_BENCH")) GTEST_SKIP() << "set FATHOM_DS4_BENCH=1 to run the benchmark";
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
        auto capture = [&](bool fused) {
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            EXPECT_EQ(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            int cur = 0;
            for (int i = 0; i < L; ++i) {
                const hc_dev &h = hs[static_cast<size_t>(i)];
                if (fused) {
                    cd::hc_fused_io io;
                    io.y = i > 0 ? y : nullptr;
                    io.x = x[cur];
                    io.x_new = i > 0 ? x[1 - cur] : nullptr;
                    io.post = post, io.comb = comb, io.mix = mix, io.sync = sync, io.norm = h.norm, io.out = xn;
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
        cudaGraphExec_t eu = capture(false), ef = capture(true);
        put(x[0], x0);
        const float tu = time_graph(eu, s_, reps);
        put(x[0], x0);
        const float tf = time_graph(ef, s_, reps);
        std::printf("  hc %s, %d sublayers per token: unfused %.3f ms (%.1f us/sublayer), fused %.3f ms (%.1f us/sublayer), %.2fx\n",
                    std::string(dtype_name(ft)).c_str(), L, tu, 1e3 * tu / L, tf, 1e3 * tf / L, tu / tf);
        EXPECT_EQ(down(sync, 1)[0], 0u);
        cudaGraphExecDestroy(eu);
        cudaGraphExecDestroy(ef);
    }
}

}  // namespace
}  // namespace fathom
