// fathom::tokenizer: loading tokenizer.ggml.* metadata (with llama.cpp's defaults and special-token fix-ups),
// token accessors, token_to_piece/decode, and utf8_stream. Encoding lives in tokenizer_encode.cpp.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cctype>

#include <xxhash.h>

#include "core/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace fathom {

namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in order.
uint32_t gpt2_byte_to_cpt(uint8_t b) {
    auto printable = [](uint32_t x) { return (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE; };
    if (printable(b)) return b;
    uint32_t n = 0;
    for (uint32_t x = 0; x < b; ++x) n += printable(x) ? 0 : 1;
    return 256 + n;
}

std::string lower_ascii(std::string_view s) {
    std::string r(s);
    for (char &c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return r;
}

// Token texts that llama.cpp treats as special roles when the metadata does not name them.
constexpr std::string_view k_eot_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                            "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
                                            "<end_of_utterance>"};
constexpr std::string_view k_eog_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                                            "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
                                            "<|end_of_text|>", "<end_of_utterance>"};
constexpr std::string_view k_eom_texts[] = {"<|eom_id|>"};
// FIM roles in llama.cpp's order: prefix, suffix, middle, pad, repo, file separator.
constexpr std::string_view k_fim_pre_texts[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
                                                "<PRE>", "▁<PRE>", "<|code_prefix|>"};
constexpr std::string_view k_fim_suf_texts[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
                                                "<SUF>", "▁<SUF>", "<|code_suffix|>"};
constexpr std::string_view k_fim_mid_texts[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
                                                "<MID>", "▁<MID>", "<|code_middle|>"};
constexpr std::string_view k_fim_pad_texts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"};
constexpr std::string_view k_fim_rep_texts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
constexpr std::string_view k_fim_sep_texts[] = {"<|file_sep|>"};

template <size_t N>
bool in_list(const std::string_view (&list)[N], std::string_view s) {
    return std::find(std::begin(list), std::end(list), s) != std::end(list);
}

}  // namespace

uint32_t token_hash(std::string_view s) {
    return static_cast<uint32_t>(XXH3_64bits(s.data(), s.size()));
}

int32_t token_index::find(std::string_view s, std::string_view arena, const std::vector<uint32_t> &off) const {
    const uint32_t h = token_hash(s);
    for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
        const slot &sl = slots_[i];
        if (sl.id == token_null) return token_null;
        if (sl.hash == h && arena.substr(off[sl.id], off[sl.id + 1] - off[sl.id]) == s) return sl.id;
    }
}

void special_trie::insert(std::string_view text, int32_t id) {
    int32_t n = 0;
    for (unsigned char b : text) {
        int32_t c = child(n, b);
        if (c < 0) {
            c = static_cast<int32_t>(nodes.size());
            auto &nx = nodes[n].next;
            nx.insert(std::lower_bound(nx.begin(), nx.end(), std::make_pair(b, int32_t{-1})), {b, c});
            nodes.emplace_back();
        }
        n = c;
    }
    nodes[n].token = id;  // the last id wins for equal texts, matching text_to_id
    first_byte[static_cast<unsigned char>(text[0])] = true;
}

int32_t special_trie::child(int32_t n, uint8_t b) const {
    const auto &nx = nodes[n].next;
    auto it = std::lower_bound(nx.begin(), nx.end(), std::make_pair(b, int32_t{-1}));
    return (it != nx.end() && it->first == b) ? it->second : -1;
}

void tokenizer::impl::check_id(int32_t id) const {
    if (id < 0 || id >= n_vocab()) {
        throw fathom::error("tokenizer: token id " + std::to_string(id) + " out of range [0, " +
                            std::to_string(n_vocab()) + ")");
    }
}

