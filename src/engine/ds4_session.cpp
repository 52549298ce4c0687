// DS4 engine and session (see ds4_session.h). The engine owns the mapped GGUF, the bound weights
// (ds4::model), the thread pool, the tokenizer and the chat template; a session owns one ds4::state
// (raw KV rings, compressor frontiers, compressed and indexer rows) and the token timeline.
//
// Prefix reuse (session::sync). A DS4 state cannot be truncated: the raw ring has overwritten rows
// older than the window, and a compressor frontier in the middle of a block holds projections of
// tokens that are not stored anywhere else. So the rule is: the state is reused only when the held
// tokens are a prefix of the requested ones (then only the new tokens are evaluated); any other
// divergence, including a request that is a strict prefix of what is held, resets the state and
// evaluates the whole prefix. Appending turns to a conversation therefore never re-evaluates.
#include "engine/ds4_session.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "backend/cpu/thread_pool.h"
#include "chat/chat_template.h"
#include "chat/ds4_chat.h"
#include "core/error.h"
#include "engine/device.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "tokenizer/tokenizer.h"
#ifdef FATHOM_ENGINE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_model.h"
#endif

namespace fathom {

namespace {

ds4::qat_mode parse_qat(const std::string &s) {
    if (s == "full") return ds4::qat_mode::full;
    if (s == "fp4only") return ds4::qat_mode::fp4only;
    if (s == "off") return ds4::qat_mode::off;
    throw error("ds4_qat '" + s + "': expected full, fp4only or off");
}

void check_options(const engine_options &o) {
    if (o.n_threads < 0) throw error("n_threads must be >= 0, got " + std::to_string(o.n_threads));
    if (o.n_ctx < 0) throw error("n_ctx must be >= 0, got " + std::to_string(o.n_ctx));
    if (o.n_batch <= 0) throw error("n_batch must be positive, got " + std::to_string(o.n_batch));
}

int online_cores() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// DeepSeek V4 chat format (src/chat/ds4_chat.h, the official encoder) in chat mode ("</think>"
// after the Assistant marker), used when the file carries no tokenizer.chat_template. The encoder
// always ends a conversation whose last turn is the user's with the generation prefix; the engine
// contract makes that depend on add_gen.
std::string render_deepseek(const std::vector<chat_message> &msgs, bool add_gen) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const auto &m : msgs) j.push_back({{"role", m.role}, {"content", m.content}});
    ds4chat::render_options o;
    o.thinking = false;
    std::string s = ds4chat::render_prompt(j, nlohmann::ordered_json(), o);
    const std::string gp = ds4chat::generation_prefix(false);
    const bool has = s.size() >= gp.size() && s.compare(s.size() - gp.size(), gp.size(), gp) == 0;
    if (!add_gen && has) s.resize(s.size() - gp.size());
    if (add_gen && !has) s += gp;
    return s;
}

class ds4_engine;

class ds4_session final : public session {
  public:
    explicit ds4_session(ds4_engine &e);
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) override;
    void eval(std::span<const int32_t> tokens, float *all_logits) override;
    std::span<const float> logits() const override {
        return have_logits_ ? std::span<const float>(logits_) : std::span<const float>();
    }
    int64_t n_past() const override { return static_cast<int64_t>(tokens_.size()); }
    const std::vector<int32_t> &tokens() const override { return tokens_; }
    void reset() override;

  private:
    bool on_gpu() const;
    void eval_chunks(std::span<const int32_t> toks, float *all_logits,
                     const std::function<void(int64_t, int64_t)> *on_progress);
    void forward_chunk(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> out);
    ds4_engine &e_;
    ds4::state st_;  // CPU state (empty when the engine runs on CUDA)
#ifdef FATHOM_ENGINE_CUDA
    std::unique_ptr<ds4::cuda_sequence> gpu_;  // device state when the engine runs on CUDA
#endif
    std::vector<int32_t> tokens_;
    std::vector<float> logits_;  // [n_vocab] of tokens_.back()
    bool have_logits_ = false;
};

