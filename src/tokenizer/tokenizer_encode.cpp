// Encoding: the special-token pre-split (llama.cpp's tokenizer_st_partition), byte-level BPE merging and
// SentencePiece merging, and the per-model driver (BOS/EOS, SPM dummy prefix).
#include <algorithm>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace fathom {

using impl_t = tokenizer::impl;

// ---- special tokens ---------------------------------------------------------------------------------------
//
// llama.cpp semantics: special tokens are applied one at a time, longest text first; each one splits every
// remaining raw fragment at all its occurrences (left to right). Only tokens that occur in the text can split
// anything, so one trie pass first collects those, and the (short) list of present tokens is then applied.
// With parse_special == false only user-defined tokens take part.

void impl_t::split_special(std::string_view text, bool parse_special, std::vector<fragment> &out) const {
    out.clear();
    if (text.empty()) return;
    std::vector<int32_t> present;
    const auto *bytes = reinterpret_cast<const uint8_t *>(text.data());
    for (size_t i = 0; i < text.size(); ++i) {
        if (!trie.first_byte[bytes[i]]) continue;
        int32_t node = 0;
        for (size_t j = i; j < text.size(); ++j) {
            node = trie.child(node, bytes[j]);
            if (node < 0) break;
            const int32_t id = trie.nodes[node].token;
            if (id == token_null) continue;
            if (parse_special || types[id] == token_type::user_defined) present.push_back(id);
        }
    }
    out.push_back({token_null, 0, static_cast<uint32_t>(text.size())});
    if (present.empty()) return;
    std::sort(present.begin(), present.end());
    present.erase(std::unique(present.begin(), present.end()), present.end());
    std::stable_sort(present.begin(), present.end(),
                     [&](int32_t a, int32_t b) { return this->text(a).size() > this->text(b).size(); });

    std::vector<fragment> next;
    auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; };
    for (int32_t id : present) {
        const std::string_view tok = this->text(id);
        next.clear();
        for (const fragment &fr : out) {
            if (fr.token != token_null) {
                next.push_back(fr);
                continue;
            }
            uint32_t off = fr.off, len = fr.len;
            while (len > 0) {
                const size_t m = text.substr(off, len).find(tok);
                if (m == std::string_view::npos) {
                    next.push_back({token_null, off, len});
                    break;
                }
                if (m > 0) next.push_back({token_null, off, static_cast<uint32_t>(m)});
                next.push_back({id, 0, 0});
                uint32_t r_off = off + static_cast<uint32_t>(m + tok.size());
                uint32_t r_len = len - static_cast<uint32_t>(m + tok.size());
                if (rstrip[id]) {
                    while (r_len > 0 && is_space(text[r_off])) {
                        ++r_off;
                        --r_len;
                    }
                }
                off = r_off;
                len = r_len;
            }
        }
        out.swap(next);
    }
}

// ---- byte-level BPE ---------------------------------------------------------------------------------------

