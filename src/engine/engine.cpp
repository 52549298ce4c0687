// engine / session implementation of include/fathom/engine.h for the dense family on the CPU or
// CUDA backend. The engine owns the mapped GGUF, the backend (and so the one thread pool, or the
// device copy of the weights), the model weights, the tokenizer, the chat template and, on the
// CPU, the one paged KV pool of all its sessions (src/kv/kv_pool.h); sessions own a block table
// in that pool (CPU) or a contiguous device KV cache (CUDA, where a session also replays its
// single-token decode step as a captured CUDA graph), activation scratch and the token timeline.
// Forward calls of all sessions of one engine are serialised by a mutex, so sessions may live on
// different threads without oversubscribing the cores. The GPU is reached only through dense_gpu.h (the
// CUDA backend and its step graphs), chosen once at load (make_cuda).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "gguf/fingerprint.h"
#include "chat/chat_template.h"
#include "engine/sync_plan.h"
#include "engine/ds4_session.h"
#include "core/error.h"
#include "core/state_io.h"
#include "fathom/engine.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "models/dense.h"
#include "tokenizer/tokenizer.h"
#include "engine/dense_gpu.h"
#include "engine/device.h"

namespace fathom {

namespace {

std::string gib(uint64_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

// Built-in templates for files without tokenizer.chat_template (llama.cpp falls back to ChatML
// for every model; Gemma files get Gemma's turn format, which is what they were trained on).
std::string render_builtin_template(const std::string &arch, const std::vector<chat_message> &msgs, bool add_gen) {
    std::string out;
    if (arch.rfind("gemma", 0) == 0) {
        // Gemma: no system role; a system message is prepended to the first user turn.
        std::string pending_system;
        for (const auto &m : msgs) {
            if (m.role == "system") {
                pending_system += m.content + "\n\n";
                continue;
            }
            const std::string role = m.role == "assistant" ? "model" : m.role;
            out += "<start_of_turn>" + role + "\n" + pending_system + m.content + "<end_of_turn>\n";
            pending_system.clear();
        }
        if (add_gen) out += "<start_of_turn>model\n";
        return out;
    }
    for (const auto &m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_gen) out += "<|im_start|>assistant\n";
    return out;
}

int default_threads() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : std::max(1u, std::thread::hardware_concurrency());
}

class engine_impl;

class session_impl final : public session {
public:
    explicit session_impl(engine_impl &e);
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) override;
    void eval(std::span<const int32_t> tokens, float *all_logits) override;
    std::span<const float> logits() const override {
        return have_logits_ ? std::span<const float>(logits_) : std::span<const float>();
    }
    int64_t n_past() const override { return static_cast<int64_t>(tokens_.size()); }
    const std::vector<int32_t> &tokens() const override { return tokens_; }
    void reset() override {
        tokens_.clear();
        have_logits_ = false;
        if (kv_) kv_->n_used = 0;
        if (seq_ >= 0) {
            reserved_ = 0;
            pool_->shrink(seq_, 0);
        }
    }
    ~session_impl() override {
        if (seq_ >= 0) pool_->seq_close(seq_);
    }
    void truncate(int64_t n_keep) override;
    bool rolls_back() const override { return true; }  // truncate drops positions (drop_after)
    bool kv_reserve(int64_t n_tokens) override;
    int64_t kv_blocks() const override { return seq_ >= 0 ? pool_->held(seq_) : 0; }
    // Saved states: CPU sessions (paged KV) and CUDA sessions (the contiguous device cache, copied
    // through the host head by head): the same DNS1 stream.
    bool save_state(state_writer &w) const override;
    bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) override;
    bool loads_state_prefix() const override { return true; }

private:
    friend class engine_impl;  // decode_step (batched) reads and advances kv_/tokens_/logits_
    void eval_chunks(std::span<const int32_t> toks, float *all_logits,
                     const std::function<void(int64_t, int64_t)> *on_progress);
    // Drop held tokens beyond `keep` (their KV is stale; paged: their blocks beyond the
    // reservation go back to the pool).
    void drop_after(size_t keep);
    // Paged: make the table cover positions [0, end) or throw (the pool's cap is reached).
    void kv_cover(int64_t end);
    // save_state / load_state: the geometry preamble, and the K/V rows of positions [0, n) of every
    // layer, K then V, head by head (`visit(row_ptr, n_rows)` per run of rows inside one block).
    void state_geometry(state_writer &w, int64_t n_tokens, bool has_logits) const;
    template <class F>
    void state_rows(int64_t n, F &&visit) const;
    // The contiguous cache's views of layer il in the stream's order: K then V, head by head, each the
    // rows of positions [0, n) (the cache is head-major: row h * n_ctx + pos).
    std::vector<tensor> layer_views(int32_t il, int64_t n) const;
    dense_kv kv_target() {
        dense_kv d;
        if (seq_ >= 0) {
            d.pool = pool_;
            d.seq = seq_;
        } else {
            d.cache = kv_.get();
        }
        return d;
    }
    engine_impl &e_;
    std::unique_ptr<kv_cache> kv_;  // CUDA: the session's contiguous device cache (null when paged)
    kv_pool *pool_ = nullptr;       // CPU: the engine's pool, the session's sequence in it
    int seq_ = -1;
    int64_t reserved_ = 0;          // positions kept allocated ahead (kv_reserve)
    std::unique_ptr<dense_scratch> scratch_;
    std::vector<int32_t> tokens_;
    std::vector<float> logits_;  // [n_vocab] of tokens_.back()
    bool have_logits_ = false;
    // CUDA: single-token decode through a captured graph. Returns false when the step must run
    // eagerly (CPU engine, graphs off, the session's first decode, or a capture that failed).
    bool decode_graph(int32_t token);
    std::unique_ptr<dense_step_graph> graph_;
    int64_t eager_decodes_ = 0;
    bool graph_failed_ = false;
};

