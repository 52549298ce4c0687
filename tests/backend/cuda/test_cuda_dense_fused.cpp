// The CUDA backend's fused decode ops (backend.h "fused ops": mul_mat_normed, mul_mat_add, glu_mul_mat_add,
// rms_norm_add, qk_rope_store) against references computed here in double from the definitions (dequantised weights
// from the CPU's dequantize_row, RMSNorm, RoPE pairs, f16 rounding of the cache), not from any backend op.
// Outputs are NaN-poisoned first. Tolerances: the fast GEMV's int8 activations (q8_0 weights, one row)
// give ~6e-3 relative error (bound 2e-2), its f32-activation form (f16 / f32 weights) f32 rounding; the elementwise
// parts are f32 arithmetic (1e-5). Skipped when no CUDA device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace fathom {
namespace {

using cuda_test::randn;
using pair_t = cuda_test::tensor_pair;

class CudaDenseFused : public cuda_test::cuda_backend_pair_test {
  protected:
    // A weight [rows x cols] of `type` from random values (reference quantiser), on the device and prepared
    // for the fast GEMV (prepare_weight, as the dense loader does), with its dequantised f32 rows.
    struct weight {
        pair_t t;
        std::vector<float> f;  // dequantised [rows * cols]
    };
    weight make_weight(dtype type, int64_t cols, int64_t rows) {
        const auto v = randn(static_cast<size_t>(cols * rows), rng_, 0.5f);
        const size_t rb = dtype_row_bytes(type, cols);
        std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
        weight w;
        w.f.resize(v.size());
        for (int64_t r = 0; r < rows; ++r) {
            if (type == dtype::f32)
                std::memcpy(q.data() + rb * r, v.data() + r * cols, rb);
            else
                cpu::quantize_row(type, v.data() + r * cols, q.data() + rb * r, cols);
            cpu::dequantize_row(type, q.data() + rb * r, w.f.data() + r * cols, cols);
        }
        w.t = make(type, cols, rows, q.data());
        gpu_->prepare_weight(w.t.d);
        return w;
    }
    // y[r] = sum_k W[r, k] x[k] in double.
    static std::vector<double> matvec(const std::vector<float> &W, int64_t rows, int64_t cols, const double *x) {
        std::vector<double> y(static_cast<size_t>(rows));
        for (int64_t r = 0; r < rows; ++r) {
            double s = 0;
            for (int64_t k = 0; k < cols; ++k) s += static_cast<double>(W[static_cast<size_t>(r * cols + k)]) * x[k];
            y[static_cast<size_t>(r)] = s;
        }
        return y;
    }
    // x / sqrt(mean(x^2) + eps) * w in double.
    static std::vector<double> rmsnorm(const float *x, const float *w, int64_t n, float eps) {
        double ss = 0;
        for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
        const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
        std::vector<double> y(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = x[i] * r * (w ? w[i] : 1.0f);
        return y;
    }

    std::mt19937 rng_{4321};
};

// One row (the decode step): Qwen3-0.6B's QKV shapes (K 1024; N 2048, 1024, 1024) and gate/up (N 3072):
// all q8_0 (the int8 kernel with the norm folded in), q8_0 + f16 (the same kernel, f16 rows with the
// normed f32 x), with an f32 weight (the norm into xn, then the f32-activation GEMV), with a q4_k weight
// (no fast form: the separate ops). x must be left as it was (it is the residual stream). M = 3: the
// separate ops.
TEST_F(CudaDenseFused, MulMatNormedMatchesReference) {
    const int64_t K = 1024;
    const float eps = 1e-6f;
    struct mix {
        const char *name;
        dtype t[3];
        int64_t n[3];
        int n_pairs;
        double tol;
    };
    const mix mixes[] = {
        {"q8_0 qkv", {dtype::q8_0, dtype::q8_0, dtype::q8_0}, {2048, 1024, 1024}, 3, 2e-2},
        {"q8_0 gate/up", {dtype::q8_0, dtype::q8_0, dtype::q8_0}, {3072, 3072, 0}, 2, 2e-2},
        {"q8_0 + f16", {dtype::q8_0, dtype::f16, dtype::q8_0}, {2048, 1024, 1024}, 3, 2e-2},
        {"f32 + f16", {dtype::f32, dtype::f32, dtype::f16}, {2048, 1024, 1024}, 3, 1e-5},
        {"q4_k (no fast form)", {dtype::q8_0, dtype::q4_k, dtype::q8_0}, {2048, 1024, 1024}, 3, 1e-5},
    };
    for (const mix &m : mixes) {
        for (int64_t M : {1, 3}) {
            SCOPED_TRACE(std::string(m.name) + " M=" + std::to_string(M));
            std::vector<weight> ws;
            for (int i = 0; i < m.n_pairs; ++i) ws.push_back(make_weight(m.t[i], K, m.n[i]));
            const auto xv = randn(static_cast<size_t>(K * M), rng_, 2.0f);
            const auto nv = randn(static_cast<size_t>(K), rng_, 0.3f);
            std::vector<float> nw(nv.size());
            for (size_t i = 0; i < nv.size(); ++i) nw[i] = 1.0f + nv[i];
            auto x = make_f32(K, M, xv), norm = make_f32(K, 1, nw), xn = out_f32(K, M);
            std::vector<pair_t> ys;
            for (int i = 0; i < m.n_pairs; ++i) ys.push_back(out_f32(m.n[i], M));
            const tensor *w[3], *y[3];
            for (int i = 0; i < m.n_pairs; ++i) w[i] = &ws[static_cast<size_t>(i)].t.d, y[i] = &ys[static_cast<size_t>(i)].d;
            gpu_->mul_mat_normed(x.d, norm.d, eps, xn.d, m.n_pairs, w, y);
            EXPECT_EQ(down(x.d), xv) << "x changed";
            for (int i = 0; i < m.n_pairs; ++i) {
                const auto got = down(ys[static_cast<size_t>(i)].d);
                std::vector<double> ref;
                for (int64_t r = 0; r < M; ++r) {
                    const auto xn_ref = rmsnorm(xv.data() + r * K, nw.data(), K, eps);
                    const auto yr = matvec(ws[static_cast<size_t>(i)].f, m.n[i], K, xn_ref.data());
                    ref.insert(ref.end(), yr.begin(), yr.end());
                }
                const double tol = M == 1 ? m.tol : 1e-5;
                EXPECT_LE(cuda_test::rel_l2(got, ref), tol) << "pair " << i;
            }
        }
    }
}

// acc += x . W^T: Qwen3-0.6B's output projection (K 2048) and down projection (K 3072) to E 1024, q8_0
// (the int8 GEMV accumulating into acc), f16 (f32 activations), q4_k (the separate ops); M = 1 and 2.
TEST_F(CudaDenseFused, MulMatAddAccumulates) {
    const int64_t N = 1024;
    for (int64_t K : {2048, 3072}) {
        for (dtype t : {dtype::q8_0, dtype::f16, dtype::q4_k}) {
            for (int64_t M : {1, 2}) {
                SCOPED_TRACE(std::string(dtype_name(t)) + " K=" + std::to_string(K) + " M=" + std::to_string(M));
                const weight w = make_weight(t, K, N);
                const auto xv = randn(static_cast<size_t>(K * M), rng_, 1.0f);
                const auto av = randn(static_cast<size_t>(N * M), rng_, 3.0f);
                auto x = make_f32(K, M, xv), acc = make_f32(N, M, av), tmp = out_f32(N, M);
                gpu_->mul_mat_add(x.d, w.t.d, tmp.d, acc.d);
                const auto got = down(acc.d);
                std::vector<float> delta(got.size());
                std::vector<double> ref;
                for (int64_t r = 0; r < M; ++r) {
                    std::vector<double> xd(xv.begin() + r * K, xv.begin() + (r + 1) * K);
                    const auto yr = matvec(w.f, N, K, xd.data());
                    ref.insert(ref.end(), yr.begin(), yr.end());
                }
                for (size_t i = 0; i < got.size(); ++i) delta[i] = got[i] - av[i];
                EXPECT_LE(cuda_test::rel_l2(delta, ref), t == dtype::q8_0 && M == 1 ? 2e-2 : 1e-4);  // acc's rounding included
            }
        }
    }
}

// acc += (act(gate) * up) . W^T (the down projection with the GLU folded in): q8_0 (the int8 GEMV forms
// the activation in its x staging), f16 and q4_k (glu, then the f16 fast GEMV / the separate ops); silu
// and gelu_tanh; Qwen3-0.6B's n_ff 3072 -> E 1024.
TEST_F(CudaDenseFused, GluMulMatAddAccumulates) {
    const int64_t K = 3072, N = 1024;
    for (glu_kind kind : {glu_kind::swiglu, glu_kind::geglu}) {
        for (dtype t : {dtype::q8_0, dtype::f16, dtype::q4_k}) {
            for (int64_t M : {1, 2}) {
                SCOPED_TRACE(std::string(dtype_name(t)) + (kind == glu_kind::swiglu ? " silu" : " gelu") +
                             " M=" + std::to_string(M));
                const weight w = make_weight(t, K, N);
                const auto gv = randn(static_cast<size_t>(K * M), rng_, 2.0f);
                const auto uv = randn(static_cast<size_t>(K * M), rng_, 1.0f);
                const auto av = randn(static_cast<size_t>(N * M), rng_, 3.0f);
                auto gate = make_f32(K, M, gv), up = make_f32(K, M, uv), acc = make_f32(N, M, av), tmp = out_f32(N, M);
                gpu_->glu_mul_mat_add(gate.d, up.d, kind, w.t.d, tmp.d, acc.d);
                const auto got = down(acc.d);
                std::vector<double> ref;
                for (int64_t r = 0; r < M; ++r) {
                    std::vector<double> h(static_cast<size_t>(K));
                    for (int64_t i = 0; i < K; ++i) {
                        const double g = gv[static_cast<size_t>(r * K + i)], u = uv[static_cast<size_t>(r * K + i)];
                        const double a = kind == glu_kind::swiglu
                                             ? g / (1.0 + std::exp(-g))
                                             : 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * g * (1.0 + 0.044715 * g * g)));
                        h[static_cast<size_t>(i)] = a * u;
                    }
                    const auto yr = matvec(w.f, N, K, h.data());
                    ref.insert(ref.end(), yr.begin(), yr.end());
                }
                std::vector<float> delta(got.size());
                for (size_t i = 0; i < got.size(); ++i) delta[i] = got[i] - av[i];
                EXPECT_LE(cuda_test::rel_l2(delta, ref), t == dtype::q8_0 && M == 1 ? 2e-2 : 1e-4);
            }
        }
    }
}

