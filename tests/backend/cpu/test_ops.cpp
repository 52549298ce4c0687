// CPU backend ops against naive float64 references on random inputs, hand-worked RoPE values,
// the thread pool, and thread-count invariance (1, 2 and 3 threads give identical bits).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/thread_pool.h"
#include "core/error.h"

using namespace fathom;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (auto &x : v) x = d(rng);
    return v;
}

double rel_l2(const std::vector<double> &ref, const float *got) {
    double e = 0, r = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        e += (ref[i] - got[i]) * (ref[i] - got[i]);
        r += ref[i] * ref[i];
    }
    return std::sqrt(e / std::max(r, 1e-300));
}

std::unique_ptr<backend> make_cpu(int n_threads, bool exact = false) {
    cpu_options o;
    o.n_threads = n_threads;
    o.exact = exact;
    o.batch_invariant = false;  // the llama.cpp-order tests below
    return make_cpu_backend(o);
}

tensor f32(std::vector<float> &v, int64_t cols, int64_t rows) { return make_tensor(dtype::f32, cols, rows, v.data()); }

}  // namespace

TEST(ThreadPool, EveryShareRunsOnceAndReuses) {
    cpu::thread_pool pool(3);
    for (int iter = 0; iter < 300; ++iter) {
        std::atomic<int> mask{0}, calls{0};
        const int n_max = 1 + iter % 3;
        pool.run([&](int ith, int nth) {
            EXPECT_EQ(nth, n_max);
            mask.fetch_or(1 << ith);
            calls.fetch_add(1);
        }, n_max);
        ASSERT_EQ(calls.load(), n_max);
        ASSERT_EQ(mask.load(), (1 << n_max) - 1);
    }
}

TEST(Ops, RmsNormMatchesF64) {
    auto be = make_cpu(2);
    const int64_t n = 300, rows = 70;
    auto x = randn(n * rows, 1), w = randn(n, 2), y(std::vector<float>(n * rows));
    be->rms_norm(f32(x, n, rows), nullptr, 1e-5f, f32(y, n, rows));
    std::vector<double> ref(n * rows);
    for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
        const double s = 1.0 / std::sqrt(ss / n + 1e-5);
        for (int64_t i = 0; i < n; ++i) ref[r * n + i] = x[r * n + i] * s;
    }
    EXPECT_LT(rel_l2(ref, y.data()), 1e-6);
    tensor wt = f32(w, n, 1);
    be->rms_norm(f32(x, n, rows), &wt, 1e-5f, f32(x, n, rows));  // in place, with weight
    for (int64_t i = 0; i < n * rows; ++i) ref[i] *= w[i % n];
    EXPECT_LT(rel_l2(ref, x.data()), 1e-6);
}

// RoPE at position 1, base 10000, n_rot = 4: theta = (1, 10000^(-1/2)) = (1, 0.01), values
// worked by hand: (x0 cos t - x1 sin t, x0 sin t + x1 cos t) for each rotated pair.
TEST(Ops, RopeHandWorked) {
    auto be = make_cpu(1);
    rope_params p;
    p.n_rot = 4;
    p.freq_base = 10000.0f;
    std::vector<float> table(4), x{1, 2, 3, 4, 7};  // head_dim 5: the last dim passes through
    be->rope_table(1, 1, p, f32(table, 4, 1));
    be->rope(f32(x, 5, 1), 5, f32(table, 4, 1), rope_mode::normal);
    const double normal[] = {-1.1426396637476532, 1.922075596544176, 2.9598506679133294, 4.029799501669161, 7};
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(x[i], normal[i], 1e-6) << i;

    x = {1, 2, 3, 4, 7};  // NeoX pairs (x0, x2) with theta 1 and (x1, x3) with theta 0.01
    be->rope(f32(x, 5, 1), 5, f32(table, 4, 1), rope_mode::neox);
    const double neox[] = {-1.9841106485555495, 1.959900667496664, 2.4623779024123156, 4.019799668334994, 7};
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(x[i], neox[i], 1e-6) << i;

    // Position 3, base 100, linear scaling 1/2: theta = 3 * 0.5 * (1, 0.1).
    p.freq_base = 100.0f;
    p.freq_scale = 0.5f;
    be->rope_table(3, 1, p, f32(table, 4, 1));
    EXPECT_NEAR(table[0], std::cos(1.5), 1e-6);
    EXPECT_NEAR(table[1], std::sin(1.5), 1e-6);
    EXPECT_NEAR(table[2], std::cos(0.15), 1e-6);
    EXPECT_NEAR(table[3], std::sin(0.15), 1e-6);
    // llama3-style frequency factors divide theta.
    const float ff[] = {1.0f, 4.0f};
    p.freq_scale = 1.0f;
    p.freq_factors = ff;
    be->rope_table(3, 1, p, f32(table, 4, 1));
    EXPECT_NEAR(table[0], std::cos(3.0), 1e-6);
    EXPECT_NEAR(table[2], std::cos(0.075), 1e-6);
}

