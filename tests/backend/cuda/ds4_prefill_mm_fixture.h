// Shared by tests/backend/cuda/test_cuda_ds4_prefill_mm.cpp and bench/cuda/bench_ds4_prefill_mm.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "cuda_test_util.h"
#include "models/cuda/ds4_host_util.h"

namespace fathom::cuda_test::ds4_prefill_mm_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

constexpr float kSentinel = 12345.0f;

inline float bf16_round(float x) {
    return cpu::bf16_to_f32(cpu::f32_to_bf16(x));
}

// A weight [rows, cols] of type t in GGUF rows (row_bytes = dtype_row_bytes). exact: values are small
// integers (q8_0: d = 1, |q| <= 8; iq2_xxs: d = 1, scale nibble 1 -> 3, 9.375, 16.125; q2_k: d = dmin
// = 1; mxfp4: e = 127 -> 0 .. 6 in halves; float types: integers -8 .. 8), all exact in bf16.
inline std::vector<uint8_t> make_weight(dtype t, int64_t rows, int64_t cols, std::mt19937 &rng, bool exact, float sd = 0.05f) {
    const size_t rb = dtype_row_bytes(t, cols), n = static_cast<size_t>(rows * cols);
    std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
    std::uniform_int_distribution<int> small(-8, 8);
    auto put16 = [&](size_t off, uint16_t v) { std::memcpy(&q[off], &v, 2); };
    if (t == dtype::f32 || t == dtype::f16 || t == dtype::bf16) {
        std::vector<float> f = randn(n, rng, sd);
        if (exact)
            for (auto &v : f) v = static_cast<float>(small(rng));
        for (size_t i = 0; i < n; ++i) {
            if (t == dtype::f32) std::memcpy(&q[4 * i], &f[i], 4);
            else put16(2 * i, t == dtype::f16 ? cpu::f32_to_f16(f[i]) : cpu::f32_to_bf16(f[i]));
        }
        return q;
    }
    const bool kquant = t == dtype::q3_k || t == dtype::q4_k || t == dtype::q5_k || t == dtype::q6_k;
    if (exact && kquant) throw error("test: make_weight has no exact form for the K-quants");
    if (!exact && (t == dtype::q8_0 || t == dtype::q2_k || t == dtype::mxfp4 || kquant)) {
        const auto f = randn(n, rng, sd);
        for (int64_t r = 0; r < rows; ++r) cpu::quantize_row(t, f.data() + r * cols, q.data() + rb * r, cols);
        return q;
    }
    for (auto &b : q) b = static_cast<uint8_t>(rng() >> 24);
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    const uint16_t one = cpu::f32_to_f16(1.0f);
    if (t == dtype::q8_0) {  // exact: d = 1, q in -8 .. 8
        for (size_t off = 0; off < q.size(); off += 34) {
            put16(off, one);
            for (int j = 0; j < 32; ++j) q[off + 2 + j] = static_cast<uint8_t>(static_cast<int8_t>(small(rng)));
        }
    } else if (t == dtype::iq2_xxs) {  // random codes; d random (~sd) or 1 with scale nibble 1
        for (size_t off = 0; off < q.size(); off += 66) {
            put16(off, exact ? one : cpu::f32_to_f16(sd / 50.0f * ud(rng)));
            if (exact)
                for (int g = 0; g < 8; ++g) q[off + 2 + 8 * g + 7] = static_cast<uint8_t>((q[off + 2 + 8 * g + 7] & 0x0F) | 0x10);
        }
    } else if (t == dtype::q2_k) {  // exact: d = dmin = 1 (values sc * q - m, integers)
        for (size_t off = 0; off < q.size(); off += 84) {
            put16(off + 80, one);
            put16(off + 82, one);
        }
    } else if (t == dtype::mxfp4) {  // exact: e = 127 (x = e2m1 value)
        for (size_t off = 0; off < q.size(); off += 17) q[off] = 127;
    }
    return q;
}
// A weight on the device for the runner: GGUF rows, or (repack) q8_0 prepared by gemv_prepare.
struct dev_weight {
    cd::gemv_weight fast;
    cd::gemm_weight w;
};

// A MoE layer on the host (CPU reference view) and on the device (moe_layer).
struct moe_case {
    dtype gu, dn, sh, router;
    bool hash, shared;
    int64_t D, F;
    int E, k;
};
struct moe_model {
    ds4::hparams hp;
    ds4::layer_weights l;
    std::vector<uint8_t> gate, up, down, gsh, ush, dsh, router;
    std::vector<float> bias;
    std::vector<int32_t> tid2eid;
    cd::moe_layer d;
};

using cuda_test::host_bank;
using cuda_test::host_matrix;