namespace {

using impl_t = tokenizer::impl;

void load_vocab(impl_t &t, const gguf::file &f) {
    const auto &tokens = f.get_string_array("tokenizer.ggml.tokens");
    const size_t n = tokens.size();
    if (n == 0 || n > static_cast<size_t>(INT32_MAX)) {
        throw fathom::error(f.path() + ": tokenizer.ggml.tokens has " + std::to_string(n) + " entries");
    }
    std::vector<int64_t> types;
    if (f.has("tokenizer.ggml.token_type")) {
        types = f.get_int_array("tokenizer.ggml.token_type");
        if (types.size() != n) throw fathom::error(f.path() + ": tokenizer.ggml.token_type length differs from tokens");
    }
    std::vector<double> scores;
    if (f.has("tokenizer.ggml.scores")) {
        scores = f.get_float_array("tokenizer.ggml.scores");
        if (scores.size() != n) throw fathom::error(f.path() + ": tokenizer.ggml.scores length differs from tokens");
    }
    t.text_off.resize(n + 1);
    t.types.resize(n);
    t.scores.resize(n);
    t.rstrip.assign(n, 0);
    size_t total = 0;
    for (const auto &s : tokens) total += s.empty() ? 24 : s.size();
    if (total > UINT32_MAX) throw fathom::error(f.path() + ": tokenizer.ggml.tokens too large");
    t.arena.reserve(total);
    for (size_t i = 0; i < n; ++i) {
        t.text_off[i] = static_cast<uint32_t>(t.arena.size());
        if (tokens[i].empty()) {
            t.arena += "[EMPTY_" + std::to_string(i) + "]";  // llama.cpp's stand-in for empty texts
        } else {
            t.arena += tokens[i];
        }
        const int64_t ty = types.empty() ? 1 : types[i];
        t.types[i] = (ty >= 0 && ty <= 6) ? static_cast<token_type>(ty) : token_type::undefined;
        t.scores[i] = scores.empty() ? 0.0f : static_cast<float>(scores[i]);
    }
    t.text_off[n] = static_cast<uint32_t>(t.arena.size());
    t.text_to_id.build(static_cast<int32_t>(n), [&t](int32_t id) { return t.text(id); });
}

void load_bpe_merges(impl_t &t, const gguf::file &f) {
    const auto &merges = f.get_string_array("tokenizer.ggml.merges");
    t.merges.reserve(merges.size());
    std::string joined;
    for (size_t i = 0; i < merges.size(); ++i) {
        const std::string_view m = merges[i];
        const size_t sp = m.find(' ', 1);
        if (sp == std::string_view::npos) {
            throw fathom::error(f.path() + ": tokenizer.ggml.merges[" + std::to_string(i) + "] has no space");
        }
        const int32_t l = t.find(m.substr(0, sp));
        const int32_t r = t.find(m.substr(sp + 1));
        joined.assign(m.substr(0, sp));
        joined.append(m.substr(sp + 1));
        const int32_t res = t.find(joined);
        // A merge whose parts or result are not tokens can never produce a token: skip it.
        if (l < 0 || r < 0 || res < 0) continue;
        const uint64_t key = static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32 | static_cast<uint32_t>(r);
        t.merges.emplace(key, impl_t::merge_info{static_cast<int32_t>(i), res});  // first rank wins
    }
    t.char_byte.assign(512, -1);
    for (int b = 0; b < 256; ++b) {
        const uint32_t cpt = gpt2_byte_to_cpt(static_cast<uint8_t>(b));
        t.byte_char[b].clear();
        unicode::utf8_append(t.byte_char[b], cpt);
        t.byte_token[b] = t.find(t.byte_char[b]);
        t.char_byte[cpt] = b;
    }
    // A byte's token should be a normal one: DeepSeek LLM also has user-defined tokens with the same texts
    // (e.g. "ÿ"), which text_to_id prefers but which render as the UTF-8 character, not the byte.
    for (int32_t id = 0; id < t.n_vocab(); ++id) {
        const std::string_view s = t.text(id);
        if (t.types[id] != token_type::normal || s.size() > 2) continue;
        const unicode::utf8_unit u = unicode::utf8_decode(s, 0);
        if (u.len != s.size() || u.cpt >= t.char_byte.size() || t.char_byte[u.cpt] < 0) continue;
        const int b = t.char_byte[u.cpt];
        if (t.byte_token[b] < 0 || t.types[t.byte_token[b]] != token_type::normal) t.byte_token[b] = id;
    }
}

// Marks every byte that some token has directly before a U+2581 outside the token's leading U+2581 run.
void find_spm_space_joins(impl_t &t) {
    static constexpr std::string_view k_sp = "\xE2\x96\x81";
    for (int32_t id = 0; id < t.n_vocab(); ++id) {
        const std::string_view s = t.text(id);
        size_t p = 0;
        while (s.compare(p, 3, k_sp) == 0) p += 3;
        for (size_t q = s.find(k_sp, p); q != std::string_view::npos; q = s.find(k_sp, q + 3)) {
            if (q > 0) t.spm_joins_space[static_cast<uint8_t>(s[q - 1])] = true;
        }
    }
}

void load_spm_bytes(impl_t &t) {
    static const char *hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
        const char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        int32_t id = t.find(std::string_view(buf, 6));
        if (id < 0) id = t.find(std::string_view(reinterpret_cast<const char *>(&b), 1));  // plain byte token
        t.byte_token[b] = id;
    }
}

