// PFlash: lossy prompt compression before the target's prefill, scored by a small drafter model.
//
//   target tokens --(pieces)--> text + byte offsets --(drafter tokenizer)--> drafter tokens + offsets
//   --(drafter forward: windowed prefill, full attention for the last Q queries)--> per-token scores
//   --(chunk ranking, head/tail/anchors/structure)--> kept byte ranges --> the ORIGINAL target tokens
//   covering them, in order.
//
// The drafter may use a different tokenizer than the target: the two only meet through byte offsets
// into the same text, so no kept text is ever detokenised and re-tokenised. docs/pflash.md has the
// design, the defaults and the measured costs.
//
// A compressor is not thread-safe (it owns the drafter's state); use one per worker. Every failure
// throws fathom::error with a one-line message.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fathom/engine.h"

namespace fathom::pflash {

// What happens to the drafter's weights and state after a compress() call.
enum class drafter_residency {
    keep,               // load once, keep loaded (its KV prefix is reused by the next call)
    release_after_use,  // load for each call, release afterwards
    auto_select,        // keep when the drafter file is at most auto_keep_max_bytes, else release
};

// Parses "keep" | "release" (or "release-after-use") | "auto"; throws on anything else.
drafter_residency parse_residency(const std::string &s);
const char *residency_name(drafter_residency r);

// Throws fathom::error unless r is finite and in [0, 1]. `what` names the surface in the message
// (e.g. "--keep-ratio").
void validate_keep_ratio(double r, const std::string &what = "keep_ratio");
// Throws fathom::error unless d is "cpu", "cuda" or "cuda:N" (whether that device is usable is the
// drafter load's check). `what` names the surface (e.g. "--drafter-device").
void validate_drafter_device(const std::string &d, const std::string &what = "drafter_device");

struct options {
    std::string drafter_path;   // GGUF of a dense drafter (llama / qwen3 / gemma3 family)
    double keep_ratio = 0.2;    // fraction of chunks kept, in [0, 1]; 0 keeps only forced chunks
    int32_t chunk_tokens = 32;  // drafter tokens per selection chunk
    int32_t min_chunks = 1;     // keep at least this many chunks (unless keep_ratio == 0)
    int32_t head_chunks = 1;    // always kept at the start ...
    int32_t tail_chunks = 2;    // ... and at the end (the question usually sits there)
    int32_t query_tokens = 8;   // Q: the last Q drafter tokens are the scoring queries
    int32_t smooth_kernel = 5;  // moving-average width over token scores (odd, 1 = none)
    int32_t drafter_window = 512;  // sliding window of the drafter's prefill (0 = full attention)
    // Drafter tokens per forward call; 0 = by device: 512 on the CPU, 4096 on a GPU (each GPU chunk
    // re-dequantises the drafter's weights for its GEMMs and costs a host sync, so long chunks pay).
    int32_t drafter_batch = 0;
    int32_t effective_drafter_batch() const;
    // Anchor rule (the query's own words point at earlier text): the query is the last
    // anchor_tail_tokens drafter tokens of the last user message (of the whole prompt when no chat
    // turns are found; role markers and the assistant header never count). Each anchor_ngram-gram of the
    // query that holds a content token (a letter; not whitespace / punctuation / digits alone) and
    // does not cut a word, and that occurs earlier 1..anchor_max_hits times (also as whole words),
    // marks the chunks within anchor_radius_tokens drafter tokens of its occurrences. Anchors are not
    // forced beyond the budget: they claim at most round(anchor_budget_fraction x budget) chunks of it,
    // the query's last n-grams first (a share reserved even when head/tail/structure fill the
    // budget); the scores fill the rest. So keep_ratio bounds the output (at most
    // max(budget, forced + share) chunks) whatever the prompt repeats. anchor_ngram == 0 disables the rule.
    int32_t anchor_ngram = 4;
    int32_t anchor_tail_tokens = 96;
    int32_t anchor_max_hits = 4;
    int32_t anchor_radius_tokens = 16;
    double anchor_budget_fraction = 0.5;  // in [0, 1]
    // Structure: chat role markers are always kept; the system prompt and the last user message are
    // kept verbatim when these are set; tool-call and JSON blocks are never cut (kept whole or dropped).
    bool verbatim_system = true;
    bool verbatim_last_user = true;
    bool score_cache = true;             // reuse scores of content-hashed chunks seen by earlier calls
    int64_t score_cache_max_entries = 1 << 16;
    drafter_residency residency = drafter_residency::auto_select;
    uint64_t auto_keep_max_bytes = uint64_t{1} << 30;
    int n_threads = 0;                   // drafter threads, 0 = online cores
    // Where the drafter runs: "cpu", or "cuda" / "cuda:N" in a CUDA build (weights, KV and the scoring
    // attention on that GPU; loading fails with the device's reason when it cannot be used).
    std::string drafter_device = "cpu";

    // Throws on the first invalid field (keep_ratio checked by validate_keep_ratio).
    void validate() const;
};

struct result {
    std::vector<int32_t> tokens;       // kept target tokens, original ids in original order
    int64_t n_original = 0;            // target tokens in
    int64_t n_effective = 0;           // target tokens out (tokens.size())
    int64_t n_drafter_tokens = 0;      // drafter tokens of the prompt
    int64_t n_drafter_evaluated = 0;   // of those, evaluated by the drafter forward this call
    int64_t n_chunks = 0, n_kept_chunks = 0, n_forced_chunks = 0, n_cached_chunks = 0;
    int64_t n_anchor_chunks = 0;       // kept because of the anchor rule (part of the budget)
    std::vector<std::pair<uint64_t, uint64_t>> kept_bytes;  // kept [begin, end) byte ranges of the text
    double load_s = 0, score_s = 0, select_s = 0, total_s = 0;
    // score_s split: drafter prefill (windowed), query forward (full attention), tail-query scoring.
    double drafter_prefill_s = 0, drafter_query_s = 0, drafter_attend_s = 0;
};

class compressor {
public:
    // Validates the options. With residency keep the drafter is loaded now; otherwise on first use.
    static std::unique_ptr<compressor> create(const options &opts);
    virtual ~compressor() = default;

    virtual const options &opts() const = 0;
    // Set the keep ratio for the next calls (validated).
    virtual void set_keep_ratio(double r) = 0;
    // Set options::verbatim_system / verbatim_last_user for the next calls.
    virtual void set_verbatim(bool system, bool last_user) = 0;

    // Compress `prompt` (tokens of `target`). Prompts of at most (head + tail) chunks come back whole.
    virtual result compress(const engine &target, std::span<const int32_t> prompt) = 0;

    // Drafter residency. load_drafter() is a no-op when loaded; a failed load leaves nothing behind.
    virtual void load_drafter() = 0;
    virtual void release_drafter() = 0;
    virtual bool drafter_loaded() const = 0;
    virtual void clear_score_cache() = 0;
    virtual size_t score_cache_size() const = 0;
};

}  // namespace fathom::pflash