class engine_impl final : public engine {
public:
    engine_impl(const engine_options &o, std::shared_ptr<const gguf::file> file) : opts_(o), file_(std::move(file)) {
        const int cuda_ordinal = resolve_cuda_ordinal(o.device);  // throws for an unusable forced device
        if (o.n_threads < 0) throw error("n_threads must be >= 0, got " + std::to_string(o.n_threads));
        if (o.n_ctx < 0) throw error("n_ctx must be >= 0, got " + std::to_string(o.n_ctx));
        if (o.n_batch < 0) throw error("n_batch must be >= 0, got " + std::to_string(o.n_batch));
        const dense_hparams hp = dense_load_hparams(*file_);  // arch check before anything heavy
        n_ctx_ = o.n_ctx > 0 ? o.n_ctx : std::min(hp.n_ctx_train, 8192);
        n_batch_ = std::min<int64_t>(o.n_batch > 0 ? o.n_batch : 512, n_ctx_);
        const int64_t max_cols = std::max({int64_t{hp.n_embd}, int64_t{hp.n_head} * hp.head_dim, int64_t{hp.n_ff}});
        cpu_options co;
        co.n_threads = o.n_threads > 0 ? o.n_threads : default_threads();
        co.exact = o.exact;
        co.batch_invariant = o.batch_invariant;
        co.max_cols = max_cols;
        co.max_rows = n_batch_;
        co.max_ctx = n_ctx_;
        if (cuda_ordinal >= 0) {
            make_cuda(cuda_ordinal, hp);
        } else {
            cpu_be_ = make_cpu_backend(co);
            be_ = cpu_be_.get();
        }
        if (o.on_load_progress) o.on_load_progress(0, file_->size());
        model_ = dense_load(*file_, *be_);
        // The CPU backend reads K/V through block tables: one pool for all sessions, 16-token
        // blocks, no cap until a scheduler sets one (kv_pool_configure). CUDA keeps per-session
        // contiguous device caches.
        if (be_->supports_paged_kv()) {
            const int32_t bt = 16;
            pool_ = std::make_unique<fathom::kv_pool>(*be_, hp.n_layer, hp.n_head_kv, hp.head_dim, kv_type(), bt,
                                                      arena_blocks(bt), 0);
        }
        tok_ = std::make_unique<tokenizer>(*file_);
        if (tok_->n_vocab() != model_->hp.n_vocab && tok_->n_vocab() > model_->hp.n_vocab)
            throw error(o.model_path + ": tokenizer has " + std::to_string(tok_->n_vocab()) + " tokens, the model " +
                        std::to_string(model_->hp.n_vocab));
        const std::string_view tmpl = file_->get_string("tokenizer.chat_template", "");
        if (!tmpl.empty()) template_.emplace(std::string(tmpl));
        fill_info(o);
        if (o.on_load_progress) o.on_load_progress(file_->size(), file_->size());
    }

    const model_info &info() const override { return info_; }

