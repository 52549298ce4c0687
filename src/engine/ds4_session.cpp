// The DS4 session (ds4_internal.h): prefix reuse (sync), evaluation, rollback, saved states, sampling
// and the halves of an in-flight append; the design is described in ds4_internal.h.
#include "engine/ds4_internal.h"

#include <exception>

namespace fathom::ds4_detail {

ds4_session::ds4_session(ds4_engine &e) : e_(e) {
    gpu_ = e.new_gpu_sequence();  // null unless the engine runs on one GPU
    if (e.pipelined()) pl_ = e.new_pipeline();
    if (!on_gpu() && !on_pipeline()) st_ = e.fresh_state();
    drafter_ = e.new_drafter();
    if (gpu_ && drafter_ && !drafter_->feature_layers().empty())  // DSpark: the device captures its features
        gpu_->set_feature_layers(drafter_->feature_layers(), drafter_->context_rows());
    logits_.assign(static_cast<size_t>(e.model().hp.n_vocab), 0.0f);
}

ds4::step_extras ds4_session::extras_buffers::view(size_t n_rows, const ds4::hparams &hp, std::span<const int> layers) {
    const size_t D = static_cast<size_t>(hp.n_embd);
    hc.resize(n_rows * static_cast<size_t>(hp.n_hc) * D);
    features.resize(n_rows * layers.size() * D);
    return {hc, layers, features};
}

void ds4_session::observe(const extras_buffers &x, size_t r0, int64_t p0, size_t n) const {
    const ds4::hparams &hp = e_.model().hp;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd),
                 F = drafter_->feature_layers().size() * static_cast<size_t>(hp.n_embd);
    drafter_->observe(tokens_, p0, drafter_->wants_hc_state() ? std::span<const float>(x.hc).subspan(r0 * S, n * S) : std::span<const float>(),
                      F > 0 ? std::span<const float>(x.features).subspan(r0 * F, n * F) : std::span<const float>());
}

std::vector<int32_t> ds4_session::draft(std::span<const int32_t> history, int32_t max) {
    if (!drafter_) return {};
    if (history.size() != tokens_.size() + 1 || !std::equal(tokens_.begin(), tokens_.end(), history.begin()))
        throw error("draft: the history must be what the session holds plus the pending token");
    std::lock_guard<std::mutex> lock(e_.forward_mutex());  // the drafter's products use the engine's pool
    return drafter_->draft(tokens_, history.back(), static_cast<int32_t>(std::min<int64_t>(max, rollback_limit())),
                           &draft_conf_);
}

bool ds4_session::on_pipeline() const {
    return e_.pipelined();
}

int64_t ds4_session::rollback_floor() const {
    if (gpu_) return gpu_->rollback_floor();
    return ds4::rollback_floor(st_);
}

bool ds4_session::on_gpu() const {
    return gpu_ != nullptr;
}

void ds4_session::reset() {
    if (gpu_) gpu_->reset();
    if (pl_) {
        try {
            pl_->reset();
        } catch (const std::exception &) {
            pl_.reset();  // a rank has failed: the next forward builds a new pipeline
        }
    }
    if (!on_gpu() && !on_pipeline()) st_ = e_.fresh_state();
    if (drafter_) drafter_->reset();
    tokens_.clear();
    have_logits_ = false;
    logits_on_device_ = false;
    device_rows_ = 0;
}

bool ds4_session::kv_reserve(int64_t n_tokens) {
    if (n_tokens < 0) throw error("kv_reserve: negative token count");
    if (gpu_) return gpu_->reserve(n_tokens);
    return true;
}

int64_t ds4_session::kv_blocks() const {
    const int64_t bt = e_.kv_block_tokens();
    if (gpu_ && bt > 0 && e_.kv_block_bytes() > 0) return (gpu_->mapped_tokens() + bt - 1) / bt;
    return 0;
}