// acc += rms_norm(x) * w over rows (Gemma3's post-norms: E 640).
TEST_F(CudaDenseFused, RmsNormAddMatchesReference) {
    const int64_t n = 640, rows = 3;
    const float eps = 1e-6f;
    const auto xv = randn(static_cast<size_t>(n * rows), rng_, 4.0f);
    const auto wv = randn(static_cast<size_t>(n), rng_, 1.0f);
    const auto av = randn(static_cast<size_t>(n * rows), rng_, 1.0f);
    auto x = make_f32(n, rows, xv), w = make_f32(n, 1, wv), acc = make_f32(n, rows, av);
    gpu_->rms_norm_add(x.d, w.d, eps, acc.d);
    std::vector<double> ref;
    for (int64_t r = 0; r < rows; ++r) {
        const auto y = rmsnorm(xv.data() + r * n, wv.data(), n, eps);
        for (int64_t i = 0; i < n; ++i) ref.push_back(av[static_cast<size_t>(r * n + i)] + y[static_cast<size_t>(i)]);
    }
    EXPECT_LE(cuda_test::rel_l2(down(acc.d), ref), 1e-6);
}

// qk_rope_store against the definition: per-head RMSNorm (optional), RoPE of the first n_rot dims
// (normal pairs or neox halves) by a table made here, q scaled, k / v in the cache rows h * n_ctx + pos
// (f16: rounded to half). Also at device positions (offset 0 + set_step_pos), and positions outside the
// cache (host: throws; device: reported by synchronize, nothing written).
TEST_F(CudaDenseFused, QkRopeStoreMatchesReference) {
    struct shape_case {
        int32_t n_head, n_head_kv, hd, n_rot;
        int64_t n_tok;
        bool neox, norms, f16;
        float q_scale;
    };
    const shape_case cases[] = {
        {16, 8, 128, 128, 1, true, true, true, 1.0f},     // Qwen3-0.6B decode
        {16, 8, 128, 128, 3, true, true, false, 1.0f},
        {4, 1, 256, 256, 1, true, true, true, 0.0625f},   // Gemma3-270M (q scaled)
        {9, 3, 64, 64, 2, false, false, true, 1.0f},      // SmolLM2 (normal pairs, no q/k norm)
        {8, 2, 80, 32, 1, false, true, false, 1.0f},      // partial rotation
    };
    const float eps = 1e-6f;
    const int64_t n_ctx = 16, p0 = 5;
    for (const shape_case &c : cases) {
        for (bool device_pos : {false, true}) {
            SCOPED_TRACE("H " + std::to_string(c.n_head) + " hd " + std::to_string(c.hd) + " n_tok " +
                         std::to_string(c.n_tok) + (device_pos ? " device positions" : ""));
            const int64_t Q = int64_t{c.n_head} * c.hd, KV = int64_t{c.n_head_kv} * c.hd, T = c.n_tok;
            const auto qv = randn(static_cast<size_t>(Q * T), rng_, 1.5f);
            const auto kv = randn(static_cast<size_t>(KV * T), rng_, 1.5f);
            const auto vv = randn(static_cast<size_t>(KV * T), rng_, 1.0f);
            const auto qn = randn(static_cast<size_t>(c.hd), rng_, 1.0f), kn = randn(static_cast<size_t>(c.hd), rng_, 1.0f);
            std::vector<float> table(static_cast<size_t>(T * c.n_rot));
            for (int64_t t = 0; t < T; ++t)
                for (int i = 0; i < c.n_rot / 2; ++i) {
                    const double th = static_cast<double>(p0 + t) * std::pow(10000.0, -2.0 * i / c.n_rot);
                    table[static_cast<size_t>(t * c.n_rot + 2 * i)] = static_cast<float>(std::cos(th));
                    table[static_cast<size_t>(t * c.n_rot + 2 * i + 1)] = static_cast<float>(std::sin(th));
                }
            auto q = make_f32(Q, T, qv), k = make_f32(KV, T, kv), v = make_f32(KV, T, vv);
            auto qnw = make_f32(c.hd, 1, qn), knw = make_f32(c.hd, 1, kn), tab = make_f32(c.n_rot, T, table);
            const dtype ct = c.f16 ? dtype::f16 : dtype::f32;
            const size_t cache_elems = static_cast<size_t>(c.n_head_kv * n_ctx * c.hd);
            std::vector<uint8_t> zero(cache_elems * (c.f16 ? 2 : 4), 0);
            auto kc = make(ct, c.hd, c.n_head_kv * n_ctx, zero.data()), vc = make(ct, c.hd, c.n_head_kv * n_ctx, zero.data());
            qk_rope_store_params p;
            p.head_dim = c.hd;
            p.q_norm = c.norms ? &qnw.d : nullptr;
            p.k_norm = c.norms ? &knw.d : nullptr;
            p.eps = eps;
            p.table = &tab.d;
            p.mode = c.neox ? rope_mode::neox : rope_mode::normal;
            p.q_scale = c.q_scale;
            p.k_cache = &kc.d;
            p.v_cache = &vc.d;
            p.n_head_kv = c.n_head_kv;
            p.n_ctx = n_ctx;
            p.p0 = device_pos ? 0 : p0;
            if (device_pos) {
                gpu_->set_step_pos(p0);
                gpu_->set_device_positions(true);
            }
            gpu_->qk_rope_store(q.d, k.d, v.d, p);
            gpu_->set_device_positions(false);

            // The reference: one head of `row` (hd floats) normed, rotated, scaled.
            const auto head_ref = [&](const float *row, const float *nw, int64_t t, float scale) {
                std::vector<double> h(static_cast<size_t>(c.hd));
                if (c.norms) h = rmsnorm(row, nw, c.hd, eps);
                else for (int d = 0; d < c.hd; ++d) h[static_cast<size_t>(d)] = row[d];
                const int half = c.n_rot / 2;
                for (int i = 0; i < half; ++i) {
                    const int a = c.neox ? i : 2 * i, b = c.neox ? i + half : 2 * i + 1;
                    const double cs = table[static_cast<size_t>(t * c.n_rot + 2 * i)];
                    const double sn = table[static_cast<size_t>(t * c.n_rot + 2 * i + 1)];
                    const double x0 = h[static_cast<size_t>(a)], x1 = h[static_cast<size_t>(b)];
                    h[static_cast<size_t>(a)] = x0 * cs - x1 * sn;
                    h[static_cast<size_t>(b)] = x0 * sn + x1 * cs;
                }
                for (double &e : h) e *= scale;
                return h;
            };
            std::vector<double> q_ref, k_ref;
            for (int64_t t = 0; t < T; ++t) {
                for (int h = 0; h < c.n_head; ++h) {
                    const auto r = head_ref(qv.data() + t * Q + h * c.hd, qn.data(), t, c.q_scale);
                    q_ref.insert(q_ref.end(), r.begin(), r.end());
                }
                for (int h = 0; h < c.n_head_kv; ++h) {
                    const auto r = head_ref(kv.data() + t * KV + h * c.hd, kn.data(), t, 1.0f);
                    k_ref.insert(k_ref.end(), r.begin(), r.end());
                }
            }
            EXPECT_LE(cuda_test::rel_l2(down(q.d), q_ref), 1e-5) << "q";
            EXPECT_LE(cuda_test::rel_l2(down(k.d), k_ref), 1e-5) << "k";
            // Cache rows: position p0 + t of kv head h; f16 rounding of the reference's f32 value.
            std::vector<uint8_t> kcb(zero.size()), vcb(zero.size());
            gpu_->download(kc.d, kcb.data());
            gpu_->download(vc.d, vcb.data());
            const auto cache_at = [&](const std::vector<uint8_t> &b, size_t i) {
                if (!c.f16) return static_cast<double>(reinterpret_cast<const float *>(b.data())[i]);
                return static_cast<double>(cpu::f16_to_f32(reinterpret_cast<const uint16_t *>(b.data())[i]));
            };
            double k_err = 0, v_err = 0;
            size_t nonzero = 0;
            for (int h = 0; h < c.n_head_kv; ++h)
                for (int64_t pos = 0; pos < n_ctx; ++pos)
                    for (int d = 0; d < c.hd; ++d) {
                        const size_t ci = static_cast<size_t>((h * n_ctx + pos) * c.hd + d);
                        const int64_t t = pos - p0;
                        const bool stored = t >= 0 && t < T;
                        const double kr = stored ? k_ref[static_cast<size_t>(t * KV + h * c.hd + d)] : 0.0;
                        const double vr = stored ? vv[static_cast<size_t>(t * KV + h * c.hd + d)] : 0.0;
                        k_err = std::max(k_err, std::fabs(cache_at(kcb, ci) - kr) / (1.0 + std::fabs(kr)));
                        v_err = std::max(v_err, std::fabs(cache_at(vcb, ci) - vr) / (1.0 + std::fabs(vr)));
                        nonzero += cache_at(kcb, ci) != 0.0;
                    }
            const double tol = c.f16 ? 1e-3 : 1e-5;  // half rounding: 2^-11 relative
            EXPECT_LE(k_err, tol) << "k cache";
            EXPECT_LE(v_err, tol) << "v cache";
            EXPECT_GT(nonzero, static_cast<size_t>(T * c.n_head_kv * c.hd) / 2) << "k not stored";
        }
    }
}