    std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
        return tok_->encode(text, add_special, parse_special);
    }
    std::string token_to_piece(int32_t token) const override { return tok_->token_to_piece(token); }
    std::string detokenize(std::span<const int32_t> tokens) const override { return tok_->decode(tokens); }
    bool is_end_of_generation(int32_t token) const override { return tok_->is_eog(token); }
    bool is_control_token(int32_t token) const override {
        const token_type t = tok_->type(token);
        return t == token_type::control || t == token_type::unknown || t == token_type::unused;
    }
    int32_t bos_token() const override { return tok_->bos(); }

    std::string apply_chat_template(const std::vector<chat_message> &messages, bool add_gen,
                                    chat_thinking thinking = chat_thinking::template_default) const override {
        if (!template_) return render_builtin_template(info_.arch, messages, add_gen);
        chat_template_inputs in;
        for (const auto &m : messages) in.messages.push_back({{"role", m.role}, {"content", m.content}});
        in.add_generation_prompt = add_gen;
        set_thinking_vars(in, thinking);
        if (tok_->bos() != token_null) in.bos_token = tok_->token_to_piece(tok_->bos());
        if (tok_->eos() != token_null) in.eos_token = tok_->token_to_piece(tok_->eos());
        return template_->render(in);
    }

    std::unique_ptr<session> new_session() override { return std::make_unique<session_impl>(*this); }
    // CPU (paged KV) only. kv changes the saved rows; the numerics change every value after a load.
    std::string state_identity() const override {
        if (!pool_ && cuda_ordinal_ < 0) return {};
        std::call_once(identity_once_, [&] { file_identity_ = gguf::file_fingerprint(*file_); });
        const char *numerics = opts_.exact ? "exact" : opts_.batch_invariant ? "invariant" : "llamacpp";
        // A CUDA state is offered only to CUDA engines: the backends' logits differ in the last bits.
        return "dense arch=" + model_->hp.arch + " file=" + file_identity_ +
               " kv=" + (kv_type() == dtype::f32 ? "f32" : "f16") + " numerics=" + numerics +
               (cuda_ordinal_ >= 0 ? " backend=cuda gpu=\"" + gpu_name_ + "\"" : std::string());
    }
    kv_pool_info kv_pool() const override {
        kv_pool_info i;
        if (!pool_) return i;
        i.block_tokens = pool_->block_tokens();
        i.max_blocks = pool_->max_blocks();
        i.n_blocks = pool_->n_blocks();
        i.n_used = pool_->n_used();
        return i;
    }
    bool kv_pool_configure(int32_t block_tokens, int64_t max_blocks) override {
        if (!pool_) return false;
        pool_->configure(block_tokens, arena_blocks(block_tokens), max_blocks);
        return true;
    }
    // One forward for all sessions' tokens (dense_forward over a batch); defined below session_impl.
    void decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens) override;
    // Paged (CPU): every item's missing tokens in one forward (dense_forward over a batch); otherwise (CUDA,
    // whose GEMM numerics depend on the row count) engine::sync_step's decode_step + per-session sync.
    void sync_step(std::span<const sync_item> items) override;

    // ---- for sessions ----
    const dense_model &model() const { return *model_; }
    backend &be() { return *be_; }
    std::mutex &forward_mutex() { return forward_mutex_; }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_batch() const { return n_batch_; }
    bool cuda_graphs() const { return opts_.cuda_graphs; }
    // CUDA: select the engine's device on the calling thread (the CUDA runtime's current device is
    // per thread; server workers are not the loading thread).
    void bind_device() {
        if (gpu_) gpu_->make_current();
    }
    dense_gpu *gpu() const { return gpu_.get(); }  // null on the CPU
    double measure_copy_bandwidth() override {
        if (gpu_) {
            std::lock_guard<std::mutex> lock(forward_mutex_);
            return gpu_measure_copy_bandwidth(cuda_ordinal_);
        }
        return 0.0;
    }
    dtype kv_type() const { return opts_.kv == kv_precision::f32 ? dtype::f32 : dtype::f16; }
    fathom::kv_pool *paged_kv() { return pool_.get(); }