TEST(Ops, RopeMultiHeadMultiToken) {
    auto be = make_cpu(2);
    const int hd = 8, nh = 3, n = 5;
    rope_params p;
    p.n_rot = 6;
    p.freq_base = 500.0f;
    std::vector<float> table(n * 6), x = randn(n * nh * hd, 3), x0 = x;
    be->rope_table(10, n, p, f32(table, 6, n));
    be->rope(f32(x, nh * hd, n), hd, f32(table, 6, n), rope_mode::neox);
    for (int t = 0; t < n; ++t)
        for (int h = 0; h < nh; ++h)
            for (int i = 0; i < 3; ++i) {
                const double th = (10 + t) * std::pow(500.0, -2.0 * i / 6);
                const float *a = &x0[(t * nh + h) * hd];
                EXPECT_NEAR(x[(t * nh + h) * hd + i], a[i] * std::cos(th) - a[i + 3] * std::sin(th), 1e-5);
                EXPECT_NEAR(x[(t * nh + h) * hd + i + 3], a[i] * std::sin(th) + a[i + 3] * std::cos(th), 1e-5);
                EXPECT_EQ(x[(t * nh + h) * hd + 6], a[6]);
            }
}

namespace {

// Naive attention in float64 over f32 caches [n_kv*n_ctx, hd].
std::vector<double> naive_attention(const std::vector<float> &q, const std::vector<float> &k,
                                    const std::vector<float> &v, const attn_params &p, int64_t n_tok) {
    const int hd = p.head_dim;
    std::vector<double> out(n_tok * p.n_head * hd, 0.0);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int h = 0; h < p.n_head; ++h) {
            const int hk = h / (p.n_head / p.n_head_kv);
            const int64_t pos = p.n_past + t;
            std::vector<double> s;
            std::vector<int64_t> js;
            for (int64_t j = 0; j <= pos; ++j) {
                if (p.window > 0 && pos - j >= p.window) continue;
                double d = 0;
                for (int i = 0; i < hd; ++i) d += double(q[(t * p.n_head + h) * hd + i]) * k[(hk * p.n_ctx + j) * hd + i];
                d *= p.scale;
                if (p.softcap > 0) d = p.softcap * std::tanh(d / p.softcap);
                s.push_back(d);
                js.push_back(j);
            }
            double mx = -1e300, sum = 0;
            for (double d : s) mx = std::max(mx, d);
            for (double &d : s) sum += (d = std::exp(d - mx));
            for (size_t a = 0; a < s.size(); ++a)
                for (int i = 0; i < hd; ++i)
                    out[(t * p.n_head + h) * hd + i] += s[a] / sum * v[(hk * p.n_ctx + js[a]) * hd + i];
        }
    return out;
}

}  // namespace

