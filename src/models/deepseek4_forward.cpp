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

// ---- tensor-parallel views -----------------------------------------------------------------------

tp_slice tp_whole(const hparams &hp) {
    return {0, hp.n_head, 0, hp.o_groups, 0, hp.n_expert, 0, hp.n_ff_exp};
}

matrix matrix_rows(const matrix &w, int64_t r0, int64_t r1) {
    if (r0 < 0 || r1 < r0 || r1 > w.rows)
        throw error("ds4: row block [" + std::to_string(r0) + ", " + std::to_string(r1) + ") outside " +
                    std::to_string(w.rows) + " rows");
    matrix v = w;
    v.data = w.data + static_cast<size_t>(r0) * w.row_bytes;
    v.rows = r1 - r0;
    return v;
}

matrix matrix_cols(const matrix &w, int64_t c0, int64_t c1, const char *what) {
    if (c0 == 0 && c1 == w.cols) return w;
    const int64_t bs = dtype_info(w.type).block_size;
    if (c0 < 0 || c1 <= c0 || c1 > w.cols)
        throw error(std::string("ds4 tp: ") + what + ": column block [" + std::to_string(c0) + ", " +
                    std::to_string(c1) + ") outside " + std::to_string(w.cols) + " columns");
    // A quantised row is a sequence of whole blocks: a view can only start and end on a block boundary.
    if (c0 % bs != 0 || (c1 - c0) % bs != 0)
        throw error(std::string("ds4 tp: ") + what + " is " + std::string(dtype_info(w.type).name) + " (blocks of " +
                    std::to_string(bs) + "): its column block [" + std::to_string(c0) + ", " + std::to_string(c1) +
                    ") does not start and end on a block boundary; use fewer ranks");
    matrix v = w;
    v.data = w.data + dtype_row_bytes(w.type, c0);
    v.cols = c1 - c0;
    return v;
}

void block_forward(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                   qat_mode qat, float *x, std::span<const int32_t> tokens,
                   std::span<const int64_t> positions, const tp_block *tp) {
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
    attention_layer(hp, ropes, l, ls, qat, u.data(), positions, y.data(), tp ? &tp->slice : nullptr);
    if (tp) tp->reduce(y);  // partial [n, D] of this rank's heads -> the sum over all ranks
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
    moe_forward_batch(hp, l, u.data(), tokens, y.data(), tp ? &tp->slice : nullptr);
    if (tp) tp->reduce(y);  // partial [n, D] of this rank's experts -> the sum over all ranks
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

void embed_tokens(const model &m, std::span<const int32_t> tokens, std::span<float> x) {
    const size_t S = static_cast<size_t>(m.hp.n_hc) * static_cast<size_t>(m.hp.n_embd);
    if (x.size() != tokens.size() * S)
        throw error("ds4 embed: state buffer of " + std::to_string(x.size()) + " floats, expected " +
                    std::to_string(tokens.size() * S));
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || tokens[i] >= m.hp.n_vocab)
            throw error("ds4 embed: token id " + std::to_string(tokens[i]) + " outside [0, " +
                        std::to_string(m.hp.n_vocab) + ")");
        embed_token(m, tokens[i], &x[i * S]);
    }
}

// Blocks [l0, l1) of every rank (tp null) or one tensor-parallel rank.
static void run_layers(const model &m, std::span<layer_state> layers, qat_mode qat, const exec_options &exec,
                       int l0, int l1, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                       std::span<float> x, const tp_block *tp) {
    const size_t n = tokens.size(), S = static_cast<size_t>(m.hp.n_hc) * static_cast<size_t>(m.hp.n_embd);
    if (l0 < 0 || l1 < l0 || l1 > static_cast<int>(m.layers.size()))
        throw error("ds4 forward_layers: range [" + std::to_string(l0) + ", " + std::to_string(l1) +
                    ") outside the model's " + std::to_string(m.layers.size()) + " layers");
    if (layers.size() != static_cast<size_t>(l1 - l0))
        throw error("ds4 forward_layers: " + std::to_string(layers.size()) + " layer states for range [" +
                    std::to_string(l0) + ", " + std::to_string(l1) + ")");
    if (positions.size() != n || x.size() != n * S)
        throw error("ds4 forward_layers: " + std::to_string(n) + " tokens, " + std::to_string(positions.size()) +
                    " positions and a state of " + std::to_string(x.size()) + " floats (expected " +
                    std::to_string(n * S) + ")");
    if (n == 0) return;
    const exec_scope scope(exec);
    const rope_set ropes = make_rope_set(m.hp);
    for (int il = l0; il < l1; ++il)
        block_forward(m.hp, ropes, m.layers[static_cast<size_t>(il)], layers[static_cast<size_t>(il - l0)], qat,
                      x.data(), tokens, positions, tp);
}

void forward_layers(const model &m, std::span<layer_state> layers, qat_mode qat, const exec_options &exec,
                    int l0, int l1, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                    std::span<float> x) {
    run_layers(m, layers, qat, exec, l0, l1, tokens, positions, x, nullptr);
}

void forward_layers_tp(const model &m, std::span<layer_state> layers, qat_mode qat, const exec_options &exec,
                       int l0, int l1, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                       std::span<float> x, const tp_block &tp) {
    run_layers(m, layers, qat, exec, l0, l1, tokens, positions, x, &tp);
}

void head_logits(const model &m, const exec_options &exec, std::span<const float> x, std::span<float> logits) {
    const hparams &hp = m.hp;
    const int64_t D = hp.n_embd, S = hp.n_hc * D, V = hp.n_vocab;
    const int64_t n = static_cast<int64_t>(x.size()) / S;
    if (static_cast<int64_t>(x.size()) != n * S || n == 0 ||
        (static_cast<int64_t>(logits.size()) != n * V && static_cast<int64_t>(logits.size()) != V))
        throw error("ds4 head: state of " + std::to_string(x.size()) + " floats and logits buffer of " +
                    std::to_string(logits.size()) + " floats do not match n_hc*D = " + std::to_string(S) +
                    ", n_vocab = " + std::to_string(V));
    const exec_scope scope(exec);
    // z = HCHead(X); logits = W_out * RMSNorm(z; output_norm) (all tokens or the last one).
    const int64_t i0 = static_cast<int64_t>(logits.size()) == V ? n - 1 : 0;
    std::vector<float> z(static_cast<size_t>(D));
    for (int64_t i = i0; i < n; ++i) {
        hc_head(hp, m.hc_head, &x[static_cast<size_t>(i * S)], z.data());
        rms_norm(z.data(), D, m.output_norm.data(), hp.rms_eps, z.data());
        matmul(m.output, z.data(), 1, &logits[static_cast<size_t>((i - i0) * V)]);
    }
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
    const int64_t n = static_cast<int64_t>(tokens.size()), S = m.hp.n_hc * m.hp.n_embd;
    if (n == 0) return;
    std::vector<float> x(static_cast<size_t>(n * S));  // [n, n_hc, D] hyper-connection state
    embed_tokens(m, tokens, x);
    forward_layers(m, st.layers, st.qat, st.exec, 0, static_cast<int>(m.layers.size()), tokens, positions, x);
    st.n_past += n;
    if (!out.hc_state.empty()) std::copy(x.begin(), x.end(), out.hc_state.begin());
    if (!out.logits.empty()) head_logits(m, st.exec, x, out.logits);
}

}  // namespace fathom::ds4