private:
    // Pool arenas hold one full context each, so the pool grows in the steps a contiguous cache
    // per session would have taken.
    int64_t arena_blocks(int32_t block_tokens) const { return (n_ctx_ + block_tokens - 1) / block_tokens; }
    // The CUDA backend on device `ordinal`, after checking that the weights, one session's KV cache
    // and the scratch buffers fit in the device's free memory (so loading never fails midway).
    void make_cuda(int ordinal, const dense_hparams &hp) {
        std::unique_ptr<dense_gpu> gpu = make_dense_gpu(ordinal);
        const gpu_memory mem = gpu_query_memory(ordinal);  // after the context and cuBLAS workspace
        const uint64_t E = static_cast<uint64_t>(hp.n_embd), Q = uint64_t(hp.n_head) * static_cast<uint64_t>(hp.head_dim),
                       KV = uint64_t(hp.n_head_kv) * static_cast<uint64_t>(hp.head_dim), F = static_cast<uint64_t>(hp.n_ff),
                       B = static_cast<uint64_t>(n_batch_), V = static_cast<uint64_t>(hp.n_vocab);
        uint64_t weights = file_->size();  // upper bound: tensor data plus the metadata
        // + the fast decode GEMV's repacked copies of q8_0 matrices (rows of whole 512-element tiles; the
        // CUDA backend's prepare_weight keeps the GGUF rows too, for prefill): 17/16 of a row's 34/32.
        for (const gguf::tensor_info &ti : file_->tensors())
            if (ti.type == dtype::q8_0 && ti.ne[0] % 512 == 0) weights += ti.nbytes;
        const uint64_t kv = static_cast<uint64_t>(n_ctx_) *
                            kv_cache::bytes_per_token(hp.n_layer, hp.n_head_kv, hp.head_dim, kv_type());
        const uint64_t max_cols = std::max({E, Q, F});
        // Session activations (dense_scratch), the largest weight dequantised to bf16 for a prefill
        // GEMM, x in bf16, attention partials, and 64 MiB for kernels' and cuBLAS's own needs.
        const uint64_t scratch = B * (3 * E + 2 * Q + 2 * KV + 2 * F + 2 * static_cast<uint64_t>(hp.rope.n_rot)) * 4 +
                                 (8u << 20) + std::max({V * E, F * E, Q * E}) * 2 + B * max_cols * 2 +
                                 B * static_cast<uint64_t>(hp.n_head) * 64 * (static_cast<uint64_t>(hp.head_dim) + 2) * 4 +
                                 (64u << 20);
        const uint64_t need = weights + kv + scratch;
        if (need > mem.free_bytes)
            throw error("device 'cuda:" + std::to_string(ordinal) + "' (" + mem.name + "): needs " + gib(need) +
                        " (weights " + gib(weights) + " + KV cache of " + std::to_string(n_ctx_) + " tokens " + gib(kv) +
                        " + scratch " + gib(scratch) + ") but only " + gib(mem.free_bytes) +
                        " is free (lower --ctx or use --device cpu)");
        device_name_ = "cuda:" + std::to_string(ordinal) + " (" + mem.name + ")";
        gpu_name_ = mem.name;
        cuda_ordinal_ = ordinal;
        gpu_ = std::move(gpu);
        be_ = &gpu_->be();
    }

    // Weight bytes a single-token step reads: every layer tensor, the final norm, the output head
    // and one embedding row.
    uint64_t decode_weight_bytes() const {
        uint64_t b = 0;
        auto add = [&b](const tensor &t) { b += t.data ? t.nbytes() : 0; };
        for (const dense_layer &ly : model_->layers)
            for (const tensor *t : {&ly.attn_norm, &ly.wq, &ly.wk, &ly.wv, &ly.wo, &ly.bq, &ly.bk, &ly.bv, &ly.bo,
                                    &ly.attn_q_norm, &ly.attn_k_norm, &ly.post_attn_norm, &ly.ffn_norm, &ly.ffn_gate,
                                    &ly.ffn_up, &ly.ffn_down, &ly.post_ffn_norm})
                add(*t);
        add(model_->output_norm);
        add(model_->output);
        b += model_->tok_embd.nb1;
        return b;
    }

    void fill_info(const engine_options &o) {
        const dense_hparams &hp = model_->hp;
        info_.arch = hp.arch;
        info_.name = std::string(file_->get_string("general.name", ""));
        info_.path = o.model_path;
        info_.file_bytes = file_->size();
        info_.n_params = model_->n_params;
        info_.n_vocab = hp.n_vocab;
        info_.n_ctx_train = hp.n_ctx_train;
        info_.n_ctx = static_cast<int32_t>(n_ctx_);
        info_.n_layer = hp.n_layer;
        info_.n_embd = hp.n_embd;
        info_.kv_bytes_per_token = kv_cache::bytes_per_token(hp.n_layer, hp.n_head_kv, hp.head_dim, kv_type());
        info_.chat_template = template_ ? template_->source() : "";
        info_.device = device_name_;
        info_.decode_weight_bytes = decode_weight_bytes();
    }

    engine_options opts_;
    std::shared_ptr<const gguf::file> file_;  // mapped weights: must outlive model_
    // The backend every forward runs on (be_): the CUDA backend that gpu_ owns (one GPU, make_cuda), or
    // the CPU backend in cpu_be_. Declared before model_, whose weights live there.
    std::unique_ptr<dense_gpu> gpu_;
    std::unique_ptr<backend> cpu_be_;
    backend *be_ = nullptr;
    std::unique_ptr<dense_model> model_;
    std::unique_ptr<fathom::kv_pool> pool_;  // paged KV of all sessions (CPU); null on CUDA
    std::unique_ptr<tokenizer> tok_;
    std::optional<chat_template> template_;
    model_info info_;
    int64_t n_ctx_ = 0, n_batch_ = 0;
    std::mutex forward_mutex_;
    mutable std::once_flag identity_once_;  // state_identity: the file's fingerprint, computed once
    mutable std::string file_identity_;
    // A session's part of a fused sync_step: its new tokens prefix[keep, end) still to evaluate.
    struct step_work {
        session_impl *s = nullptr;
        std::span<const int32_t> rest;  // not yet evaluated
        bool want_logits = true;
        int32_t n_rows = 0;      // sync_item::n_rows: the last n_rows of rest (one piece) with every row's logits
        float *rows = nullptr;
    };
    std::vector<step_work> plan_sync_step(std::span<const sync_item> items, std::vector<size_t> &alone);
    void run_sync_step(std::vector<step_work> &work);
    // One batched forward over seqs (under forward_mutex_), in batch_scratch_: created on the first
    // batched step and grown (at least doubling) when a step has more rows than it holds.
    void run_batch(std::span<const dense_seq> seqs) {
        int64_t rows = 0;
        for (const dense_seq &sq : seqs) rows += static_cast<int64_t>(sq.tokens.size());
        if (!batch_scratch_ || batch_scratch_->n_batch < rows)
            batch_scratch_ = dense_scratch_create(model_->hp, *be_,
                                                  std::max<int64_t>(rows, batch_scratch_ ? 2 * batch_scratch_->n_batch : 8));
        dense_forward(*model_, *be_, *batch_scratch_, seqs);
    }
    std::unique_ptr<dense_scratch> batch_scratch_;  // activations of the batched steps
    std::string device_name_ = "cpu";
    std::string gpu_name_;  // the CUDA device's name (state_identity: the GEMMs' launch shapes follow it)
    int cuda_ordinal_ = -1;
};

session_impl::session_impl(engine_impl &e) : e_(e) {
    e.bind_device();
    const dense_hparams &hp = e.model().hp;
    pool_ = e.paged_kv();
    if (pool_) seq_ = pool_->seq_open();
    else kv_ = std::make_unique<kv_cache>(e.be(), hp.n_layer, hp.n_head_kv, hp.head_dim, e.n_ctx(), e.kv_type());
    scratch_ = dense_scratch_create(hp, e.be(), e.n_batch());
    logits_.assign(static_cast<size_t>(hp.n_vocab), 0.0f);
    tokens_.reserve(static_cast<size_t>(e.n_ctx()));
}