TEST(Ops, AttentionMatchesNaive) {
    struct cfg {
        int n_head, n_head_kv, hd, n_past, n_tok, window;
        float softcap;
        bool f16;
    } cases[] = {
        {4, 4, 16, 0, 7, 0, 0, false},  {6, 2, 32, 5, 4, 0, 0, false}, {6, 3, 8, 9, 1, 0, 0, false},
        {4, 1, 16, 3, 9, 4, 0, false},  {4, 2, 16, 2, 5, 0, 5.0f, false}, {6, 2, 32, 5, 4, 0, 0, true},
    };
    for (const cfg &c : cases) {
        attn_params p;
        p.n_head = c.n_head;
        p.n_head_kv = c.n_head_kv;
        p.head_dim = c.hd;
        p.n_ctx = 32;
        p.n_past = c.n_past;
        p.scale = 1.0f / std::sqrt(float(c.hd));
        p.softcap = c.softcap;
        p.window = c.window;
        const int64_t n_tok = c.n_tok, kv_rows = c.n_head_kv * p.n_ctx;
        auto q = randn(n_tok * c.n_head * c.hd, 10), kf = randn(kv_rows * c.hd, 11), vf = randn(kv_rows * c.hd, 12);
        std::vector<float> out(q.size());
        std::vector<uint16_t> k16(kf.size()), v16(vf.size());
        if (c.f16) {  // round the caches to f16 so the reference sees the same values
            for (size_t i = 0; i < kf.size(); ++i) {
                k16[i] = cpu::f32_to_f16(kf[i]);
                kf[i] = cpu::f16_to_f32(k16[i]);
                v16[i] = cpu::f32_to_f16(vf[i]);
                vf[i] = cpu::f16_to_f32(v16[i]);
            }
        }
        const tensor kt = c.f16 ? make_tensor(dtype::f16, c.hd, kv_rows, k16.data()) : f32(kf, c.hd, kv_rows);
        const tensor vt = c.f16 ? make_tensor(dtype::f16, c.hd, kv_rows, v16.data()) : f32(vf, c.hd, kv_rows);
        const auto ref = naive_attention(q, kf, vf, p, n_tok);
        for (int nth : {1, 2, 3}) {
            auto be = make_cpu(nth, /*exact=*/true);
            be->attention(f32(q, c.n_head * c.hd, n_tok), kt, vt, p, f32(out, c.n_head * c.hd, n_tok));
            EXPECT_LT(rel_l2(ref, out.data()), 2e-6) << "case n_head " << c.n_head << " window " << c.window << " threads "
                                                     << nth;
        }
        // Fast mode mirrors llama.cpp: q and the normalised probabilities pass through f16. Against
        // the float64 reference that is f16-level error; against a float64 reference that rounds q
        // and P the same way it is float-order noise only.
        if (c.softcap == 0) {
            std::vector<float> q16(q.size());
            for (size_t i = 0; i < q.size(); ++i) q16[i] = cpu::f16_to_f32(cpu::f32_to_f16(q[i]));
            std::vector<double> ref16(q.size());
            for (int64_t t = 0; t < n_tok; ++t)
                for (int h = 0; h < c.n_head; ++h) {
                    const int64_t pos = p.n_past + t, hk = h / (c.n_head / c.n_head_kv);
                    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
                    std::vector<double> sc(pos + 1);
                    double mx = -1e300, sum = 0;
                    for (int64_t j = lo; j <= pos; ++j) {
                        double d = 0;
                        for (int i = 0; i < c.hd; ++i) d += double(q16[(t * c.n_head + h) * c.hd + i]) * kf[(hk * p.n_ctx + j) * c.hd + i];
                        sc[j] = d * p.scale;
                        mx = std::max(mx, sc[j]);
                    }
                    for (int64_t j = lo; j <= pos; ++j) sum += sc[j] = std::exp(sc[j] - mx);
                    for (int i = 0; i < c.hd; ++i) {
                        double o = 0;
                        for (int64_t j = lo; j <= pos; ++j)
                            o += double(cpu::f16_to_f32(cpu::f32_to_f16(float(sc[j] / sum)))) * vf[(hk * p.n_ctx + j) * c.hd + i];
                        ref16[(t * c.n_head + h) * c.hd + i] = o;
                    }
                }
            std::vector<float> fast(q.size());
            for (int nth : {1, 2}) {
                make_cpu(nth)->attention(f32(q, c.n_head * c.hd, n_tok), kt, vt, p, f32(fast, c.n_head * c.hd, n_tok));
                EXPECT_LT(rel_l2(ref16, fast.data()), 2e-5) << "fast mode vs f16-rounding reference, n_head " << c.n_head;
                EXPECT_LT(rel_l2(ref, fast.data()), 3e-3) << "fast mode vs float64";
                EXPECT_GT(rel_l2(ref, fast.data()), 1e-5) << "fast mode should carry llama.cpp's f16 roundings";
            }
        }
    }
}