// Reads an optional special id; like llama.cpp an out-of-range value keeps the default.
void read_special(const gguf::file &f, const char *key, int32_t n_vocab, int32_t &id) {
    if (!f.has(key)) return;
    const int64_t v = f.get_int(key);
    if (v >= 0 && v < n_vocab) id = static_cast<int32_t>(v);
}

// llama.cpp's text-based fix-ups: find EOT/EOM/FIM tokens by text when the metadata does not name them,
// force those tokens to control type, and build the end-of-generation set. llama.cpp takes whichever candidate
// its hash map yields first; we take the first text of each list (so Llama 3's EOT is <|eot_id|>, not
// <|end_of_text|>).
void detect_special_roles(impl_t &t, const gguf::file &f) {
    const int32_t n = t.n_vocab();
    int32_t fim[6] = {token_null, token_null, token_null, token_null, token_null, token_null};
    const char *fim_keys[6][2] = {
        {"tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"},
        {"tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"},
        {"tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"},
        {"tokenizer.ggml.fim_pad_token_id", nullptr},
        {"tokenizer.ggml.fim_rep_token_id", nullptr},
        {"tokenizer.ggml.fim_sep_token_id", nullptr}};
    for (int k = 0; k < 6; ++k) {
        read_special(f, fim_keys[k][0], n, fim[k]);
        if (fim_keys[k][1]) read_special(f, fim_keys[k][1], n, fim[k]);
    }
    // A role left unset by the metadata goes to the first text of its list that the vocab has.
    auto claim = [&](int32_t &role, const auto &texts) {
        if (role != token_null) return;
        for (std::string_view s : texts) {
            if (const int32_t id = t.find(s); id >= 0) {
                role = id;
                t.types[id] = token_type::control;
                return;
            }
        }
    };
    claim(t.eot, k_eot_texts);
    claim(t.eom, k_eom_texts);
    claim(fim[0], k_fim_pre_texts);
    claim(fim[1], k_fim_suf_texts);
    claim(fim[2], k_fim_mid_texts);
    claim(fim[3], k_fim_pad_texts);
    claim(fim[4], k_fim_rep_texts);
    claim(fim[5], k_fim_sep_texts);
    std::vector<int32_t> eog;
    for (int k = 3; k < 6; ++k) {
        if (fim[k] != token_null) eog.push_back(fim[k]);
    }
    for (int32_t id = 0; id < n; ++id) {
        if (t.find(t.text(id)) != id) continue;
        const std::string_view s = t.text(id);
        if (in_list(k_eog_texts, s)) {
            eog.push_back(id);
            t.types[id] = token_type::control;
        }
        // gpt-oss (harmony) markers are rendered text, not control tokens.
        if (s == "<|channel|>" || s == "<|message|>" || s == "<|start|>" || s == "<|constrain|>") {
            t.types[id] = token_type::user_defined;
        }
    }
    for (int32_t id : {t.eos, t.eot, t.eom}) {
        if (id != token_null) eog.push_back(id);
    }
    std::sort(eog.begin(), eog.end());
    eog.erase(std::unique(eog.begin(), eog.end()), eog.end());
    // o200k_harmony: with <|return|> and <|call|> present, <|end|> ends a message, not the generation.
    const int32_t ret = t.find("<|return|>"), call = t.find("<|call|>"), end = t.find("<|end|>");
    if (ret >= 0 && call >= 0 && end >= 0) {
        eog.erase(std::remove(eog.begin(), eog.end(), end), eog.end());
        t.types[end] = token_type::user_defined;
    }
    t.eog = std::move(eog);
}

void build_specials(impl_t &t, const gguf::file &f) {
    const int32_t n = t.n_vocab();
    std::vector<int32_t> specials;
    for (int32_t id = 0; id < n; ++id) {
        const token_type ty = t.types[id];
        if (ty == token_type::control || ty == token_type::user_defined || ty == token_type::unknown) {
            specials.push_back(id);
            t.trie.insert(t.text(id), id);
        }
    }
    // Phi-3 (by general.name, as llama.cpp does): special tokens swallow the whitespace that follows them,
    // except <unk>, <s> and <|endoftext|>; </s> does too.
    const std::string name = lower_ascii(f.get_string("general.name", ""));
    if (name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos) {
        for (int32_t id : specials) t.rstrip[id] = 1;
        if (int32_t id = t.find("</s>"); id >= 0) t.rstrip[id] = 1;
        for (const char *s : {"<unk>", "<s>", "<|endoftext|>"}) {
            if (int32_t id = t.find(s); id >= 0) t.rstrip[id] = 0;
        }
    }
}

