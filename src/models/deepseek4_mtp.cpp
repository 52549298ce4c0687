// DS4 MTP head (see deepseek4_mtp.h): loading in both layouts and the per-row forward
//   e = e_proj (RMSNorm(Embed[u_i]) * enorm);  X_s = e + h_proj (RMSNorm(H_(i,s)) * hnorm)
//   X = Block(X);  logits = W_out (RMSNorm(HCHead_mtp(X)) * norm).
#include "models/deepseek4_mtp.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

namespace {

// The MTP file's shape keys must agree with the main model's (each mismatch names its key).
void check_compatible(const gguf::file &f, const hparams &a, const hparams &b) {
    const std::pair<const char *, std::pair<int64_t, int64_t>> keys[] = {
        {"embedding_length", {a.n_embd, b.n_embd}},
        {"vocab_size", {a.n_vocab, b.n_vocab}},
        {"attention.head_count", {a.n_head, b.n_head}},
        {"attention.key_length", {a.head_dim, b.head_dim}},
        {"rope.dimension_count", {a.n_rot, b.n_rot}},
        {"attention.q_lora_rank", {a.q_lora, b.q_lora}},
        {"attention.output_group_count", {a.o_groups, b.o_groups}},
        {"attention.output_lora_rank", {a.o_rank, b.o_rank}},
        {"attention.sliding_window", {a.window, b.window}},
        {"expert_count", {a.n_expert, b.n_expert}},
        {"expert_used_count", {a.n_expert_used, b.n_expert_used}},
        {"expert_shared_count", {a.n_expert_shared, b.n_expert_shared}},
        {"expert_feed_forward_length", {a.n_ff_exp, b.n_ff_exp}},
        {"hyper_connection.count", {a.n_hc, b.n_hc}},
    };
    for (const auto &[k, v] : keys)
        if (v.first != v.second)
            throw error(f.path() + ": MTP file key deepseek4." + std::string(k) + " = " +
                        std::to_string(v.first) + " differs from the main model's " +
                        std::to_string(v.second));
}

std::vector<float> vec_f32(const gguf::file &f, const std::string &name, int64_t n) {
    const gguf::tensor_info &t = f.tensor(name);
    if (t.n_dims != 1 || t.ne[0] != n)
        throw error(f.path() + ": tensor " + name + " must have shape {" + std::to_string(n) + "}");
    if (t.type != dtype::f32 && t.type != dtype::f16 && t.type != dtype::bf16)
        throw error(f.path() + ": tensor " + name + " has type " + std::string(dtype_name(t.type)) +
                    ", expected f32, f16 or bf16");
    std::vector<float> v(static_cast<size_t>(n));
    if (t.type == dtype::f32)
        std::memcpy(v.data(), t.data, v.size() * sizeof(float));
    else
        cpu::dequantize_row(t.type, t.data, v.data(), n);
    return v;
}

matrix mat(const gguf::file &f, const std::string &name, int64_t cols, int64_t rows) {
    const gguf::tensor_info &t = f.tensor(name);
    if (t.n_dims != 2 || t.ne[0] != cols || t.ne[1] != rows)
        throw error(f.path() + ": tensor " + name + " must have shape {" + std::to_string(cols) + ", " +
                    std::to_string(rows) + "}");
    const auto &ti = dtype_info(t.type);
    if ((t.type != dtype::f32 && !ti.compute) || cols % ti.block_size != 0)
        throw error(f.path() + ": tensor " + name + " has unsupported type " + std::string(ti.name));
    return {t.type, t.data, rows, cols, dtype_row_bytes(t.type, cols)};
}

hc_weights head_hc(const gguf::file &f, const std::string &stem, const hparams &hp) {
    hc_weights w;
    w.fn = mat(f, stem + "fn.weight", static_cast<int64_t>(hp.n_hc) * hp.n_embd, hp.n_hc);
    w.base = vec_f32(f, stem + "base.weight", hp.n_hc);
    w.scale = vec_f32(f, stem + "scale.weight", 1);
    return w;
}

}  // namespace

