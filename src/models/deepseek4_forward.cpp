// DS4 whole-model forward (spec section 2): embedding -> n_layer blocks, each an HC-wrapped
// attention half and an HC-wrapped MoE half -> HC head -> final norm -> logits. Evaluated
// layer-major over a chunk of tokens; all cross-token state lives in ds4::state.
#include <algorithm>
#include <cstring>
#include <string>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

void block_forward(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                   qat_mode qat, float *x, std::span<const int32_t> tokens,
                   std::span<const int64_t> positions) {
    const int64_t n = static_cast<int64_t>(positions.size()), D = hp.n_embd, S = hp.n_hc * D;
    const size_t nh = static_cast<size_t>(hp.n_hc);
    std::vector<float> u(static_cast<size_t>(n * D)), y(static_cast<size_t>(n * D));
    std::vector<float> post(static_cast<size_t>(n) * nh), comb(static_cast<size_t>(n) * nh * nh);
    std::vector<float> x_old(static_cast<size_t>(S));

    // attention half: (u, post, comb) = HCPre(X); a = Attn(RMSNorm(u)); X = HCPost(a, X, post, comb)
    for (int64_t i = 0; i < n; ++i) {
        float *ui = &u[static_cast<size_t>(i * D)];
        hc_pre(hp, l.hc_attn, x + i * S, ui, &post[static_cast<size_t>(i) * nh],
               &comb[static_cast<size_t>(i) * nh * nh]);
        rms_norm(ui, D, l.attn_norm.data(), hp.rms_eps, ui);
    }
    attention_layer(hp, ropes, l, ls, qat, u.data(), positions, y.data());
    for (int64_t i = 0; i < n; ++i) {
        std::copy(x + i * S, x + (i + 1) * S, x_old.begin());
        hc_post(hp.n_hc, D, &y[static_cast<size_t>(i * D)], x_old.data(), &post[static_cast<size_t>(i) * nh],
                &comb[static_cast<size_t>(i) * nh * nh], x + i * S);
    }

    // MoE half: HCPre per token, experts batched over the chunk's tokens routed to them, HCPost.
    for (int64_t i = 0; i < n; ++i) {
        float *ui = &u[static_cast<size_t>(i * D)];
        hc_pre(hp, l.hc_ffn, x + i * S, ui, &post[static_cast<size_t>(i) * nh],
               &comb[static_cast<size_t>(i) * nh * nh]);
        rms_norm(ui, D, l.ffn_norm.data(), hp.rms_eps, ui);
    }
    moe_forward_batch(hp, l, u.data(), tokens, y.data());
    for (int64_t i = 0; i < n; ++i) {
        std::copy(x + i * S, x + (i + 1) * S, x_old.begin());
        hc_post(hp.n_hc, D, &y[static_cast<size_t>(i * D)], x_old.data(), &post[static_cast<size_t>(i) * nh],
                &comb[static_cast<size_t>(i) * nh * nh], x + i * S);
    }
}

// Embedding row of `token` into all n_hc streams of x [n_hc, D].
static void embed_token(const model &m, int32_t token, float *x) {
    const int64_t D = m.hp.n_embd;
    const uint8_t *src = m.tok_embd.row(token);
    if (m.tok_embd.type == dtype::f32)
        std::memcpy(x, src, static_cast<size_t>(D) * sizeof(float));
    else
        cpu::dequantize_row(m.tok_embd.type, src, x, D);
    for (int s = 1; s < m.hp.n_hc; ++s) std::copy(x, x + D, x + s * D);
}

static void check_inputs(const model &m, const state &st, std::span<const int32_t> tokens,
                         std::span<const int64_t> positions, const forward_out &out) {
    const size_t n = tokens.size();
    if (positions.size() != n)
        throw error("ds4 forward: " + std::to_string(n) + " tokens but " + std::to_string(positions.size()) +
                    " positions");
    if (st.layers.size() != m.layers.size()) throw error("ds4 forward: state does not belong to this model");
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= m.hp.n_vocab)
            throw error("ds4 forward: token id " + std::to_string(tokens[i]) + " outside [0, " +
                        std::to_string(m.hp.n_vocab) + ")");
        // Compressors pool blocks of absolute positions: the sequence must be contiguous.
        if (positions[i] != st.n_past + static_cast<int64_t>(i))
            throw error("ds4 forward: position " + std::to_string(positions[i]) + " at index " +
                        std::to_string(i) + ", expected " +
                        std::to_string(st.n_past + static_cast<int64_t>(i)));
    }
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    if (!out.logits.empty() && out.logits.size() != n * V && out.logits.size() != V)
        throw error("ds4 forward: logits buffer of " + std::to_string(out.logits.size()) +
                    " floats, expected " + std::to_string(n * V) + " or " + std::to_string(V));
    const size_t S = static_cast<size_t>(m.hp.n_hc) * static_cast<size_t>(m.hp.n_embd);
    if (!out.hc_state.empty() && out.hc_state.size() != n * S)
        throw error("ds4 forward: hc_state buffer of " + std::to_string(out.hc_state.size()) +
                    " floats, expected " + std::to_string(n * S));
}

void forward(const model &m, state &st, std::span<const int32_t> tokens, std::span<const int64_t> positions,
             const forward_out &out) {
    check_inputs(m, st, tokens, positions, out);
    const exec_scope exec(st.exec);  // threading / quantised products for every matmul below
    const hparams &hp = m.hp;
    const int64_t n = static_cast<int64_t>(tokens.size()), D = hp.n_embd, S = hp.n_hc * D, V = hp.n_vocab;
    if (n == 0) return;
    const rope_set ropes = make_rope_set(hp);
    std::vector<float> x(static_cast<size_t>(n * S));  // [n, n_hc, D] hyper-connection state
    for (int64_t i = 0; i < n; ++i)
        embed_token(m, tokens[static_cast<size_t>(i)], &x[static_cast<size_t>(i * S)]);
    for (size_t il = 0; il < m.layers.size(); ++il)
        block_forward(hp, ropes, m.layers[il], st.layers[il], st.qat, x.data(), tokens, positions);
    st.n_past += n;
    if (!out.hc_state.empty()) std::copy(x.begin(), x.end(), out.hc_state.begin());
    if (out.logits.empty()) return;
    // Head: z = HCHead(X); logits = W_out * RMSNorm(z; output_norm) (all tokens or the last one).
    const int64_t i0 = static_cast<int64_t>(out.logits.size()) == V ? n - 1 : 0;
    std::vector<float> z(static_cast<size_t>(D));
    for (int64_t i = i0; i < n; ++i) {
        hc_head(hp, m.hc_head, &x[static_cast<size_t>(i * S)], z.data());
        rms_norm(z.data(), D, m.output_norm.data(), hp.rms_eps, z.data());
        matmul(m.output, z.data(), 1, &out.logits[static_cast<size_t>((i - i0) * V)]);
    }
}

}  // namespace fathom::ds4
