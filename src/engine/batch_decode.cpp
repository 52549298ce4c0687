// Batched step of the dense family (see batch_decode.h). The layer sequence mirrors dense_forward()
// (src/models/dense_forward.cpp) op for op, with these per-sequence differences: the RoPE table
// rows of a sequence start at its own position, K/V store and attention run per sequence against
// that sequence's cache (contiguous, or its block table in the engine's paged pool), and the
// final norm and output head run only on the rows whose logits are wanted. Everything else
// (norms, projections, GLU, residuals) runs once over all rows.
//
// Row layout of the activations: the sequences with one token (decodes) come first, in their
// order, so their attention is one batched call (backend::attention_paged_rows); the sequences
// with several tokens (prompt chunks) follow, each a contiguous block of rows attending as
// dense_forward's chunk does (one causal attention call over its own rows).
#include "engine/batch_decode.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "models/dense.h"

namespace fathom {

dense_batch_decoder::dense_batch_decoder(const dense_model &m, backend &be) : m_(m), be_(be) {}
dense_batch_decoder::~dense_batch_decoder() = default;

namespace {

void linear(backend &be, const tensor &x, const tensor &w, const tensor &y, const tensor &bias) {
    const tensor *pw[] = {&w};
    const tensor *py[] = {&y};
    be.mul_mat(x, 1, pw, py);
    if (bias.data) be.add(y, bias, y);
}

// blocks[i]: sequence i's block addresses when it is paged (filled here).
void validate(std::span<const dense_batch_seq> seqs, const dense_hparams &hp, std::vector<std::vector<uint8_t *>> &blocks) {
    if (seqs.empty()) throw error("batch decode: no sequences");
    if (blocks.size() < seqs.size()) blocks.resize(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
        const dense_batch_seq &q = seqs[i];
        const std::string who = "batch decode: sequence " + std::to_string(i);
        if (!q.kv.cache == !q.kv.pool) throw error(who + " needs exactly one cache or pool sequence");
        if (q.tokens.empty()) throw error(who + " has no tokens");
        int64_t cap = 0;
        if (q.kv.cache) {
            cap = q.kv.cache->n_ctx;
            if (q.kv.cache->n_layer != hp.n_layer || q.kv.cache->n_head_kv != hp.n_head_kv || q.kv.cache->head_dim != hp.head_dim)
                throw error(who + " has a cache of another geometry");
        } else {
            const kv_pool &p = *q.kv.pool;
            if (p.n_layer() != hp.n_layer || p.n_head_kv() != hp.n_head_kv || p.head_dim() != hp.head_dim)
                throw error(who + " has a pool of another geometry");
            p.block_addrs(q.kv.seq, blocks[i]);
            cap = static_cast<int64_t>(blocks[i].size()) * p.block_tokens();
        }
        const int64_t n = static_cast<int64_t>(q.tokens.size());
        if (q.pos < 0 || q.pos + n > cap)
            throw error(who + " positions [" + std::to_string(q.pos) + ", " + std::to_string(q.pos + n) + ") outside the " +
                        (q.kv.cache ? "cache of " : "KV blocks held, ") + std::to_string(cap));
        for (int32_t t : q.tokens)
            if (t < 0 || t >= hp.n_vocab)
                throw error("batch decode: token id " + std::to_string(t) + " outside the vocabulary [0, " +
                            std::to_string(hp.n_vocab) + ")");
        for (size_t j = 0; j < i; ++j)
            if (seqs[j].kv.cache == q.kv.cache && seqs[j].kv.pool == q.kv.pool && seqs[j].kv.seq == q.kv.seq)
                throw error("batch decode: two sequences share one cache");
    }
}

}  // namespace

void dense_batch_decoder::run(std::span<const dense_batch_seq> seqs) {
    const dense_hparams &hp = m_.hp;
    validate(seqs, hp, blocks_);
    const size_t B = seqs.size();

    // ---- row layout: one-token sequences first (rows [0, n_single_)), then the multi-token ones ----
    row0_.assign(B, 0);
    n_single_ = 0;
    for (size_t i = 0; i < B; ++i)
        if (seqs[i].tokens.size() == 1) row0_[i] = n_single_++;
    int64_t n = n_single_;
    for (size_t i = 0; i < B; ++i)
        if (seqs[i].tokens.size() > 1) {
            row0_[i] = n;
            n += static_cast<int64_t>(seqs[i].tokens.size());
        }
    n_rows_ = n;
    if (!s_ || s_->n_batch < n) s_ = dense_scratch_create(hp, be_, std::max<int64_t>(n, s_ ? 2 * s_->n_batch : 8));
    dense_scratch &s = *s_;
    const int32_t hd = hp.head_dim;

    const tensor x = view_rows(s.x, 0, n), xn = view_rows(s.xn, 0, n), q = view_rows(s.q, 0, n),
                 k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n), attn = view_rows(s.attn, 0, n),
                 o = view_rows(s.o, 0, n), gate = view_rows(s.gate, 0, n), up = view_rows(s.up, 0, n);
    const tensor rope_g = view_rows(s.rope_g, 0, n), rope_l = view_rows(s.rope_l, 0, n);