class ds4_engine final : public engine {
  public:
    ds4_engine(const engine_options &o, std::shared_ptr<const gguf::file> file) : opts_(o), file_(std::move(file)) {
        check_options(o);
        qat_ = parse_qat(o.ds4_qat);
        const int ordinal = resolve_cuda_ordinal(o.device);  // -1: CPU; throws for an unusable forced device
        if (o.on_load_progress) o.on_load_progress(0, file_->size());
        model_ = ds4::load_model(file_);
        if (ordinal < 0 && file_->get_int("fathom.synth.replicate_rows", 0) > 0)
            throw error(o.model_path + ": a sparse synthetic file (fathom.synth.replicate_rows) is for CUDA benchmarks "
                        "only: its stored rows are not the model on the CPU; use --device cuda");
        const ds4::hparams &hp = model_->hp;
        n_ctx_train_ = file_->get_int("deepseek4.context_length", 0);
        if (n_ctx_train_ < 0 || n_ctx_train_ > INT32_MAX)
            throw error(file_->path() + ": deepseek4.context_length = " + std::to_string(n_ctx_train_) + " out of range");
        const int64_t def_ctx = n_ctx_train_ > 0 ? std::min<int64_t>(n_ctx_train_, 8192) : 8192;
        n_ctx_ = o.n_ctx > 0 ? o.n_ctx : def_ctx;
        n_batch_ = std::min<int64_t>(o.n_batch, n_ctx_);
        pool_ = std::make_unique<cpu::thread_pool>(o.n_threads > 0 ? o.n_threads : online_cores());
        exec_.pool = pool_.get();
        exec_.quantised = !o.exact;
        if (file_->has("tokenizer.ggml.model")) {
            tok_ = std::make_unique<tokenizer>(*file_);
            if (tok_->n_vocab() > hp.n_vocab)
                throw error(o.model_path + ": tokenizer has " + std::to_string(tok_->n_vocab()) + " tokens, the model " +
                            std::to_string(hp.n_vocab));
        }
        const std::string_view tmpl = file_->get_string("tokenizer.chat_template", "");
        if (!tmpl.empty()) template_.emplace(std::string(tmpl));
        fill_info();
        if (ordinal >= 0) make_cuda(ordinal);
        if (o.on_load_progress) o.on_load_progress(file_->size(), file_->size());
    }

    const model_info &info() const override { return info_; }

    std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
        return tok().encode(text, add_special, parse_special);
    }
    std::string token_to_piece(int32_t token) const override { return tok().token_to_piece(token); }
    std::string detokenize(std::span<const int32_t> tokens) const override { return tok().decode(tokens); }
    bool is_end_of_generation(int32_t token) const override { return tok_ && tok_->is_eog(token); }
    int32_t bos_token() const override { return tok_ ? tok_->bos() : -1; }

    std::string apply_chat_template(const std::vector<chat_message> &messages, bool add_gen) const override {
        if (!template_) return render_deepseek(messages, add_gen);
        chat_template_inputs in;
        for (const auto &m : messages) in.messages.push_back({{"role", m.role}, {"content", m.content}});
        in.add_generation_prompt = add_gen;
        if (tok_ && tok_->bos() != token_null) in.bos_token = tok_->token_to_piece(tok_->bos());
        if (tok_ && tok_->eos() != token_null) in.eos_token = tok_->token_to_piece(tok_->eos());
        return template_->render(in);
    }

    std::unique_ptr<session> new_session() override { return std::make_unique<ds4_session>(*this); }

    // ---- for sessions ----
    const ds4::model &model() const { return *model_; }
    ds4::state fresh_state() const {
        ds4::state st = ds4::new_state(*model_, qat_, opts_.kv);
        st.exec = exec_;
        return st;
    }
    std::mutex &forward_mutex() { return forward_mutex_; }
#ifdef FATHOM_ENGINE_CUDA
    // Device weights (null on the CPU) and a fresh device sequence of n_ctx tokens.
    const std::shared_ptr<const ds4::cuda_weights> &gpu() const { return gpu_; }
    std::unique_ptr<ds4::cuda_sequence> new_gpu_sequence() const {
        return std::make_unique<ds4::cuda_sequence>(gpu_, n_ctx_, opts_.cuda_graphs);
    }
