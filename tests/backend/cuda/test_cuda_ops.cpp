// CUDA backend vs the CPU reference backend, op by op, on fresh random inputs. Every CUDA output
// buffer is NaN-poisoned before the op so an element the kernel forgot to write fails the check
// (rel_l2 is NaN then, and NaN <= tol is false). The reference is the CPU backend in exact mode
// (its default mode mirrors llama.cpp's f16 roundings in attention, gelu and rope); the default
// mode is used only to bound the decode GEMV error by the CPU quantised path's own error.
// Skipped when no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace fathom {
namespace {

using cuda_test::randn;
using cuda_test::rel_l2;
using pair_t = cuda_test::tensor_pair;

// The exact-mode pair fixture plus the CPU backend's default mode (cpu_) and an RNG.
class CudaOps : public cuda_test::cuda_backend_pair_test {
protected:
    void SetUp() override {
        cuda_backend_pair_test::SetUp();
        if (IsSkipped()) return;
        cpu_ = make_cpu_backend({.n_threads = 2});
    }
    // Quantise random weights [rows x cols] to `type` with the reference quantiser.
    std::vector<uint8_t> quant(dtype type, int64_t cols, int64_t rows, std::mt19937 &rng) {
        const auto f = randn(static_cast<size_t>(cols * rows), rng, 0.5f);
        const size_t rb = dtype_row_bytes(type, cols);
        std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
        for (int64_t r = 0; r < rows; ++r) cpu::quantize_row(type, f.data() + r * cols, q.data() + rb * r, cols);
        return q;
    }

    std::unique_ptr<backend> cpu_;
    std::mt19937 rng_{1234};
};

// q3_k rows of K = 768 are 330 bytes: every other row starts 2 bytes off a 4-byte boundary.
const dtype kWeightTypes[] = {dtype::f32,  dtype::f16,  dtype::bf16, dtype::q4_0, dtype::q4_1,
                              dtype::q5_0, dtype::q5_1, dtype::q8_0, dtype::q2_k, dtype::q3_k,
                              dtype::q4_k, dtype::q5_k, dtype::q6_k};

TEST_F(CudaOps, GetRowsEveryType) {
    for (dtype t : kWeightTypes) {
        SCOPED_TRACE(std::string(dtype_name(t)));
        const int64_t K = 512, V = 50;
        const auto q = quant(t, K, V, rng_);
        auto tab = make(t, K, V, q.data());
        const int32_t ids[] = {0, 49, 7, 7, 23};
        auto o = out_f32(K, 5);
        exact_->get_rows(tab.h, ids, 5, o.h);
        gpu_->get_rows(tab.d, ids, 5, o.d);
        EXPECT_LE(rel_l2(down(o.d), hostv(o)), 1e-6);
    }
}

TEST_F(CudaOps, GetRowsRejectsBadIds) {
    const auto q = quant(dtype::q8_0, 64, 4, rng_);
    auto tab = make(dtype::q8_0, 64, 4, q.data());
    auto o = out_f32(64, 1);
    const int32_t bad = 4;
    EXPECT_THROW(gpu_->get_rows(tab.d, &bad, 1, o.d), error);
    // Device ids are checked on the device and reported by synchronize().
    auto id = make(dtype::i32, 1, 1, &bad);
    gpu_->get_rows_device(tab.d, static_cast<const int32_t *>(id.d.data), 1, o.d);
    EXPECT_THROW(gpu_->synchronize(), error);
    gpu_->synchronize();  // the error word was cleared
}

// Decode (M <= 8: GEMV on the raw blocks) and prefill (M > 8: bf16 cuBLAS) against the exact CPU
// path (dequantised f32 weights, f32 dots). Decode must be as exact as f32 arithmetic allows and no
// worse than the CPU's own quantised-activation path; prefill is a bf16 path (<= 1e-2).
TEST_F(CudaOps, MulMatEveryTypeDecodeAndPrefill) {
    const int64_t K = 768, N = 97;
    for (dtype t : kWeightTypes) {
        const auto q = quant(t, K, N, rng_);
        auto W = make(t, K, N, q.data());
        for (int64_t M : {1, 3, 8, 37}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(M));
            auto x = make_f32(K, M, randn(static_cast<size_t>(K * M), rng_));
            auto ye = out_f32(N, M), yq = out_f32(N, M), yg = out_f32(N, M);
            const tensor *wh[] = {&W.h}, *wd[] = {&W.d};
            const tensor *oe[] = {&ye.h}, *oq[] = {&yq.h}, *og[] = {&yg.d};
            exact_->mul_mat(x.h, 1, wh, oe);
            cpu_->mul_mat(x.h, 1, wh, oq);
            gpu_->mul_mat(x.d, 1, wd, og);
            const auto exact = hostv(ye);
            const double cpu_err = rel_l2(hostv(yq), exact), gpu_err = rel_l2(down(yg.d), exact);
            if (M <= 8) {
                EXPECT_LE(gpu_err, 1e-5);
                EXPECT_LE(gpu_err, std::max(cpu_err, 1e-6));
            } else {
                EXPECT_LE(gpu_err, t == dtype::f32 ? 1e-5 : 1e-2);
            }
        }
    }
}