std::string make_piece(const impl_t &t, int32_t id) {
    const std::string_view text = t.text(id);
    switch (t.types[id]) {
        case token_type::control:
        case token_type::unknown:
        case token_type::user_defined:
            return std::string(text);
        case token_type::normal:
            break;
        case token_type::byte:
            if (text.size() == 6 && text.substr(0, 3) == "<0x" && text[5] == '>') {
                auto hex = [](char c) {
                    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                          : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
                };
                const int hi = hex(text[3]), lo = hex(text[4]);
                if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
            }
            return {};  // a byte-typed token that does not spell <0xNN>: nothing to render
        default:
            return {};  // unused / undefined tokens render as nothing, as in llama.cpp
    }
    std::string out;
    if (t.model == tokenizer::model_kind::spm) {
        // U+2581 (E2 96 81) -> ' '
        for (size_t i = 0; i < text.size(); ++i) {
            if (i + 2 < text.size() && text.compare(i, 3, "\xE2\x96\x81") == 0) {
                out += ' ';
                i += 2;
            } else {
                out += text[i];
            }
        }
        return out;
    }
    // Byte-level BPE: each code point is one byte; code points outside the mapping pass through as UTF-8.
    for (size_t pos = 0; pos < text.size();) {
        const unicode::utf8_unit u = unicode::utf8_decode(text, pos);
        if (u.cpt < t.char_byte.size() && t.char_byte[u.cpt] >= 0) {
            out += static_cast<char>(t.char_byte[u.cpt]);
        } else {
            out.append(text.substr(pos, u.len));
        }
        pos += u.len;
    }
    return out;
}

}  // namespace

tokenizer::tokenizer(const gguf::file &f) : p_(std::make_unique<impl>()) {
    impl &t = *p_;
    const std::string_view model = f.get_string("tokenizer.ggml.model");
    t.pre_name = std::string(f.get_string("tokenizer.ggml.pre", "default"));
    load_vocab(t, f);
    const int32_t n = t.n_vocab();
    if (model == "gpt2") {
        t.model = model_kind::bpe;
        t.pre = tok_detail::pre_kind_from_name(t.pre_name);
        const std::string &p = t.pre_name;
        if (p == "llama3" || p == "llama-v3" || p == "llama-bpe" || p == "falcon3" || p == "pixtral") {
            t.ignore_merges = true;
            t.add_bos = true;
        }
        load_bpe_merges(t, f);
    } else if (model == "llama") {
        t.model = model_kind::spm;
        t.add_space_prefix = true;
        t.add_bos = true;
        t.bos = 1 < n ? 1 : token_null;
        t.eos = 2 < n ? 2 : token_null;
        t.unk = 0;
        load_spm_bytes(t);
        find_spm_space_joins(t);
    } else {
        throw fathom::error(f.path() + ": unsupported tokenizer.ggml.model '" + std::string(model) + "'");
    }
    t.add_space_prefix = f.get_bool("tokenizer.ggml.add_space_prefix", t.add_space_prefix);
    read_special(f, "tokenizer.ggml.bos_token_id", n, t.bos);
    read_special(f, "tokenizer.ggml.eos_token_id", n, t.eos);
    read_special(f, "tokenizer.ggml.eot_token_id", n, t.eot);
    read_special(f, "tokenizer.ggml.eom_token_id", n, t.eom);
    read_special(f, "tokenizer.ggml.unknown_token_id", n, t.unk);
    read_special(f, "tokenizer.ggml.padding_token_id", n, t.pad);
    t.add_bos = f.get_bool("tokenizer.ggml.add_bos_token", t.add_bos);
    t.add_eos = f.get_bool("tokenizer.ggml.add_eos_token", t.add_eos);
    if (t.add_bos && t.bos == token_null) throw fathom::error(f.path() + ": tokenizer adds BOS but has no BOS id");
    if (t.add_eos && t.eos == token_null) throw fathom::error(f.path() + ": tokenizer adds EOS but has no EOS id");

    detect_special_roles(t, f);
    build_specials(t, f);
    t.pieces.resize(n);
    for (int32_t id = 0; id < n; ++id) t.pieces[id] = make_piece(t, id);
    // "\n" is one word of one byte for every pre-tokenizer, so its token is the byte's token.
    t.nl = t.byte_token['\n'];
}

