// PFlash's cross-tokenizer bridge: token sequences <-> byte ranges of one shared text.
//
//   target tokens -> text + one [begin, end) span per token (concatenated pieces: exact by construction)
//   text -> drafter tokens + spans (the drafter's own encode, then its pieces aligned to the text)
//   kept byte ranges -> the target tokens that intersect them (snapped to UTF-8 character boundaries)
//
// Spans are half-open byte ranges into the text. Target spans tile the text. Drafter spans are in
// order and disjoint but may be empty (a BOS the drafter adds, a control token with no text).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fathom {
class tokenizer;
}

namespace fathom::pflash {

struct byte_span {
    uint64_t begin = 0, end = 0;
    bool operator==(const byte_span &) const = default;
};

struct spanned_text {
    std::string text;
    std::vector<byte_span> spans;  // [n_tokens]
};

// Concatenate the pieces of `tokens` (piece_of(id) = raw bytes of one token). Spans tile the text.
spanned_text text_from_pieces(std::span<const int32_t> tokens, const std::function<std::string(int32_t)> &piece_of);

// Encode `text` with the drafter's tokenizer (special-token texts parsed, BOS prepended when the vocab
// asks for it) and align each token's piece with the text. Handles SPM dummy-prefix spaces, special
// tokens that swallow following whitespace, byte-fallback tokens and zero-width control tokens.
// Throws fathom::error if a token cannot be placed (the offsets would otherwise be guesses).
struct drafter_tokens {
    std::vector<int32_t> ids;
    std::vector<byte_span> spans;
};
drafter_tokens encode_with_offsets(const tokenizer &tok, std::string_view text);

// Sort, merge overlapping or touching ranges, drop empty ones.
std::vector<byte_span> merge_ranges(std::vector<byte_span> ranges);

// Widen every range to whole UTF-8 characters of `text` (begin back over continuation bytes, end
// forward over them), then merge.
std::vector<byte_span> snap_utf8(std::string_view text, std::vector<byte_span> ranges);

// Indices of the tokens whose span intersects one of the (merged, sorted) ranges; zero-width tokens
// are always kept (BOS and other control tokens without text). Ascending.
std::vector<int64_t> tokens_covering(std::span<const byte_span> token_spans, std::span<const byte_span> ranges);

}  // namespace fathom::pflash
