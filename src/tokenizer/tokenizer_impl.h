// Private state of fathom::tokenizer, shared by tokenizer.cpp (loading, decoding) and tokenizer_encode.cpp
// (special-token split, BPE and SPM). Tests may include it to reach internals.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

namespace fathom {

// Byte trie over the special-token texts, used to find which of them occur in a text in one pass.
struct special_trie {
    struct node {
        std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
        int32_t token = token_null;                      // token whose text ends here
    };
    std::vector<node> nodes{1};
    bool first_byte[256] = {};

    void insert(std::string_view text, int32_t id);
    int32_t child(int32_t n, uint8_t b) const;
};

// Text -> token id, open addressing over (hash, id) slots; keys are compared against the vocab arena.
// Flat and cache-friendly: the lookup sits on the hot path of SPM merging and of loading merges.
class token_index {
public:
    // `text_of(id)` must stay valid for the index's lifetime. Equal texts: the highest id wins (llama.cpp).
    template <typename TextOf>
    void build(int32_t n, TextOf text_of);
    int32_t find(std::string_view s, std::string_view arena, const std::vector<uint32_t> &off) const;

private:
    struct slot {
        uint32_t hash;
        int32_t id;  // token_null when empty
    };
    std::vector<slot> slots_;
    uint64_t mask_ = 0;
};

uint32_t token_hash(std::string_view s);

template <typename TextOf>
void token_index::build(int32_t n, TextOf text_of) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(n) * 2) cap <<= 1;
    slots_.assign(cap, slot{0, token_null});
    mask_ = cap - 1;
    for (int32_t id = 0; id < n; ++id) {
        const std::string_view s = text_of(id);
        const uint32_t h = token_hash(s);
        for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
            slot &sl = slots_[i];
            if (sl.id == token_null) {
                sl = {h, id};
                break;
            }
            if (sl.hash == h && text_of(sl.id) == s) {
                sl.id = id;  // duplicate text: the later id wins
                break;
            }
        }
    }
}

struct tokenizer::impl {
    model_kind model = model_kind::bpe;
    std::string pre_name;
    tok_detail::pre_kind pre = tok_detail::pre_kind::default_bpe;
    bool ignore_merges = false;  // llama3 family: a word that is itself a token skips the merges
    bool add_bos = false, add_eos = false, add_space_prefix = false;

    // Vocabulary: texts live in one arena, addressed by [text_off[i], text_off[i+1]).
    std::string arena;
    std::vector<uint32_t> text_off;  // [n_vocab + 1]
    std::vector<token_type> types;   // [n_vocab]
    std::vector<float> scores;       // [n_vocab]
    std::vector<uint8_t> rstrip;     // [n_vocab] special token eats following whitespace (llama.cpp RSTRIP)
    token_index text_to_id;  // last id wins on duplicate texts, as llama.cpp

    int32_t bos = token_null, eos = token_null, eot = token_null, eom = token_null;
    int32_t pad = token_null, unk = token_null, nl = token_null;
    std::vector<int32_t> eog;  // sorted

    // Byte-level BPE: (left id, right id) -> merge rank and merged id.
    struct merge_info {
        int32_t rank;
        int32_t id;
    };
    std::unordered_map<uint64_t, merge_info> merges;
    int32_t byte_token[256];          // BPE: id of the GPT-2 code point of each byte; SPM: id of <0xNN>
    std::string byte_char[256];       // BPE: UTF-8 of the GPT-2 code point of each byte
    std::vector<int32_t> char_byte;   // BPE decode: code point (< 512) -> byte, -1 if not a byte char

    // SPM: bytes b such that some token contains b followed by U+2581 (after its leading U+2581 run).
    bool spm_joins_space[256] = {};

    // Special tokens (control, user-defined, unknown) for the pre-split of encode().
    special_trie trie;
    std::vector<std::string> pieces;  // token_to_piece(id, render_special = true), precomputed

    int32_t n_vocab() const { return static_cast<int32_t>(types.size()); }
    std::string_view text(int32_t id) const {
        return std::string_view(arena).substr(text_off[id], text_off[id + 1] - text_off[id]);
    }
    int32_t find(std::string_view s) const { return text_to_id.find(s, arena, text_off); }
    void check_id(int32_t id) const;

    // tokenizer_encode.cpp
    struct fragment {
        int32_t token;  // token_null for raw text
        uint32_t off, len;
    };
    void split_special(std::string_view text, bool parse_special, std::vector<fragment> &out) const;
    void encode_bpe(std::string_view text, std::vector<int32_t> &out) const;
    void encode_spm(std::string_view escaped, std::vector<int32_t> &out) const;
    void encode_spm_segment(std::string_view escaped, std::vector<int32_t> &out) const;
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;
};

}  // namespace fathom
