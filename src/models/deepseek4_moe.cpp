// DS4 hyper-connections (HC pre/post with Sinkhorn, HC head; spec section 3) and the MoE FFN
// (sqrt-softplus router, hash or biased top-k routing, clamped SwiGLU experts, shared expert;
// spec section 5).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

// ---- hyper-connections ----------------------------------------------------------------------------

void sinkhorn(float *c, int n, int iters, float eps) {
    // 1. row softmax, + eps
    for (int j = 0; j < n; ++j) {
        float *row = c + j * n;
        const float mx = *std::max_element(row, row + n);
        float sum = 0;
        for (int k = 0; k < n; ++k) sum += (row[k] = std::exp(row[k] - mx));
        for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
    }
    auto col_norm = [&] {
        for (int k = 0; k < n; ++k) {
            float s = 0;
            for (int j = 0; j < n; ++j) s += c[j * n + k];
            for (int j = 0; j < n; ++j) c[j * n + k] /= (s + eps);
        }
    };
    auto row_norm = [&] {
        for (int j = 0; j < n; ++j) {
            float s = 0;
            for (int k = 0; k < n; ++k) s += c[j * n + k];
            for (int k = 0; k < n; ++k) c[j * n + k] /= (s + eps);
        }
    };
    // 2. column normalise; 3. (iters - 1) rounds of row then column normalisation.
    col_norm();
    for (int it = 1; it < iters; ++it) {
        row_norm();
        col_norm();
    }
}

void hc_split_sinkhorn(const float *mix, const float *scale, const float *base, int n_hc, int iters,
                       float eps, float *pre, float *post, float *comb) {
    for (int s = 0; s < n_hc; ++s) {
        pre[s] = sigmoid(mix[s] * scale[0] + base[s]) + eps;
        post[s] = 2.0f * sigmoid(mix[n_hc + s] * scale[1] + base[n_hc + s]);
    }
    for (int i = 0; i < n_hc * n_hc; ++i) comb[i] = mix[2 * n_hc + i] * scale[2] + base[2 * n_hc + i];
    sinkhorn(comb, n_hc, iters, eps);
}

// mix = (F v) / sqrt(mean(v^2) + eps) for the flattened state v [n_hc*D], F v given in mix.
static void hc_mix_scale(const hparams &hp, const hc_weights &w, const float *x, float *mix) {
    const int64_t n = static_cast<int64_t>(hp.n_hc) * hp.n_embd;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + hp.rms_eps));
    for (int64_t k = 0; k < w.fn.rows; ++k) mix[k] *= r;
}

static std::vector<float> hc_mix(const hparams &hp, const hc_weights &w, const float *x) {
    std::vector<float> mix(static_cast<size_t>(w.fn.rows));
    matmul(w.fn, x, 1, mix.data());
    hc_mix_scale(hp, w, x, mix.data());
    return mix;
}

// u = sum_s w[s] * X_s
static void hc_weighted_sum(int n_hc, int64_t dim, const float *w, const float *x, float *u) {
    for (int64_t i = 0; i < dim; ++i) {
        float acc = 0;
        for (int s = 0; s < n_hc; ++s) acc += w[s] * x[s * dim + i];
        u[i] = acc;
    }
}

void hc_pre_mixed(const hparams &hp, const hc_weights &w, const float *x, float *mix, float *u, float *post,
                  float *comb) {
    hc_mix_scale(hp, w, x, mix);
    std::vector<float> pre(static_cast<size_t>(hp.n_hc));
    hc_split_sinkhorn(mix, w.scale.data(), w.base.data(), hp.n_hc, hp.sinkhorn_iters, hp.hc_eps, pre.data(), post,
                      comb);
    hc_weighted_sum(hp.n_hc, hp.n_embd, pre.data(), x, u);
}

void hc_pre(const hparams &hp, const hc_weights &w, const float *x, float *u, float *post, float *comb) {
    std::vector<float> mix(static_cast<size_t>(w.fn.rows));
    matmul(w.fn, x, 1, mix.data());
    hc_pre_mixed(hp, w, x, mix.data(), u, post, comb);
}

void hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post, const float *comb,
             float *x_new) {
    for (int k = 0; k < n_hc; ++k)
        for (int64_t i = 0; i < dim; ++i) {
            float acc = post[k] * y[i];
            for (int j = 0; j < n_hc; ++j) acc += comb[j * n_hc + k] * x_old[j * dim + i];
            x_new[k * dim + i] = acc;
        }
}

