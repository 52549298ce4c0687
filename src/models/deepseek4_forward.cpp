// DS4 whole-model forward (spec section 2): embedding -> n_layer blocks, each an HC-wrapped
// attention half and an HC-wrapped MoE half -> HC head -> final norm -> logits. Evaluated
// layer-major over a chunk of tokens; all cross-token state lives in ds4::state.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "models/deepseek4_exec.h"
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

// ---- the CPU executor (deepseek4_exec.h) ----------------------------------------------------------
// The reference implementation of the executor's operations over R rows: x [R, n_hc, D] (the caller's
// buffer, updated in place), every product over all rows at once (matmul / cpu::gemm compute each row
// as they would alone: batch invariant), the attention and compressor state updates row by row in row
// order against each row's own sequence state (`state_of`), tensor parallel through `tp` (a rank's
// partial sublayer outputs, all-reduced before HCPost).
namespace {

// layers: the blocks it holds, block il at layers[il - l_base]; logit_rows / out: the head's rows and
// their logits [logit_rows.size(), n_vocab].
class cpu_executor final : public executor {
  public:
    using state_fn = std::function<layer_state &(size_t row, int il)>;
    cpu_executor(const model *m, const hparams &hp, std::span<const layer_weights> layers, int l_base,
                 const rope_set &ropes, qat_mode qat, float *x, std::span<const int32_t> tokens,
                 std::span<const int64_t> positions, state_fn state_of, const tp_block *tp,
                 std::span<const int32_t> logit_rows = {}, std::span<float> out = {})
        : m_(m), hp_(hp), layers_(layers), l_base_(l_base), ropes_(ropes), qat_(qat), x_(x), tokens_(tokens),
          positions_(positions), state_of_(std::move(state_of)), tp_(tp), logit_rows_(logit_rows), out_(out),
          n_(static_cast<int64_t>(positions.size())) {
        const size_t n = static_cast<size_t>(n_), D = static_cast<size_t>(hp.n_embd), nh = static_cast<size_t>(hp.n_hc);
        u_.resize(n * D);
        y_.resize(n * D);
        post_.resize(n * nh);
        comb_.resize(n * nh * nh);
    }

    void embed() override {
        const size_t S = static_cast<size_t>(hp_.n_hc) * static_cast<size_t>(hp_.n_embd);
        embed_tokens(*m_, tokens_, std::span<float>(x_, static_cast<size_t>(n_) * S));
    }

