// PFlash compressor (include/fathom/pflash.h): options, drafter residency, the chunk score cache and
// the compress() pipeline tying text_map, structure, drafter and select together.
#include <chrono>
#include <cmath>
#include <unordered_map>

#include <xxhash.h>

#include "core/error.h"
#include "fathom/pflash.h"
#include "pflash/drafter.h"
#include "pflash/select.h"
#include "pflash/structure.h"
#include "pflash/text_map.h"

namespace fathom::pflash {

drafter_residency parse_residency(const std::string &s) {
    if (s == "keep") return drafter_residency::keep;
    if (s == "release" || s == "release-after-use") return drafter_residency::release_after_use;
    if (s == "auto") return drafter_residency::auto_select;
    throw error("drafter residency '" + s + "': expected keep, release-after-use or auto");
}

const char *residency_name(drafter_residency r) {
    switch (r) {
    case drafter_residency::keep: return "keep";
    case drafter_residency::release_after_use: return "release-after-use";
    case drafter_residency::auto_select: return "auto";
    }
    return "?";
}

void validate_drafter_device(const std::string &d, const std::string &what) {
    if (d != "cpu" && d != "cuda" && d.rfind("cuda:", 0) != 0)
        throw error(what + ": must be cpu, cuda or cuda:N, got '" + d + "'");
}

void validate_keep_ratio(double r, const std::string &what) {
    if (!std::isfinite(r)) throw error(what + ": must be a finite number in [0, 1], got " + std::to_string(r));
    if (r < 0.0 || r > 1.0) throw error(what + ": must be in [0, 1], got " + std::to_string(r));
}

int32_t options::effective_drafter_batch() const {
    if (drafter_batch > 0) return drafter_batch;
    return drafter_device == "cpu" ? 512 : 4096;
}

void options::validate() const {
    validate_keep_ratio(keep_ratio);
    auto need = [](bool ok, const char *field, const std::string &rule, int64_t v) {
        if (!ok) throw error(std::string("pflash option ") + field + ": must be " + rule + ", got " + std::to_string(v));
    };
    if (drafter_path.empty()) throw error("pflash: a drafter model path is required");
    need(chunk_tokens >= 1 && chunk_tokens <= 4096, "chunk_tokens", "in [1, 4096]", chunk_tokens);
    need(min_chunks >= 0, "min_chunks", ">= 0", min_chunks);
    need(head_chunks >= 0, "head_chunks", ">= 0", head_chunks);
    need(tail_chunks >= 0, "tail_chunks", ">= 0", tail_chunks);
    need(drafter_batch >= 0, "drafter_batch", ">= 0 (0 = by device)", drafter_batch);
    need(query_tokens >= 1 && query_tokens <= effective_drafter_batch(), "query_tokens", "in [1, drafter_batch]",
         query_tokens);
    need(smooth_kernel >= 1 && smooth_kernel % 2 == 1, "smooth_kernel", "odd and >= 1", smooth_kernel);
    need(drafter_window >= 0, "drafter_window", ">= 0", drafter_window);
    need(anchor_ngram >= 0, "anchor_ngram", ">= 0", anchor_ngram);
    need(anchor_tail_tokens >= 0, "anchor_tail_tokens", ">= 0", anchor_tail_tokens);
    need(anchor_max_hits >= 1, "anchor_max_hits", ">= 1", anchor_max_hits);
    need(anchor_radius_tokens >= 0, "anchor_radius_tokens", ">= 0", anchor_radius_tokens);
    if (!std::isfinite(anchor_budget_fraction) || anchor_budget_fraction < 0.0 || anchor_budget_fraction > 1.0)
        throw error("pflash option anchor_budget_fraction: must be a finite number in [0, 1], got " +
                    std::to_string(anchor_budget_fraction));
    need(score_cache_max_entries >= 1, "score_cache_max_entries", ">= 1", score_cache_max_entries);
    need(n_threads >= 0, "n_threads", ">= 0", n_threads);
    validate_drafter_device(drafter_device, "pflash option drafter_device");
}

namespace {

double seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class compressor_impl final : public compressor {
public:
    explicit compressor_impl(const options &o) : opts_(o) {
        opts_.validate();
        if (opts_.residency == drafter_residency::keep) load_drafter();
    }

    const options &opts() const override { return opts_; }
    void set_keep_ratio(double r) override {
        validate_keep_ratio(r);
        opts_.keep_ratio = r;
    }
    void set_verbatim(bool system, bool last_user) override {
        opts_.verbatim_system = system;
        opts_.verbatim_last_user = last_user;
    }

    void load_drafter() override {
        if (drafter_) return;
        drafter_ = drafter::load(opts_.drafter_path, opts_.n_threads, opts_.effective_drafter_batch(),
                                 opts_.drafter_device);  // all or nothing
    }
    void release_drafter() override { drafter_.reset(); }
    bool drafter_loaded() const override { return drafter_ != nullptr; }
    void clear_score_cache() override { cache_.clear(); }
    size_t score_cache_size() const override { return cache_.size(); }

    result compress(const engine &target, std::span<const int32_t> prompt) override;

private:
    // Chunk scores of `ids` (one per chunk): cached ones reused, the rest from the (loaded) drafter.
    std::vector<float> chunk_scores(std::span<const int32_t> ids, result &r);
    bool release_after_use() const {
        if (opts_.residency == drafter_residency::auto_select)
            return drafter_ && drafter_->file_bytes() > opts_.auto_keep_max_bytes;
        return opts_.residency == drafter_residency::release_after_use;
    }

    options opts_;
    std::unique_ptr<drafter> drafter_;
    // Chained content hash of a chunk (its tokens and everything before it) -> its normalised score.
    std::unordered_map<uint64_t, float> cache_;
};

std::vector<float> compressor_impl::chunk_scores(std::span<const int32_t> ids, result &r) {
    const int64_t n = static_cast<int64_t>(ids.size()), C = opts_.chunk_tokens;
    const int64_t n_chunks = (n + C - 1) / C;
    // The hash of chunk c covers chunks 0..c: a chunk's score depends on what precedes it.
    std::vector<uint64_t> key(static_cast<size_t>(n_chunks));
    uint64_t h = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(C);
    std::vector<float> out(static_cast<size_t>(n_chunks), 0.0f);
    std::vector<bool> hit(static_cast<size_t>(n_chunks), false);
    int64_t n_hit = 0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t a = c * C, len = std::min(n, a + C) - a;
        h = XXH3_64bits_withSeed(ids.data() + a, static_cast<size_t>(len) * sizeof(int32_t), h);
        key[static_cast<size_t>(c)] = h;
        if (!opts_.score_cache) continue;
        if (const auto it = cache_.find(h); it != cache_.end()) {
            out[static_cast<size_t>(c)] = it->second;
            hit[static_cast<size_t>(c)] = true;
            ++n_hit;
        }
    }
    r.n_cached_chunks = n_hit;
    if (n_hit == n_chunks) return out;