// K = 800 is 25 blocks of 32: rows of the 2-byte aligned formats (q8_0: 850 bytes) alternate
// between 4-byte aligned and misaligned starts, which the funnel-shift loads must handle.
TEST_F(CudaOps, MulMatOddBlockCountRows) {
    const int64_t K = 800, N = 61;
    for (dtype t : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q4_1, dtype::f16, dtype::bf16}) {
        const auto q = quant(t, K, N, rng_);
        auto W = make(t, K, N, q.data());
        for (int64_t M : {1, 2, 37}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(M));
            auto x = make_f32(K, M, randn(static_cast<size_t>(K * M), rng_));
            auto ye = out_f32(N, M), yg = out_f32(N, M);
            const tensor *wh[] = {&W.h}, *wd[] = {&W.d}, *oe[] = {&ye.h}, *og[] = {&yg.d};
            exact_->mul_mat(x.h, 1, wh, oe);
            gpu_->mul_mat(x.d, 1, wd, og);
            EXPECT_LE(rel_l2(down(yg.d), hostv(ye)), M <= 8 ? 1e-5 : 1e-2);
        }
        const int32_t ids[] = {N - 1, 0, 30};  // last row: its last block ends misaligned
        auto o = out_f32(K, 3), oc = out_f32(K, 3);
        exact_->get_rows(W.h, ids, 3, oc.h);
        gpu_->get_rows(W.d, ids, 3, o.d);
        EXPECT_LE(rel_l2(down(o.d), hostv(oc)), 1e-6);
    }
}

TEST_F(CudaOps, MulMatPairsShareActivations) {
    const int64_t K = 512;
    const dtype types[] = {dtype::q4_k, dtype::q8_0, dtype::q6_k};
    const int64_t ns[] = {64, 33, 128};
    std::vector<pair_t> ws;
    for (int i = 0; i < 3; ++i) {
        const auto q = quant(types[i], K, ns[i], rng_);
        ws.push_back(make(types[i], K, ns[i], q.data()));
    }
    for (int64_t M : {5, 20}) {
        auto x = make_f32(K, M, randn(static_cast<size_t>(K * M), rng_));
        std::vector<pair_t> oe, og;
        for (int i = 0; i < 3; ++i) {
            oe.push_back(out_f32(ns[i], M));
            og.push_back(out_f32(ns[i], M));
        }
        const tensor *wh[] = {&ws[0].h, &ws[1].h, &ws[2].h}, *wd[] = {&ws[0].d, &ws[1].d, &ws[2].d};
        const tensor *ph[] = {&oe[0].h, &oe[1].h, &oe[2].h}, *pd[] = {&og[0].d, &og[1].d, &og[2].d};
        exact_->mul_mat(x.h, 3, wh, ph);
        gpu_->mul_mat(x.d, 3, wd, pd);
        for (int i = 0; i < 3; ++i) EXPECT_LE(rel_l2(down(og[i].d), hostv(oe[i])), M <= 8 ? 1e-5 : 1e-2);
    }
}