bool ds4_session::verification_rows(size_t n, size_t n_logits) const {
    return n > 1 && n_logits == n * static_cast<size_t>(e_.model().hp.n_vocab) &&
           static_cast<int64_t>(n) <= rollback_limit() + 1;
}

void ds4_session::forward_chunk(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> out) {
    if (on_pipeline()) {
        if (!pl_) pl_ = e_.new_pipeline();
        // Logits for every chunk (logits_ takes those nobody asked for): rank 0 then waits for the last
        // rank, so no rank still computes (on the shared thread pool) when the forward mutex is released.
        // A verification-sized evaluation with every row's logits runs one forward per row: its CUDA stages
        // then take the decode step's numerics, as one GPU's multi-row step does (one CPU is batch
        // invariant either way), so a pipeline's logits stay those of one device of the same kind.
        const size_t V = static_cast<size_t>(e_.model().hp.n_vocab), n = toks.size();
        try {
            if (verification_rows(n, out.size()))
                for (size_t i = 0; i < n; ++i) pl_->forward(toks.subspan(i, 1), pos.subspan(i, 1), out.subspan(i * V, V));
            else
                pl_->forward(toks, pos, out.empty() ? std::span<float>(logits_) : out);
        } catch (...) {
            pl_.reset();  // the ranks' states disagree now: stop and join them (see the banner)
            throw;
        }
        return;
    }
    if (gpu_) {
        // A verification's rows (every row's logits, at most a rollback's width): one decode step each, so
        // greedy speculation gives plain decoding's tokens (chunked prefill rounds products to bf16). With a
        // drafter: what it reads (the MTP head: final HC states into xb_.hc; DSpark: capture-layer features
        // into xb_.features) of every verified row, or of a prompt's last context_rows() rows (earlier rows
        // cannot change a draft); xb_rows_ of them.
        const ds4::hparams &hp = e_.model().hp;
        const size_t n = toks.size(), S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
        const bool rows = verification_rows(n, out.size()) || rows_to_device_;
        xb_rows_ = drafter_ ? (rows ? n : std::min<size_t>(n, static_cast<size_t>(drafter_->context_rows()))) : 0;
        xb_.hc.clear();
        xb_.features.clear();
        if (drafter_ && drafter_->wants_hc_state()) xb_.hc.resize(xb_rows_ * S);
        if (drafter_) xb_.features.resize(xb_rows_ * drafter_->feature_layers().size() * static_cast<size_t>(hp.n_embd));
        if (rows)
            gpu_->eval_rows(toks, rows_to_device_ ? std::span<float>() : out, xb_.hc, xb_.features);
        else
            gpu_->eval(toks, out, xb_.hc, xb_.features);
        return;
    }
    if (!drafter_) {
        ds4::forward(e_.model(), st_, toks, pos, {out, {}});
        return;
    }
    // With a drafter: the same forward as rows of one step, which also hands over its extras.
    const size_t n = toks.size(), V = static_cast<size_t>(e_.model().hp.n_vocab);
    std::vector<ds4::step_row> rows(n);
    for (size_t i = 0; i < n; ++i) rows[i] = {0, pos[i], toks[i]};
    std::vector<int32_t> logit_rows;
    if (out.size() == n * V)
        for (size_t i = 0; i < n; ++i) logit_rows.push_back(static_cast<int32_t>(i));
    else if (!out.empty())
        logit_rows.push_back(static_cast<int32_t>(n - 1));
    ds4::state *seq = &st_;
    ds4::step(e_.model(), std::span<ds4::state *const>(&seq, 1), rows, logit_rows, out,
              xb_.view(n, e_.model().hp, drafter_->feature_layers()));
}