    // (u, post, comb) = HCPre(X) per row; xn = RMSNorm(u) in place in u. The mixing products of all rows
    // in one matmul (each row's as alone), the per-row rest over the pool: the bits of hc_pre row by row.
    void hc_pre(int il, sublayer which) override {
        const layer_weights &l = layer(il);
        const int64_t D = hp_.n_embd, S = hp_.n_hc * D;
        const size_t nh = static_cast<size_t>(hp_.n_hc);
        const bool attn = which == sublayer::attention;
        const hc_weights &w = attn ? l.hc_attn : l.hc_ffn;
        const int64_t nm = w.fn.rows;
        mix_.resize(static_cast<size_t>(n_ * nm));
        matmul(w.fn, x_, n_, mix_.data());
        parallel_for(n_, 8 * S, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
                float *ui = &u_[static_cast<size_t>(i * D)];
                ds4::hc_pre_mixed(hp_, w, x_ + i * S, &mix_[static_cast<size_t>(i * nm)], ui,
                                  &post_[static_cast<size_t>(i) * nh], &comb_[static_cast<size_t>(i) * nh * nh]);
                rms_norm(ui, D, attn ? l.attn_norm.data() : l.ffn_norm.data(), hp_.rms_eps, ui);
            }
        });
    }

    void attention(int il) override {
        std::vector<layer_state *> states(static_cast<size_t>(n_));
        for (size_t i = 0; i < states.size(); ++i) states[i] = &state_of_(i, il);
        attention_rows(hp_, ropes_, layer(il), states, qat_, u_.data(), positions_, y_.data(), tp_ ? &tp_->slice : nullptr);
        if (tp_) tp_->reduce(y_);  // partial [n, D] of this rank's heads -> the sum over all ranks
    }

    void attention_state(int il) override {
        std::vector<layer_state *> states(static_cast<size_t>(n_));
        for (size_t i = 0; i < states.size(); ++i) states[i] = &state_of_(i, il);
        attention_state_rows(hp_, ropes_, layer(il), states, qat_, u_.data(), positions_);
    }

    void moe(int il) override {
        moe_forward_batch(hp_, layer(il), u_.data(), tokens_, y_.data(), tp_ ? &tp_->slice : nullptr);
        if (tp_) tp_->reduce(y_);  // partial [n, D] of this rank's experts -> the sum over all ranks
    }

    void hc_post() override {
        const int64_t D = hp_.n_embd, S = hp_.n_hc * D;
        const size_t nh = static_cast<size_t>(hp_.n_hc);
        parallel_for(n_, 2 * S * hp_.n_hc, [&](int64_t i0, int64_t i1) {
            thread_local std::vector<float> x_old;  // per thread: rows run on both threads
            x_old.resize(static_cast<size_t>(S));
            for (int64_t i = i0; i < i1; ++i) {
                std::copy(x_ + i * S, x_ + (i + 1) * S, x_old.begin());
                ds4::hc_post(hp_.n_hc, D, &y_[static_cast<size_t>(i * D)], x_old.data(),
                             &post_[static_cast<size_t>(i) * nh], &comb_[static_cast<size_t>(i) * nh * nh], x_ + i * S);
            }
        });
    }

    void head() override {  // every logit row in one pass over the output matrix
        const size_t S = static_cast<size_t>(hp_.n_hc) * static_cast<size_t>(hp_.n_embd);
        std::vector<const float *> rows;
        for (const int32_t r : logit_rows_) rows.push_back(x_ + static_cast<size_t>(r) * S);
        head_rows(hp_, m_->hc_head, m_->output_norm.data(), m_->output, rows, out_.data());
    }

  private:
    const layer_weights &layer(int il) const { return layers_[static_cast<size_t>(il - l_base_)]; }
    const model *m_;  // embed / head only (null for a lone block)
    const hparams &hp_;
    std::span<const layer_weights> layers_;
    int l_base_;
    const rope_set &ropes_;
    qat_mode qat_;
    float *x_;
    std::span<const int32_t> tokens_;
    std::span<const int64_t> positions_;
    state_fn state_of_;
    const tp_block *tp_;
    std::span<const int32_t> logit_rows_;
    std::span<float> out_;
    int64_t n_;
    std::vector<float> u_, y_, post_, comb_, mix_;
};

}  // namespace

void block_forward(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                   qat_mode qat, float *x, std::span<const int32_t> tokens,
                   std::span<const int64_t> positions, const tp_block *tp) {
    cpu_executor ex(nullptr, hp, std::span<const layer_weights>(&l, 1), 0, ropes, qat, x, tokens, positions,
                    [&](size_t, int) -> layer_state & { return ls; }, tp);
    run_block(ex, 0);
}

void block_state(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls, qat_mode qat,
                 float *x, std::span<const int32_t> tokens, std::span<const int64_t> positions) {
    cpu_executor ex(nullptr, hp, std::span<const layer_weights>(&l, 1), 0, ropes, qat, x, tokens, positions,
                    [&](size_t, int) -> layer_state & { return ls; }, nullptr);
    run_block_state(ex, 0);
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
    cpu_executor ex(&m, m.hp, m.layers, 0, ropes, qat, x.data(), tokens, positions,
                    [&](size_t, int il) -> layer_state & { return layers[static_cast<size_t>(il - l0)]; }, tp);
    run_forward(ex, static_cast<int>(m.layers.size()), l0, l1, false, false);
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
    std::vector<const float *> rows;
    for (int64_t i = i0; i < n; ++i) rows.push_back(&x[static_cast<size_t>(i * S)]);
    head_rows(hp, m.hc_head, m.output_norm.data(), m.output, rows, logits.data());
}

