// DSpark drafter forward (see deepseek4_dspark.h; normative: ../shared/golden/ds4-tiny-dspark/README.md,
// "The computation"). Shapes in comments are torch order [rows, cols], row-major.
#include "models/deepseek4_dspark.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_qat.h"

namespace fathom::ds4 {

// ---- target features ------------------------------------------------------------------------------

void dspark_capture(const model &target, const dspark_weights &w, state &st, std::span<const int32_t> tokens,
                    std::span<const int64_t> positions, std::span<float> features, std::span<float> logits) {
    const hparams &hp = target.hp;
    const size_t n = tokens.size(), D = static_cast<size_t>(hp.n_embd), S = static_cast<size_t>(hp.n_hc) * D;
    const size_t F = static_cast<size_t>(w.feature_dim());
    if (positions.size() != n || features.size() != n * F)
        throw error("ds4 dspark capture: " + std::to_string(n) + " tokens, " +
                    std::to_string(positions.size()) + " positions and a feature buffer of " +
                    std::to_string(features.size()) + " floats (expected " + std::to_string(n * F) + ")");
    if (st.layers.size() != target.layers.size())
        throw error("ds4 dspark capture: state does not belong to the target");
    for (size_t i = 0; i < n; ++i)  // compressors pool absolute blocks: contiguous positions only
        if (positions[i] != st.n_past + static_cast<int64_t>(i))
            throw error("ds4 dspark capture: position " + std::to_string(positions[i]) + " at index " +
                        std::to_string(i) + ", expected " +
                        std::to_string(st.n_past + static_cast<int64_t>(i)));
    if (n == 0) return;
    std::vector<float> x(n * S);  // [n, n_hc, D] hyper-connection state
    embed_tokens(target, tokens, x);
    // forward() is embed -> forward_layers(0, n_layer) -> head; running one layer at a time gives
    // the same bits and lets the state after each capture layer be read.
    const std::span<layer_state> layers(st.layers);
    for (int l = 0; l < hp.n_layer; ++l) {
        forward_layers(target, layers.subspan(static_cast<size_t>(l), 1), st.qat, st.exec, l, l + 1, tokens,
                       positions, x);
        for (size_t t = 0; t < w.cfg.target_layers.size(); ++t) {
            if (w.cfg.target_layers[t] != l) continue;
            for (size_t i = 0; i < n; ++i) {  // f_l(i) = (X_0 + ... + X_(n_hc-1)) / n_hc
                float *f = &features[i * F + t * D];
                const float *xi = &x[i * S];
                for (size_t k = 0; k < D; ++k) {
                    float acc = 0;
                    for (int s = 0; s < hp.n_hc; ++s) acc += xi[static_cast<size_t>(s) * D + k];
                    f[k] = acc / static_cast<float>(hp.n_hc);
                }
            }
        }
    }
    st.n_past += static_cast<int64_t>(n);
    if (!logits.empty()) head_logits(target, st.exec, x, logits);
}

namespace {

// ---- stage attention ------------------------------------------------------------------------------

// K = V rows of one stage: RMSNorm(W_kv . x; kv_norm), RoPE on the tail at pos0 + i, then (qat full)
// the FP8 round trip of the non-RoPE dims. x [n, D] -> kv [n, d] (appended to `out`).
void stage_kv(const hparams &hp, const rope_table &rope, const layer_weights &l, qat_mode qat, const float *x,
              int64_t n, int64_t pos0, std::vector<float> &out) {
    const int64_t d = hp.head_dim, nr = hp.n_rot;
    const size_t o = out.size();
    out.resize(o + static_cast<size_t>(n * d));
    if (n == 0) return;
    matmul(l.kv, x, n, &out[o]);
    for (int64_t i = 0; i < n; ++i) {
        float *k = &out[o + static_cast<size_t>(i * d)];
        rms_norm(k, d, l.kv_norm.data(), hp.rms_eps, k);
        rope_apply(k + (d - nr), rope, pos0 + i, false);
        if (qat == qat_mode::full) fp8_round_trip(k, d - nr);
    }
}

// Attention sublayer of one stage over the block (spec 4 with the DSpark key set): xn [B, D] normed
// block rows at positions S..S+B-1, ctx_kv [n_ctx, d] this stage's K/V rows of the context positions (in
// position order, dspark_context); every block row attends to all context rows and all B block rows
// (bidirectional: no mask inside the block). Output y [B, D].
void stage_attention(const hparams &hp, const rope_table &rope, const layer_weights &l, qat_mode qat,
                     const float *xn, int64_t B, int64_t S, const float *ctx_kv, int64_t n_ctx, float *y) {
    const int64_t D = hp.n_embd, d = hp.head_dim, H = hp.n_head, nr = hp.n_rot, r = hp.o_rank;
    // q [B, H*d] = W_qb . RMSNorm(W_qa . x; q_norm), each head RMS-normalised, RoPE at S + j.
    std::vector<float> q_lat(static_cast<size_t>(B * hp.q_lora)), q(static_cast<size_t>(B * H * d));
    matmul(l.q_a, xn, B, q_lat.data());
    for (int64_t j = 0; j < B; ++j)
        rms_norm(&q_lat[static_cast<size_t>(j * hp.q_lora)], hp.q_lora, l.q_a_norm.data(), hp.rms_eps,
                 &q_lat[static_cast<size_t>(j * hp.q_lora)]);
    matmul(l.q_b, q_lat.data(), B, q.data());
    for (int64_t j = 0; j < B; ++j)
        for (int64_t h = 0; h < H; ++h) {
            float *qh = &q[static_cast<size_t>((j * H + h) * d)];
            rms_norm(qh, d, nullptr, hp.rms_eps, qh);
            rope_apply(qh + (d - nr), rope, S + j, false);
        }
    // keys = values [n_ctx + B, d]: the context rows (this stage's W_kv on main_x), then the block rows.
    std::vector<float> kv(ctx_kv, ctx_kv + n_ctx * d);
    stage_kv(hp, rope, l, qat, xn, B, S, kv);
    const int64_t n_keys = n_ctx + B, gd = H / hp.o_groups * d;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    std::vector<float> o(static_cast<size_t>(H * d)), z(static_cast<size_t>(hp.o_groups * r));
    for (int64_t j = 0; j < B; ++j) {
        attend_with_sink(&q[static_cast<size_t>(j * H * d)], kv.data(), n_keys, l.sinks.data(),
                         static_cast<int>(H), d, scale, o.data());
        for (int64_t h = 0; h < H; ++h)
            rope_apply(&o[static_cast<size_t>(h * d + d - nr)], rope, S + j, true);
        // Grouped low-rank output (spec 4.7): z_g = W_oa[g] . o_g, y = W_ob . concat(z_g).
        for (int64_t g = 0; g < hp.o_groups; ++g)
            matmul_rows(l.out_a, g * r, (g + 1) * r, &o[static_cast<size_t>(g * gd)], 1,
                        &z[static_cast<size_t>(g * r)]);
        matmul(l.out_b, z.data(), 1, y + j * D);
    }
}

// One stage (an ordinary DS4 block with the attention above): X [B, n_hc, D] updated in place.
void stage_forward(const hparams &hp, const rope_table &rope, const layer_weights &l, qat_mode qat,
                   std::span<const int32_t> ids, int64_t S, const float *ctx_kv, int64_t n_ctx, float *x) {
    const int64_t B = static_cast<int64_t>(ids.size()), D = hp.n_embd, SW = hp.n_hc * D;
    const size_t nh = static_cast<size_t>(hp.n_hc);
    std::vector<float> u(static_cast<size_t>(B * D)), y(static_cast<size_t>(B * D));
    std::vector<float> post(static_cast<size_t>(B) * nh), comb(static_cast<size_t>(B) * nh * nh),
        x_old(static_cast<size_t>(SW));
    auto pre = [&](const hc_weights &hw, const std::vector<float> &norm) {
        for (int64_t j = 0; j < B; ++j) {
            float *uj = &u[static_cast<size_t>(j * D)];
            hc_pre(hp, hw, x + j * SW, uj, &post[static_cast<size_t>(j) * nh],
                   &comb[static_cast<size_t>(j) * nh * nh]);
            rms_norm(uj, D, norm.data(), hp.rms_eps, uj);
        }
    };
    auto post_all = [&] {
        for (int64_t j = 0; j < B; ++j) {
            std::copy(x + j * SW, x + (j + 1) * SW, x_old.begin());
            hc_post(hp.n_hc, D, &y[static_cast<size_t>(j * D)], x_old.data(),
                    &post[static_cast<size_t>(j) * nh], &comb[static_cast<size_t>(j) * nh * nh], x + j * SW);
        }
    };
    pre(l.hc_attn, l.attn_norm);
    stage_attention(hp, rope, l, qat, u.data(), B, S, ctx_kv, n_ctx, y.data());
    post_all();
    pre(l.hc_ffn, l.ffn_norm);
    moe_forward_batch(hp, l, u.data(), ids, y.data());  // learned routing: ids are not read
    post_all();
}

// Row `id` of a [V, r] table as f32.
std::vector<float> table_row(const matrix &m, int32_t id) {
    std::vector<float> v(static_cast<size_t>(m.cols));
    if (m.type == dtype::f32)
        std::memcpy(v.data(), m.row(id), v.size() * sizeof(float));
    else
        cpu::dequantize_row(m.type, m.row(id), v.data(), m.cols);
    return v;
}

// Head, Markov chain and confidence for the final HC state x [B, n_hc, D] (README steps 5-7).
void block_head(const model &target, const dspark_weights &w, const float *x, std::span<const int32_t> forced,
                dspark_block &b) {
    const hparams &hp = w.hp;
    const int64_t B = w.cfg.block_size, D = hp.n_embd, V = hp.n_vocab, r = w.cfg.markov_rank,
                  SW = hp.n_hc * D;
    b.hc_head_out.resize(static_cast<size_t>(B * D));
    b.base_logits.resize(static_cast<size_t>(B * V));
    b.corrected_logits.resize(static_cast<size_t>(B * V));
    std::vector<float> zn(static_cast<size_t>(B * D)), bias(static_cast<size_t>(V)),
        cin(static_cast<size_t>(D + r));
    for (int64_t j = 0; j < B; ++j) {
        float *z = &b.hc_head_out[static_cast<size_t>(j * D)];
        hc_head(hp, w.hc_head, x + j * SW, z);  // z_j (pre-norm) feeds the confidence head too
        rms_norm(z, D, w.output_norm.data(), hp.rms_eps, &zn[static_cast<size_t>(j * D)]);
    }
    // base logits with the target's output head, all B rows in one pass over it (a row's bits are a lone row's)
    matmul(target.output, zn.data(), B, b.base_logits.data());
    int32_t prev = b.input_ids[0];  // x_0 = the seed
    for (int64_t j = 0; j < B; ++j) {
        const float *z = &b.hc_head_out[static_cast<size_t>(j * D)];
        const float *U = &b.base_logits[static_cast<size_t>(j * V)];
        const int32_t xj = forced.empty() ? prev : forced[static_cast<size_t>(j)];
        const std::vector<float> e = table_row(w.markov_w1, xj);  // W1[x_j] [r]
        matmul(w.markov_w2, e.data(), 1, bias.data());            // B_j = W2 . W1[x_j] [V]
        float *C = &b.corrected_logits[static_cast<size_t>(j * V)];
        for (int64_t v = 0; v < V; ++v) C[v] = U[v] + bias[static_cast<size_t>(v)];
        const int32_t next = static_cast<int32_t>(std::max_element(C, C + V) - C);  // ties: lowest id
        std::copy(z, z + D, cin.begin());
        std::copy(e.begin(), e.end(), cin.begin() + D);
        const float c = dot_f32(w.conf_w.data(), cin.data(), D + r) + w.conf_bias;
        b.markov_prev.push_back(xj);
        b.draft_tokens.push_back(next);
        b.confidence_logit.push_back(c);
        b.confidence.push_back(sigmoid(c));
        prev = next;
    }
}

}  // namespace

dspark_context new_dspark_context(const dspark_weights &w) {
    dspark_context c;
    c.rows = static_cast<int64_t>(w.cfg.window) + w.cfg.block_size + max_rollback + 1;
    c.pos.assign(static_cast<size_t>(c.rows), -1);
    c.kv.assign(w.stages.size(), std::vector<float>(static_cast<size_t>(c.rows * w.hp.head_dim)));
    return c;
}

void dspark_observe(const dspark_weights &w, qat_mode qat, const exec_options &exec, dspark_context &c, int64_t p0,
                    std::span<const float> features) {
    const hparams &hp = w.hp;
    const int64_t F = w.feature_dim(), D = hp.n_embd, d = hp.head_dim;
    const int64_t n = static_cast<int64_t>(features.size()) / F;
    if (n * F != static_cast<int64_t>(features.size()) || p0 < 0)
        throw error("ds4 dspark: " + std::to_string(features.size()) + " feature floats at position " +
                    std::to_string(p0) + " are not whole rows of " + std::to_string(F));
    if (c.kv.size() != w.stages.size() || c.rows < 1) throw error("ds4 dspark: the context is not this drafter's");
    // Only the last `window` positions can be context of a later block (README step 2).
    const int64_t keep = std::min<int64_t>(w.cfg.window, n), first = n - keep;
    if (keep == 0) return;
    const exec_scope scope(exec);
    // main_x [keep, D] = RMSNorm(W_fc . feat; hidden_norm), then each stage's K/V rows of it.
    std::vector<float> main_x(static_cast<size_t>(keep * D));
    matmul(w.fc, &features[static_cast<size_t>(first * F)], keep, main_x.data());
    for (int64_t i = 0; i < keep; ++i)
        rms_norm(&main_x[static_cast<size_t>(i * D)], D, w.hidden_norm.data(), hp.rms_eps, &main_x[static_cast<size_t>(i * D)]);
    const rope_table rope = rope_plain(hp.rope_base, hp.n_rot);
    std::vector<float> kv;
    for (size_t k = 0; k < w.stages.size(); ++k) {
        kv.clear();
        stage_kv(hp, rope, w.stages[k], qat, main_x.data(), keep, p0 + first, kv);
        for (int64_t i = 0; i < keep; ++i) {
            const int64_t q = p0 + first + i, r = q % c.rows;
            std::copy(&kv[static_cast<size_t>(i * d)], &kv[static_cast<size_t>((i + 1) * d)], &c.kv[k][static_cast<size_t>(r * d)]);
        }
    }
    for (int64_t i = 0; i < keep; ++i) c.pos[static_cast<size_t>((p0 + first + i) % c.rows)] = p0 + first + i;
}

void dspark_truncate(dspark_context &c, int64_t n) {
    for (int64_t &q : c.pos)
        if (q >= n) q = -1;
}

dspark_block dspark_draft_at(const model &target, const dspark_weights &w, qat_mode qat, const exec_options &exec,
                             const dspark_context &c, int64_t S, int32_t seed_token,
                             std::span<const int32_t> markov_inputs) {
    const hparams &hp = w.hp;
    const int64_t D = hp.n_embd, B = w.cfg.block_size, d = hp.head_dim;
    if (S < 0) throw error("ds4 dspark: negative position");
    if (seed_token < 0 || seed_token >= hp.n_vocab)
        throw error("ds4 dspark: seed token " + std::to_string(seed_token) + " outside the vocabulary");
    if (!markov_inputs.empty() && static_cast<int64_t>(markov_inputs.size()) != B)
        throw error("ds4 dspark: " + std::to_string(markov_inputs.size()) + " Markov inputs for a block of " +
                    std::to_string(B));
    for (int32_t t : markov_inputs)
        if (t < 0 || t >= hp.n_vocab)
            throw error("ds4 dspark: Markov input " + std::to_string(t) + " outside the vocabulary");
    if (c.kv.size() != w.stages.size() || c.rows < 1) throw error("ds4 dspark: the context is not this drafter's");
    const exec_scope scope(exec);
    dspark_block b;
    b.seed_pos = S;
    // Context (README step 2): the longest run of observed positions ending at S - 1, at most `window`.
    auto held = [&](int64_t q) { return q >= 0 && c.pos[static_cast<size_t>(q % c.rows)] == q; };
    int64_t c0 = S;
    while (c0 > 0 && S - c0 < w.cfg.window && held(c0 - 1)) --c0;
    const int64_t n_ctx = S - c0;
    for (int64_t q = c0; q < S; ++q) b.ctx_positions.push_back(q);
    // Block input (step 3): [seed, noise x (B-1)] embedded with the target's table into every stream.
    b.input_ids.assign(static_cast<size_t>(B), w.cfg.noise_token);
    b.input_ids[0] = seed_token;
    std::vector<float> x(static_cast<size_t>(B * hp.n_hc * D));
    embed_tokens(target, b.input_ids, x);
    // Stages (step 4): ratio-0 attention, plain RoPE with the drafter's base, each over its own context rows.
    const rope_table rope = rope_plain(hp.rope_base, hp.n_rot);
    std::vector<float> ctx(static_cast<size_t>(n_ctx * d));
    for (size_t k = 0; k < w.stages.size(); ++k) {
        for (int64_t q = c0; q < S; ++q)
            std::copy_n(&c.kv[k][static_cast<size_t>((q % c.rows) * d)], d, &ctx[static_cast<size_t>((q - c0) * d)]);
        stage_forward(hp, rope, w.stages[k], qat, b.input_ids, S, ctx.data(), n_ctx, x.data());
    }
    block_head(target, w, x.data(), markov_inputs, b);
    return b;
}

dspark_block dspark_draft(const model &target, const dspark_weights &w, qat_mode qat,
                          const exec_options &exec, std::span<const float> ctx_features, int64_t ctx_pos0,
                          int32_t seed_token, std::span<const int32_t> markov_inputs) {
    const int64_t F = w.feature_dim();
    const int64_t n_all = static_cast<int64_t>(ctx_features.size()) / F;
    if (n_all * F != static_cast<int64_t>(ctx_features.size()) || ctx_pos0 < 0)
        throw error("ds4 dspark: " + std::to_string(ctx_features.size()) + " feature floats at position " +
                    std::to_string(ctx_pos0) + " are not whole rows of " + std::to_string(F));
    if (seed_token < 0 || seed_token >= w.hp.n_vocab)  // (before any work)
        throw error("ds4 dspark: seed token " + std::to_string(seed_token) + " outside the vocabulary");
    dspark_context c = new_dspark_context(w);
    dspark_observe(w, qat, exec, c, ctx_pos0, ctx_features);
    return dspark_draft_at(target, w, qat, exec, c, ctx_pos0 + n_all, seed_token, markov_inputs);
}

}  // namespace fathom::ds4