TEST_F(CudaOps, RmsNorm) {
    for (int64_t n : {576, 1000}) {
        auto x = make_f32(n, 5, randn(static_cast<size_t>(n * 5), rng_, 3.0f));
        auto w = make_f32(n, 1, randn(static_cast<size_t>(n), rng_));
        for (bool with_w : {true, false}) {
            auto o = out_f32(n, 5);
            exact_->rms_norm(x.h, with_w ? &w.h : nullptr, 1e-6f, o.h);
            gpu_->rms_norm(x.d, with_w ? &w.d : nullptr, 1e-6f, o.d);
            EXPECT_LE(rel_l2(down(o.d), hostv(o)), 1e-6);
        }
    }
}

TEST_F(CudaOps, RopeTableAndRotation) {
    std::vector<float> ff(32);
    for (int i = 0; i < 32; ++i) ff[static_cast<size_t>(i)] = 1.0f + 0.25f * static_cast<float>(i % 5);
    rope_params plain;
    plain.n_rot = 64;
    plain.freq_base = 10000.0f;
    rope_params yarn = plain;
    yarn.freq_base = 1000000.0f;
    yarn.freq_scale = 0.25f;
    yarn.ext_factor = 1.0f;
    yarn.attn_factor = 1.1f;
    yarn.n_ctx_orig = 4096;
    rope_params factors = plain;
    factors.freq_factors = ff.data();
    int idx = 0;
    for (const rope_params &p : {plain, yarn, factors}) {
        SCOPED_TRACE("params " + std::to_string(idx++));
        auto tab = out_f32(64, 7);
        exact_->rope_table(1000, 7, p, tab.h);
        gpu_->rope_table(1000, 7, p, tab.d);
        EXPECT_LE(rel_l2(down(tab.d), hostv(tab)), 1e-6);
        for (rope_mode mode : {rope_mode::normal, rope_mode::neox}) {
            const int32_t hd = 96;  // n_rot 64 < head_dim: the last 32 dims pass through
            const auto xv = randn(static_cast<size_t>(7 * 4 * hd), rng_);
            auto x = make_f32(4 * hd, 7, xv);
            exact_->rope(x.h, hd, tab.h, mode);
            gpu_->rope(x.d, hd, tab.d, mode);
            EXPECT_LE(rel_l2(down(x.d), hostv(x)), 1e-6);
        }
    }
}

// kv_store fills both caches (positions [0, n_past + n_tok)), then attention over them.
TEST_F(CudaOps, KvStoreAndAttention) {
    struct cfg {
        int32_t n_head, n_head_kv, hd;
        int64_t n_ctx, n_past, n_tok;
        float softcap;
        int32_t window;
    };
    const cfg cases[] = {
        {9, 3, 64, 300, 100, 1, 0.0f, 0},      // SmolLM2-like decode (GQA 3)
        {8, 2, 64, 300, 100, 5, 0.0f, 0},      // small batch
        {8, 2, 64, 300, 0, 40, 0.0f, 0},       // prefill (one split)
        {4, 1, 256, 2048, 1500, 2, 50.0f, 0},  // Gemma-like head_dim 256 with softcap
        {4, 1, 256, 2048, 1500, 3, 0.0f, 512}, // sliding window
        {6, 6, 80, 200, 10, 1, 0.0f, 4},       // head_dim not a multiple of 32, tiny window
    };
    for (const cfg &c : cases) {
        for (dtype ct : {dtype::f32, dtype::f16}) {
            SCOPED_TRACE("hd=" + std::to_string(c.hd) + " n_tok=" + std::to_string(c.n_tok) + " cache=" +
                         std::string(dtype_name(ct)));
            const int64_t span = c.n_past + c.n_tok, kvw = static_cast<int64_t>(c.n_head_kv) * c.hd;
            std::vector<uint8_t> zb(dtype_row_bytes(ct, c.hd) * static_cast<size_t>(c.n_head_kv * c.n_ctx), 0);
            auto kc = make(ct, c.hd, c.n_head_kv * c.n_ctx, zb.data());
            auto vc = make(ct, c.hd, c.n_head_kv * c.n_ctx, zb.data());
            auto ks = make_f32(kvw, span, randn(static_cast<size_t>(kvw * span), rng_));
            auto vs = make_f32(kvw, span, randn(static_cast<size_t>(kvw * span), rng_));
            // Store in two pieces to exercise p0 > 0.
            const int64_t cut = span / 2;
            for (auto [r0, n] : {std::pair<int64_t, int64_t>{0, cut}, {cut, span - cut}}) {
                exact_->kv_store(view_rows(ks.h, r0, n), kc.h, c.n_head_kv, c.n_ctx, r0);
                exact_->kv_store(view_rows(vs.h, r0, n), vc.h, c.n_head_kv, c.n_ctx, r0);
                gpu_->kv_store(view_rows(ks.d, r0, n), kc.d, c.n_head_kv, c.n_ctx, r0);
                gpu_->kv_store(view_rows(vs.d, r0, n), vc.d, c.n_head_kv, c.n_ctx, r0);
            }
            std::vector<uint8_t> kdev(kc.host.size());
            gpu_->download(kc.d, kdev.data());
            EXPECT_EQ(std::memcmp(kdev.data(), kc.host.data(), kdev.size()), 0);
            const attn_params p = cuda_test::attn_params_of(c);
            const int64_t qw = static_cast<int64_t>(c.n_head) * c.hd;
            auto q = make_f32(qw, c.n_tok, randn(static_cast<size_t>(qw * c.n_tok), rng_, 2.0f));
            auto o = out_f32(qw, c.n_tok);
            exact_->attention(q.h, kc.h, vc.h, p, o.h);
            gpu_->attention(q.d, kc.d, vc.d, p, o.d);
            EXPECT_LE(rel_l2(down(o.d), hostv(o)), 1e-5);
        }
    }
}

