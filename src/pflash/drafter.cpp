// PFlash drafter: loading, the windowed scoring forward and the tail-query attention scores (see
// drafter.h). The forward follows models/dense_forward.cpp layer by layer; it differs in what it
// needs to produce (no logits, pre-RoPE q/k captured, the last layer stops after its q/k) and in its
// attention (sliding window for the prefill), which is why it is PFlash's own rather than a flag on
// the runtime's forward.
#include "pflash/drafter.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <thread>

#include "backend/cpu/vec.h"
#include "core/error.h"
#include "engine/device.h"
#ifdef FATHOM_ENGINE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace fathom::pflash {

namespace {

double seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int online_cores() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

std::unique_ptr<drafter> drafter::load(const std::string &path, int n_threads, int32_t n_batch,
                                       const std::string &device) {
    // Members are filled one by one inside a unique_ptr: if any step throws, the partial drafter is
    // destroyed (backend last), so a failed load leaves no weights, mappings or threads behind.
    std::unique_ptr<drafter> d(new drafter());
    d->file_ = gguf::file::open(path);
    const std::string arch(d->file_->get_string("general.architecture", ""));
    if (!dense_supports_arch(arch))
        throw error("pflash: drafter " + path + " has architecture '" + arch + "', expected a dense llama/qwen3/gemma3 model");
    const dense_hparams hp = dense_load_hparams(*d->file_);
    d->n_batch_ = n_batch;
    d->n_threads_ = n_threads > 0 ? n_threads : online_cores();
    const int ordinal = resolve_cuda_ordinal(device);  // -1: the CPU; throws for an unusable device
    if (ordinal >= 0) {
#ifdef FATHOM_ENGINE_CUDA
        cuda_options cu;
        cu.device = ordinal;
        d->be_ = make_cuda_backend(cu);
#endif
    } else {
        cpu_options co;
        co.n_threads = d->n_threads_;
        co.max_cols = std::max({int64_t{hp.n_embd}, int64_t{hp.n_head} * hp.head_dim, int64_t{hp.n_ff}});
        co.max_rows = n_batch;
        co.max_ctx = 4096;  // the attention scratch grows with the span
        d->be_ = make_cpu_backend(co);
    }
    d->model_ = dense_load(*d->file_, *d->be_);
    d->tok_ = std::make_unique<tokenizer>(*d->file_);
    d->scratch_ = dense_scratch_create(d->model_->hp, *d->be_, n_batch);
    return d;
}

drafter::~drafter() { reset_state(); }

void drafter::reset_state() {
    held_.clear();
    kpre_.clear();
    if (kpre_mem_ && be_) be_->release(kpre_mem_);
    kpre_mem_ = nullptr;
    kv_.reset();
}

void drafter::ensure_capacity(int64_t n) {
    if (kv_ && kv_->n_ctx >= n) return;
    // Grow to a power of two (>= 4096): the CPU backend maps pages lazily, so unused capacity is free,
    // and regrowing (which drops the held prefix) stays rare.
    int64_t cap = 4096;
    while (cap < n) cap *= 2;
    const dense_hparams &hp = model_->hp;
    reset_state();
    kv_ = std::make_unique<kv_cache>(*be_, hp.n_layer, hp.n_head_kv, hp.head_dim, cap, dtype::f16);
    const int64_t rows = int64_t{hp.n_head_kv} * cap;
    const size_t per = static_cast<size_t>(rows) * static_cast<size_t>(hp.head_dim) * 2;
    kpre_mem_ = be_->alloc(per * static_cast<size_t>(hp.n_layer));
    for (int32_t l = 0; l < hp.n_layer; ++l)
        kpre_.push_back(make_tensor(dtype::f16, hp.head_dim, rows, static_cast<uint8_t *>(kpre_mem_) + per * static_cast<size_t>(l)));
}

void drafter::forward(const int32_t *ids, int64_t n, int64_t p0, int32_t window, const std::vector<tensor> *q_out) {
    const dense_model &m = *model_;
    const dense_hparams &hp = m.hp;
    backend &be = *be_;
    dense_scratch &s = *scratch_;
    const int32_t hd = hp.head_dim;
    const int64_t qw = int64_t{hp.n_head} * hd;
    const tensor x = view_rows(s.x, 0, n), xn = view_rows(s.xn, 0, n), q = view_rows(s.q, 0, n),
                 k = view_rows(s.k, 0, n), v = view_rows(s.v, 0, n), attn = view_rows(s.attn, 0, n),
                 o = view_rows(s.o, 0, n), gate = view_rows(s.gate, 0, n), up = view_rows(s.up, 0, n);
    const tensor rope_g = view_rows(s.rope_g, 0, n), rope_l = view_rows(s.rope_l, 0, n);

    be.get_rows(m.tok_embd, ids, n, x);                                      // [n, E]
    if (hp.embed_scale) be.scale(x, std::sqrt(static_cast<float>(hp.n_embd)));
    be.rope_table(p0, n, hp.rope, rope_g);
    be.rope_table(p0, n, hp.rope_local, rope_l);

    attn_params ap;
    ap.n_head = hp.n_head;
    ap.n_head_kv = hp.n_head_kv;
    ap.head_dim = hd;
    ap.n_ctx = kv_->n_ctx;
    ap.n_past = p0;
    ap.scale = hp.attn_scale;
    ap.softcap = hp.attn_softcap;

    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const dense_layer &ly = m.layers[static_cast<size_t>(il)];
        const bool swa = hp.swa_layer[static_cast<size_t>(il)];
        const bool last = il == hp.n_layer - 1;  // its keys and queries are all the scores need

        be.rms_norm(x, &ly.attn_norm, hp.rms_eps, xn);
        {
            const tensor *w[] = {&ly.wq, &ly.wk, &ly.wv};
            const tensor *y[] = {&q, &k, &v};
            be.mul_mat(xn, last ? 2 : 3, w, y);                              // q [n, H*hd], k/v [n, Hkv*hd]
        }
        if (ly.bq.data) be.add(q, ly.bq, q);
        if (ly.bk.data) be.add(k, ly.bk, k);
        if (hp.qk_norm) {
            be.rms_norm(reshape(q, hd), &ly.attn_q_norm, hp.rms_eps, reshape(q, hd));
            be.rms_norm(reshape(k, hd), &ly.attn_k_norm, hp.rms_eps, reshape(k, hd));
        }
        // Pre-RoPE keys for every token, pre-RoPE queries for the scoring queries.
        be.kv_store(k, kpre_[static_cast<size_t>(il)], hp.n_head_kv, kv_->n_ctx, p0);
        if (q_out) be.copy(q, (*q_out)[static_cast<size_t>(il)]);
        if (last) break;
        if (ly.bv.data) be.add(v, ly.bv, v);
        const tensor &table = swa ? rope_l : rope_g;
        be.rope(q, hd, table, hp.rope.mode);
        be.rope(k, hd, table, hp.rope.mode);
        be.kv_store(k, kv_->k[static_cast<size_t>(il)], hp.n_head_kv, kv_->n_ctx, p0);
        be.kv_store(v, kv_->v[static_cast<size_t>(il)], hp.n_head_kv, kv_->n_ctx, p0);
        // The model's own sliding window (gemma3 local layers) still applies inside ours.
        int32_t w = window;
        if (swa && hp.n_swa > 0) w = w > 0 ? std::min(w, hp.n_swa) : hp.n_swa;
        ap.window = w;
        be.attention(q, kv_->k[static_cast<size_t>(il)], kv_->v[static_cast<size_t>(il)], ap, attn);
        be.mul_mat(attn, 1, std::array<const tensor *, 1>{&ly.wo}.data(), std::array<const tensor *, 1>{&o}.data());
        if (ly.bo.data) be.add(o, ly.bo, o);
        if (hp.post_norms) be.rms_norm(o, &ly.post_attn_norm, hp.rms_eps, o);
        be.add(x, o, x);

        be.rms_norm(x, &ly.ffn_norm, hp.rms_eps, xn);
        {
            const tensor *w2[] = {&ly.ffn_gate, &ly.ffn_up};
            const tensor *y2[] = {&gate, &up};
            be.mul_mat(xn, 2, w2, y2);
        }
        be.glu(gate, up, hp.act, gate);
        be.mul_mat(gate, 1, std::array<const tensor *, 1>{&ly.ffn_down}.data(), std::array<const tensor *, 1>{&o}.data());
        if (hp.post_norms) be.rms_norm(o, &ly.post_ffn_norm, hp.rms_eps, o);
        be.add(x, o, x);
    }
    be.synchronize();
    kv_->n_used = std::max(kv_->n_used, p0 + n);
}

