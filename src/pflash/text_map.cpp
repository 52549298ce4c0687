// Cross-tokenizer byte-offset mapping for PFlash (see text_map.h).
#include "pflash/text_map.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fathom::pflash {

spanned_text text_from_pieces(std::span<const int32_t> tokens, const std::function<std::string(int32_t)> &piece_of) {
    spanned_text out;
    out.spans.reserve(tokens.size());
    for (int32_t id : tokens) {
        const uint64_t b = out.text.size();
        out.text += piece_of(id);
        out.spans.push_back({b, out.text.size()});
    }
    return out;
}

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

// Bytes of text from `pos` that `piece` stands for, or -1. SPM vocabularies escape ' ' as U+2581 and
// render it back as ' ', so there a piece's ' ' also stands for a literal U+2581 in the text.
int64_t match_len(std::string_view text, uint64_t pos, std::string_view piece, bool spm) {
    static constexpr std::string_view k_sp = "\xE2\x96\x81";
    uint64_t t = pos;
    for (char c : piece) {
        if (t < text.size() && text[t] == c) {
            ++t;
        } else if (spm && c == ' ' && text.compare(t, 3, k_sp) == 0) {
            t += 3;
        } else {
            return -1;
        }
    }
    return static_cast<int64_t>(t - pos);
}

}  // namespace

drafter_tokens encode_with_offsets(const tokenizer &tok, std::string_view text) {
    drafter_tokens out;
    if (tok.add_bos() && tok.bos() != token_null) out.ids.push_back(tok.bos());
    {
        std::vector<int32_t> body = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
        out.ids.insert(out.ids.end(), body.begin(), body.end());
    }
    out.spans.reserve(out.ids.size());
    const bool spm = tok.model() == tokenizer::model_kind::spm;
    uint64_t pos = 0;
    bool prev_special = false;  // the previous token may have swallowed whitespace after it (RSTRIP)
    for (size_t i = 0; i < out.ids.size(); ++i) {
        const int32_t id = out.ids[i];
        const token_type ty = tok.type(id);
        const bool special = ty == token_type::control || ty == token_type::user_defined;
        const std::string piece = tok.token_to_piece(id, /*render_special=*/true);
        for (;;) {
            if (const int64_t m = match_len(text, pos, piece, spm); !piece.empty() && m >= 0) {
                out.spans.push_back({pos, pos + static_cast<uint64_t>(m)});
                pos += static_cast<uint64_t>(m);
                break;
            }
            // SPM dummy prefix: the tokenizer added a space that is not in the text.
            if (const int64_t m = piece.size() > 1 && piece[0] == ' ' ? match_len(text, pos, std::string_view(piece).substr(1), spm) : -1;
                m >= 0) {
                out.spans.push_back({pos, pos + static_cast<uint64_t>(m)});
                pos += static_cast<uint64_t>(m);
                break;
            }
            if (piece == " " && tok.add_space_prefix() && (pos == 0 || prev_special)) {
                out.spans.push_back({pos, pos});  // a lone dummy-prefix token
                break;
            }
            // Whitespace swallowed by the special token before: it belongs to that token.
            if (prev_special && !out.spans.empty() && pos < text.size() && is_space(text[pos])) {
                while (pos < text.size() && is_space(text[pos])) ++pos;
                out.spans.back().end = pos;
                continue;
            }
            // A control token whose text is not in the text (the BOS added above): zero width.
            if (ty == token_type::control || piece.empty()) {
                out.spans.push_back({pos, pos});
                break;
            }
            // Byte fallback to the unknown token: one byte per token.
            if (id == tok.unk() && pos < text.size()) {
                out.spans.push_back({pos, pos + 1});
                ++pos;
                break;
            }
            throw error("pflash: drafter token " + std::to_string(id) + " does not align with the prompt text at byte " +
                        std::to_string(pos));
        }
        prev_special = special;
    }
    if (pos < text.size()) {
        if (prev_special && !out.spans.empty()) {
            while (pos < text.size() && is_space(text[pos])) ++pos;
            out.spans.back().end = pos;
        }
        if (pos < text.size())
            throw error("pflash: drafter tokens cover " + std::to_string(pos) + " of " + std::to_string(text.size()) +
                        " prompt bytes");
    }
    return out;
}

std::vector<byte_span> merge_ranges(std::vector<byte_span> ranges) {
    std::erase_if(ranges, [](const byte_span &r) { return r.end <= r.begin; });
    std::sort(ranges.begin(), ranges.end(), [](const byte_span &a, const byte_span &b) { return a.begin < b.begin; });
    std::vector<byte_span> out;
    for (const byte_span &r : ranges) {
        if (!out.empty() && r.begin <= out.back().end) {
            out.back().end = std::max(out.back().end, r.end);
        } else {
            out.push_back(r);
        }
    }
    return out;
}

std::vector<byte_span> snap_utf8(std::string_view text, std::vector<byte_span> ranges) {
    auto is_cont = [&](uint64_t i) { return (static_cast<uint8_t>(text[i]) & 0xC0) == 0x80; };
    for (byte_span &r : ranges) {
        r.begin = std::min<uint64_t>(r.begin, text.size());
        r.end = std::min<uint64_t>(r.end, text.size());
        // Back over at most 3 continuation bytes (a longer run is not one character: leave it).
        for (int k = 0; k < 3 && r.begin > 0 && r.begin < text.size() && is_cont(r.begin); ++k) --r.begin;
        for (int k = 0; k < 3 && r.end > r.begin && r.end < text.size() && is_cont(r.end); ++k) ++r.end;
    }
    return merge_ranges(std::move(ranges));
}

std::vector<int64_t> tokens_covering(std::span<const byte_span> token_spans, std::span<const byte_span> ranges) {
    std::vector<int64_t> out;
    size_t r = 0;
    for (size_t i = 0; i < token_spans.size(); ++i) {
        const byte_span t = token_spans[i];
        if (t.end <= t.begin) {
            out.push_back(static_cast<int64_t>(i));
            continue;
        }
        while (r < ranges.size() && ranges[r].end <= t.begin) ++r;  // ranges are sorted and disjoint
        if (r < ranges.size() && ranges[r].begin < t.end) out.push_back(static_cast<int64_t>(i));
    }
    return out;
}

}  // namespace fathom::pflash