TEST_F(CudaOps, KvStoreOutOfCacheIsCaught) {
    auto kc = out_f32(64, 2 * 16);
    auto src = make_f32(128, 1, randn(128, rng_));
    EXPECT_THROW(gpu_->kv_store(src.d, kc.d, 2, 16, 16), error);  // host check
    gpu_->set_device_positions(true);
    gpu_->set_step_pos(16);
    gpu_->kv_store(src.d, kc.d, 2, 16, 0);  // device check
    gpu_->set_device_positions(false);
    EXPECT_THROW(gpu_->synchronize(), error);
}

TEST_F(CudaOps, Elementwise) {
    const int64_t n = 1000, rows = 6;
    auto a = make_f32(n, rows, randn(static_cast<size_t>(n * rows), rng_, 3.0f));
    auto b = make_f32(n, rows, randn(static_cast<size_t>(n * rows), rng_, 3.0f));
    auto b1 = make_f32(n, 1, randn(static_cast<size_t>(n), rng_));
    for (glu_kind k : {glu_kind::swiglu, glu_kind::geglu}) {
        auto o = out_f32(n, rows);
        exact_->glu(a.h, b.h, k, o.h);
        gpu_->glu(a.d, b.d, k, o.d);
        EXPECT_LE(rel_l2(down(o.d), hostv(o)), 1e-6);
    }
    for (const pair_t *bb : {&b, &b1}) {
        auto o = out_f32(n, rows);
        exact_->add(a.h, bb->h, o.h);
        gpu_->add(a.d, bb->d, o.d);
        EXPECT_LE(rel_l2(down(o.d), hostv(o)), 1e-7);
    }
    {
        auto x = make_f32(n, rows, hostv(a));
        exact_->scale(x.h, 0.37f);
        gpu_->scale(x.d, 0.37f);
        EXPECT_LE(rel_l2(down(x.d), hostv(x)), 1e-7);
        exact_->softcap(x.h, 2.5f);
        gpu_->softcap(x.d, 2.5f);
        EXPECT_LE(rel_l2(down(x.d), hostv(x)), 1e-6);
        exact_->softmax(x.h);
        gpu_->softmax(x.d);
        EXPECT_LE(rel_l2(down(x.d), hostv(x)), 1e-6);
    }
    {
        auto o = out_f32(n, rows);
        exact_->copy(a.h, o.h);
        gpu_->copy(a.d, o.d);
        EXPECT_EQ(down(o.d), hostv(o));
        std::vector<uint16_t> nan16(static_cast<size_t>(n * rows), 0x7e00);
        auto h = make(dtype::f16, n, rows, nan16.data());
        exact_->copy(a.h, h.h);
        gpu_->copy(a.d, h.d);
        std::vector<uint8_t> got(h.host.size());
        gpu_->download(h.d, got.data());
        EXPECT_EQ(got, h.host);  // bit-exact round-to-nearest-even
    }
}

}  // namespace
}  // namespace fathom