void ds4_session::eval_chunks(std::span<const int32_t> toks, float *all_logits,
                              const std::function<void(int64_t, int64_t)> *on_progress) {
    draft_conf_.clear();
    device_rows_ = 0;
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
    // Prefix checkpoints (one CPU device; not for evaluations that want every row's logits: verifications)
    ds4_checkpoints *ck = all_logits || !rolls_back() ? nullptr : e_.checkpoints();
    if (ck) ck->before_append(st_, tokens_, total);
    std::vector<int64_t> pos;
    for (int64_t done = 0; done < total;) {
        const int64_t n = std::min(e_.n_batch(), total - done);
        const bool last = done + n == total;
        std::span<float> out;
        if (all_logits)
            out = std::span<float>(all_logits + done * n_vocab, static_cast<size_t>(n * n_vocab));
        else if (last && !on_gpu())  // CUDA keeps them on the device until logits() / sample()
            out = std::span<float>(logits_);
        pos.resize(static_cast<size_t>(n));
        std::iota(pos.begin(), pos.end(), n_past());
        have_logits_ = false;
        logits_on_device_ = false;
        // On a throw mid-chunk the state may be half-updated: the session is left empty, not torn.
        try {
            forward_chunk(toks.subspan(static_cast<size_t>(done), static_cast<size_t>(n)), pos, out);
        } catch (...) {
            reset();
            throw;
        }
        tokens_.insert(tokens_.end(), toks.begin() + done, toks.begin() + done + n);
        if (drafter_ && !on_gpu() && !on_pipeline()) observe(xb_, 0, n_past() - n, static_cast<size_t>(n));
        if (drafter_ && on_gpu())  // the rows forward_chunk kept (the last ones)
            observe(xb_, 0, n_past() - static_cast<int64_t>(xb_rows_), xb_rows_);
        done += n;
        if (last) {
            if (all_logits)
                std::memcpy(logits_.data(), all_logits + (total - 1) * n_vocab, static_cast<size_t>(n_vocab) * sizeof(float));
            else
                logits_on_device_ = on_gpu();
            have_logits_ = true;
        }
        if (ck)  // a prompt's end (with its logits) or a grid crossing
            ck->after_eval(st_, tokens_, n_past() - n,
                           last && total >= 2 ? std::span<const float>(logits_) : std::span<const float>());
        if (on_progress && *on_progress) (*on_progress)(done, total);
    }
}

// ---- saved states -----------------------------------------------------------------------------------
// Stream: ds4::write_state's (deepseek4_state.cpp), then u64 has_logits and, when set, the last token's
// logits [n_vocab] f32.

bool ds4_session::save_state(state_writer &w) const {
    if (on_pipeline()) return false;
    if (on_gpu())
        gpu_->save_state(w);
    else
        ds4::write_state(e_.model(), st_, w);
    state_io::put<uint64_t>(w, have_logits_ ? 1 : 0);
    if (have_logits_) {
        const std::span<const float> lg = logits();  // downloads them when they are on the device
        w.write(lg.data(), lg.size() * sizeof(float));
    }
    return true;
}

bool ds4_session::load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) {
    if (on_pipeline()) return false;
    const int64_t n = static_cast<int64_t>(tokens.size()), n_vocab = e_.model().hp.n_vocab;
    if (n < 1 || n > e_.n_ctx())
        throw error("saved state: " + std::to_string(n) + " tokens do not fit the context");
    if (n_keep != n)
        throw error("saved state: a DeepSeek V4 state loads whole (keep " + std::to_string(n_keep) + " of " +
                    std::to_string(n) + ")");
    for (int32_t t : tokens)
        if (t < 0 || t >= n_vocab)
            throw error("saved state: token id " + std::to_string(t) + " outside the vocabulary");
    reset();
    try {
        if (on_gpu())
            gpu_->load_state(r, n);
        else
            ds4::read_state(e_.model(), st_, r, n);
        const uint64_t has_logits = state_io::get<uint64_t>(r);
        if (has_logits > 1) throw error("saved state: bad logits flag");
        if (has_logits) r.read(logits_.data(), logits_.size() * sizeof(float));
        if (on_gpu() && has_logits) gpu_->restore_logits(logits_);  // sample() reads them on the device
        if (r.remaining() != 0)
            throw error("saved state: " + std::to_string(r.remaining()) + " bytes past its end");
        tokens_.assign(tokens.begin(), tokens.end());
        have_logits_ = has_logits == 1;
    } catch (...) {
        reset();  // a half-read state is torn
        throw;
    }
    return true;
}