void session_impl::eval_chunks(std::span<const int32_t> toks, float *all_logits,
                               const std::function<void(int64_t, int64_t)> *on_progress) {
    const dense_model &m = e_.model();
    const int64_t n_vocab = m.hp.n_vocab, total = static_cast<int64_t>(toks.size());
    if (total == 0) return;
    if (n_past() + total > e_.n_ctx())
        throw error("context full: " + std::to_string(n_past()) + " + " + std::to_string(total) + " tokens exceed n_ctx " +
                    std::to_string(e_.n_ctx()));
    for (int32_t t : toks)
        if (t < 0 || t >= n_vocab)
            throw error("token id " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
    std::lock_guard<std::mutex> lock(e_.forward_mutex());
    e_.bind_device();
    for (int64_t done = 0; done < total;) {
        const int64_t n = std::min(e_.n_batch(), total - done);
        const bool last = done + n == total;
        float *out = nullptr;
        int64_t n_out = 0;
        if (all_logits) {
            out = all_logits + done * n_vocab;
            n_out = n;
        } else if (last) {
            out = logits_.data();
            n_out = 1;
        }
        have_logits_ = false;
        kv_cover(n_past() + n);
        if (!(n == 1 && out == logits_.data() && decode_graph(toks[static_cast<size_t>(done)])))
            dense_forward(m, e_.be(), kv_target(), *scratch_, toks.data() + done, n, n_past(), n_out, out);
        tokens_.insert(tokens_.end(), toks.begin() + done, toks.begin() + done + n);
        if (kv_) kv_->n_used = n_past();
        done += n;
        if (last) {
            if (all_logits) std::memcpy(logits_.data(), out + (n - 1) * n_vocab, static_cast<size_t>(n_vocab) * sizeof(float));
            have_logits_ = true;
        }
        if (on_progress && *on_progress) (*on_progress)(done, total);
    }
}

bool session_impl::decode_graph(int32_t token) {
    dense_gpu *gpu = e_.gpu();
    if (!gpu || !e_.cuda_graphs() || graph_failed_) return false;
    if (!graph_) {
        // The first decode runs eagerly: it sizes the backend's scratch (attention key-split partials),
        // which cannot grow while a graph is being captured.
        if (eager_decodes_++ == 0) return false;
        graph_ = gpu->new_step_graph(logits_.size() * sizeof(float));
    }
    if (!graph_->ready() || graph_->stale()) {
        // Captured at position offset 0; replay() supplies the position and the token id.
        const dense_model &m = e_.model();
        try {
            graph_->capture([&](backend &proxy) {
                const int32_t placeholder = 0;  // replaced by the device id buffer
                dense_forward(m, proxy, *kv_, *scratch_, &placeholder, 1, 0, 1, logits_.data());
            });
        } catch (const error &ex) {
            std::fprintf(stderr, "fathom: CUDA graph capture failed (%s); decoding eagerly\n", ex.what());
            graph_failed_ = true;
            graph_.reset();
            return false;
        }
    }
    graph_->replay(&token, n_past());
    return true;
}

void session_impl::eval(std::span<const int32_t> tokens, float *all_logits) { eval_chunks(tokens, all_logits, nullptr); }

void session_impl::sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) {
    if (static_cast<int64_t>(prefix.size()) > e_.n_ctx())
        throw error("prompt of " + std::to_string(prefix.size()) + " tokens exceeds n_ctx " + std::to_string(e_.n_ctx()));
    if (prefix.empty()) {
        reset();
        if (on_progress) on_progress(0, 0);
        return;
    }
    size_t keep = 0;
    while (keep < prefix.size() && keep < tokens_.size() && prefix[keep] == tokens_[keep]) ++keep;
    if (keep == prefix.size() && keep == tokens_.size() && have_logits_) {
        if (on_progress) on_progress(0, 0);
        return;
    }
    // The logits of prefix.back() are needed: if it is already held but is not the last token
    // evaluated (or its logits were not kept), evaluate it again.
    if (keep == prefix.size()) --keep;
    drop_after(keep);
    eval_chunks(prefix.subspan(keep), nullptr, &on_progress);
}

void session_impl::drop_after(size_t keep) {
    if (keep < tokens_.size()) have_logits_ = false;
    tokens_.resize(std::min(keep, tokens_.size()));
    if (kv_) kv_->n_used = n_past();  // positions >= keep are stale and get overwritten
    if (seq_ >= 0) pool_->shrink(seq_, std::max(reserved_, n_past()));
}

void session_impl::truncate(int64_t n_keep) {
    if (n_keep < n_past()) drop_after(static_cast<size_t>(std::max<int64_t>(n_keep, 0)));
}

bool session_impl::kv_reserve(int64_t n_tokens) {
    if (n_tokens < 0) throw error("kv_reserve: negative token count");
    if (seq_ < 0) return true;  // CUDA: the contiguous cache already covers n_ctx
    const int64_t cover = std::max(n_tokens, n_past());
    if (!pool_->reserve(seq_, cover)) return false;
    pool_->shrink(seq_, cover);
    reserved_ = n_tokens;
    return true;
}

void session_impl::kv_cover(int64_t end) {
    if (seq_ >= 0 && !pool_->reserve(seq_, end))
        throw error("KV pool full: " + std::to_string(pool_->blocks_for(end) - pool_->held(seq_)) + " more blocks of " +
                    std::to_string(pool_->block_tokens()) + " tokens needed, " + std::to_string(pool_->n_available()) +
                    " available (cap " + std::to_string(pool_->max_blocks()) + ")");
}