#endif
    double measure_copy_bandwidth() override {
#ifdef FATHOM_ENGINE_CUDA
        if (gpu_) {
            std::lock_guard<std::mutex> lock(forward_mutex_);
            return cuda_measure_copy_bandwidth(ordinal_);
        }
#endif
        return 0.0;
    }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_batch() const { return n_batch_; }

  private:
    const tokenizer &tok() const {
        if (!tok_) throw error(opts_.model_path + ": the file has no tokenizer (tokenizer.ggml.model)");
        return *tok_;
    }

    // Upload the weights to CUDA device `ordinal` (memory checked before any allocation).
    void make_cuda(int ordinal) {
#ifdef FATHOM_ENGINE_CUDA
        ds4::cuda_run_options co;
        co.device = ordinal;
        co.qat = qat_;
        co.kv = opts_.kv;
        const size_t seq = ds4::cuda_sequence_bytes(model_->hp, opts_.kv, n_ctx_);
        const cuda_device_memory mem = cuda_query_memory(ordinal);
        if (seq + file_->size() > mem.free_bytes)
            throw error("device 'cuda:" + std::to_string(ordinal) + "' (" + mem.name + "): the weights (" +
                        std::to_string(file_->size() >> 20) + " MiB) and one " + std::to_string(n_ctx_) +
                        "-token context (" + std::to_string(seq >> 20) + " MiB) exceed its " +
                        std::to_string(mem.free_bytes >> 20) + " MiB free; lower --ctx or use more devices");
        gpu_ = ds4::cuda_upload(*model_, co, [&](uint64_t done, uint64_t total) {
            if (opts_.on_load_progress && total) opts_.on_load_progress(done * file_->size() / total, file_->size());
        });
        ordinal_ = ordinal;
        info_.device = "cuda:" + std::to_string(ordinal) + " (" + mem.name + ")";
        info_.decode_weight_bytes = static_cast<uint64_t>(ds4::cuda_bytes_per_token(*gpu_));
#else
        (void)ordinal;
#endif
    }

    void fill_info() {
        const ds4::hparams &hp = model_->hp;
        info_.arch = "deepseek4";
        info_.name = std::string(file_->get_string("general.name", ""));
        info_.path = opts_.model_path;
        info_.file_bytes = file_->size();
        for (const auto &t : file_->tensors()) info_.n_params += static_cast<uint64_t>(t.nelements());
        info_.n_vocab = hp.n_vocab;
        info_.n_ctx_train = static_cast<int32_t>(n_ctx_train_);
        info_.n_ctx = static_cast<int32_t>(std::min<int64_t>(n_ctx_, INT32_MAX));
        info_.n_layer = hp.n_layer;
        info_.n_embd = hp.n_embd;
        info_.kv_bytes_per_token =
            static_cast<uint64_t>(std::ceil(ds4::kv_bytes_per_token(hp, opts_.kv, n_ctx_)));
        info_.chat_template = template_ ? template_->source() : "";
    }

    engine_options opts_;
    std::shared_ptr<const gguf::file> file_;
    std::unique_ptr<ds4::model> model_;
    ds4::qat_mode qat_ = ds4::qat_mode::full;
    std::unique_ptr<cpu::thread_pool> pool_;
    ds4::exec_options exec_;
    std::unique_ptr<tokenizer> tok_;
    std::optional<chat_template> template_;
    model_info info_;
    int64_t n_ctx_train_ = 0, n_ctx_ = 0, n_batch_ = 0;
    std::mutex forward_mutex_;
#ifdef FATHOM_ENGINE_CUDA
    std::shared_ptr<const ds4::cuda_weights> gpu_;
#endif
    int ordinal_ = -1;
};

ds4_session::ds4_session(ds4_engine &e) : e_(e) {
#ifdef FATHOM_ENGINE_CUDA
    if (e.gpu()) gpu_ = e.new_gpu_sequence();
#endif
    if (!on_gpu()) st_ = e.fresh_state();
    logits_.assign(static_cast<size_t>(e.model().hp.n_vocab), 0.0f);
}