tokenizer::~tokenizer() = default;
tokenizer::tokenizer(tokenizer &&) noexcept = default;
tokenizer &tokenizer::operator=(tokenizer &&) noexcept = default;

std::vector<int32_t> tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
    return p_->encode(text, add_special, parse_special);
}

std::string tokenizer::token_to_piece(int32_t id, bool render_special) const {
    p_->check_id(id);
    if (!render_special && (p_->types[id] == token_type::control || p_->types[id] == token_type::unknown)) return {};
    return p_->pieces[id];
}

std::string tokenizer::decode(std::span<const int32_t> ids, decode_options opt) const {
    std::string out;
    bool strip = opt.strip_prefix_space && p_->add_space_prefix;
    for (int32_t id : ids) {
        p_->check_id(id);
        const token_type ty = p_->types[id];
        if (!opt.render_special && (ty == token_type::control || ty == token_type::unknown)) continue;
        std::string_view piece = p_->pieces[id];
        if (strip && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
        strip = false;  // only the first piece, as llama.cpp's detokenize
        out += piece;
    }
    return out;
}

int32_t tokenizer::n_vocab() const { return p_->n_vocab(); }
tokenizer::model_kind tokenizer::model() const { return p_->model; }
const std::string &tokenizer::pre_name() const { return p_->pre_name; }
std::string_view tokenizer::token_text(int32_t id) const {
    p_->check_id(id);
    return p_->text(id);
}
token_type tokenizer::type(int32_t id) const {
    p_->check_id(id);
    return p_->types[id];
}
float tokenizer::score(int32_t id) const {
    p_->check_id(id);
    return p_->scores[id];
}
int32_t tokenizer::find_token(std::string_view text) const { return p_->find(text); }
int32_t tokenizer::bos() const { return p_->bos; }
int32_t tokenizer::eos() const { return p_->eos; }
int32_t tokenizer::eot() const { return p_->eot; }
int32_t tokenizer::eom() const { return p_->eom; }
int32_t tokenizer::pad() const { return p_->pad; }
int32_t tokenizer::unk() const { return p_->unk; }
int32_t tokenizer::nl() const { return p_->nl; }
bool tokenizer::is_eog(int32_t id) const { return std::binary_search(p_->eog.begin(), p_->eog.end(), id); }
const std::vector<int32_t> &tokenizer::eog_ids() const { return p_->eog; }
bool tokenizer::is_control(int32_t id) const {
    return id >= 0 && id < p_->n_vocab() && p_->types[id] == token_type::control;
}
bool tokenizer::add_bos() const { return p_->add_bos; }
bool tokenizer::add_eos() const { return p_->add_eos; }
bool tokenizer::add_space_prefix() const { return p_->add_space_prefix; }

// ---- utf8_stream ------------------------------------------------------------------------------------------

namespace {

// Length of the longest suffix of s that is a valid but unfinished UTF-8 sequence (0 if none).
size_t unfinished_suffix(std::string_view s) {
    const size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n; ++back) {
        const auto lead = static_cast<uint8_t>(s[n - back]);
        if ((lead & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
        size_t need = 0;
        if (lead >= 0xC2 && lead <= 0xDF) need = 2;
        else if (lead >= 0xE0 && lead <= 0xEF) need = 3;
        else if (lead >= 0xF0 && lead <= 0xF4) need = 4;
        if (need <= back) return 0;  // ASCII, invalid lead, or a sequence that is already complete
        // The bytes after the lead must be a valid prefix (second-byte limits exclude overlongs/surrogates).
        if (back >= 2) {
            const auto b1 = static_cast<uint8_t>(s[n - back + 1]);
            const uint8_t lo = lead == 0xE0 ? 0xA0 : lead == 0xF0 ? 0x90 : 0x80;
            const uint8_t hi = lead == 0xED ? 0x9F : lead == 0xF4 ? 0x8F : 0xBF;
            if (b1 < lo || b1 > hi) return 0;
        }
        return back;
    }
    return 0;
}

}  // namespace

std::string utf8_stream::push(std::string_view bytes) {
    held_.append(bytes);
    const size_t keep = unfinished_suffix(held_);
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
}

std::string utf8_stream::flush() {
    std::string out;
    out.swap(held_);
    return out;
}

}  // namespace fathom