    ids_.resize(static_cast<size_t>(n));
    for (size_t i = 0; i < B; ++i)
        std::copy(seqs[i].tokens.begin(), seqs[i].tokens.end(), ids_.begin() + row0_[i]);
    be_.get_rows(m_.tok_embd, ids_.data(), n, x);                           // [rows, E]
    if (hp.embed_scale) be_.scale(x, std::sqrt(static_cast<float>(hp.n_embd)));
    const bool any_swa = std::find(hp.swa_layer.begin(), hp.swa_layer.end(), true) != hp.swa_layer.end();
    for (size_t i = 0; i < B; ++i) {  // sequence i's rows rotated by its own positions
        const int64_t ni = static_cast<int64_t>(seqs[i].tokens.size());
        be_.rope_table(seqs[i].pos, ni, hp.rope, view_rows(rope_g, row0_[i], ni));
        if (any_swa) be_.rope_table(seqs[i].pos, ni, hp.rope_local, view_rows(rope_l, row0_[i], ni));
    }

    // All sequences paged (the engine's pool): the one-token sequences attend in one batched call.
    all_paged_ = true;
    for (const dense_batch_seq &sq : seqs) all_paged_ = all_paged_ && sq.kv.pool;
    pages_.resize(B);
    past_.resize(B);

    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const dense_layer &ly = m_.layers[static_cast<size_t>(il)];
        const bool swa = hp.swa_layer[static_cast<size_t>(il)];

        // ---- attention block: projections batched over all rows ----
        be_.rms_norm(x, &ly.attn_norm, hp.rms_eps, xn);                      // [rows, E]
        {
            const tensor *w[] = {&ly.wq, &ly.wk, &ly.wv};
            const tensor *y[] = {&q, &k, &v};
            be_.mul_mat(xn, 3, w, y);                                        // M = rows
        }
        if (ly.bq.data) be_.add(q, ly.bq, q);
        if (ly.bk.data) be_.add(k, ly.bk, k);
        if (ly.bv.data) be_.add(v, ly.bv, v);
        if (hp.qk_norm) {
            be_.rms_norm(reshape(q, hd), &ly.attn_q_norm, hp.rms_eps, reshape(q, hd));
            be_.rms_norm(reshape(k, hd), &ly.attn_k_norm, hp.rms_eps, reshape(k, hd));
        }
        const tensor &table = swa ? rope_l : rope_g;
        be_.rope(q, hd, table, hp.rope.mode);                                // row r rotated by its position
        be_.rope(k, hd, table, hp.rope.mode);
        if (hp.scale_q) be_.scale(q, hp.attn_scale);                        // gemma3: q scaled, scores not
        attend(seqs, il, swa);                                               // attn [rows, H*hd]
        linear(be_, attn, ly.wo, o, ly.bo);                                  // [rows, E]
        if (hp.post_norms) be_.rms_norm(o, &ly.post_attn_norm, hp.rms_eps, o);
        be_.add(x, o, x);

        // ---- feed-forward block ----
        be_.rms_norm(x, &ly.ffn_norm, hp.rms_eps, xn);
        {
            const tensor *w[] = {&ly.ffn_gate, &ly.ffn_up};
            const tensor *y[] = {&gate, &up};
            be_.mul_mat(xn, 2, w, y);                                        // [rows, n_ff] each
        }
        be_.glu(gate, up, hp.act, gate);
        linear(be_, gate, ly.ffn_down, o, tensor{});
        if (hp.post_norms) be_.rms_norm(o, &ly.post_ffn_norm, hp.rms_eps, o);
        be_.add(x, o, x);
    }
    for (const dense_batch_seq &sq : seqs)
        if (sq.kv.cache)
            sq.kv.cache->n_used = std::max(sq.kv.cache->n_used, sq.pos + static_cast<int64_t>(sq.tokens.size()));
    output(seqs);
    be_.synchronize();
}