std::unique_ptr<mtp_weights> load_mtp(const model &main, std::shared_ptr<const gguf::file> fp) {
    const gguf::file &f = *fp;
    const hparams &hp = main.hp;
    const hparams fh = load_hparams(f);
    check_compatible(f, fh, hp);
    auto w = std::make_unique<mtp_weights>();
    const int64_t D = hp.n_embd;
    if (f.find_tensor("mtp.0.e_proj.weight")) {
        // antirez/ds4 layout: block_count counts only the main blocks, so the MTP block has no entry
        // in the per-block clamp arrays; it takes the last main block's (DS4C requires all equal).
        const float clamp = fh.clamp_exp.back(), clamp_sh = fh.clamp_shexp.back();
        w->block = load_layer(f, hp, "mtp.0.", 0, false, clamp, clamp_sh);
        w->e_proj = mat(f, "mtp.0.e_proj.weight", D, D);
        w->h_proj = mat(f, "mtp.0.h_proj.weight", D, D);
        w->enorm = vec_f32(f, "mtp.0.enorm.weight", D);
        w->hnorm = vec_f32(f, "mtp.0.hnorm.weight", D);
        w->norm = vec_f32(f, "mtp.0.norm.weight", D);
        w->hc_head = head_hc(f, "mtp.0.hc_head_", hp);
    } else {
        // llama.cpp layout: the MTP block is blk.<n_layer>, counted in block_count.
        if (fh.n_nextn < 1 || fh.n_layer != hp.n_layer)
            throw error(f.path() + ": not an MTP file for this model (deepseek4.nextn_predict_layers = " +
                        std::to_string(fh.n_nextn) + ", main blocks " + std::to_string(fh.n_layer) + " vs " +
                        std::to_string(hp.n_layer) + ")");
        const size_t il = static_cast<size_t>(hp.n_layer);
        if (fh.compress_ratio[il] != 0)
            throw error(f.path() + ": deepseek4.attention.compress_ratios[" + std::to_string(il) +
                        "] of the MTP block must be 0");
        const std::string p = "blk." + std::to_string(il) + ".";
        w->block = load_layer(f, hp, p, 0, false, fh.clamp_exp[il], fh.clamp_shexp[il]);
        const matrix eh = mat(f, p + "nextn.eh_proj.weight", 2 * D, D);
        w->e_proj = {eh.type, eh.data, D, D, eh.row_bytes};
        w->h_proj = {eh.type, eh.data + dtype_row_bytes(eh.type, D), D, D, eh.row_bytes};
        w->enorm = vec_f32(f, p + "nextn.enorm.weight", D);
        w->hnorm = vec_f32(f, p + "nextn.hnorm.weight", D);
        w->norm = vec_f32(f, p + "nextn.shared_head_norm.weight", D);
        w->hc_head = head_hc(f, "output_hc_", hp);
    }
    w->file = std::move(fp);
    return w;
}

std::unique_ptr<mtp_weights> load_mtp(const model &main, const std::string &path) {
    return load_mtp(main, std::shared_ptr<const gguf::file>(gguf::file::open(path)));
}

mtp_state new_mtp_state(const model &main, const mtp_weights &w, qat_mode qat, kv_precision kv) {
    mtp_state st;
    st.qat = qat;
    st.block = new_layer_state(main.hp, w.block, kv);
    return st;
}

void mtp_truncate(mtp_state &st, int64_t n) {
    if (n > st.n_past || n < std::max<int64_t>(0, st.reached - max_rollback))
        throw error("ds4 mtp: cannot roll back to " + std::to_string(n) + " rows (holds " + std::to_string(st.n_past) +
                    ", reached " + std::to_string(st.reached) + ")");
    st.n_past = n;  // a window-only block: its ring is indexed by position, nothing else to drop
}