void head_rows(const hparams &hp, const hc_weights &hc, const float *norm, const matrix &output,
               std::span<const float *const> rows, float *logits) {
    const int64_t D = hp.n_embd, V = hp.n_vocab, n = static_cast<int64_t>(rows.size());
    constexpr int64_t kRows = 64;  // z rows per product: the quantised GEMMs' activation panel
    std::vector<float> z(static_cast<size_t>(std::min(n, kRows) * D));
    for (int64_t r0 = 0; r0 < n; r0 += kRows) {
        const int64_t m = std::min(kRows, n - r0);
        for (int64_t i = 0; i < m; ++i) {
            float *zi = &z[static_cast<size_t>(i * D)];
            hc_head(hp, hc, rows[static_cast<size_t>(r0 + i)], zi);
            rms_norm(zi, D, norm, hp.rms_eps, zi);
        }
        matmul(output, z.data(), m, logits + r0 * V);
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

// Every row of a step through the executor-driven forward: rows [R] of sequences seqs[row_seq[r]] at
// positions[r]; the logits of `logit_rows` into logits, the final HC state of every row into hc_out
// (when not empty). The caller has checked the rows; n_past advances here.
static void eval_rows(const model &m, std::span<state *const> seqs, std::span<const int32_t> tokens,
                      std::span<const int64_t> positions, std::span<const int32_t> row_seq,
                      std::span<const int32_t> logit_rows, std::span<float> logits, const step_extras &extras) {
    const size_t R = tokens.size(), S = static_cast<size_t>(m.hp.n_hc) * static_cast<size_t>(m.hp.n_embd);
    if (R == 0) return;
    std::vector<float> x(R * S);  // [R, n_hc, D] hyper-connection state
    const state &first = *seqs[0];
    const exec_scope scope(first.exec);
    const rope_set ropes = make_rope_set(m.hp);
    cpu_executor ex(&m, m.hp, m.layers, 0, ropes, first.qat, x.data(), tokens, positions,
                    [&](size_t r, int il) -> layer_state & {
                        return seqs[static_cast<size_t>(row_seq[r])]->layers[static_cast<size_t>(il)];
                    },
                    nullptr, logit_rows, logits);
    // Feature capture: after block feature_layers[f], features[r][f*D ..] = the mean of row r's streams.
    const size_t D = static_cast<size_t>(m.hp.n_embd), nh = static_cast<size_t>(m.hp.n_hc),
                 nf = extras.feature_layers.size();
    std::function<void(int)> capture;
    if (nf > 0 && !extras.features.empty())
        capture = [&](int il) {
            for (size_t f = 0; f < nf; ++f) {
                if (extras.feature_layers[f] != il) continue;
                for (size_t r = 0; r < R; ++r) {
                    float *out = &extras.features[(r * nf + f) * D];
                    const float *xr = &x[r * S];
                    for (size_t i = 0; i < D; ++i) {
                        float acc = 0;
                        for (size_t k = 0; k < nh; ++k) acc += xr[k * D + i];
                        out[i] = acc / static_cast<float>(nh);
                    }
                }
            }
        };
    const int n_layer = static_cast<int>(m.layers.size());
    run_forward(ex, n_layer, 0, n_layer, true, !logits.empty(), capture);
    for (size_t r = 0; r < R; ++r) {
        state &st = *seqs[static_cast<size_t>(row_seq[r])];
        st.n_past = positions[r] + 1;
        st.reached = std::max(st.reached, st.n_past);
    }
    if (!extras.hc_state.empty()) std::copy(x.begin(), x.end(), extras.hc_state.begin());
}

void forward(const model &m, state &st, std::span<const int32_t> tokens, std::span<const int64_t> positions,
             const forward_out &out) {
    check_inputs(m, st, tokens, positions, out);
    const size_t n = tokens.size(), V = static_cast<size_t>(m.hp.n_vocab);
    if (n == 0) return;
    std::vector<int32_t> logit_rows;  // every row, or the last one
    if (out.logits.size() == n * V)
        for (size_t i = 0; i < n; ++i) logit_rows.push_back(static_cast<int32_t>(i));
    else if (!out.logits.empty())
        logit_rows.push_back(static_cast<int32_t>(n - 1));
    state *one = &st;
    const std::vector<int32_t> row_seq(n, 0);
    eval_rows(m, std::span<state *const>(&one, 1), tokens, positions, row_seq, logit_rows, out.logits,
              {out.hc_state, {}, {}});
}

void step(const model &m, std::span<state *const> seqs, std::span<const step_row> rows,
          std::span<const int32_t> logit_rows, std::span<float> logits) {
    step(m, seqs, rows, logit_rows, logits, {});
}

void step(const model &m, std::span<state *const> seqs, std::span<const step_row> rows,
          std::span<const int32_t> logit_rows, std::span<float> logits, const step_extras &extras) {
    const size_t R = rows.size(), V = static_cast<size_t>(m.hp.n_vocab);
    const size_t S = static_cast<size_t>(m.hp.n_hc) * static_cast<size_t>(m.hp.n_embd), D = static_cast<size_t>(m.hp.n_embd);
    if (!extras.hc_state.empty() && extras.hc_state.size() != R * S)
        throw error("ds4 step: hc_state buffer of " + std::to_string(extras.hc_state.size()) + " floats, expected " +
                    std::to_string(R * S));
    for (int l : extras.feature_layers)
        if (l < 0 || l >= m.hp.n_layer) throw error("ds4 step: feature layer " + std::to_string(l) + " outside the model");
    if (!extras.features.empty() && extras.features.size() != R * extras.feature_layers.size() * D)
        throw error("ds4 step: features buffer of " + std::to_string(extras.features.size()) + " floats, expected " +
                    std::to_string(R * extras.feature_layers.size() * D));
    for (size_t k = 0; k < seqs.size(); ++k) {
        const std::string who = "ds4 step: sequence " + std::to_string(k);
        if (!seqs[k]) throw error(who + " is null");
        if (seqs[k]->layers.size() != m.layers.size()) throw error(who + ": state does not belong to this model");
        if (seqs[k]->qat != seqs[0]->qat || seqs[k]->kv != seqs[0]->kv)
            throw error(who + ": QAT mode or KV precision differs from sequence 0's");
        for (size_t j = 0; j < k; ++j)
            if (seqs[j] == seqs[k]) throw error(who + " is sequence " + std::to_string(j) + " again");
    }
    std::vector<int64_t> next(seqs.size());
    for (size_t k = 0; k < seqs.size(); ++k) next[k] = seqs[k]->n_past;
    std::vector<int32_t> tokens(R), row_seq(R);
    std::vector<int64_t> positions(R);
    for (size_t r = 0; r < R; ++r) {
        const step_row &w = rows[r];
        const std::string who = "ds4 step: row " + std::to_string(r);
        if (w.seq < 0 || static_cast<size_t>(w.seq) >= seqs.size())
            throw error(who + " names sequence " + std::to_string(w.seq) + "; the step has " +
                        std::to_string(seqs.size()));
        if (w.token < 0 || w.token >= m.hp.n_vocab)
            throw error(who + ": token id " + std::to_string(w.token) + " outside [0, " + std::to_string(m.hp.n_vocab) + ")");
        int64_t &nx = next[static_cast<size_t>(w.seq)];
        // Compressors pool blocks of absolute positions: a sequence's rows must continue it without gaps.
        if (w.pos != nx)
            throw error(who + ": position " + std::to_string(w.pos) + " of sequence " + std::to_string(w.seq) +
                        ", expected " + std::to_string(nx));
        ++nx;
        tokens[r] = w.token;
        positions[r] = w.pos;
        row_seq[r] = w.seq;
    }
    for (int32_t r : logit_rows)
        if (r < 0 || static_cast<size_t>(r) >= R)
            throw error("ds4 step: logits asked of row " + std::to_string(r) + " of " + std::to_string(R));
    if (logits.size() != logit_rows.size() * V)
        throw error("ds4 step: logits buffer of " + std::to_string(logits.size()) + " floats, expected " +
                    std::to_string(logit_rows.size() * V));
    eval_rows(m, seqs, tokens, positions, row_seq, logit_rows, logits, extras);
}

}  // namespace fathom::ds4