void hc_head(const hparams &hp, const hc_weights &w, const float *x, float *z) {
    const std::vector<float> mix = hc_mix(hp, w, x);
    std::vector<float> pre(static_cast<size_t>(hp.n_hc));
    for (int s = 0; s < hp.n_hc; ++s)
        pre[static_cast<size_t>(s)] = sigmoid(mix[s] * w.scale[0] + w.base[s]) + hp.hc_eps;
    hc_weighted_sum(hp.n_hc, hp.n_embd, pre.data(), x, z);
}

// ---- MoE ---------------------------------------------------------------------------------------------

route moe_route(const hparams &hp, const layer_weights &l, const float *logits, int32_t token) {
    const int E = hp.n_expert, k = hp.n_expert_used;
    std::vector<float> score(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) score[static_cast<size_t>(e)] = std::sqrt(softplus(logits[e]));
    route r;
    if (l.hash) {
        const int32_t *row = l.tid2eid.data() + static_cast<size_t>(token) * static_cast<size_t>(k);
        r.experts.assign(row, row + k);
    } else {
        // top-k of score + bias (bias selects only); ties -> lower expert id
        std::vector<float> biased(score);
        for (int e = 0; e < E; ++e) biased[static_cast<size_t>(e)] += l.exp_bias[static_cast<size_t>(e)];
        std::vector<int> idx(static_cast<size_t>(E));
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
            return biased[static_cast<size_t>(a)] > biased[static_cast<size_t>(b)] ||
                   (biased[static_cast<size_t>(a)] == biased[static_cast<size_t>(b)] && a < b);
        });
        r.experts.assign(idx.begin(), idx.begin() + k);
    }
    float sum = 0;
    for (int e : r.experts) sum += score[static_cast<size_t>(e)];
    for (int e : r.experts)
        r.weights.push_back(score[static_cast<size_t>(e)] / sum * hp.expert_weights_scale);
    return r;
}

void swiglu_clamped(float *g, const float *v, int64_t n, float clamp) {
    for (int64_t i = 0; i < n; ++i) g[i] = silu(std::min(g[i], clamp)) * std::clamp(v[i], -clamp, clamp);
}

// One expert over the m tokens that use it: rows `xs` [m, D] gathered from the chunk, per-token
// routing weights `w` [m]; out [m, D] = W2 (w * swiglu(W1 x, W3 x)) (the weight multiplies h before
// W2). Each token's arithmetic is that of a lone token (products are per row), so batching does not
// change a bit on the reference path.
static void expert_rows(const matrix &w1, const matrix &w3, const matrix &w2, float clamp, const float *xs,
                        const float *w, int64_t m, float *out) {
    const int64_t F = w1.rows;
    thread_local std::vector<float> g, v;  // kept between calls (see moe_forward_batch)
    g.resize(static_cast<size_t>(m * F));
    v.resize(g.size());
    matmul(w1, xs, m, g.data());
    matmul(w3, xs, m, v.data());
    // Rows are independent (the same bits over the pool). The task reads the buffers through pointers:
    // naming a thread_local inside it would name the running thread's own copy.
    float *gp = g.data();
    const float *vp = v.data();
    parallel_for(m, 8 * F, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            float *gi = gp + i * F;
            swiglu_clamped(gi, vp + i * F, F, clamp);
            for (int64_t j = 0; j < F; ++j) gi[j] *= w[i];
        }
    });
    matmul(w2, g.data(), m, out);
}