    const auto t1 = std::chrono::steady_clock::now();
    drafter_stats ds;
    const std::vector<float> tok = drafter_->score(ids, {opts_.query_tokens, opts_.drafter_window}, ds);
    r.n_drafter_evaluated = ds.n_evaluated;
    r.drafter_prefill_s = ds.prefill_s;
    r.drafter_query_s = ds.query_s;
    r.drafter_attend_s = ds.score_s;
    const std::vector<float> fresh = chunk_means(smooth_scores(tok, opts_.smooth_kernel), opts_.chunk_tokens);
    // Normalise by the mean over the chunks scored now, so scores cached from calls with other
    // prompt lengths (attention mass spread over fewer keys) stay comparable.
    double mean = 0;
    for (int64_t c = 0; c < n_chunks; ++c)
        if (!hit[static_cast<size_t>(c)]) mean += fresh[static_cast<size_t>(c)];
    mean /= static_cast<double>(n_chunks - n_hit);
    const float inv = mean > 0 ? static_cast<float>(1.0 / mean) : 1.0f;
    if (opts_.score_cache && static_cast<int64_t>(cache_.size()) + n_chunks > opts_.score_cache_max_entries)
        cache_.clear();  // simple bound: start over rather than track recency
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (hit[static_cast<size_t>(c)]) continue;
        out[static_cast<size_t>(c)] = fresh[static_cast<size_t>(c)] * inv;
        if (opts_.score_cache) cache_[key[static_cast<size_t>(c)]] = out[static_cast<size_t>(c)];
    }
    r.score_s = seconds(t1);
    return out;
}

result compressor_impl::compress(const engine &target, std::span<const int32_t> prompt) {
    const auto t0 = std::chrono::steady_clock::now();
    result r;
    r.n_original = static_cast<int64_t>(prompt.size());
    if (prompt.empty()) throw error("pflash: empty prompt");
    const spanned_text tt =
        text_from_pieces(prompt, [&](int32_t id) { return target.token_to_piece(id); });
    auto keep_all = [&]() {
        r.tokens.assign(prompt.begin(), prompt.end());
        r.n_effective = r.n_original;
        r.kept_bytes = {{0, tt.text.size()}};
        r.total_s = seconds(t0);
        return r;
    };
    if (opts_.keep_ratio >= 1.0 || tt.text.empty()) return keep_all();

    try {
        auto tl = std::chrono::steady_clock::now();
        load_drafter();
        r.load_s = seconds(tl);
        const drafter_tokens dt = encode_with_offsets(drafter_->tok(), tt.text);
        const int64_t n = static_cast<int64_t>(dt.ids.size()), C = opts_.chunk_tokens;
        r.n_drafter_tokens = n;
        r.n_chunks = (n + C - 1) / C;
        if (r.n_chunks <= int64_t{opts_.head_chunks} + opts_.tail_chunks) {
            r.n_kept_chunks = r.n_forced_chunks = r.n_chunks;
            if (release_after_use()) release_drafter();
            return keep_all();
        }
        const std::vector<float> scores = chunk_scores(dt.ids, r);
        const auto ts = std::chrono::steady_clock::now();
        const prompt_structure st = find_structure(tt.text, opts_.verbatim_system, opts_.verbatim_last_user);
        const selection sel = select_spans(dt.ids, dt.spans, scores, st, tt.text, opts_);
        for (bool k : sel.kept_chunk) r.n_kept_chunks += k ? 1 : 0;
        r.n_forced_chunks = sel.n_forced;
        r.n_anchor_chunks = sel.n_anchor;
        r.kept_bytes.reserve(sel.kept.size());
        for (const byte_span &b : sel.kept) r.kept_bytes.push_back({b.begin, b.end});
        for (int64_t i : tokens_covering(tt.spans, sel.kept)) r.tokens.push_back(prompt[static_cast<size_t>(i)]);
        r.n_effective = static_cast<int64_t>(r.tokens.size());
        r.select_s = seconds(ts);
    } catch (...) {
        if (release_after_use()) release_drafter();
        throw;
    }
    if (release_after_use()) release_drafter();
    r.total_s = seconds(t0);
    return r;
}

}  // namespace

std::unique_ptr<compressor> compressor::create(const options &opts) { return std::make_unique<compressor_impl>(opts); }

}  // namespace fathom::pflash