class CudaDs4PrefillMm : public cuda_test::cuda_fixture {
  protected:
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        err_ = dev<uint32_t>(1);
    }
    uint32_t take_err() {
        const uint32_t e = down(err_, 1)[0];
        cudaMemset(err_, 0, 4);
        return e;
    }
    // w must outlive the returned weight's use (fast points into it).
    void upload(dev_weight &d, dtype t, const std::vector<uint8_t> &q, int64_t rows, int64_t cols, bool repack) {
        const size_t rb = dtype_row_bytes(t, cols);
        void *src = up(q);
        d.w = {};
        d.w.type = t;
        d.w.rows = rows;
        d.w.cols = cols;
        if (!repack) {
            d.w.p = src;
            d.w.row_bytes = rb;
            return;
        }
        void *dst = raw(cd::gemv_prepared_bytes(t, rows, cols));
        d.fast = cd::gemv_prepare(t, src, rb, rows, cols, dst, s_);
        ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        d.w.fast = &d.fast;
    }
    std::vector<float> filled(size_t n, float v) { return std::vector<float>(n, v); }
    void build(moe_model &m, const moe_case &c) {
        const int64_t D = c.D, F = c.F;
        const int E = c.E, k = c.k;
        auto &hp = m.hp;
        hp.n_embd = static_cast<int>(D);
        hp.n_ff_exp = static_cast<int>(F);
        hp.n_expert = E;
        hp.n_expert_used = k;
        hp.n_expert_shared = c.shared ? 1 : 0;
        hp.expert_weights_scale = 1.5f;
        hp.n_vocab = 97;
        const float sd_in = 1.0f / std::sqrt(static_cast<float>(D)), sd_f = 1.0f / std::sqrt(static_cast<float>(F));
        m.gate = make_weight(c.gu, F * E, D, rng_, false, sd_in);
        m.up = make_weight(c.gu, F * E, D, rng_, false, sd_in);
        m.down = make_weight(c.dn, D * E, F, rng_, false, sd_f);
        m.gsh = make_weight(c.sh, F, D, rng_, false, sd_in);
        m.ush = make_weight(c.sh, F, D, rng_, false, sd_in);
        m.dsh = make_weight(c.sh, D, F, rng_, false, sd_f);
        m.router = make_weight(c.router, E, D, rng_, false, 2.0f * sd_in);
        m.bias = randn(static_cast<size_t>(E), rng_, 0.3f);
        m.tid2eid.resize(static_cast<size_t>(hp.n_vocab * k));
        for (int t = 0; t < hp.n_vocab; ++t) {  // k distinct experts per token
            std::vector<int32_t> p(static_cast<size_t>(E));
            std::iota(p.begin(), p.end(), 0);
            std::shuffle(p.begin(), p.end(), rng_);
            std::copy(p.begin(), p.begin() + k, m.tid2eid.begin() + t * k);
        }
        auto &l = m.l;
        l.hash = c.hash;
        l.clamp = 1.0f;  // small clamps: both SwiGLU clamps are exercised
        l.clamp_sh = 1.25f;
        l.gate_inp = host_matrix(c.router, m.router, E, D);
        if (!c.hash) l.exp_bias = m.bias;
        l.tid2eid = m.tid2eid;
        l.gate_exps = host_bank(c.gu, m.gate, F, D, E);
        l.up_exps = host_bank(c.gu, m.up, F, D, E);
        l.down_exps = host_bank(c.dn, m.down, D, F, E);
        l.gate_sh = host_matrix(c.sh, m.gsh, F, D);
        l.up_sh = host_matrix(c.sh, m.ush, F, D);
        l.down_sh = host_matrix(c.sh, m.dsh, D, F);
        auto &d = m.d;
        d.gate_inp_type = c.router;
        d.gate_inp = up(m.router);
        d.gate_inp_row_bytes = dtype_row_bytes(c.router, D);
        d.exp_bias = c.hash ? nullptr : up(m.bias);
        d.tid2eid = up(m.tid2eid);
        d.n_vocab = hp.n_vocab;
        d.n_expert = E;
        d.n_used = k;
        d.weights_scale = hp.expert_weights_scale;
        d.clamp = l.clamp;
        d.clamp_sh = l.clamp_sh;
        d.gate = dev_bank(c.gu, m.gate, F, D, E);
        d.up = dev_bank(c.gu, m.up, F, D, E);
        d.down = dev_bank(c.dn, m.down, D, F, E);
        if (c.shared) {
            d.gate_sh = dev_bank(c.sh, m.gsh, F, D, 1);
            d.up_sh = dev_bank(c.sh, m.ush, F, D, 1);
            d.down_sh = dev_bank(c.sh, m.dsh, D, F, 1);
        }
    }
    // y [n_tok, D] by the decode chain, token by token.
    std::vector<float> decode_chain(const moe_model &m, const float *xd, const int32_t *tok_d, int64_t n_tok) {
        const int64_t D = m.hp.n_embd, F = m.hp.n_ff_exp;
        const int E = m.hp.n_expert, k = m.hp.n_expert_used;
        const cd::moe_scratch sc = dev_moe_scratch(E, k, F);
        float *y = poisoned(static_cast<size_t>(n_tok * D));
        for (int64_t t = 0; t < n_tok; ++t) cd::launch_moe_ffn(m.d, xd + t * D, tok_d + t, sc, y + t * D, err_, s_);
        return down(y, static_cast<size_t>(n_tok * D));
    }

    uint32_t *err_ = nullptr;
    std::mt19937 rng_{20261201};
};

}  // namespace fathom::cuda_test::ds4_prefill_mm_suite
