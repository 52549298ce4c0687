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

// Anchor rule (pflash.h options): chunk indices forced by n-grams of the query tail.
std::vector<bool> anchor_chunks(std::span<const int32_t> ids, const options &o);

// Number of chunks the budget allows: 0 if keep_ratio == 0, else max(min_chunks, round(r * n)), <= n.
int64_t chunk_budget(int64_t n_chunks, const options &o);

struct selection {
    std::vector<bool> kept_chunk;     // [n_chunks]
    int64_t n_forced = 0;
    std::vector<byte_span> kept;      // merged byte ranges of the text
};

// ids/spans: the drafter tokens; chunk_scores: one per chunk of o.chunk_tokens tokens.
selection select_spans(std::span<const int32_t> ids, std::span<const byte_span> spans,
                       std::span<const float> chunk_scores, const prompt_structure &st, std::string_view text,
                       const options &o);

}  // namespace fathom::pflash