// ---- saved states ------------------------------------------------------------------------------
// Stream (little-endian; docs/prompt-cache.md "Dense state"): u32 magic "DNS1", u32 version 1, u64
// n_layer, n_head_kv, head_dim, KV dtype (0 f16, 1 f32), n_vocab, n_tokens, has_logits; then the KV
// rows [n_layer][K, V][n_head_kv][n_tokens][head_dim] (position-major, so independent of the pool's
// block size); then, when has_logits, the last token's logits [n_vocab] f32.

constexpr uint32_t dense_state_magic = 0x31534e44;  // "DNS1"

void session_impl::state_geometry(state_writer &w, int64_t n_tokens, bool has_logits) const {
    const dense_hparams &hp = e_.model().hp;
    state_io::put<uint32_t>(w, dense_state_magic);
    state_io::put<uint32_t>(w, 1);
    for (const int64_t v : {int64_t{hp.n_layer}, int64_t{hp.n_head_kv}, int64_t{hp.head_dim},
                            int64_t{e_.kv_type() == dtype::f32 ? 1 : 0}, int64_t{hp.n_vocab}, n_tokens,
                            int64_t{has_logits ? 1 : 0}})
        state_io::put<uint64_t>(w, static_cast<uint64_t>(v));
}

template <class F>
void session_impl::state_rows(int64_t n, F &&visit) const {
    std::vector<uint8_t *> addrs;
    pool_->block_addrs(seq_, addrs);
    const int64_t bt = pool_->block_tokens(), n_addr = static_cast<int64_t>(addrs.size());
    const size_t row = dtype_row_bytes(pool_->type(), pool_->head_dim());
    for (int32_t il = 0; il < pool_->n_layer(); ++il) {
        const kv_pages pg = pool_->pages(addrs, il);
        for (const size_t off : {pg.k_offset, pg.v_offset})
            for (int32_t h = 0; h < pool_->n_head_kv(); ++h)
                for (int64_t p0 = 0; p0 < n; p0 += bt) {
                    uint8_t *base = p0 / bt < n_addr ? addrs[static_cast<size_t>(p0 / bt)] + off +
                                                           static_cast<size_t>(h * bt) * row
                                                     : nullptr;
                    visit(base, p0, std::min(bt, n - p0), row);
                }
    }
}

std::vector<tensor> session_impl::layer_views(int32_t il, int64_t n) const {
    const size_t row = dtype_row_bytes(kv_->type, kv_->head_dim);
    std::vector<tensor> v;
    for (const tensor *t : {&kv_->k[static_cast<size_t>(il)], &kv_->v[static_cast<size_t>(il)]})
        for (int32_t h = 0; h < kv_->n_head_kv; ++h)
            v.push_back(make_tensor(kv_->type, kv_->head_dim, n,
                                    static_cast<uint8_t *>(t->data) +
                                        static_cast<size_t>(h) * static_cast<size_t>(kv_->n_ctx) * row));
    return v;
}

bool session_impl::save_state(state_writer &w) const {
    if (seq_ < 0 && !kv_) return false;
    state_geometry(w, n_past(), have_logits_);
    if (seq_ >= 0) {
        state_rows(n_past(), [&](const uint8_t *p, int64_t, int64_t rows, size_t row) {
            if (!p) throw error("saved state: the block table does not cover the held tokens");
            w.write(p, static_cast<size_t>(rows) * row);
        });
    } else if (n_past() > 0) {  // the device cache through the host, a layer at a time: the forward
        std::vector<uint8_t> buf;  // lock (other slots' steps wait) is held once per layer, not per head
        for (int32_t il = 0; il < kv_->n_layer; ++il) {
            const std::vector<tensor> views = layer_views(il, n_past());
            buf.resize(views.size() * views[0].nbytes());
            {
                std::lock_guard<std::mutex> lock(e_.forward_mutex());
                e_.bind_device();
                for (size_t i = 0; i < views.size(); ++i) e_.be().download(views[i], buf.data() + i * views[i].nbytes());
            }
            w.write(buf.data(), buf.size());
        }
    }
    if (have_logits_) w.write(logits_.data(), logits_.size() * sizeof(float));
    return true;
}

