// The forward pass of the dense family: ONE code path for prefill (n tokens), decode (n = 1), a
// batch of sequences at their own positions (the engine's continuous batching, speculative
// verification) and PFlash's drafter (through its attention hook):
// embeddings -> n_layer x [norm, QKV, (q/k norm), (hook), RoPE, KV store, causal GQA attention, output
// projection, (post-norm), residual, norm, gated FFN, (post-norm), residual] -> final norm ->
// logits for the requested rows. Reads top to bottom; family differences are hp flags, per-sequence
// differences (positions, K/V, which rows get logits) are confined to the RoPE tables, attend() and
// output().
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "core/error.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "models/dense.h"

namespace fathom {

dense_scratch::~dense_scratch() {
    if (be && mem) be->release(mem);
}

std::unique_ptr<dense_scratch> dense_scratch_create(const dense_hparams &hp, backend &be, int64_t n_batch) {
    if (n_batch <= 0) throw error("n_batch must be positive");
    auto s = std::make_unique<dense_scratch>();
    s->n_batch = n_batch;
    // Logits are produced a few rows at a time (n_vocab can be 262144: a full [n_batch x n_vocab]
    // buffer would cost hundreds of MiB); about 8 MiB per chunk.
    s->n_logit_rows = std::clamp<int64_t>((int64_t{8} << 20) / (int64_t{hp.n_vocab} * 4), 1, n_batch);
    const int64_t E = hp.n_embd, Q = int64_t{hp.n_head} * hp.head_dim, KV = int64_t{hp.n_head_kv} * hp.head_dim;
    struct spec {
        tensor *t;
        int64_t cols, rows;
    } specs[] = {
        {&s->x, E, n_batch},         {&s->xn, E, n_batch},          {&s->q, Q, n_batch},
        {&s->k, KV, n_batch},        {&s->v, KV, n_batch},          {&s->attn, Q, n_batch},
        {&s->o, E, n_batch},         {&s->gate, hp.n_ff, n_batch},  {&s->up, hp.n_ff, n_batch},
        {&s->rope_g, hp.rope.n_rot, n_batch}, {&s->rope_l, hp.rope.n_rot, n_batch},
        {&s->logits, hp.n_vocab, s->n_logit_rows},
    };
    size_t total = 0;
    for (const spec &sp : specs) total += (static_cast<size_t>(sp.cols * sp.rows) * sizeof(float) + 63) & ~size_t{63};
    s->mem = be.alloc(total);
    s->be = &be;
    auto *p = static_cast<uint8_t *>(s->mem);
    for (const spec &sp : specs) {
        *sp.t = make_tensor(dtype::f32, sp.cols, sp.rows, p);
        p += (static_cast<size_t>(sp.cols * sp.rows) * sizeof(float) + 63) & ~size_t{63};
    }
    return s;
}

namespace {

void emit(const dense_trace &tr, const char *name, int32_t layer, const tensor &t) {
    if (tr.fn) tr.fn(tr.user, name, layer, t);
}

// y = x . W^T (+ bias).
void linear(backend &be, const tensor &x, const tensor &w, const tensor &y, const tensor &bias) {
    const tensor *pw[] = {&w};
    const tensor *py[] = {&y};
    be.mul_mat(x, 1, pw, py);
    if (bias.data) be.add(y, bias, y);
}

// Checks every sequence (before any op runs) and lays out the rows: s.row0, s.n_single, s.ids and,
// for paged sequences, s.kv_blocks. Returns the number of rows.
int64_t plan_rows(const dense_hparams &hp, dense_scratch &s, std::span<const dense_seq> seqs) {
    if (seqs.empty()) throw error("forward: no sequences");
    const size_t B = seqs.size();
    if (s.kv_blocks.size() < B) s.kv_blocks.resize(B);
    for (size_t i = 0; i < B; ++i) {
        const dense_seq &q = seqs[i];
        const std::string who = "forward: sequence " + std::to_string(i);
        if (!q.kv.cache == !q.kv.pool) throw error(who + " needs exactly one of a KV cache and a KV pool sequence");
        const int64_t n = static_cast<int64_t>(q.tokens.size());
        if (n == 0) throw error(who + " has no tokens");
        if (q.logits && (q.n_out < 0 || q.n_out > n))
            throw error(who + ": n_out outside [0, " + std::to_string(n) + "]");
        int64_t cap = 0;
        if (q.kv.cache) {
            const kv_cache &c = *q.kv.cache;
            if (c.n_layer != hp.n_layer || c.n_head_kv != hp.n_head_kv || c.head_dim != hp.head_dim)
                throw error(who + " has a cache of another geometry");
            cap = c.n_ctx;
        } else {
            const kv_pool &p = *q.kv.pool;
            if (p.n_layer() != hp.n_layer || p.n_head_kv() != hp.n_head_kv || p.head_dim() != hp.head_dim)
                throw error(who + " has a pool of another geometry");
            p.block_addrs(q.kv.seq, s.kv_blocks[i]);  // looked up once for all layers
            cap = static_cast<int64_t>(s.kv_blocks[i].size()) * p.block_tokens();
        }
        if (q.pos < 0 || q.pos + n > cap)
            throw error(who + ": positions [" + std::to_string(q.pos) + ", " + std::to_string(q.pos + n) +
                        ") exceed the " + (q.kv.cache ? "context " : "KV blocks held ") + std::to_string(cap));
        for (int32_t t : q.tokens)
            if (t < 0 || t >= hp.n_vocab)
                throw error("forward: token id " + std::to_string(t) + " outside the vocabulary [0, " +
                            std::to_string(hp.n_vocab) + ")");
        for (size_t j = 0; j < i; ++j)
            if (seqs[j].kv.cache == q.kv.cache && seqs[j].kv.pool == q.kv.pool && seqs[j].kv.seq == q.kv.seq)
                throw error("forward: sequences " + std::to_string(j) + " and " + std::to_string(i) +
                            " share one cache");
    }
    // One-token sequences first (rows [0, n_single)), then the multi-token ones.
    s.row0.assign(B, 0);
    s.n_single = 0;
    for (size_t i = 0; i < B; ++i)
        if (seqs[i].tokens.size() == 1) s.row0[i] = s.n_single++;
    int64_t n = s.n_single;
    for (size_t i = 0; i < B; ++i)
        if (seqs[i].tokens.size() > 1) {
            s.row0[i] = n;
            n += static_cast<int64_t>(seqs[i].tokens.size());
        }
    if (n > s.n_batch)
        throw error("forward: " + std::to_string(n) + " rows exceed the scratch's n_batch " +
                    std::to_string(s.n_batch));
    s.ids.resize(static_cast<size_t>(n));
    for (size_t i = 0; i < B; ++i)
        std::copy(seqs[i].tokens.begin(), seqs[i].tokens.end(), s.ids.begin() + s.row0[i]);
    return n;
}

// Layer il: store every sequence's new K/V at its positions (unless `stored`: qk_rope_store did), then attention of its rows over its
// own cache (positions [0, pos + n_i)). When every sequence is paged, the one-token rows attend in
// one batched call (backend::attention_paged_rows: each row's bits are those of its own call).
void attend(const dense_hparams &hp, backend &be, dense_scratch &s, std::span<const dense_seq> seqs, int64_t n,
            int32_t il, int32_t window, bool stored) {
    const tensor q = view_rows(s.q, 0, n), k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n),
                 attn = view_rows(s.attn, 0, n);
    attn_params ap;
    ap.n_head = hp.n_head;
    ap.n_head_kv = hp.n_head_kv;
    ap.head_dim = hp.head_dim;
    ap.scale = hp.scale_q ? 1.0f : hp.attn_scale;  // gemma3: q already scaled
    ap.softcap = hp.attn_softcap;
    ap.window = window;
    bool all_paged = true;
    for (const dense_seq &sq : seqs) all_paged = all_paged && sq.kv.pool;
    const bool rows_call = all_paged && s.n_single > 1;
    s.pages.resize(static_cast<size_t>(s.n_single));
    s.past.resize(static_cast<size_t>(s.n_single));
    for (size_t i = 0; i < seqs.size(); ++i) {
        const dense_seq &sq = seqs[i];
        const int64_t r0 = s.row0[i], ni = static_cast<int64_t>(sq.tokens.size());
        const tensor qi = view_rows(q, r0, ni), ki = view_rows(k, r0, ni), vi = view_rows(v, r0, ni),
                     oi = view_rows(attn, r0, ni);
        ap.n_past = sq.pos;
        if (sq.kv.cache) {
            kv_cache &kv = *sq.kv.cache;
            const tensor &kc = kv.k[static_cast<size_t>(il)], &vc = kv.v[static_cast<size_t>(il)];
            if (!stored) {
                be.kv_store(ki, kc, hp.n_head_kv, kv.n_ctx, sq.pos);
                be.kv_store(vi, vc, hp.n_head_kv, kv.n_ctx, sq.pos);
            }
            ap.n_ctx = kv.n_ctx;
            be.attention(qi, kc, vc, ap, oi);                                // [n_i, H*hd]
            continue;
        }
        const kv_pages pg = sq.kv.pool->pages(s.kv_blocks[i], il);           // this layer, via the block table
        be.kv_store_paged(ki, vi, pg, sq.pos);
        ap.n_ctx = 0;  // the block table bounds the positions
        if (rows_call && ni == 1) {  // attends below, with the other one-token rows
            s.pages[static_cast<size_t>(r0)] = pg;
            s.past[static_cast<size_t>(r0)] = sq.pos;
            continue;
        }
        be.attention_paged(qi, pg, ap, oi);                                  // causal over its own rows
    }
    if (rows_call) {  // rows [0, n_single): one token each, s.pages / s.past in row order
        ap.n_ctx = 0;
        ap.n_past = 0;
        const size_t ns = static_cast<size_t>(s.n_single);
        be.attention_paged_rows(view_rows(q, 0, s.n_single), std::span<const kv_pages>(s.pages.data(), ns),
                                std::span<const int64_t>(s.past.data(), ns), ap, view_rows(attn, 0, s.n_single));
    }
}

// Final norm of the rows whose logits are wanted (each sequence's last n_out rows), packed in row
// order into xn rows [0, n_out) (a run of consecutive rows normed in one call), then the output head
// a chunk of rows at a time; each run of rows whose destinations are consecutive is downloaded in
// one call (a batch of one: one download per chunk).
void output(const dense_model &m, backend &be, dense_scratch &s, std::span<const dense_seq> seqs,
            const dense_trace &trace) {
    const dense_hparams &hp = m.hp;
    const size_t V = static_cast<size_t>(hp.n_vocab);
    std::vector<std::pair<int64_t, float *>> want;  // (source row, its logits' destination), row order
    for (size_t i = 0; i < seqs.size(); ++i) {
        const dense_seq &sq = seqs[i];
        if (!sq.logits) continue;
        const int64_t first = s.row0[i] + static_cast<int64_t>(sq.tokens.size()) - sq.n_out;
        for (int64_t r = 0; r < sq.n_out; ++r) want.push_back({first + r, sq.logits + static_cast<size_t>(r) * V});
    }
    std::sort(want.begin(), want.end(), [](const auto &a, const auto &b) { return a.first < b.first; });
    const int64_t n_out = static_cast<int64_t>(want.size());
    if (n_out == 0) return;
    const auto src_row = [&](int64_t j) { return want[static_cast<size_t>(j)].first; };
    const auto dst_row = [&](int64_t j) { return want[static_cast<size_t>(j)].second; };
    for (int64_t j = 0; j < n_out;) {
        int64_t len = 1;
        while (j + len < n_out && src_row(j + len) == src_row(j) + len) ++len;
        be.rms_norm(view_rows(s.x, src_row(j), len), &m.output_norm, hp.rms_eps, view_rows(s.xn, j, len));
        j += len;
    }
    emit(trace, "result_norm", -1, view_rows(s.xn, 0, n_out));
    for (int64_t r0 = 0; r0 < n_out; r0 += s.n_logit_rows) {
        const int64_t nr = std::min(s.n_logit_rows, n_out - r0);
        const tensor lg = view_rows(s.logits, 0, nr);                        // [nr, n_vocab]
        linear(be, view_rows(s.xn, r0, nr), m.output, lg, tensor{});
        if (hp.final_softcap > 0) be.softcap(lg, hp.final_softcap);
        for (int64_t j = 0; j < nr;) {
            int64_t len = 1;
            while (j + len < nr && dst_row(r0 + j + len) == dst_row(r0 + j) + static_cast<size_t>(len) * V) ++len;
            be.download(view_rows(lg, j, len), dst_row(r0 + j));
            j += len;
        }
    }
}

}  // namespace