std::vector<float> drafter::score(std::span<const int32_t> ids, const drafter_score_params &p, drafter_stats &st) {
    const int64_t n = static_cast<int64_t>(ids.size());
    if (n == 0) return {};
    const int64_t n_vocab = model_->hp.n_vocab;
    for (int32_t t : ids)
        if (t < 0 || t >= n_vocab) throw error("pflash: drafter token id " + std::to_string(t) + " outside its vocabulary");
    const int64_t n_q = std::min<int64_t>(std::max(1, p.query_tokens), n);
    const int64_t n_pre = n - n_q;  // prefilled with the window; the n_q queries get full attention
    ensure_capacity(n);

    // Reuse the held windowed prefix (the tokens are the same, so are their keys).
    int64_t keep = 0;
    while (keep < n_pre && keep < static_cast<int64_t>(held_.size()) && held_[static_cast<size_t>(keep)] == ids[static_cast<size_t>(keep)])
        ++keep;
    held_.resize(static_cast<size_t>(keep));
    kv_->n_used = keep;

    auto t0 = std::chrono::steady_clock::now();
    for (int64_t p0 = keep; p0 < n_pre;) {
        const int64_t m = std::min<int64_t>(n_batch_, n_pre - p0);
        forward(ids.data() + p0, m, p0, p.window, nullptr);
        held_.insert(held_.end(), ids.begin() + p0, ids.begin() + p0 + m);
        p0 += m;
    }
    st.prefill_s = seconds(t0);
    t0 = std::chrono::steady_clock::now();
    // The scoring queries' pre-RoPE rows, per layer, and agg [n_q, n] (zeroed by alloc) in backend memory.
    const dense_hparams &hp = model_->hp;
    const int64_t qw = int64_t{hp.n_head} * hp.head_dim;
    const size_t q_bytes = static_cast<size_t>(n_q * qw) * sizeof(float), agg_bytes = static_cast<size_t>(n_q * n) * sizeof(float);
    void *mem = be_->alloc(q_bytes * static_cast<size_t>(hp.n_layer) + agg_bytes);
    std::vector<float> agg(static_cast<size_t>(n_q * n));
    try {
        std::vector<tensor> q_pre;
        for (int32_t l = 0; l < hp.n_layer; ++l)
            q_pre.push_back(make_tensor(dtype::f32, qw, n_q, static_cast<uint8_t *>(mem) + q_bytes * static_cast<size_t>(l)));
        const tensor agg_t = make_tensor(dtype::f32, n, n_q, static_cast<uint8_t *>(mem) + q_bytes * static_cast<size_t>(hp.n_layer));
        forward(ids.data() + n_pre, n_q, n_pre, /*window=*/0, &q_pre);
        be_->synchronize();
        st.query_s = seconds(t0);
        st.n_evaluated = n - keep;
        t0 = std::chrono::steady_clock::now();
        // agg[t, j] = max over layers and heads of query t's attention probability on key j.
        for (int32_t l = 0; l < hp.n_layer; ++l)
            be_->attention_prob_max(q_pre[static_cast<size_t>(l)], kpre_[static_cast<size_t>(l)], hp.n_head, hp.n_head_kv,
                                    kv_->n_ctx, hp.attn_scale, hp.attn_softcap, n_pre, agg_t);
        be_->download(agg_t, agg.data());
        be_->synchronize();
    } catch (...) {
        be_->release(mem);
        throw;
    }
    be_->release(mem);
    std::vector<float> out(static_cast<size_t>(n), 0.0f);
    for (int64_t t = 0; t < n_q; ++t)
        for (int64_t j = 0; j < n; ++j) out[static_cast<size_t>(j)] += agg[static_cast<size_t>(t * n + j)];
    for (float &v : out) v /= static_cast<float>(n_q);
    st.score_s = seconds(t0);
    return out;
}

}  // namespace fathom::pflash