bool session_impl::load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) {
    if (seq_ < 0 && !kv_) return false;
    const dense_hparams &hp = e_.model().hp;
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n_keep < 1 || n_keep > n)
        throw error("saved state: keep " + std::to_string(n_keep) + " of " + std::to_string(n));
    // Only the kept positions must fit: the rows of later ones are read and dropped, so a prefix of an
    // entry saved with a longer context (the identity leaves the context out) loads too.
    if (n_keep > e_.n_ctx())
        throw error("saved state: " + std::to_string(n_keep) + " tokens do not fit the context");
    for (int32_t t : tokens)
        if (t < 0 || t >= hp.n_vocab)
            throw error("saved state: token id " + std::to_string(t) + " outside the vocabulary");
    drop_after(0);  // holds nothing; the reservation (kv_reserve) stays
    have_logits_ = false;
    try {
        if (state_io::get<uint32_t>(r) != dense_state_magic)
            throw error("saved state: not a dense-model state");
        if (state_io::get<uint32_t>(r) != 1) throw error("saved state: unknown dense state version");
        state_io::expect(r, static_cast<uint64_t>(hp.n_layer), "layer count");
        state_io::expect(r, static_cast<uint64_t>(hp.n_head_kv), "KV head count");
        state_io::expect(r, static_cast<uint64_t>(hp.head_dim), "head dim");
        state_io::expect(r, e_.kv_type() == dtype::f32 ? 1 : 0, "KV precision (0 f16, 1 f32)");
        state_io::expect(r, static_cast<uint64_t>(hp.n_vocab), "vocabulary size");
        state_io::expect(r, static_cast<uint64_t>(n), "token count");
        const uint64_t has_logits = state_io::get<uint64_t>(r);
        if (has_logits > 1) throw error("saved state: bad logits flag");
        if (seq_ >= 0) {
            kv_cover(n_keep);
            // Rows of positions >= n_keep are read and dropped (a run straddling n_keep keeps its head).
            state_rows(n, [&](uint8_t *p, int64_t p0, int64_t rows, size_t row) {
                const int64_t kept = std::clamp<int64_t>(n_keep - p0, 0, rows);
                if (kept > 0) r.read(p, static_cast<size_t>(kept) * row);  // p != null: kv_cover(n_keep)
                state_io::skip(r, static_cast<uint64_t>(rows - kept) * row);
            });
        } else {  // the device cache: a layer's kept rows read (the rest skipped) outside the forward
            std::vector<uint8_t> buf;  // lock, then uploaded under it (once per layer)
            const size_t row = dtype_row_bytes(kv_->type, kv_->head_dim);
            for (int32_t il = 0; il < kv_->n_layer; ++il) {
                const std::vector<tensor> views = layer_views(il, n_keep);
                buf.resize(views.size() * views[0].nbytes());
                for (size_t i = 0; i < views.size(); ++i) {
                    r.read(buf.data() + i * views[i].nbytes(), views[i].nbytes());
                    state_io::skip(r, static_cast<uint64_t>(n - n_keep) * row);
                }
                std::lock_guard<std::mutex> lock(e_.forward_mutex());
                e_.bind_device();
                for (size_t i = 0; i < views.size(); ++i)  // synchronous copies: buf is refilled next layer
                    e_.be().upload(views[i], buf.data() + i * views[i].nbytes());
            }
            kv_->n_used = n_keep;
        }
        if (has_logits) r.read(logits_.data(), logits_.size() * sizeof(float));
        if (r.remaining() != 0)
            throw error("saved state: " + std::to_string(r.remaining()) + " bytes past its end");
        tokens_.assign(tokens.begin(), tokens.begin() + n_keep);
        have_logits_ = has_logits && n_keep == n;
    } catch (...) {
        tokens_.clear();
        have_logits_ = false;
        drop_after(0);
        throw;
    }
    return true;
}

void engine_impl::decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens) {
    if (sessions.size() != tokens.size())
        throw error("decode_step: " + std::to_string(sessions.size()) + " sessions but " +
                    std::to_string(tokens.size()) + " tokens");
    if (sessions.empty()) return;
    std::vector<session_impl *> ss(sessions.size());
    std::vector<dense_seq> seqs(sessions.size());
    for (size_t i = 0; i < sessions.size(); ++i) {
        auto *s = dynamic_cast<session_impl *>(sessions[i]);
        if (!s || &s->e_ != this) throw error("decode_step: session " + std::to_string(i) + " was not created by this engine");
        if (s->n_past() + 1 > n_ctx_)
            throw error("context full: " + std::to_string(s->n_past()) + " + 1 tokens exceed n_ctx " + std::to_string(n_ctx_));
        if (tokens[i] < 0 || tokens[i] >= model_->hp.n_vocab)
            throw error("token id " + std::to_string(tokens[i]) + " outside the vocabulary [0, " +
                        std::to_string(model_->hp.n_vocab) + ")");
        if (std::find(ss.begin(), ss.begin() + static_cast<std::ptrdiff_t>(i), s) != ss.begin() + static_cast<std::ptrdiff_t>(i))
            throw error("decode_step: session " + std::to_string(i) + " appears twice");
        ss[i] = s;
        seqs[i] = {s->kv_target(), s->n_past(), tokens.subspan(i, 1), s->logits_.data(), 1};
    }
    for (session_impl *s : ss) s->kv_cover(s->n_past() + 1);
    std::lock_guard<std::mutex> lock(forward_mutex_);
    bind_device();
    for (session_impl *s : ss) s->have_logits_ = false;
    run_batch(seqs);
    for (size_t i = 0; i < ss.size(); ++i) {
        ss[i]->tokens_.push_back(tokens[i]);
        if (ss[i]->kv_) ss[i]->kv_->n_used = ss[i]->n_past();
        ss[i]->have_logits_ = true;
    }
}

void engine_impl::sync_step(std::span<const sync_item> items) {
    if (!pool_) {
        engine::sync_step(items);
        return;
    }
    // Verification items (n_rows > 0) whose new tokens exceed one piece run alone after the fused forward.
    std::vector<size_t> alone;
    std::vector<step_work> work = plan_sync_step(items, alone);
    if (!work.empty()) run_sync_step(work);
    for (size_t i : alone) sync_with_rows(items[i]);
}