std::span<const float> ds4_session::logits() const {
    if (!have_logits_) return {};
    if (logits_on_device_) {
        gpu_->last_logits(logits_);
        logits_on_device_ = false;
    }
    return logits_;
}

namespace {

// smp's token from logits that live on a device: their summary there (top(k, penalties, repeat, frequency,
// presence): sampler::sample_top), else (a NaN / +inf, which sample() then reports, or a summary that cannot
// decide) every logit downloaded (all()) and sampled on the host.
template <class Top, class All>
sample_result sample_summarised(sampler &smp, std::span<const int32_t> history, int64_t n_vocab, Top &&top, All &&all) {
    const sampling_params &p = smp.params();
    const auto pen = smp.penalty_counts(history, n_vocab);
    if (std::optional<logits_top> t = top(smp.top_candidates(), pen, p.repeat_penalty, p.frequency_penalty, p.presence_penalty))
        if (auto r = smp.sample_top(*t)) return *r;
    return smp.sample(all(), history);
}

}  // namespace

sample_result ds4_session::sample(sampler &smp, std::span<const int32_t> history) {
    if (have_logits_ && logits_on_device_)  // summarised on the device: n_vocab logits stay there
        return sample_summarised(smp, history, e_.model().hp.n_vocab,
                                 [&](auto... a) { return gpu_->top(a...); }, [&] { return logits(); });
    return smp.sample(logits(), history);
}

void ds4_session::eval(std::span<const int32_t> tokens, float *all_logits) {
    eval_chunks(tokens, all_logits, nullptr);
}

bool ds4_session::eval_verify(std::span<const int32_t> tokens, float *rows) {
    const size_t n = tokens.size();
    // One step of rows (at most a rollback's width and the device's step) on one GPU; else the default.
    if (!gpu_ || n < 2 || static_cast<int64_t>(n) > rollback_limit() + 1 || n > static_cast<size_t>(e_.max_gpu_step_rows()) ||
        n > static_cast<size_t>(e_.n_batch()))
        return session::eval_verify(tokens, rows);
    rows_to_device_ = true;
    struct clear_flag {
        bool &f;
        ~clear_flag() { f = false; }
    } clear{rows_to_device_};
    eval_chunks(tokens, nullptr, nullptr);
    device_rows_ = static_cast<size_t>(gpu_->rows_held());
    if (device_rows_ != n) throw error("eval_verify: the device kept " + std::to_string(device_rows_) + " of " + std::to_string(n) + " rows");
    return false;
}

sample_result ds4_session::sample_row(size_t j, sampler &smp, std::span<const int32_t> history) {
    if (!gpu_ || j >= device_rows_) return session::sample_row(j, smp, history);
    const int64_t V = e_.model().hp.n_vocab;
    std::vector<float> row;
    return sample_summarised(
        smp, history, V, [&](auto... a) { return gpu_->row_top(j, a...); },
        [&] {
            row.resize(static_cast<size_t>(V));
            gpu_->row_logits(j, row);
            return std::span<const float>(row);
        });
}

size_t ds4_session::drop_after(size_t n) {
    if (n >= tokens_.size()) return tokens_.size();
    device_rows_ = 0;
    if (rolls_back() && static_cast<int64_t>(n) >= rollback_floor()) {
        if (gpu_)
            gpu_->truncate(static_cast<int64_t>(n));
        else
            ds4::truncate(st_, static_cast<int64_t>(n));
        if (drafter_) drafter_->truncate(static_cast<int64_t>(n));
        tokens_.resize(n);
        have_logits_ = false;
        return n;
    }
    reset();  // beyond what the state can roll back: rebuilt from the kept tokens by the caller
    return 0;
}