namespace {

// The arguments of mtp_forward / mtp_observe for n rows (each mismatch named).
void check_rows(const hparams &hp, const mtp_state &st, std::span<const float> hc_state,
                std::span<const int32_t> next_tokens, std::span<const int64_t> positions) {
    const int64_t n = static_cast<int64_t>(next_tokens.size()), S = hp.n_hc * hp.n_embd;
    if (positions.size() != next_tokens.size() || hc_state.size() != static_cast<size_t>(n * S))
        throw error("ds4 mtp: " + std::to_string(n) + " tokens, " + std::to_string(positions.size()) +
                    " positions and " + std::to_string(hc_state.size()) + " state floats do not match");
    for (int64_t i = 0; i < n; ++i) {
        if (positions[static_cast<size_t>(i)] != st.n_past + i)
            throw error("ds4 mtp: position " + std::to_string(positions[static_cast<size_t>(i)]) +
                        ", expected " + std::to_string(st.n_past + i));
        if (next_tokens[static_cast<size_t>(i)] < 0 || next_tokens[static_cast<size_t>(i)] >= hp.n_vocab)
            throw error("ds4 mtp: token id " + std::to_string(next_tokens[static_cast<size_t>(i)]) +
                        " out of range");
    }
}

// The block's input of n rows: x [n, n_hc, D], stream s of row i = e_proj(RMSNorm(embed(t_i)) * enorm)
// + h_proj(RMSNorm(hc_state[i, s]) * hnorm). Each product takes all its rows at once (matmul is batch
// invariant: every row's bits are those of a one-row product), so h_proj's weights are read once per
// call, not once per stream and row.
std::vector<float> mtp_input(const model &main, const mtp_weights &w, std::span<const float> hc_state,
                             std::span<const int32_t> next_tokens) {
    const hparams &hp = main.hp;
    const int64_t n = static_cast<int64_t>(next_tokens.size()), D = hp.n_embd, nh = hp.n_hc;
    std::vector<float> emb(static_cast<size_t>(n * D)), e(static_cast<size_t>(n * D)),
        hs(static_cast<size_t>(n * nh * D)), h(static_cast<size_t>(n * nh * D));
    for (int64_t i = 0; i < n; ++i) {
        float *ei = &emb[static_cast<size_t>(i * D)];
        const uint8_t *row = main.tok_embd.row(next_tokens[static_cast<size_t>(i)]);
        if (main.tok_embd.type == dtype::f32)
            std::memcpy(ei, row, static_cast<size_t>(D) * sizeof(float));
        else
            cpu::dequantize_row(main.tok_embd.type, row, ei, D);
        rms_norm(ei, D, w.enorm.data(), hp.rms_eps, ei);
    }
    matmul(w.e_proj, emb.data(), n, e.data());
    for (int64_t r = 0; r < n * nh; ++r)  // per-stream RMSNorm of the main state
        rms_norm(&hc_state[static_cast<size_t>(r * D)], D, w.hnorm.data(), hp.rms_eps, &hs[static_cast<size_t>(r * D)]);
    matmul(w.h_proj, hs.data(), n * nh, h.data());
    std::vector<float> x(static_cast<size_t>(n * nh * D));
    for (int64_t r = 0; r < n * nh; ++r)
        for (int64_t k = 0; k < D; ++k)
            x[static_cast<size_t>(r * D + k)] = e[static_cast<size_t>((r / nh) * D + k)] + h[static_cast<size_t>(r * D + k)];
    return x;
}

}  // namespace

void mtp_forward(const model &main, const mtp_weights &w, mtp_state &st, std::span<const float> hc_state,
                 std::span<const int32_t> next_tokens, std::span<const int64_t> positions,
                 std::span<float> logits, std::span<float> hc_out) {
    const exec_scope exec(st.exec);  // threading / quantised products for every matmul below
    const hparams &hp = main.hp;
    const int64_t n = static_cast<int64_t>(next_tokens.size()), D = hp.n_embd, S = hp.n_hc * D, V = hp.n_vocab;
    check_rows(hp, st, hc_state, next_tokens, positions);
    if (!logits.empty() && logits.size() != static_cast<size_t>(n * V) && logits.size() != static_cast<size_t>(V))
        throw error("ds4 mtp: logits buffer of " + std::to_string(logits.size()) + " floats");
    if (!hc_out.empty() && hc_out.size() != static_cast<size_t>(n * S))
        throw error("ds4 mtp: hc_out buffer of " + std::to_string(hc_out.size()) + " floats");
    if (n == 0) return;
    std::vector<float> x = mtp_input(main, w, hc_state, next_tokens);
    block_forward(hp, make_rope_set(hp), w.block, st.block, st.qat, x.data(), next_tokens, positions);
    st.n_past += n;
    st.reached = std::max(st.reached, st.n_past);
    if (!hc_out.empty()) std::copy(x.begin(), x.end(), hc_out.begin());
    if (logits.empty()) return;
    const int64_t i0 = static_cast<int64_t>(logits.size()) == V ? n - 1 : 0;
    std::vector<const float *> rows;
    for (int64_t i = i0; i < n; ++i) rows.push_back(&x[static_cast<size_t>(i * S)]);
    head_rows(hp, w.hc_head, w.norm.data(), main.output, rows, logits.data());
}

void mtp_observe(const model &main, const mtp_weights &w, mtp_state &st, std::span<const float> hc_state,
                 std::span<const int32_t> next_tokens, std::span<const int64_t> positions) {
    const exec_scope exec(st.exec);
    check_rows(main.hp, st, hc_state, next_tokens, positions);
    if (next_tokens.empty()) return;
    std::vector<float> x = mtp_input(main, w, hc_state, next_tokens);
    block_state(main.hp, make_rope_set(main.hp), w.block, st.block, st.qat, x.data(), next_tokens, positions);
    st.n_past += static_cast<int64_t>(next_tokens.size());
    st.reached = std::max(st.reached, st.n_past);
}

}  // namespace fathom::ds4
