// A deterministic stand-in for fathom::engine so the server, scheduler and daemon can be tested
// without a model. Its behaviour is simple enough to predict by hand in every test:
//   vocabulary: token b (0..255) is the byte b; 256 = end of generation; 257 = BOS.
//   tokenize: [BOS if add_special] + the bytes.  chat template: "[role]content\n" per message
//   ("[assistant]\x02content\n" for assistant turns), then "[assistant]\x02" as the generation prompt
//   ("[assistant]<think>\x02" with thinking on).
//   next token (logit 10, every other logit 0):
//     - after the \x02 marker (chat): the last user message is echoed byte by byte, then EOG;
//       a user message starting with "LOOP" makes it emit 'x' forever;
//     - otherwise (completion): 'a' + (number of tokens held % 26), forever.
//   saved states (the prompt cache): "FAKE", the token count, then `state_pad` filler bytes (to give
//   entries a size); a state loads any prefix (loads_state_prefix), the logits re-derived from the
//   tokens. Identity "fake-model" unless a test sets another.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <thread>

#include "fathom/engine.h"

namespace fathom::test {

constexpr int32_t k_eog = 256;
constexpr int32_t k_bos = 257;
constexpr int32_t k_vocab = 258;

// An engine-wide KV pool that maps memory at a coarser grain than the scheduler's blocks, as DeepSeek V4 on
// a GPU does (2 MiB blocks per row array): a session holding n positions maps ceil(n / granule) + 1
// granules (the +1: the rounding the block counts cannot see). Off while granule == 0.
struct fake_coarse_pool {
    int64_t granule = 0;   // positions per granule
    int64_t capacity = 0;  // granules
    int32_t block_tokens = 16;
    std::atomic<int64_t> used{0};
};

class fake_session : public session {
public:
    fake_session(int n_ctx, std::atomic<int64_t> &evaluated, int delay_us, fake_coarse_pool *pool = nullptr)
        : n_ctx_(n_ctx), evaluated_(evaluated), delay_us_(delay_us), logits_(k_vocab, 0.0f), pool_(pool) {}
    ~fake_session() override {
        if (pool_) pool_->used -= granules_;
    }
    bool kv_reserve(int64_t n) override {
        if (!pool_ || pool_->granule == 0) return true;
        const int64_t want = (std::max<int64_t>(n, int64_t(toks_.size())) + pool_->granule - 1) / pool_->granule + 1;
        if (want > granules_ && pool_->used + (want - granules_) > pool_->capacity) return false;
        pool_->used += want - granules_;
        granules_ = want;
        return true;
    }
    int64_t kv_blocks() const override {
        return pool_ && pool_->granule > 0 ? granules_ * pool_->granule / pool_->block_tokens : 0;
    }

    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &) override {
        size_t l = 0;
        while (l < prefix.size() && l < toks_.size() && prefix[l] == toks_[l]) ++l;
        if (l == prefix.size() && l > 0) l -= 1;  // re-derive the last token's logits
        toks_.resize(l);
        eval(prefix.subspan(l));
    }
    void eval(std::span<const int32_t> tokens, float *all_logits = nullptr) override {
        held_.clear();
        if (int64_t(toks_.size() + tokens.size()) > n_ctx_) throw error("fake: context full");
        if (pool_ && pool_->granule > 0 && granules_ * pool_->granule < int64_t(toks_.size() + tokens.size()) + pool_->granule &&
            !kv_reserve(int64_t(toks_.size() + tokens.size())))
            throw error("fake: the KV pool is exhausted");
        for (size_t i = 0; i < tokens.size(); ++i) {
            const int32_t t = tokens[i];
            if (t < 0 || t >= k_vocab) throw error("fake: bad token");
            toks_.push_back(t);
            if (all_logits) {  // row i: the logits after tokens[0..i]
                float *row = all_logits + i * k_vocab;
                std::fill(row, row + k_vocab, 0.0f);
                row[next_token()] = 10.0f;
            }
        }
        evaluated_ += int64_t(tokens.size());
        if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
        std::fill(logits_.begin(), logits_.end(), 0.0f);
        logits_[next_token()] = 10.0f;
    }
    std::span<const float> logits() const override { return logits_; }
    // device_rows: poses as a session whose logits live on a device (a DS4 GPU session): a verification's
    // rows stay in `held_` (eval_verify returns false) and sample_row samples them, counted in rows_sampled.
    bool samples_on_device() const override { return device_rows; }
    bool eval_verify(std::span<const int32_t> tokens, float *rows) override {
        if (!device_rows) return session::eval_verify(tokens, rows);
        std::vector<float> held(tokens.size() * k_vocab);
        eval(tokens, held.data());
        held_ = std::move(held);
        return false;
    }
    sample_result sample_row(size_t j, sampler &smp, std::span<const int32_t> history) override {
        if (j >= verify_rows_held()) return session::sample_row(j, smp, history);
        if (rows_sampled) ++*rows_sampled;
        return smp.sample(std::span<const float>(held_).subspan(j * k_vocab, k_vocab), history);
    }
    size_t verify_rows_held() const override { return held_.size() / k_vocab; }
    bool device_rows = false;
    std::atomic<int64_t> *rows_sampled = nullptr;  // counts sample_row calls (the engine's counter)
    // Dropping positions is free (speculative decoding's rollback); the logits follow the kept tokens.
    void truncate(int64_t n_keep) override {
        held_.clear();
        if (n_keep >= int64_t(toks_.size())) return;
        toks_.resize(size_t(std::max<int64_t>(n_keep, 0)));
        std::fill(logits_.begin(), logits_.end(), 0.0f);
        if (!toks_.empty()) logits_[next_token()] = 10.0f;
    }
    bool rolls_back() const override { return true; }
    int64_t n_past() const override { return int64_t(toks_.size()); }
    const std::vector<int32_t> &tokens() const override { return toks_; }
    void reset() override {
        held_.clear();
        toks_.clear();
        if (pool_) pool_->used -= granules_;
        granules_ = 0;
    }
    bool save_state(state_writer &w) const override {
        const uint64_t n = toks_.size();
        w.write("FAKE", 4);
        w.write(&n, sizeof n);
        const std::vector<char> pad(state_pad, 'p');
        w.write(pad.data(), pad.size());
        return true;
    }
    bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) override {
        char magic[4];
        uint64_t n = 0;
        r.read(magic, 4);
        r.read(&n, sizeof n);
        toks_.clear();
        if (loads_tried) ++*loads_tried;
        if (load_throws) throw std::bad_alloc();  // not a fathom::error: out of memory, say
        if (std::memcmp(magic, "FAKE", 4) != 0 || n != tokens.size() || n_keep < 1 || n_keep > int64_t(n) ||
            r.remaining() != state_pad)
            throw error("fake: bad state");
        std::vector<char> pad(state_pad);
        r.read(pad.data(), pad.size());
        toks_.assign(tokens.begin(), tokens.begin() + n_keep);
        std::fill(logits_.begin(), logits_.end(), 0.0f);
        logits_[next_token()] = 10.0f;
        ++states_loaded;
        return true;
    }
    bool loads_state_prefix() const override { return true; }
    size_t state_pad = 1000;
    bool load_throws = false;  // load_state throws std::bad_alloc after reading the stream's head
    std::atomic<int> *loads_tried = nullptr;  // counts load_state calls that got past the stream's head
    std::atomic<int> states_loaded{0};

    int32_t next_token() const {
        size_t marker = toks_.size();
        for (size_t i = toks_.size(); i-- > 0;)
            if (toks_[i] == 2) {
                marker = i;
                break;
            }
        if (marker == toks_.size()) return 'a' + int32_t(toks_.size() % 26);
        // Last "[user]" before the marker; its content runs to the next '\n'.
        const std::string pat = "[user]";
        std::string text;
        for (size_t i = 0; i < marker; ++i) text += char(toks_[i] < 256 ? toks_[i] : 0);
        const size_t u = text.rfind(pat);
        std::string content;
        if (u != std::string::npos) content = text.substr(u + pat.size(), text.find('\n', u) - u - pat.size());
        const size_t k = toks_.size() - 1 - marker;
        if (content.rfind("LOOP", 0) == 0) return 'x';
        return k < content.size() ? int32_t(static_cast<unsigned char>(content[k])) : k_eog;
    }

