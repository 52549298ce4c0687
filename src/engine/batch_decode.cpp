// Batched decode step of the dense family (see batch_decode.h). The layer sequence mirrors
// dense_forward() (src/models/dense_forward.cpp) for n = 1 token, op for op, with three per-row
// differences: the RoPE table has one row per sequence (its own position), and K/V store and
// attention run per sequence against that sequence's cache (contiguous, or its block table in the
// engine's paged pool). Everything else (norms, projections,
// GLU, residuals, output) runs once over all B rows.
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
        if (!q.kv.cache == !q.kv.pool || !q.logits)
            throw error("batch decode: sequence " + std::to_string(i) + " needs exactly one cache or pool sequence, and logits");
        int64_t cap = 0;
        if (q.kv.cache) {
            cap = q.kv.cache->n_ctx;
            if (q.kv.cache->n_layer != hp.n_layer || q.kv.cache->n_head_kv != hp.n_head_kv || q.kv.cache->head_dim != hp.head_dim)
                throw error("batch decode: sequence " + std::to_string(i) + " has a cache of another geometry");
        } else {
            const kv_pool &p = *q.kv.pool;
            if (p.n_layer() != hp.n_layer || p.n_head_kv() != hp.n_head_kv || p.head_dim() != hp.head_dim)
                throw error("batch decode: sequence " + std::to_string(i) + " has a pool of another geometry");
            p.block_addrs(q.kv.seq, blocks[i]);
            cap = static_cast<int64_t>(blocks[i].size()) * p.block_tokens();
        }
        if (q.pos < 0 || q.pos + 1 > cap)
            throw error("batch decode: sequence " + std::to_string(i) + " position " + std::to_string(q.pos) +
                        " outside the " + (q.kv.cache ? "cache of " : "KV blocks held, ") + std::to_string(cap));
        if (q.token < 0 || q.token >= hp.n_vocab)
            throw error("batch decode: token id " + std::to_string(q.token) + " outside the vocabulary [0, " +
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
    const int64_t n = static_cast<int64_t>(seqs.size());
    if (!s_ || s_->n_batch < n) s_ = dense_scratch_create(hp, be_, std::max<int64_t>(n, s_ ? 2 * s_->n_batch : 8));
    dense_scratch &s = *s_;
    const int32_t hd = hp.head_dim;

    const tensor x = view_rows(s.x, 0, n), xn = view_rows(s.xn, 0, n), q = view_rows(s.q, 0, n),
                 k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n), attn = view_rows(s.attn, 0, n),
                 o = view_rows(s.o, 0, n), gate = view_rows(s.gate, 0, n), up = view_rows(s.up, 0, n);
    const tensor rope_g = view_rows(s.rope_g, 0, n), rope_l = view_rows(s.rope_l, 0, n);

    int32_t ids[1];
    for (int64_t i = 0; i < n; ++i) {  // row i = sequence i's token at its own position
        ids[0] = seqs[static_cast<size_t>(i)].token;
        be_.get_rows(m_.tok_embd, ids, 1, view_rows(x, i, 1));
    }
    if (hp.embed_scale) be_.scale(x, std::sqrt(static_cast<float>(hp.n_embd)));
    const bool any_swa = std::find(hp.swa_layer.begin(), hp.swa_layer.end(), true) != hp.swa_layer.end();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = seqs[static_cast<size_t>(i)].pos;
        be_.rope_table(pos, 1, hp.rope, view_rows(rope_g, i, 1));
        if (any_swa) be_.rope_table(pos, 1, hp.rope_local, view_rows(rope_l, i, 1));
    }

    // All sequences paged (the engine's pool): attention runs as one batched call per layer.
    bool all_paged = true;
    for (const dense_batch_seq &sq : seqs) all_paged = all_paged && sq.kv.pool;
    if (all_paged) {
        pages_.resize(seqs.size());
        past_.resize(seqs.size());
        for (size_t i = 0; i < seqs.size(); ++i) past_[i] = seqs[i].pos;
    }

    attn_params ap;
    ap.n_head = hp.n_head;
    ap.n_head_kv = hp.n_head_kv;
    ap.head_dim = hd;
    ap.scale = hp.scale_q ? 1.0f : hp.attn_scale;
    ap.softcap = hp.attn_softcap;

    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const dense_layer &ly = m_.layers[static_cast<size_t>(il)];
        const bool swa = hp.swa_layer[static_cast<size_t>(il)];

        // ---- attention block: projections batched over all sequences ----
        be_.rms_norm(x, &ly.attn_norm, hp.rms_eps, xn);                      // [B, E]
        {
            const tensor *w[] = {&ly.wq, &ly.wk, &ly.wv};
            const tensor *y[] = {&q, &k, &v};
            be_.mul_mat(xn, 3, w, y);                                        // M = B
        }
        if (ly.bq.data) be_.add(q, ly.bq, q);
        if (ly.bk.data) be_.add(k, ly.bk, k);
        if (ly.bv.data) be_.add(v, ly.bv, v);
        if (hp.qk_norm) {
            be_.rms_norm(reshape(q, hd), &ly.attn_q_norm, hp.rms_eps, reshape(q, hd));
            be_.rms_norm(reshape(k, hd), &ly.attn_k_norm, hp.rms_eps, reshape(k, hd));
        }
        const tensor &table = swa ? rope_l : rope_g;
        be_.rope(q, hd, table, hp.rope.mode);                                // row i rotated by position pos_i
        be_.rope(k, hd, table, hp.rope.mode);
        if (hp.scale_q) be_.scale(q, hp.attn_scale);                        // gemma3: q scaled, scores not
        ap.window = swa ? hp.n_swa : 0;
        if (all_paged) {  // store each sequence's K/V, then one attention call over all of them
            for (size_t i = 0; i < seqs.size(); ++i) {
                pages_[i] = seqs[i].kv.pool->pages(blocks_[i], il);
                be_.kv_store_paged(view_rows(k, static_cast<int64_t>(i), 1),
                                   view_rows(v, static_cast<int64_t>(i), 1), pages_[i], seqs[i].pos);
            }
            ap.n_ctx = 0;
            be_.attention_paged_rows(q, std::span<const kv_pages>(pages_.data(), seqs.size()),
                                     std::span<const int64_t>(past_.data(), seqs.size()), ap, attn);
        }
        // ---- otherwise per sequence: store K/V at its position, attend over its own cache ----
        for (int64_t i = 0; i < n && !all_paged; ++i) {
            const dense_batch_seq &sq = seqs[static_cast<size_t>(i)];
            ap.n_past = sq.pos;
            if (sq.kv.cache) {
                kv_cache &kv = *sq.kv.cache;
                const tensor &kc = kv.k[static_cast<size_t>(il)], &vc = kv.v[static_cast<size_t>(il)];
                be_.kv_store(view_rows(k, i, 1), kc, hp.n_head_kv, kv.n_ctx, sq.pos);
                be_.kv_store(view_rows(v, i, 1), vc, hp.n_head_kv, kv.n_ctx, sq.pos);
                ap.n_ctx = kv.n_ctx;
                be_.attention(view_rows(q, i, 1), kc, vc, ap, view_rows(attn, i, 1));
            } else {
                const kv_pages pg = sq.kv.pool->pages(blocks_[static_cast<size_t>(i)], il);
                be_.kv_store_paged(view_rows(k, i, 1), view_rows(v, i, 1), pg, sq.pos);
                ap.n_ctx = 0;  // the block table bounds the positions
                be_.attention_paged(view_rows(q, i, 1), pg, ap, view_rows(attn, i, 1));
            }
        }
        linear(be_, attn, ly.wo, o, ly.bo);                                  // [B, E]
        if (hp.post_norms) be_.rms_norm(o, &ly.post_attn_norm, hp.rms_eps, o);
        be_.add(x, o, x);

        // ---- feed-forward block ----
        be_.rms_norm(x, &ly.ffn_norm, hp.rms_eps, xn);
        {
            const tensor *w[] = {&ly.ffn_gate, &ly.ffn_up};
            const tensor *y[] = {&gate, &up};
            be_.mul_mat(xn, 2, w, y);                                        // [B, n_ff] each
        }
        be_.glu(gate, up, hp.act, gate);
        linear(be_, gate, ly.ffn_down, o, tensor{});
        if (hp.post_norms) be_.rms_norm(o, &ly.post_ffn_norm, hp.rms_eps, o);
        be_.add(x, o, x);
    }
    for (const dense_batch_seq &sq : seqs)
        if (sq.kv.cache) sq.kv.cache->n_used = std::max(sq.kv.cache->n_used, sq.pos + 1);

    // ---- output: final norm, logits a chunk of rows at a time, each row to its sequence ----
    be_.rms_norm(x, &m_.output_norm, hp.rms_eps, xn);
    for (int64_t r0 = 0; r0 < n; r0 += s.n_logit_rows) {
        const int64_t nr = std::min(s.n_logit_rows, n - r0);
        const tensor lg = view_rows(s.logits, 0, nr);                        // [nr, n_vocab]
        linear(be_, view_rows(xn, r0, nr), m_.output, lg, tensor{});
        if (hp.final_softcap > 0) be_.softcap(lg, hp.final_softcap);
        for (int64_t j = 0; j < nr; ++j) be_.download(view_rows(lg, j, 1), seqs[static_cast<size_t>(r0 + j)].logits);
    }
    be_.synchronize();
}

}  // namespace fathom
