// The forward pass of the dense family, one code path for prefill (n tokens) and decode (n = 1):
// embeddings -> n_layer x [norm, QKV, (q/k norm), RoPE, KV store, causal GQA attention, output
// projection, (post-norm), residual, norm, gated FFN, (post-norm), residual] -> final norm ->
// logits for the requested last rows. Reads top to bottom; family differences are hp flags.
#include <algorithm>
#include <cmath>
#include <string>

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

dense_trace g_dense_trace;

namespace {

void trace(const char *name, int32_t layer, const tensor &t) {
    if (g_dense_trace.fn) g_dense_trace.fn(g_dense_trace.user, name, layer, t);
}

// y = x . W^T (+ bias), for one or more weights sharing x.
void linear(backend &be, const tensor &x, const tensor &w, const tensor &y, const tensor &bias) {
    const tensor *pw[] = {&w};
    const tensor *py[] = {&y};
    be.mul_mat(x, 1, pw, py);
    if (bias.data) be.add(y, bias, y);
}

}  // namespace

void dense_forward(const dense_model &m, backend &be, kv_cache &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits) {
    dense_kv dk;
    dk.cache = &kv;
    dense_forward(m, be, dk, s, tokens, n, p0, n_out, logits);
}

void dense_forward(const dense_model &m, backend &be, const dense_kv &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits) {
    const dense_hparams &hp = m.hp;
    if (n <= 0 || n > s.n_batch) throw error("forward: " + std::to_string(n) + " tokens outside [1, n_batch]");
    if (!kv.cache == !kv.pool) throw error("forward: exactly one of a KV cache and a KV pool sequence");
    // Paged: the block addresses of the sequence, looked up once for all layers.
    if (kv.pool) kv.pool->block_addrs(kv.seq, s.kv_blocks);
    const int64_t cap = kv.cache ? kv.cache->n_ctx : static_cast<int64_t>(s.kv_blocks.size()) * kv.pool->block_tokens();
    if (p0 < 0 || p0 + n > cap)
        throw error("forward: positions [" + std::to_string(p0) + ", " + std::to_string(p0 + n) + ") exceed the " +
                    (kv.cache ? "context " : "KV blocks held ") + std::to_string(cap));
    if (n_out < 0 || n_out > n) throw error("forward: n_out outside [0, n]");
    const int32_t hd = hp.head_dim;

    // Views of the first n rows of every activation buffer.
    const tensor x = view_rows(s.x, 0, n), xn = view_rows(s.xn, 0, n), q = view_rows(s.q, 0, n),
                 k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n), attn = view_rows(s.attn, 0, n),
                 o = view_rows(s.o, 0, n), gate = view_rows(s.gate, 0, n), up = view_rows(s.up, 0, n);
    const tensor rope_g = view_rows(s.rope_g, 0, n), rope_l = view_rows(s.rope_l, 0, n);

    be.get_rows(m.tok_embd, tokens, n, x);                                   // [n, E]
    if (hp.embed_scale) be.scale(x, std::sqrt(static_cast<float>(hp.n_embd)));
    trace("inp_scaled", -1, x);
    be.rope_table(p0, n, hp.rope, rope_g);                                   // [n, n_rot] (cos, sin)
    const bool any_swa = std::find(hp.swa_layer.begin(), hp.swa_layer.end(), true) != hp.swa_layer.end();
    if (any_swa) be.rope_table(p0, n, hp.rope_local, rope_l);

    attn_params ap;
    ap.n_head = hp.n_head;
    ap.n_head_kv = hp.n_head_kv;
    ap.head_dim = hd;
    ap.n_ctx = kv.cache ? kv.cache->n_ctx : 0;  // paged: the block table bounds the positions
    ap.n_past = p0;
    ap.scale = hp.scale_q ? 1.0f : hp.attn_scale;
    ap.softcap = hp.attn_softcap;

    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const dense_layer &ly = m.layers[static_cast<size_t>(il)];
        const bool swa = hp.swa_layer[static_cast<size_t>(il)];

        // ---- attention block ----
        be.rms_norm(x, &ly.attn_norm, hp.rms_eps, xn);                       // attn_norm [n, E]
        trace("attn_norm", il, xn);
        {
            const tensor *w[] = {&ly.wq, &ly.wk, &ly.wv};
            const tensor *y[] = {&q, &k, &v};
            be.mul_mat(xn, 3, w, y);                                         // q [n, H*hd], k/v [n, Hkv*hd]
        }
        if (ly.bq.data) be.add(q, ly.bq, q);
        if (ly.bk.data) be.add(k, ly.bk, k);
        if (ly.bv.data) be.add(v, ly.bv, v);
        if (hp.qk_norm) {
            be.rms_norm(reshape(q, hd), &ly.attn_q_norm, hp.rms_eps, reshape(q, hd));  // per head [n*H, hd]
            be.rms_norm(reshape(k, hd), &ly.attn_k_norm, hp.rms_eps, reshape(k, hd));
        }
        const tensor &table = swa ? rope_l : rope_g;
        be.rope(q, hd, table, hp.rope.mode);
        be.rope(k, hd, table, hp.rope.mode);
        if (hp.scale_q) be.scale(q, hp.attn_scale);
        trace("Qcur", il, q);
        trace("Kcur", il, k);
        trace("Vcur", il, v);
        ap.window = swa ? hp.n_swa : 0;
        if (kv.cache) {
            const tensor &kc = kv.cache->k[static_cast<size_t>(il)], &vc = kv.cache->v[static_cast<size_t>(il)];
            be.kv_store(k, kc, hp.n_head_kv, kv.cache->n_ctx, p0);
            be.kv_store(v, vc, hp.n_head_kv, kv.cache->n_ctx, p0);
            be.attention(q, kc, vc, ap, attn);                               // [n, H*hd]
        } else {
            const kv_pages pg = kv.pool->pages(s.kv_blocks, il);             // this layer, via the block table
            be.kv_store_paged(k, v, pg, p0);
            be.attention_paged(q, pg, ap, attn);                             // [n, H*hd]
        }
        trace("kqv_out", il, attn);
        linear(be, attn, ly.wo, o, ly.bo);                                   // attn_out [n, E]
        trace("attn_out", il, o);
        if (hp.post_norms) be.rms_norm(o, &ly.post_attn_norm, hp.rms_eps, o);
        trace("attn_post_norm", il, o);
        be.add(x, o, x);                                                     // residual
        trace("ffn_inp", il, x);

        // ---- feed-forward block ----
        be.rms_norm(x, &ly.ffn_norm, hp.rms_eps, xn);
        trace("ffn_norm", il, xn);
        {
            const tensor *w[] = {&ly.ffn_gate, &ly.ffn_up};
            const tensor *y[] = {&gate, &up};
            be.mul_mat(xn, 2, w, y);                                         // [n, n_ff] each
        }
        trace("ffn_gate", il, gate);
        trace("ffn_up", il, up);
        be.glu(gate, up, hp.act, gate);                                      // act(gate) * up
        trace("ffn_glu", il, gate);
        linear(be, gate, ly.ffn_down, o, tensor{});                          // ffn_out [n, E]
        trace("ffn_down", il, o);
        if (hp.post_norms) be.rms_norm(o, &ly.post_ffn_norm, hp.rms_eps, o);
        trace("ffn_out", il, o);
        be.add(x, o, x);
        trace("l_out", il, x);
    }
    if (kv.cache) kv.cache->n_used = std::max(kv.cache->n_used, p0 + n);
    if (n_out == 0 || !logits) {
        be.synchronize();
        return;
    }

    // ---- output: final norm and logits of the last n_out rows, a chunk of rows at a time ----
    const tensor xo = view_rows(s.x, n - n_out, n_out), xno = view_rows(s.xn, n - n_out, n_out);
    be.rms_norm(xo, &m.output_norm, hp.rms_eps, xno);
    trace("result_norm", -1, xno);
    for (int64_t r0 = 0; r0 < n_out; r0 += s.n_logit_rows) {
        const int64_t nr = std::min(s.n_logit_rows, n_out - r0);
        const tensor lg = view_rows(s.logits, 0, nr);                        // [nr, n_vocab]
        linear(be, view_rows(xno, r0, nr), m.output, lg, tensor{});
        if (hp.final_softcap > 0) be.softcap(lg, hp.final_softcap);
        be.download(lg, logits + r0 * int64_t{hp.n_vocab});
    }
    be.synchronize();
}

}  // namespace fathom