private:
    int64_t n_ctx_;
    std::atomic<int64_t> &evaluated_;
    int delay_us_;
    std::vector<int32_t> toks_;
    std::vector<float> logits_;
    std::vector<float> held_;  // device_rows: the last verification's rows
    fake_coarse_pool *pool_ = nullptr;
    int64_t granules_ = 0;
};

class fake_engine : public engine {
public:
    explicit fake_engine(int n_ctx = 512, int delay_us = 0) : delay_us_(delay_us) {
        info_.arch = "fake";
        info_.name = "Fake Model";
        info_.path = "/models/fake-model.gguf";
        info_.n_vocab = k_vocab;
        info_.n_ctx = n_ctx;
        info_.n_ctx_train = n_ctx;
    }
    const model_info &info() const override { return info_; }
    // The architecture the fake poses as, and its tool format as that engine names it ("deepseek4": DSML).
    void set_arch(std::string arch) {
        info_.tool_format = arch == "deepseek4" ? "dsml" : "hermes";
        info_.arch = std::move(arch);
    }
    std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool) const override {
        std::vector<int32_t> out;
        if (add_special) out.push_back(k_bos);
        for (unsigned char c : text) out.push_back(c);
        return out;
    }
    std::string token_to_piece(int32_t t) const override { return t >= 0 && t < 256 ? std::string(1, char(t)) : ""; }
    std::string detokenize(std::span<const int32_t> toks) const override {
        std::string s;
        for (int32_t t : toks) s += token_to_piece(t);
        return s;
    }
    bool is_end_of_generation(int32_t t) const override { return t == k_eog; }
    int32_t bos_token() const override { return k_bos; }
    // Thinking on/max: the generation prompt opens a thinking block before the echo marker,
    // "[assistant]<think>\x02", so the echoed user text is the reasoning up to a "</think>" in it.
    std::string apply_chat_template(const std::vector<chat_message> &msgs, bool gen,
                                    chat_thinking thinking = chat_thinking::template_default) const override {
        std::string s;
        for (const auto &m : msgs) s += "[" + m.role + "]" + (m.role == "assistant" ? "\x02" : "") + m.content + "\n";
        const bool think = thinking == chat_thinking::on || thinking == chat_thinking::max;
        if (gen) s += think ? "[assistant]<think>\x02" : "[assistant]\x02";
        return s;
    }
    std::unique_ptr<session> new_session() override {
        ++sessions_created;
        auto s = std::make_unique<fake_session>(info_.n_ctx, evaluated, delay_us_, coarse.granule > 0 ? &coarse : nullptr);
        s->state_pad = state_pad;
        s->load_throws = load_throws;
        s->loads_tried = &state_loads_tried;
        s->device_rows = device_rows;
        s->rows_sampled = &rows_sampled;
        return s;
    }
    std::string state_identity() const override { return identity; }
    // The coarse pool (fake_coarse_pool) as the scheduler sees a paged engine's pool.
    fake_coarse_pool coarse;
    bool kv_pool_configure(int32_t block_tokens, int64_t) override {
        if (coarse.granule == 0) return false;
        coarse.block_tokens = block_tokens;
        return true;
    }
    kv_pool_info kv_pool() const override {
        kv_pool_info i;
        if (coarse.granule == 0) return i;
        i.block_tokens = coarse.block_tokens;
        i.max_blocks = i.n_blocks = coarse.capacity * coarse.granule / coarse.block_tokens;
        i.n_used = coarse.used * coarse.granule / coarse.block_tokens;
        return i;
    }
    std::string identity = "fake-model";
    size_t state_pad = 1000;  // filler bytes of each saved state
    bool load_throws = false;               // new sessions' load_state throws std::bad_alloc
    std::atomic<int> state_loads_tried{0};  // their load_state calls
    // Records the shape of the scheduler's engine steps, then runs the default (decode_step of the
    // one-token appends, sync of the rest).
    void sync_step(std::span<const sync_item> items) override {
        if (hold) {  // a test holds the worker here (its items already chosen) while it submits jobs
            ++held;
            while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            --held;
        }
        ++sync_steps;
        int n_dec = 0;
        for (const sync_item &it : items)
            n_dec += it.prefix.size() == it.sess->tokens().size() + 1 &&
                     std::equal(it.sess->tokens().begin(), it.sess->tokens().end(), it.prefix.begin());
        if (int(items.size()) > max_step_items) max_step_items = int(items.size());
        if (n_dec > 0 && int(items.size()) > n_dec) ++mixed_steps;
        engine::sync_step(items);
    }
    bool device_rows = false;            // new sessions pose as device sessions (fake_session::device_rows)
    std::atomic<int64_t> rows_sampled{0};  // their sample_row calls
    std::atomic<int64_t> evaluated{0};   // tokens evaluated by all sessions
    std::atomic<int> sessions_created{0};
    std::atomic<int> sync_steps{0};      // engine steps (worker thread writes; read after the jobs end)
    std::atomic<int> max_step_items{0};  // most sessions in one engine step
    std::atomic<int> mixed_steps{0};     // steps with decodes and prompt chunks together
    std::atomic<bool> hold{false};       // set: the next sync_step waits at its start until cleared
    std::atomic<int> held{0};            // sync_steps waiting on hold

private:
    model_info info_;
    int delay_us_;
};

// The tokens of one user message rendered with the fake's chat template plus the generation prompt.
inline std::vector<int32_t> chat_prompt(const fake_engine &e, const std::string &user) {
    return e.tokenize(e.apply_chat_template({{"user", user}}, true), true, true);
}

}  // namespace fathom::test