namespace {

struct bpe_symbol {
    int32_t id;  // token id, or token_null once merged into its left neighbour
    int32_t prev, next;
};

struct bpe_bigram {
    int32_t rank;
    int32_t left, right;        // symbol indices
    int32_t left_id, right_id;  // ids when queued: a stale entry no longer matches them
    int32_t merged;
};

// Lowest rank first; equal ranks: leftmost first.
struct bpe_bigram_after {
    bool operator()(const bpe_bigram &a, const bpe_bigram &b) const {
        return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
};

struct bpe_scratch {
    tok_detail::pre_scratch pre;
    std::vector<std::pair<uint32_t, uint32_t>> words;
    std::vector<bpe_symbol> symbols;
    std::vector<bpe_bigram> heap;
    std::string mapped;
};

}  // namespace

namespace {

void bpe_push_bigram(const impl_t &t, bpe_scratch &s, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t l = s.symbols[left].id, r = s.symbols[right].id;
    if (l < 0 || r < 0) return;
    const uint64_t key = static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32 | static_cast<uint32_t>(r);
    const auto it = t.merges.find(key);
    if (it == t.merges.end()) return;
    s.heap.push_back({it->second.rank, left, right, l, r, it->second.id});
    std::push_heap(s.heap.begin(), s.heap.end(), bpe_bigram_after{});
}

// Merge one pre-tokenized word (raw bytes) into tokens.
void bpe_word(const impl_t &t, std::string_view word, bpe_scratch &s, std::vector<int32_t> &out) {
    if (t.ignore_merges) {
        s.mapped.clear();
        for (unsigned char b : word) s.mapped += t.byte_char[b];
        if (const int32_t id = t.find(s.mapped); id >= 0) {
            out.push_back(id);
            return;
        }
    }
    const int32_t n = static_cast<int32_t>(word.size());
    s.symbols.resize(n);
    for (int32_t i = 0; i < n; ++i) {
        const auto b = static_cast<unsigned char>(word[i]);
        const int32_t id = t.byte_token[b];
        if (id < 0) {
            throw fathom::error("tokenizer: byte 0x" + std::string(1, "0123456789abcdef"[b >> 4]) +
                                std::string(1, "0123456789abcdef"[b & 15]) + " has no token in this BPE vocab");
        }
        s.symbols[i] = {id, i - 1, i + 1 < n ? i + 1 : -1};
    }
    s.heap.clear();
    for (int32_t i = 1; i < n; ++i) bpe_push_bigram(t, s, i - 1, i);
    while (!s.heap.empty()) {
        std::pop_heap(s.heap.begin(), s.heap.end(), bpe_bigram_after{});
        const bpe_bigram bg = s.heap.back();
        s.heap.pop_back();
        bpe_symbol &l = s.symbols[bg.left];
        bpe_symbol &r = s.symbols[bg.right];
        if (l.id != bg.left_id || r.id != bg.right_id || l.next != bg.right) continue;  // stale
        l.id = bg.merged;
        r.id = token_null;
        l.next = r.next;
        if (r.next >= 0) s.symbols[r.next].prev = bg.left;
        bpe_push_bigram(t, s, l.prev, bg.left);
        bpe_push_bigram(t, s, bg.left, l.next);
    }
    for (int32_t i = 0; i >= 0 && i < n; i = s.symbols[i].next) out.push_back(s.symbols[i].id);
}

}  // namespace

void impl_t::encode_bpe(std::string_view text, std::vector<int32_t> &out) const {
    bpe_scratch s;
    tok_detail::pretokenize(pre, text, s.pre, s.words);
    // Natural text repeats its words: remember each short word's ids for the rest of this call.
    // word bytes -> [first, first + count) in `out`, where that word's ids were first written.
    std::unordered_map<std::string_view, std::pair<size_t, size_t>> seen;
    for (const auto &[b, e] : s.words) {
        const std::string_view word = text.substr(b, e - b);
        if (word.size() > 32) {
            bpe_word(*this, word, s, out);
            continue;
        }
        const auto it = seen.find(word);
        if (it != seen.end()) {
            for (size_t i = 0; i < it->second.second; ++i) out.push_back(out[it->second.first + i]);
            continue;
        }
        const size_t first = out.size();
        bpe_word(*this, word, s, out);
        seen.emplace(word, std::make_pair(first, out.size() - first));
    }
}

// ---- SentencePiece BPE ------------------------------------------------------------------------------------

namespace {

struct spm_symbol {
    uint32_t off, n;  // bytes of the escaped text; n == 0 once merged away
    int32_t prev, next;
};

struct spm_bigram {
    float score;
    int32_t left, right;
    uint32_t size;  // bytes of the pair when queued
};

// Highest score first; equal scores: leftmost first.
struct spm_bigram_after {
    bool operator()(const spm_bigram &a, const spm_bigram &b) const {
        return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
};

}  // namespace

void impl_t::encode_spm(std::string_view text, std::vector<int32_t> &out) const {
    // A merge can cross the start of a U+2581 run only if some token has U+2581 right after the byte that
    // precedes the run (spm_joins_space, from the vocab at load; Gemma3 has one such token, ">▁</").
    // Elsewhere the text is cut into segments merged on their own: merges in different segments are
    // independent, so the result is the same, with small queues.
    static constexpr std::string_view k_sp = "\xE2\x96\x81";
    size_t start = 0;
    for (size_t i = 3; i + 3 <= text.size(); ++i) {
        if (text.compare(i, 3, k_sp) == 0 && text.compare(i - 3, 3, k_sp) != 0 &&
            !spm_joins_space[static_cast<uint8_t>(text[i - 1])]) {
            encode_spm_segment(text.substr(start, i - start), out);
            start = i;
            i += 2;
        }
    }
    encode_spm_segment(text.substr(start), out);
}

void impl_t::encode_spm_segment(std::string_view text, std::vector<int32_t> &out) const {
    std::vector<spm_symbol> sym;
    for (uint32_t off = 0; off < text.size();) {
        // One symbol per character; an invalid byte is a symbol of its own (llama.cpp trusts the lead byte,
        // which lets a broken sequence swallow the next character) so every byte survives the round trip.
        const uint32_t len = unicode::utf8_decode(text, off).len;
        const int32_t idx = static_cast<int32_t>(sym.size());
        sym.push_back({off, len, idx - 1, off + len < text.size() ? idx + 1 : -1});
        off += len;
    }
    std::priority_queue<spm_bigram, std::vector<spm_bigram>, spm_bigram_after> queue;
    auto try_add = [&](int32_t left, int32_t right) {
        if (left < 0 || right < 0) return;
        const uint32_t size = sym[left].n + sym[right].n;
        const int32_t id = find(text.substr(sym[left].off, size));
        if (id < 0) return;
        queue.push({scores[id], left, right, size});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
        const spm_bigram bg = queue.top();
        queue.pop();
        spm_symbol &l = sym[bg.left];
        spm_symbol &r = sym[bg.right];
        if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;  // stale
        l.n += r.n;
        r.n = 0;
        l.next = r.next;
        if (r.next >= 0) sym[r.next].prev = bg.left;
        try_add(l.prev, bg.left);
        try_add(bg.left, l.next);
    }
    for (int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) {
        const std::string_view piece = text.substr(sym[i].off, sym[i].n);
        if (const int32_t id = find(piece); id >= 0) {
            out.push_back(id);
            continue;
        }
        // Not a token: byte fallback, one token per byte.
        for (unsigned char b : piece) {
            int32_t id = byte_token[b];
            if (id < 0) id = unk;
            if (id < 0) throw fathom::error("tokenizer: byte has no <0xNN> token and the vocab has no unknown token");
            out.push_back(id);
        }
    }
}

// ---- driver -----------------------------------------------------------------------------------------------

std::vector<int32_t> impl_t::encode(std::string_view text, bool add_special, bool parse_special) const {
    if (text.size() >= UINT32_MAX) throw fathom::error("tokenizer: text of " + std::to_string(text.size()) +
                                                       " bytes is too large to encode");
    std::vector<int32_t> out;
    std::vector<fragment> frags;
    split_special(text, parse_special, frags);
    if (add_special && add_bos) out.push_back(bos);
    if (model == model_kind::bpe) {
        for (const fragment &fr : frags) {
            if (fr.token != token_null) {
                out.push_back(fr.token);
            } else {
                encode_bpe(text.substr(fr.off, fr.len), out);
            }
        }
    } else {
        bool prev_special = true;  // the dummy-prefix space goes at the start and after each special token
        std::string escaped;
        for (const fragment &fr : frags) {
            if (fr.token != token_null) {
                out.push_back(fr.token);
                prev_special = true;
                continue;
            }
            escaped.clear();
            if (add_space_prefix && prev_special) escaped += "\xE2\x96\x81";
            for (char c : text.substr(fr.off, fr.len)) {
                if (c == ' ') {
                    escaped += "\xE2\x96\x81";
                } else {
                    escaped += c;
                }
            }
            encode_spm(escaped, out);
            prev_special = false;
        }
    }
    if (add_special && add_eos) out.push_back(eos);
    return out;
}

}  // namespace fathom
