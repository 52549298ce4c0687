// Token importance scoring (include/fathom/token_scorer.h): loading, the windowed scoring forward and
// the tail-query attention scores. The forward is the model's own (models/dense_forward.cpp) with an
// attention hook (dense_attn_hook): the hook keeps the pre-RoPE keys of every token (and the pre-RoPE
// queries of the scoring tokens), narrows the attention to the prefill's sliding window, and stops the
// forward in the last layer after its q/k (no logits are needed).
#include "fathom/token_scorer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/dense_gpu.h"
#include "engine/device.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "models/dense.h"

namespace fathom {


namespace {

double seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int online_cores() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

// The dense model, its backend and the scoring state (see token_scorer.h).
class dense_token_scorer : public token_scorer {
public:
    ~dense_token_scorer() override;
    int32_t n_vocab() const override { return model_->hp.n_vocab; }
    uint64_t file_bytes() const override { return file_->size(); }
    std::vector<float> score(std::span<const int32_t> ids, const token_score_params &p, token_score_stats &st) override;
    void reset() override;

private:
    friend class token_scorer;
    dense_token_scorer() = default;
    void ensure_capacity(int64_t n);
    // Evaluate ids[0, n) at positions [p0, p0+n) with attention window `window` (0 = full), through
    // the last layer's q/k only: keeps their pre-RoPE keys in kpre_ and, if q_out is set, copies the
    // pre-RoPE queries of every layer to q_out[l] ([n, n_head*head_dim] f32 backend tensors).
    void forward(const int32_t *ids, int64_t n, int64_t p0, int32_t window, const std::vector<tensor> *q_out);

    // Declaration order = reverse destruction order: the backend outlives everything it allocated.
    std::shared_ptr<const gguf::file> file_;
    std::unique_ptr<backend> be_;
    std::unique_ptr<dense_model> model_;
    int32_t n_batch_ = 512;
    int n_threads_ = 1;
    // State (sized by ensure_capacity).
    std::unique_ptr<kv_cache> kv_;            // post-RoPE K and V, as the model's own attention needs
    void *kpre_mem_ = nullptr;                // pre-RoPE keys, f16, same layout as kv_->k
    std::vector<tensor> kpre_;                // [n_layer] x [n_head_kv*n_ctx, head_dim]
    std::unique_ptr<dense_scratch> scratch_;
    std::vector<int32_t> held_;               // tokens whose windowed KV (and pre-RoPE K) are valid
};

std::unique_ptr<token_scorer> token_scorer::load(const std::string &path, int n_threads, int32_t n_batch,
                                                 const std::string &device) {
    // Members are filled one by one inside a unique_ptr: if any step throws, the partial scorer is
    // destroyed (backend last), so a failed load leaves no weights, mappings or threads behind.
    std::unique_ptr<dense_token_scorer> d(new dense_token_scorer());
    d->file_ = gguf::file::open(path);
    const std::string arch(d->file_->get_string("general.architecture", ""));
    if (!dense_supports_arch(arch))
        throw error("pflash: drafter " + path + " has architecture '" + arch + "', expected a dense llama/qwen3/gemma3 model");
    const dense_hparams hp = dense_load_hparams(*d->file_);
    d->n_batch_ = n_batch;
    d->n_threads_ = n_threads > 0 ? n_threads : online_cores();
    const int ordinal = resolve_cuda_ordinal(device);  // -1: the CPU; throws for an unusable device
    if (ordinal >= 0) {
        d->be_ = make_gpu_backend(ordinal);
    } else {
        cpu_options co;
        co.n_threads = d->n_threads_;
        co.max_cols = std::max({int64_t{hp.n_embd}, int64_t{hp.n_head} * hp.head_dim, int64_t{hp.n_ff}});
        co.max_rows = n_batch;
        co.max_ctx = 4096;  // the attention scratch grows with the span
        d->be_ = make_cpu_backend(co);
    }
    d->model_ = dense_load(*d->file_, *d->be_);
    d->scratch_ = dense_scratch_create(d->model_->hp, *d->be_, n_batch);
    return d;
}

dense_token_scorer::~dense_token_scorer() { reset(); }

void dense_token_scorer::reset() {
    held_.clear();
    kpre_.clear();
    if (kpre_mem_ && be_) be_->release(kpre_mem_);
    kpre_mem_ = nullptr;
    kv_.reset();
}

void dense_token_scorer::ensure_capacity(int64_t n) {
    if (kv_ && kv_->n_ctx >= n) return;
    // Grow to a power of two (>= 4096): the CPU backend maps pages lazily, so unused capacity is free,
    // and regrowing (which drops the held prefix) stays rare.
    int64_t cap = 4096;
    while (cap < n) cap *= 2;
    const dense_hparams &hp = model_->hp;
    reset();
    kv_ = std::make_unique<kv_cache>(*be_, hp.n_layer, hp.n_head_kv, hp.head_dim, cap, dtype::f16);
    const int64_t rows = int64_t{hp.n_head_kv} * cap;
    const size_t per = static_cast<size_t>(rows) * static_cast<size_t>(hp.head_dim) * 2;
    kpre_mem_ = be_->alloc(per * static_cast<size_t>(hp.n_layer));
    for (int32_t l = 0; l < hp.n_layer; ++l)
        kpre_.push_back(make_tensor(dtype::f16, hp.head_dim, rows, static_cast<uint8_t *>(kpre_mem_) + per * static_cast<size_t>(l)));
}

namespace {

// The attention hook's state for one forward: where the pre-RoPE keys (and queries) go.
struct capture {
    backend *be;
    const std::vector<tensor> *k_pre;  // [n_layer] f16 [n_head_kv*n_ctx, head_dim]
    const std::vector<tensor> *q_out;  // [n_layer] f32 [n, n_head*head_dim], or null
    int64_t n_ctx, p0;
    int32_t n_head_kv;
};

void capture_pre_rope(void *user, int32_t layer, const tensor &q, const tensor &k) {
    const capture &c = *static_cast<const capture *>(user);
    c.be->kv_store(k, (*c.k_pre)[static_cast<size_t>(layer)], c.n_head_kv, c.n_ctx, c.p0);
    if (c.q_out) c.be->copy(q, (*c.q_out)[static_cast<size_t>(layer)]);
}

}  // namespace

void dense_token_scorer::forward(const int32_t *ids, int64_t n, int64_t p0, int32_t window, const std::vector<tensor> *q_out) {
    const dense_hparams &hp = model_->hp;
    capture cap{be_.get(), &kpre_, q_out, kv_->n_ctx, p0, hp.n_head_kv};
    dense_attn_hook hook;
    hook.fn = capture_pre_rope;
    hook.user = &cap;
    hook.window = window;
    hook.stop_layer = hp.n_layer - 1;  // the last layer's keys and queries are all the scores need
    dense_seq sq;
    sq.kv.cache = kv_.get();
    sq.pos = p0;
    sq.tokens = std::span<const int32_t>(ids, static_cast<size_t>(n));
    dense_forward(*model_, *be_, *scratch_, std::span<const dense_seq>(&sq, 1), dense_trace{}, hook);
}

std::vector<float> dense_token_scorer::score(std::span<const int32_t> ids, const token_score_params &p,
                                             token_score_stats &st) {
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

}  // namespace fathom
