// PFlash span selection: drafter-token chunks ranked by score, forced chunks (head, tail, anchors,
// structure), budget, then byte ranges widened to atomic blocks and whole UTF-8 characters.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "fathom/pflash.h"
#include "pflash/structure.h"
#include "pflash/text_map.h"

namespace fathom::pflash {

// Moving average of width k (odd; clipped at the ends: each output is the mean of the inputs that exist).
std::vector<float> smooth_scores(std::span<const float> x, int32_t k);

// Mean of x over each chunk of `chunk` consecutive entries (the last chunk may be shorter).
std::vector<float> chunk_means(std::span<const float> x, int32_t chunk);

// True if the text of a token carries content: an ASCII letter, or a non-ASCII character outside the
// general / CJK punctuation blocks. Whitespace, ASCII punctuation and digits alone are not content.
bool is_content_piece(std::string_view piece);

// The query span of the anchor rule: the content of the last user turn when the structure has one
// (role markers and the assistant header after it excluded), else the whole text.
byte_span anchor_query_bytes(const prompt_structure &st, std::string_view text);

// Anchor rule (pflash.h options). The query is the last anchor_tail_tokens drafter tokens lying inside
// `query` (bytes). An anchor_ngram-gram of the query qualifies when it holds at least one content token
// and does not cut a word (no ASCII letter/digit on both sides of its first or last boundary); its
// earlier occurrences (before the query, also not cutting a word) count if there are 1..anchor_max_hits
// of them. One group per qualifying n-gram: `core` = the chunks its occurrences lie in, `all` = core and
// the chunks within anchor_radius_tokens of them. Groups come latest n-gram of the query first (the
// question ends the prompt; document text inside the query window comes before it), ties rarest
// first; duplicates removed.
struct anchor_group {
    std::vector<int64_t> core, all;  // ascending chunk indices
    bool operator==(const anchor_group &) const = default;
};
std::vector<anchor_group> anchor_groups(std::span<const int32_t> ids, std::span<const byte_span> spans,
                                        std::string_view text, byte_span query, const options &o);

// Chunks the anchors may claim: round(anchor_budget_fraction * budget). Anchor chunks count against the
// budget like scored ones, so the selection stays within max(budget, n_forced + this share).
int64_t anchor_budget(int64_t budget, const options &o);

// Number of chunks the budget allows: 0 if keep_ratio == 0, else max(min_chunks, round(r * n)), <= n.
int64_t chunk_budget(int64_t n_chunks, const options &o);

struct selection {
    std::vector<bool> kept_chunk;     // [n_chunks]
    int64_t n_forced = 0;             // head, tail and structure chunks
    int64_t n_anchor = 0;             // chunks claimed by anchors (within the budget)
    std::vector<byte_span> kept;      // merged byte ranges of the text
};

// ids/spans: the drafter tokens; chunk_scores: one per chunk of o.chunk_tokens tokens.
selection select_spans(std::span<const int32_t> ids, std::span<const byte_span> spans,
                       std::span<const float> chunk_scores, const prompt_structure &st, std::string_view text,
                       const options &o);

}  // namespace fathom::pflash