void moe_forward_batch(const hparams &hp, const layer_weights &l, const float *xn,
                       std::span<const int32_t> tokens, float *y, const tp_slice *slice) {
    const tp_slice ts = slice ? *slice : tp_whole(hp);
    const int64_t n = static_cast<int64_t>(tokens.size()), D = hp.n_embd, E = hp.n_expert;
    const int k = hp.n_expert_used, n_slot = k + (hp.n_expert_shared == 1 ? 1 : 0);
    std::vector<float> logits(static_cast<size_t>(n * E));
    matmul(l.gate_inp, xn, n, logits.data());
    // users[e] = (token, slot) pairs routed to expert e; slot k is the shared expert.
    std::vector<std::vector<std::pair<int64_t, int>>> users(static_cast<size_t>(E));
    std::vector<float> weight(static_cast<size_t>(n * n_slot), 1.0f);
    for (int64_t i = 0; i < n; ++i) {
        const route r = moe_route(hp, l, &logits[static_cast<size_t>(i * E)], tokens[static_cast<size_t>(i)]);
        for (int j = 0; j < k; ++j) {
            users[static_cast<size_t>(r.experts[static_cast<size_t>(j)])].emplace_back(i, j);
            weight[static_cast<size_t>(i * n_slot + j)] = r.weights[static_cast<size_t>(j)];
        }
    }
    // Per-thread buffers kept between calls: fresh allocations of a chunk's size are mmapped, faulted in
    // and cleared on every layer.
    thread_local std::vector<float> outs, xs, ws, o;
    outs.resize(static_cast<size_t>(n * n_slot * D));  // [n, n_slot, D]
    auto run = [&](const matrix &w1, const matrix &w3, const matrix &w2, float clamp,
                   const std::vector<std::pair<int64_t, int>> &who) {
        const int64_t m = static_cast<int64_t>(who.size());
        xs.resize(static_cast<size_t>(m * D));
        ws.resize(static_cast<size_t>(m));
        o.resize(static_cast<size_t>(m * D));
        for (int64_t u = 0; u < m; ++u) {
            const auto [i, slot] = who[static_cast<size_t>(u)];
            std::copy(xn + i * D, xn + (i + 1) * D, xs.begin() + u * D);
            ws[static_cast<size_t>(u)] = weight[static_cast<size_t>(i * n_slot + slot)];
        }
        expert_rows(w1, w3, w2, clamp, xs.data(), ws.data(), m, o.data());
        for (int64_t u = 0; u < m; ++u) {
            const auto [i, slot] = who[static_cast<size_t>(u)];
            std::copy(o.begin() + u * D, o.begin() + (u + 1) * D, outs.begin() + (i * n_slot + slot) * D);
        }
    };
    // Routed experts: only those of this rank (all of them on one rank).
    for (int64_t e = ts.expert0; e < ts.expert1; ++e)
        if (!users[static_cast<size_t>(e)].empty())
            run(l.gate_exps.expert(e), l.up_exps.expert(e), l.down_exps.expert(e), l.clamp,
                users[static_cast<size_t>(e)]);
    // Shared expert: width [ff0, ff1) = rows of gate/up and the matching column block of down, so
    // its output is this rank's partial sum over the hidden units (exact on one rank: whole matrices).
    const bool shared = n_slot > k && ts.ff1 > ts.ff0;
    if (shared) {
        std::vector<std::pair<int64_t, int>> all;
        for (int64_t i = 0; i < n; ++i) all.emplace_back(i, k);
        run(matrix_rows(l.gate_sh, ts.ff0, ts.ff1), matrix_rows(l.up_sh, ts.ff0, ts.ff1),
            matrix_cols(l.down_sh, ts.ff0, ts.ff1, "ffn_down_shexp"), l.clamp_sh, all);
    }
    // Slots this rank computed: its routed experts' slots, and the shared one.
    std::vector<char> mine(static_cast<size_t>(n * n_slot), 0);
    for (int64_t e = ts.expert0; e < ts.expert1; ++e)
        for (const auto &[i, slot] : users[static_cast<size_t>(e)]) mine[static_cast<size_t>(i * n_slot + slot)] = 1;
    if (shared)
        for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i * n_slot + k)] = 1;
    // y = sum over slots in routing order, then the shared expert (the order of a lone token).
    const float *outp = outs.data();  // (a thread_local: see expert_rows)
    parallel_for(n, n_slot * D, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            float *yi = y + i * D;
            std::fill(yi, yi + D, 0.0f);
            for (int s = 0; s < n_slot; ++s) {
                if (!mine[static_cast<size_t>(i * n_slot + s)]) continue;
                const float *os = outp + (i * n_slot + s) * D;
                for (int64_t c = 0; c < D; ++c) yi[c] += os[c];
            }
        }
    });
}

void moe_forward(const hparams &hp, const layer_weights &l, const float *xn, int32_t token, float *y) {
    moe_forward_batch(hp, l, xn, std::span<const int32_t>(&token, 1), y);
}

}  // namespace fathom::ds4
