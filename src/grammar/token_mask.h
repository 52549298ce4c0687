// Structured output, part 3: from the byte automaton (json_matcher.h) to the model's tokens.
//
// vocab_index — built once per vocabulary: every token's bytes, the end-of-generation tokens, and
//   two tries of token bytes (first-child / next-sibling links): one of every usable token, one of
//   the "impure" tokens only. A token is pure when its bytes are ordinary string content: whole
//   UTF-8 characters, no quote, backslash or control byte. Control, unused and empty tokens are
//   never allowed (their text is not the model's output).
// token_constraint — one request's state: the matcher plus the mask of allowed tokens for the next
//   position. The mask walks the trie depth first, feeding each edge's byte to the matcher and
//   undoing it on the way back, so a subtree is visited only while its prefix can continue the
//   document: the work is the number of token prefixes that are valid here, not vocab x length.
//   Inside a string between characters (the state most of a document's tokens are sampled in) every
//   pure token is allowed (within maxLength, by its code-point count), and only the impure trie is
//   walked. End-of-generation tokens are allowed only when the document is complete.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "grammar/json_matcher.h"

namespace fathom::grammar {

class vocab_index {
public:
    // n_vocab tokens; piece(id): its bytes (may throw for ids the tokenizer lacks: never allowed);
    // is_eog(id): ends the generation; banned(id): a control / unused token.
    vocab_index(int32_t n_vocab, const std::function<std::string(int32_t)> &piece,
                const std::function<bool(int32_t)> &is_eog, const std::function<bool(int32_t)> &banned);

    int32_t n_vocab() const { return n_vocab_; }
    const std::string &piece(int32_t id) const { return pieces_[size_t(id)]; }
    bool usable(int32_t id) const { return id >= 0 && id < n_vocab_ && usable_[size_t(id)]; }
    bool is_eog(int32_t id) const { return id >= 0 && id < n_vocab_ && eog_[size_t(id)]; }
    int32_t pure_chars(int32_t id) const { return pure_cp_[size_t(id)]; }  // code points, 0 = not pure

    struct trie_node {
        int32_t first_child = -1, next_sibling = -1;
        int32_t tok_begin = 0, tok_end = 0;  // ids of the tokens ending here: tok_ids[tok_begin, tok_end)
        uint8_t byte = 0;
    };
    struct trie {
        std::vector<trie_node> nodes;  // [0] is the root (no byte)
        std::vector<int32_t> tok_ids;
    };
    const trie &all() const { return all_; }
    const trie &impure() const { return impure_; }
    const std::vector<uint64_t> &pure_mask() const { return pure_mask_; }
    // Pure tokens sorted by code-point count: (count, id).
    const std::vector<std::pair<int32_t, int32_t>> &pure_by_chars() const { return pure_sorted_; }
    const std::vector<int32_t> &eog_ids() const { return eog_ids_; }

private:
    static trie build(std::vector<int32_t> ids, const std::vector<std::string> &pieces);
    int32_t n_vocab_;
    std::vector<std::string> pieces_;
    std::vector<uint8_t> usable_, eog_;
    std::vector<int32_t> pure_cp_;
    std::vector<int32_t> eog_ids_;
    std::vector<uint64_t> pure_mask_;  // [ceil(n_vocab / 64)]
    std::vector<std::pair<int32_t, int32_t>> pure_sorted_;
    trie all_, impure_;
};

class token_constraint {
public:
    token_constraint(std::shared_ptr<const json_grammar> g, std::shared_ptr<const vocab_index> v);

    // The allowed tokens for the next position: bit id of mask ([ceil(n_vocab / 64)] words).
    void fill_mask(std::vector<uint64_t> &mask);
    // logits[id] = -inf for every token outside fill_mask; returns how many are allowed.
    int64_t apply(std::span<float> logits);
    // Advances by one generated token; false (state unchanged) when the token cannot come next. An
    // end-of-generation token is accepted when the document is complete (the state is then final).
    bool accept(int32_t id);
    bool accept_bytes(const std::string &bytes) { return m_.feed(bytes); }  // all or nothing
    bool complete() { return m_.complete(); }
    const json_matcher &matcher() const { return m_; }
    const vocab_index &vocab() const { return *v_; }

private:
    void walk(const vocab_index::trie &t, int32_t node, std::vector<uint64_t> &mask);
    json_matcher m_;
    std::shared_ptr<const vocab_index> v_;
    std::vector<uint64_t> scratch_;
};

}  // namespace fathom::grammar