bool ds4_session::on_gpu() const {
#ifdef FATHOM_ENGINE_CUDA
    return gpu_ != nullptr;
#else
    return false;
#endif
}

void ds4_session::reset() {
#ifdef FATHOM_ENGINE_CUDA
    if (gpu_) gpu_->reset();
#endif
    if (!on_gpu()) st_ = e_.fresh_state();
    tokens_.clear();
    have_logits_ = false;
}

void ds4_session::forward_chunk(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> out) {
#ifdef FATHOM_ENGINE_CUDA
    if (gpu_) {
        gpu_->eval(toks, out);
        return;
    }
#endif
    ds4::forward(e_.model(), st_, toks, pos, {out, {}});
}

void ds4_session::eval_chunks(std::span<const int32_t> toks, float *all_logits,
                              const std::function<void(int64_t, int64_t)> *on_progress) {
    const ds4::model &m = e_.model();
    const int64_t n_vocab = m.hp.n_vocab, total = static_cast<int64_t>(toks.size());
    if (total == 0) return;
    if (n_past() + total > e_.n_ctx())
        throw error("context full: " + std::to_string(n_past()) + " + " + std::to_string(total) +
                    " tokens exceed n_ctx " + std::to_string(e_.n_ctx()));
    for (int32_t t : toks)
        if (t < 0 || t >= n_vocab)
            throw error("token id " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
    std::lock_guard<std::mutex> lock(e_.forward_mutex());
    std::vector<int64_t> pos;
    for (int64_t done = 0; done < total;) {
        const int64_t n = std::min(e_.n_batch(), total - done);
        const bool last = done + n == total;
        std::span<float> out;
        if (all_logits)
            out = std::span<float>(all_logits + done * n_vocab, static_cast<size_t>(n * n_vocab));
        else if (last)
            out = std::span<float>(logits_);
        pos.resize(static_cast<size_t>(n));
        std::iota(pos.begin(), pos.end(), n_past());
        have_logits_ = false;
        // On a throw mid-chunk the state may be half-updated: the session is left empty, not torn.
        try {
            forward_chunk(toks.subspan(static_cast<size_t>(done), static_cast<size_t>(n)), pos, out);
        } catch (...) {
            reset();
            throw;
        }
        tokens_.insert(tokens_.end(), toks.begin() + done, toks.begin() + done + n);
        done += n;
        if (last) {
            if (all_logits)
                std::memcpy(logits_.data(), all_logits + (total - 1) * n_vocab, static_cast<size_t>(n_vocab) * sizeof(float));
            have_logits_ = true;
        }
        if (on_progress && *on_progress) (*on_progress)(done, total);
    }
}

void ds4_session::eval(std::span<const int32_t> tokens, float *all_logits) {
    eval_chunks(tokens, all_logits, nullptr);
}

void ds4_session::sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) {
    if (static_cast<int64_t>(prefix.size()) > e_.n_ctx())
        throw error("prompt of " + std::to_string(prefix.size()) + " tokens exceeds n_ctx " + std::to_string(e_.n_ctx()));
    size_t keep = 0;
    while (keep < prefix.size() && keep < tokens_.size() && prefix[keep] == tokens_[keep]) ++keep;
    if (prefix.empty() || keep < tokens_.size() || (keep == prefix.size() && !have_logits_)) {
        reset();  // diverged or shorter than what is held: the state cannot be truncated (see banner)
        keep = 0;
    } else if (keep == prefix.size()) {
        if (on_progress) on_progress(0, 0);  // exactly what is held, logits current
        return;
    }
    if (prefix.empty()) {
        if (on_progress) on_progress(0, 0);
        return;
    }
    eval_chunks(prefix.subspan(keep), nullptr, &on_progress);
}

}  // namespace

std::unique_ptr<engine> make_ds4_engine(const engine_options &opts, std::shared_ptr<const gguf::file> file) {
    return std::make_unique<ds4_engine>(opts, std::move(file));
}

}  // namespace fathom