TEST(Ops, KvStoreLayoutAndAttentionBounds) {
    auto be = make_cpu(1);
    const int n_kv = 2, hd = 4, n_ctx = 8;
    std::vector<float> src = randn(3 * n_kv * hd, 20), cache(n_kv * n_ctx * hd, 0.0f);
    be->kv_store(f32(src, n_kv * hd, 3), f32(cache, hd, n_kv * n_ctx), n_kv, n_ctx, 5);
    for (int t = 0; t < 3; ++t)
        for (int h = 0; h < n_kv; ++h)
            for (int i = 0; i < hd; ++i) EXPECT_EQ(cache[(h * n_ctx + 5 + t) * hd + i], src[(t * n_kv + h) * hd + i]);
    EXPECT_THROW(be->kv_store(f32(src, n_kv * hd, 3), f32(cache, hd, n_kv * n_ctx), n_kv, n_ctx, 6), error);
    std::vector<uint16_t> c16(cache.size());
    be->kv_store(f32(src, n_kv * hd, 3), make_tensor(dtype::f16, hd, n_kv * n_ctx, c16.data()), n_kv, n_ctx, 0);
    EXPECT_EQ(c16[(1 * n_ctx + 2) * hd + 3], cpu::f32_to_f16(src[(2 * n_kv + 1) * hd + 3]));
}

TEST(Ops, GluMatchesF64) {
    auto be = make_cpu(2, /*exact=*/true);
    const int64_t n = 1000, rows = 40;
    auto g = randn(n * rows, 4, 3.0f), u = randn(n * rows, 5);
    std::vector<float> out(n * rows);
    std::vector<double> ref(n * rows);
    be->glu(f32(g, n, rows), f32(u, n, rows), glu_kind::swiglu, f32(out, n, rows));
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    EXPECT_LT(rel_l2(ref, out.data()), 1e-6);
    be->glu(f32(g, n, rows), f32(u, n, rows), glu_kind::geglu, f32(out, n, rows));
    for (size_t i = 0; i < ref.size(); ++i) {
        const double x = g[i];
        ref[i] = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
    }
    EXPECT_LT(rel_l2(ref, out.data()), 1e-6);
    // Fast mode: swiglu with ggml's vectorised exp (still float-accurate); geglu as ggml-cpu's
    // GGML_GELU_FP16 table: gelu of the f16-rounded input, rounded to f16, saturated outside +-10.
    auto fast = make_cpu(2);
    fast->glu(f32(g, n, rows), f32(u, n, rows), glu_kind::swiglu, f32(out, n, rows));
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    EXPECT_LT(rel_l2(ref, out.data()), 1e-6);
    fast->glu(f32(g, n, rows), f32(u, n, rows), glu_kind::geglu, f32(out, n, rows));
    int n_off = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double x = cpu::f16_to_f32(cpu::f32_to_f16(g[i]));
        const double gl = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
        const double want = g[i] <= -10 ? 0.0 : g[i] >= 10 ? double(g[i]) * u[i] : cpu::f16_to_f32(cpu::f32_to_f16(float(gl))) * double(u[i]);
        n_off += std::abs(out[i] - want) > 1e-6 * (1 + std::abs(want));
    }
    EXPECT_LE(n_off, 40) << "geglu differs from the f16-table reference beyond f16 tie flips";
}