// Checks every item before any session changes (ownership, distinct sessions, context, vocabulary),
// then brings each session to the longest common prefix of what it holds and its item's prefix
// (session::sync's rule: when the whole prefix is held but its last token's logits are wanted and
// not kept, that token is evaluated again) and covers the positions to evaluate with KV blocks.
// Returns the items that have tokens to evaluate.
std::vector<engine_impl::step_work> engine_impl::plan_sync_step(std::span<const sync_item> items,
                                                                std::vector<size_t> &alone) {
    constexpr size_t nothing = SIZE_MAX;  // keep[i]: the session already holds what item i asks for
    std::vector<size_t> keep(items.size(), nothing);
    for (size_t i = 0; i < items.size(); ++i) {
        const sync_item &it = items[i];
        auto *s = dynamic_cast<session_impl *>(it.sess);
        const std::string who = "sync_step: item " + std::to_string(i);
        if (!s || &s->e_ != this) throw error(who + ": session not created by this engine");
        for (size_t j = 0; j < i; ++j)
            if (items[j].sess == it.sess) throw error(who + ": session appears twice");
        const sync_plan p = plan_sync_item(it, s->tokens_, s->have_logits_, n_ctx_, n_batch_, model_->hp.n_vocab);
        if (p.what == sync_plan::kind::alone) alone.push_back(i);
        if (p.what == sync_plan::kind::evaluate) keep[i] = p.keep;
    }
    std::vector<step_work> work;
    for (size_t i = 0; i < items.size(); ++i) {
        if (keep[i] == nothing) continue;
        auto *s = static_cast<session_impl *>(items[i].sess);
        if (items[i].prefix.empty()) {  // sync of nothing: hold nothing
            s->reset();
            continue;
        }
        s->drop_after(keep[i]);
        if (keep[i] == items[i].prefix.size()) continue;  // truncated; no logits wanted
        s->kv_cover(static_cast<int64_t>(items[i].prefix.size()));
        work.push_back({s, items[i].prefix.subspan(keep[i]), items[i].want_logits, items[i].n_rows, items[i].rows});
    }
    return work;
}

// Evaluates the planned tokens: every item's next piece (at most n_batch tokens, the split
// eval_chunks makes) in one forward, until all are done; one forward normally. Rows per forward:
// n_batch plus one per item, so a full prompt chunk and every decode of a step share it.
void engine_impl::run_sync_step(std::vector<step_work> &work) {
    std::lock_guard<std::mutex> lock(forward_mutex_);
    bind_device();
    for (step_work &w : work) w.s->have_logits_ = false;
    const int64_t cap = n_batch_ + static_cast<int64_t>(work.size());
    std::vector<dense_seq> seqs;
    std::vector<step_work *> in;
    for (;;) {
        seqs.clear();
        in.clear();
        int64_t rows = 0;
        for (step_work &w : work) {
            if (w.rest.empty()) continue;
            const int64_t piece = std::min<int64_t>(n_batch_, static_cast<int64_t>(w.rest.size()));
            if (rows > 0 && rows + piece > cap) continue;  // next forward
            const bool last = piece == static_cast<int64_t>(w.rest.size());
            // The last piece's logits: every row of a verification's last n_rows, else the last row's.
            float *out = !last ? nullptr : w.n_rows > 0 ? w.rows : w.want_logits ? w.s->logits_.data() : nullptr;
            seqs.push_back({w.s->kv_target(), w.s->n_past(), w.rest.first(static_cast<size_t>(piece)), out,
                            w.n_rows > 0 ? w.n_rows : 1});
            in.push_back(&w);
            rows += piece;
        }
        if (seqs.empty()) break;
        run_batch(seqs);
        for (size_t i = 0; i < in.size(); ++i) {
            step_work &w = *in[i];
            const size_t piece = seqs[i].tokens.size();
            w.s->tokens_.insert(w.s->tokens_.end(), w.rest.begin(), w.rest.begin() + static_cast<std::ptrdiff_t>(piece));
            if (w.s->kv_) w.s->kv_->n_used = w.s->n_past();
            w.rest = w.rest.subspan(piece);
            if (w.rest.empty() && w.n_rows > 0) {  // the session's logits are the last row's
                std::memcpy(w.s->logits_.data(), w.rows + static_cast<size_t>(w.n_rows - 1) * w.s->logits_.size(),
                            w.s->logits_.size() * sizeof(float));
                w.s->have_logits_ = true;
            } else if (w.rest.empty()) {
                w.s->have_logits_ = w.want_logits;
            }
        }
    }
}

}  // namespace

std::unique_ptr<engine> engine::load(const engine_options &opts) {
    parse_device(opts.device);  // syntax first, before touching the file
    // DeepSeek V4 has its own state and forward (src/engine/ds4_engine.cpp, CPU or one CUDA device;
    // it resolves --device itself, auto included).
    std::shared_ptr<const gguf::file> f = gguf::file::open(opts.model_path);
    if (f->get_string("general.architecture", "") == "deepseek4") {
        return make_ds4_engine(opts, std::move(f));
    }
    if (!opts.ds4_draft.empty())
        throw error(opts.model_path + ": --spec " + opts.ds4_draft + " drafts with DeepSeek V4's own heads; this model is '" +
                    std::string(f->get_string("general.architecture", "")) + "' (use --spec ngram or draft)");
    if (!opts.dist.devices.empty())  // the layer pipeline (src/dist) exists for DeepSeek V4 only
        throw error(opts.model_path + ": devices '" + opts.dist.devices + "': splitting a model over several devices is "
                    "supported for DeepSeek V4 (deepseek4) only, not '" +
                    std::string(f->get_string("general.architecture", "")) + "' yet (use one device)");
    return std::make_unique<engine_impl>(opts, std::move(f));
}

}  // namespace fathom