// Layer il: store every sequence's new K/V at its positions, then attention of its rows over its
// own cache (positions [0, pos + n_i)), exactly as dense_forward does for the same rows.
void dense_batch_decoder::attend(std::span<const dense_batch_seq> seqs, int32_t il, bool swa) {
    const dense_hparams &hp = m_.hp;
    dense_scratch &s = *s_;
    const int64_t n = n_rows_;
    const tensor q = view_rows(s.q, 0, n), k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n),
                 attn = view_rows(s.attn, 0, n);
    attn_params ap;
    ap.n_head = hp.n_head;
    ap.n_head_kv = hp.n_head_kv;
    ap.head_dim = hp.head_dim;
    ap.scale = hp.scale_q ? 1.0f : hp.attn_scale;
    ap.softcap = hp.attn_softcap;
    ap.window = swa ? hp.n_swa : 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
        const dense_batch_seq &sq = seqs[i];
        const int64_t r0 = row0_[i], ni = static_cast<int64_t>(sq.tokens.size());
        const tensor qi = view_rows(q, r0, ni), ki = view_rows(k, r0, ni), vi = view_rows(v, r0, ni),
                     oi = view_rows(attn, r0, ni);
        ap.n_past = sq.pos;
        if (sq.kv.cache) {
            kv_cache &kv = *sq.kv.cache;
            const tensor &kc = kv.k[static_cast<size_t>(il)], &vc = kv.v[static_cast<size_t>(il)];
            be_.kv_store(ki, kc, hp.n_head_kv, kv.n_ctx, sq.pos);
            be_.kv_store(vi, vc, hp.n_head_kv, kv.n_ctx, sq.pos);
            ap.n_ctx = kv.n_ctx;
            be_.attention(qi, kc, vc, ap, oi);
            continue;
        }
        const kv_pages pg = sq.kv.pool->pages(blocks_[i], il);
        be_.kv_store_paged(ki, vi, pg, sq.pos);
        ap.n_ctx = 0;  // the block table bounds the positions
        if (all_paged_ && ni == 1) {  // attends below, with the other one-token sequences
            pages_[static_cast<size_t>(r0)] = pg;
            past_[static_cast<size_t>(r0)] = sq.pos;
            continue;
        }
        be_.attention_paged(qi, pg, ap, oi);                                 // causal over its own rows
    }
    if (all_paged_ && n_single_ > 0) {  // rows [0, n_single_): one token each, pages_/past_ in row order
        ap.n_ctx = 0;
        ap.n_past = 0;
        const size_t ns = static_cast<size_t>(n_single_);
        be_.attention_paged_rows(view_rows(q, 0, n_single_), std::span<const kv_pages>(pages_.data(), ns),
                                 std::span<const int64_t>(past_.data(), ns), ap, view_rows(attn, 0, n_single_));
    }
}

// Final norm of the rows whose logits are wanted (a sequence's last row, or its last n_rows for a
// speculative verification), packed into xn rows [0, n_out)
// (consecutive source rows normed in one call), then the output head a chunk of rows at a time,
// each row downloaded to its sequence.
void dense_batch_decoder::output(std::span<const dense_batch_seq> seqs) {
    const dense_hparams &hp = m_.hp;
    dense_scratch &s = *s_;
    const size_t V = static_cast<size_t>(hp.n_vocab);
    // Rows whose logits are wanted (a sequence's last row, or its last n_rows rows), in row order, each
    // with where its logits go.
    std::vector<std::pair<int64_t, float *>> want;
    for (size_t i = 0; i < seqs.size(); ++i) {
        const int64_t last = row0_[i] + static_cast<int64_t>(seqs[i].tokens.size()) - 1;
        if (seqs[i].rows)
            for (int64_t r = 0; r < seqs[i].n_rows; ++r)
                want.push_back({last - seqs[i].n_rows + 1 + r, seqs[i].rows + static_cast<size_t>(r) * V});
        else if (seqs[i].logits)
            want.push_back({last, seqs[i].logits});
    }
    std::sort(want.begin(), want.end(), [](const auto &a, const auto &b) { return a.first < b.first; });
    const int64_t n_out = static_cast<int64_t>(want.size());
    for (int64_t j = 0; j < n_out;) {
        int64_t len = 1;  // a run of consecutive source rows
        while (j + len < n_out && want[static_cast<size_t>(j + len)].first == want[static_cast<size_t>(j)].first + len) ++len;
        be_.rms_norm(view_rows(s.x, want[static_cast<size_t>(j)].first, len), &m_.output_norm, hp.rms_eps,
                     view_rows(s.xn, j, len));
        j += len;
    }
    for (int64_t r0 = 0; r0 < n_out; r0 += s.n_logit_rows) {
        const int64_t nr = std::min(s.n_logit_rows, n_out - r0);
        const tensor lg = view_rows(s.logits, 0, nr);                        // [nr, n_vocab]
        linear(be_, view_rows(s.xn, r0, nr), m_.output, lg, tensor{});
        if (hp.final_softcap > 0) be_.softcap(lg, hp.final_softcap);
        for (int64_t j = 0; j < nr; ++j) be_.download(view_rows(lg, j, 1), want[static_cast<size_t>(r0 + j)].second);
    }
}

}  // namespace fathom