TEST(Ops, ElementwiseMatchF64) {
    auto be = make_cpu(2);
    const int64_t n = 257, rows = 9;
    auto a = randn(n * rows, 6, 4.0f), b = randn(n, 7);
    std::vector<float> out(n * rows);
    be->add(f32(a, n, rows), f32(b, n, 1), f32(out, n, rows));  // broadcast row
    for (int64_t i = 0; i < n * rows; ++i) ASSERT_EQ(out[i], a[i] + b[i % n]);
    be->scale(f32(out, n, rows), 0.5f);
    for (int64_t i = 0; i < n * rows; ++i) ASSERT_EQ(out[i], (a[i] + b[i % n]) * 0.5f);
    out = a;
    be->softcap(f32(out, n, rows), 3.0f);
    std::vector<double> ref(n * rows);
    for (int64_t i = 0; i < n * rows; ++i) ref[i] = 3.0 * std::tanh(a[i] / 3.0);
    EXPECT_LT(rel_l2(ref, out.data()), 1e-6);
    out = a;
    be->softmax(f32(out, n, rows));
    for (int64_t r = 0; r < rows; ++r) {
        double mx = -1e300, s = 0;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(a[r * n + i]));
        for (int64_t i = 0; i < n; ++i) s += std::exp(a[r * n + i] - mx);
        for (int64_t i = 0; i < n; ++i) ref[r * n + i] = std::exp(a[r * n + i] - mx) / s;
    }
    EXPECT_LT(rel_l2(ref, out.data()), 1e-6);
}

namespace {

// W [N, K] of type t built from random floats; returns the quantised bytes and the dequantised
// f32 values (what the weight "is", the reference's input).
std::vector<uint8_t> make_weight(dtype t, int64_t K, int64_t N, uint32_t seed, std::vector<float> &deq) {
    auto wf = randn(K * N, seed);
    const size_t rb = dtype_row_bytes(t, K);
    std::vector<uint8_t> q(rb * N);
    deq.resize(K * N);
    for (int64_t r = 0; r < N; ++r) {
        cpu::quantize_row(t, &wf[r * K], q.data() + r * rb, K);
        cpu::dequantize_row(t, q.data() + r * rb, &deq[r * K], K);
    }
    return q;
}

std::vector<double> naive_matmul(const std::vector<float> &w, const std::vector<float> &x, int64_t K, int64_t N,
                                 int64_t M) {
    std::vector<double> y(M * N);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < N; ++r) {
            double s = 0;
            for (int64_t k = 0; k < K; ++k) s += double(w[r * K + k]) * x[m * K + k];
            y[m * N + r] = s;
        }
    return y;
}

}  // namespace

TEST(Ops, MulMatExactAndFastMatchF64) {
    for (dtype t : {dtype::f32, dtype::f16, dtype::q8_0, dtype::q4_1, dtype::q4_k, dtype::q6_k}) {
        const int64_t K = 512, N = 72;
        for (int64_t M : {int64_t{1}, int64_t{5}, int64_t{70}}) {
            std::vector<float> deq;
            auto wq = make_weight(t, K, N, 30, deq);
            auto x = randn(K * M, 31);
            const auto ref = naive_matmul(deq, x, K, N, M);
            const tensor W = make_tensor(t, K, N, wq.data());
            std::vector<float> y(M * N);
            const tensor Y = f32(y, N, M);
            const tensor *pw[] = {&W}, *py[] = {&Y};
            // Exact: dequantised weights x f32 activations, f32 accumulation.
            make_cpu(2, true)->mul_mat(f32(x, K, M), 1, pw, py);
            EXPECT_LT(rel_l2(ref, y.data()), 2e-6) << dtype_name(t) << " exact M=" << M;
            // Fast: activations quantised to vec_dot_type (q8: ~0.5% relative error per product).
            make_cpu(2, false)->mul_mat(f32(x, K, M), 1, pw, py);
            const double tol = t == dtype::f32 ? 2e-6 : t == dtype::f16 ? 1e-3 : 1.5e-2;
            EXPECT_LT(rel_l2(ref, y.data()), tol) << dtype_name(t) << " fast M=" << M;
        }
    }
}