TEST_F(CudaDenseFused, QkRopeStoreChecksPositions) {
    const int32_t hd = 64, H = 2, Hkv = 1;
    const int64_t n_ctx = 8;
    auto q = make_f32(H * hd, 1, randn(H * hd, rng_)), k = make_f32(Hkv * hd, 1, randn(Hkv * hd, rng_)),
         v = make_f32(Hkv * hd, 1, randn(Hkv * hd, rng_)), tab = make_f32(hd, 1, randn(hd, rng_));
    std::vector<uint8_t> zero(static_cast<size_t>(Hkv * n_ctx * hd) * 2, 0);
    auto kc = make(dtype::f16, hd, Hkv * n_ctx, zero.data()), vc = make(dtype::f16, hd, Hkv * n_ctx, zero.data());
    qk_rope_store_params p;
    p.head_dim = hd;
    p.table = &tab.d;
    p.k_cache = &kc.d;
    p.v_cache = &vc.d;
    p.n_head_kv = Hkv;
    p.n_ctx = n_ctx;
    p.p0 = n_ctx;  // one past the end
    EXPECT_THROW(gpu_->qk_rope_store(q.d, k.d, v.d, p), error);
    p.p0 = 0;
    gpu_->set_step_pos(n_ctx);
    gpu_->set_device_positions(true);
    gpu_->qk_rope_store(q.d, k.d, v.d, p);
    gpu_->set_device_positions(false);
    EXPECT_THROW(gpu_->synchronize(), error);
    gpu_->synchronize();  // cleared
    std::vector<uint8_t> kcb(zero.size());
    gpu_->download(kc.d, kcb.data());
    EXPECT_EQ(kcb, zero) << "an out-of-cache position was written";
}

}  // namespace
}  // namespace fathom