void ds4_session::truncate(int64_t n_keep) {
    n_keep = std::max<int64_t>(n_keep, 0);
    if (n_keep >= n_past()) return;
    if (n_keep == 0) {
        reset();
        return;
    }
    if (rolls_back() && n_keep >= rollback_floor()) {
        drop_after(static_cast<size_t>(n_keep));  // logits() empty until the next evaluation
        return;
    }
    session::truncate(n_keep);  // through sync: rebuilt, the last kept token's logits re-derived
}

void ds4_session::sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) {
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
        if (on_progress) on_progress(0, 0);  // exactly what is held, logits current
        return;
    }
    // The whole prefix is held but its last token's logits are not: that token is evaluated again.
    if (keep == prefix.size()) --keep;
    if (restore_checkpoint(prefix, keep)) {
        keep = tokens_.size();
        if (keep == prefix.size()) {  // a checkpoint of the whole prefix, with its logits
            if (on_progress) on_progress(0, 0);
            return;
        }
    } else {
        keep = drop_after(keep);  // a diverged or longer state: rolled back when it can be, else rebuilt
    }
    eval_chunks(prefix.subspan(keep), nullptr, &on_progress);
}

int64_t ds4_session::reusable_prefix(std::span<const int32_t> prefix) const {
    size_t l = 0;
    while (l < tokens_.size() && l < prefix.size() && tokens_[l] == prefix[l]) ++l;
    int64_t keep = 0;
    if (l == tokens_.size() || (rolls_back() && static_cast<int64_t>(l) >= rollback_floor()))
        keep = static_cast<int64_t>(l);
    if (const ds4_checkpoints *ck = rolls_back() ? e_.checkpoints() : nullptr)
        keep = std::max(keep, static_cast<int64_t>(ck->longest(prefix)));
    return keep;
}

bool ds4_session::restore_checkpoint(std::span<const int32_t> prefix, size_t keep) {
    ds4_checkpoints *ck = rolls_back() ? e_.checkpoints() : nullptr;
    if (!ck) return false;
    const bool free = keep >= tokens_.size() || static_cast<int64_t>(keep) >= rollback_floor();
    if (!ck->restore(prefix, free ? keep : 0, st_, tokens_, logits_, have_logits_)) return false;
    logits_on_device_ = false;
    // The drafter's history is the old timeline's: cut back to what both share (its rings are
    // position-indexed; a deeper cut restarts its rows, as after a state load).
    if (drafter_) drafter_->truncate(static_cast<int64_t>(std::min(keep, tokens_.size())));
    return true;
}

bool ds4_session::appends_in_one_forward(std::span<const int32_t> toks) const {
    const int64_t n = static_cast<int64_t>(toks.size()), n_vocab = e_.model().hp.n_vocab;
    // eval_chunks' checks (context, vocabulary) and its chunking (one chunk: at most n_batch tokens).
    if (!on_pipeline() || n < 1 || n > e_.n_batch() || n_past() + n > e_.n_ctx()) return false;
    return std::all_of(toks.begin(), toks.end(), [&](int32_t t) { return t >= 0 && t < n_vocab; });
}

void ds4_session::submit_append(std::span<const int32_t> toks) {
    std::vector<int64_t> pos(toks.size());  // sent by submit (copied): need not outlive it
    std::iota(pos.begin(), pos.end(), n_past());
    have_logits_ = false;
    logits_on_device_ = false;
    try {
        if (!pl_) pl_ = e_.new_pipeline();
        pl_->submit(toks, pos, logits_);  // the last token's logits land in logits_ at collect
    } catch (...) {
        pl_.reset();  // as forward_chunk / eval_chunks: the ranks' states disagree; hold nothing
        reset();
        throw;
    }
}

void ds4_session::collect_append(std::span<const int32_t> toks) {
    try {
        if (!pl_) throw error("ds4: collect without a submitted forward");
        pl_->collect();
    } catch (...) {
        pl_.reset();
        reset();
        throw;
    }
    tokens_.insert(tokens_.end(), toks.begin(), toks.end());
    have_logits_ = true;
}

}  // namespace fathom::ds4_detail