void dense_forward(const dense_model &m, backend &be, kv_cache &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits, const dense_trace &trace) {
    dense_kv dk;
    dk.cache = &kv;
    dense_forward(m, be, dk, s, tokens, n, p0, n_out, logits, trace);
}

void dense_forward(const dense_model &m, backend &be, const dense_kv &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits, const dense_trace &trace) {
    if (n <= 0) throw error("forward: " + std::to_string(n) + " tokens outside [1, n_batch]");
    dense_seq sq;
    sq.kv = kv;
    sq.pos = p0;
    sq.tokens = std::span<const int32_t>(tokens, static_cast<size_t>(n));
    sq.logits = n_out > 0 ? logits : nullptr;
    sq.n_out = n_out;
    if (n_out < 0 || n_out > n) throw error("forward: n_out outside [0, n]");
    dense_forward(m, be, s, std::span<const dense_seq>(&sq, 1), trace);
}

void dense_forward(const dense_model &m, backend &be, dense_scratch &s, std::span<const dense_seq> seqs,
                   const dense_trace &trace, const dense_attn_hook &hook) {
    const dense_hparams &hp = m.hp;
    const int64_t n = plan_rows(hp, s, seqs);
    const int32_t hd = hp.head_dim;

    // Views of the first n rows of every activation buffer.
    const tensor x = view_rows(s.x, 0, n), xn = view_rows(s.xn, 0, n), q = view_rows(s.q, 0, n),
                 k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n), attn = view_rows(s.attn, 0, n),
                 o = view_rows(s.o, 0, n), gate = view_rows(s.gate, 0, n), up = view_rows(s.up, 0, n);
    const tensor rope_g = view_rows(s.rope_g, 0, n), rope_l = view_rows(s.rope_l, 0, n);

    be.get_rows(m.tok_embd, s.ids.data(), n, x);                             // [n, E]
    if (hp.embed_scale) be.scale(x, std::sqrt(static_cast<float>(hp.n_embd)));
    emit(trace, "inp_scaled", -1, x);
    const bool any_swa = std::find(hp.swa_layer.begin(), hp.swa_layer.end(), true) != hp.swa_layer.end();
    for (size_t i = 0; i < seqs.size(); ++i) {  // [n_i, n_rot] (cos, sin): sequence i's rows at its own positions
        const int64_t ni = static_cast<int64_t>(seqs[i].tokens.size());
        be.rope_table(seqs[i].pos, ni, hp.rope, view_rows(rope_g, s.row0[i], ni));
        if (any_swa) be.rope_table(seqs[i].pos, ni, hp.rope_local, view_rows(rope_l, s.row0[i], ni));
    }

    // The fused ops (backend.h: each the composition of the separate ops, so the CPU's results do not
    // change; the CUDA backend runs a decode row's as fewer kernels). A trace callback gets the separate
    // ops, whose every named intermediate it sees; the PFlash hook too (it reads q/k before RoPE).
    // qk_rope_store takes one sequence with a contiguous cache; the residual adds fold when no bias comes
    // between the projection and the add.
    const bool fuse = !trace.fn;
    const bool fuse_qk = fuse && !hook.fn && hook.stop_layer < 0 && seqs.size() == 1 && seqs[0].kv.cache;
    bool stopped = false;
    for (int32_t il = 0; il < hp.n_layer && !stopped; ++il) {
        const dense_layer &ly = m.layers[static_cast<size_t>(il)];
        const bool swa = hp.swa_layer[static_cast<size_t>(il)];
        stopped = il == hook.stop_layer;  // this layer's q/k are the last thing computed

        // ---- attention block ----
        {
            const tensor *w[] = {&ly.wq, &ly.wk, &ly.wv};
            const tensor *y[] = {&q, &k, &v};
            if (fuse) {
                be.mul_mat_normed(x, ly.attn_norm, hp.rms_eps, xn, stopped ? 2 : 3, w, y);  // norm + QKV
            } else {
                be.rms_norm(x, &ly.attn_norm, hp.rms_eps, xn);               // attn_norm [n, E]
                emit(trace, "attn_norm", il, xn);
                be.mul_mat(xn, stopped ? 2 : 3, w, y);                       // q [n, H*hd], k/v [n, Hkv*hd]
            }
        }
        if (ly.bq.data) be.add(q, ly.bq, q);
        if (ly.bk.data) be.add(k, ly.bk, k);
        if (ly.bv.data && !stopped) be.add(v, ly.bv, v);
        const tensor &table = swa ? rope_l : rope_g;
        if (fuse_qk) {  // q/k norm, RoPE, q scale and the K/V store in one op
            kv_cache &kv = *seqs[0].kv.cache;
            qk_rope_store_params qp;
            qp.head_dim = hd;
            qp.q_norm = hp.qk_norm ? &ly.attn_q_norm : nullptr;
            qp.k_norm = hp.qk_norm ? &ly.attn_k_norm : nullptr;
            qp.eps = hp.rms_eps;
            qp.table = &table;
            qp.mode = hp.rope.mode;
            qp.q_scale = hp.scale_q ? hp.attn_scale : 1.0f;
            qp.k_cache = &kv.k[static_cast<size_t>(il)];
            qp.v_cache = &kv.v[static_cast<size_t>(il)];
            qp.n_head_kv = hp.n_head_kv;
            qp.n_ctx = kv.n_ctx;
            qp.p0 = seqs[0].pos;
            be.qk_rope_store(q, k, v, qp);
        } else {
            if (hp.qk_norm) {
                be.rms_norm(reshape(q, hd), &ly.attn_q_norm, hp.rms_eps, reshape(q, hd));  // per head [n*H, hd]
                be.rms_norm(reshape(k, hd), &ly.attn_k_norm, hp.rms_eps, reshape(k, hd));
            }
            if (hook.fn) hook.fn(hook.user, il, q, k);                       // pre-RoPE q/k
            if (stopped) break;
            be.rope(q, hd, table, hp.rope.mode);                             // row r rotated by its position
            be.rope(k, hd, table, hp.rope.mode);
            if (hp.scale_q) be.scale(q, hp.attn_scale);                     // gemma3: q scaled, scores not
        }
        emit(trace, "Qcur", il, q);
        emit(trace, "Kcur", il, k);
        emit(trace, "Vcur", il, v);
        // The model's own sliding window (gemma3 local layers), narrowed by the hook's if it has one.
        int32_t window = hook.window;
        if (swa && hp.n_swa > 0) window = window > 0 ? std::min(window, hp.n_swa) : hp.n_swa;
        attend(hp, be, s, seqs, n, il, window, fuse_qk);                     // attn [n, H*hd]
        emit(trace, "kqv_out", il, attn);
        if (fuse && !ly.bo.data && !hp.post_norms) {
            be.mul_mat_add(attn, ly.wo, o, x);                               // x += attn_out
        } else if (fuse && !ly.bo.data) {
            linear(be, attn, ly.wo, o, tensor{});
            be.rms_norm_add(o, ly.post_attn_norm, hp.rms_eps, x);            // x += post_norm(attn_out)
        } else {
            linear(be, attn, ly.wo, o, ly.bo);                               // attn_out [n, E]
            emit(trace, "attn_out", il, o);
            if (hp.post_norms) be.rms_norm(o, &ly.post_attn_norm, hp.rms_eps, o);
            emit(trace, "attn_post_norm", il, o);
            be.add(x, o, x);                                                 // residual
        }
        emit(trace, "ffn_inp", il, x);

        // ---- feed-forward block ----
        {
            const tensor *w[] = {&ly.ffn_gate, &ly.ffn_up};
            const tensor *y[] = {&gate, &up};
            if (fuse) {
                be.mul_mat_normed(x, ly.ffn_norm, hp.rms_eps, xn, 2, w, y);  // norm + gate, up
            } else {
                be.rms_norm(x, &ly.ffn_norm, hp.rms_eps, xn);
                emit(trace, "ffn_norm", il, xn);
                be.mul_mat(xn, 2, w, y);                                     // [n, n_ff] each
            }
        }
        emit(trace, "ffn_gate", il, gate);
        emit(trace, "ffn_up", il, up);
        if (fuse && !hp.post_norms) {
            be.glu_mul_mat_add(gate, up, hp.act, ly.ffn_down, o, x);         // x += (act(gate) * up) . down
        } else if (fuse) {
            be.glu(gate, up, hp.act, gate);
            linear(be, gate, ly.ffn_down, o, tensor{});
            be.rms_norm_add(o, ly.post_ffn_norm, hp.rms_eps, x);             // x += post_norm(ffn_out)
        } else {
            be.glu(gate, up, hp.act, gate);                                  // act(gate) * up
            emit(trace, "ffn_glu", il, gate);
            linear(be, gate, ly.ffn_down, o, tensor{});                      // ffn_out [n, E]
            emit(trace, "ffn_down", il, o);
            if (hp.post_norms) be.rms_norm(o, &ly.post_ffn_norm, hp.rms_eps, o);
            emit(trace, "ffn_out", il, o);
            be.add(x, o, x);
        }
        emit(trace, "l_out", il, x);
    }
    for (const dense_seq &sq : seqs)
        if (sq.kv.cache)
            sq.kv.cache->n_used = std::max(sq.kv.cache->n_used, sq.pos + static_cast<int64_t>(sq.tokens.size()));
    if (!stopped) output(m, be, s, seqs, trace);                             // logits of the rows asked for
    be.synchronize();
}

}  // namespace fathom