TEST(Ops, MulMatSeveralPairsSharingInput) {
    const int64_t K = 256, M = 20;
    std::vector<float> d1, d2, d3;
    auto w1 = make_weight(dtype::q4_1, K, 40, 41, d1), w2 = make_weight(dtype::q6_k, K, 24, 42, d2),
         w3 = make_weight(dtype::f16, K, 8, 43, d3);
    auto x = randn(K * M, 44);
    std::vector<float> y1(M * 40), y2(M * 24), y3(M * 8), s1(M * 40), s2(M * 24), s3(M * 8);
    const tensor W1 = make_tensor(dtype::q4_1, K, 40, w1.data()), W2 = make_tensor(dtype::q6_k, K, 24, w2.data()),
                 W3 = make_tensor(dtype::f16, K, 8, w3.data());
    const tensor Y1 = f32(y1, 40, M), Y2 = f32(y2, 24, M), Y3 = f32(y3, 8, M);
    const tensor S1 = f32(s1, 40, M), S2 = f32(s2, 24, M), S3 = f32(s3, 8, M);
    auto be = make_cpu(2);
    const tensor *pw[] = {&W1, &W2, &W3}, *py[] = {&Y1, &Y2, &Y3};
    be->mul_mat(f32(x, K, M), 3, pw, py);
    for (int i = 0; i < 3; ++i) {  // each pair alone must give identical bits
        const tensor *w[] = {pw[i]}, *s[] = {i == 0 ? &S1 : i == 1 ? &S2 : &S3};
        be->mul_mat(f32(x, K, M), 1, w, s);
    }
    EXPECT_EQ(0, std::memcmp(y1.data(), s1.data(), y1.size() * 4));
    EXPECT_EQ(0, std::memcmp(y2.data(), s2.data(), y2.size() * 4));
    EXPECT_EQ(0, std::memcmp(y3.data(), s3.data(), y3.size() * 4));
    EXPECT_LT(rel_l2(naive_matmul(d2, x, K, 24, M), y2.data()), 1.5e-2);
}

TEST(Ops, ThreadCountInvariance) {
    const int64_t K = 576, N = 1000, M = 37;
    std::vector<float> deq;
    auto wq = make_weight(dtype::q4_1, K, N, 50, deq);
    auto x = randn(K * M, 51);
    std::vector<std::vector<float>> outs;
    for (bool exact : {false, true})
        for (int nth : {1, 2, 3}) {
            std::vector<float> y(M * N);
            const tensor W = make_tensor(dtype::q4_1, K, N, wq.data()), Y = f32(y, N, M);
            const tensor *pw[] = {&W}, *py[] = {&Y};
            make_cpu(nth, exact)->mul_mat(f32(x, K, M), 1, pw, py);
            outs.push_back(y);
        }
    for (int i : {1, 2}) EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * 4)) << "fast " << i;
    for (int i : {4, 5}) EXPECT_EQ(0, std::memcmp(outs[3].data(), outs[i].data(), outs[3].size() * 4)) << "exact " << i;
}

TEST(Ops, GetRowsDequantisesAndValidatesIds) {
    auto be = make_cpu(2);
    const int64_t K = 64, N = 10;
    std::vector<float> deq;
    auto tq = make_weight(dtype::q8_0, K, N, 60, deq);
    const tensor T = make_tensor(dtype::q8_0, K, N, tq.data());
    std::vector<float> out(3 * K);
    const int32_t ids[] = {9, 0, 4};
    be->get_rows(T, ids, 3, f32(out, K, 3));
    for (int i = 0; i < 3; ++i)
        for (int k = 0; k < K; ++k) ASSERT_EQ(out[i * K + k], deq[ids[i] * K + k]);
    const int32_t bad[] = {10};
    EXPECT_THROW(be->get_rows(T, bad, 1, f32(out, K, 1)), error);
    const int32_t neg[] = {-1};
    EXPECT_THROW(be->get_rows(T, neg, 1, f32(out, K, 1)), error);
}

TEST(Ops, ShapeMismatchesThrow) {
    auto be = make_cpu(1);
    std::vector<float> a(12), b(12);
    EXPECT_THROW(be->add(f32(a, 4, 3), f32(b, 3, 4), f32(a, 4, 3)), error);
    EXPECT_THROW(be->rms_norm(f32(a, 4, 3), nullptr, 1e-5f, f32(b, 6, 2)), error);
    const tensor W = f32(b, 3, 4), Y = f32(a, 4, 3);
    const tensor *pw[] = {&W}, *py[] = {&Y};
    EXPECT_THROW(be->mul_mat(f32(a, 4, 3), 1, pw, py), error);  // K 4 vs weight K 3
    EXPECT_THROW(make_cpu_backend(cpu_options{0}), error);
}
