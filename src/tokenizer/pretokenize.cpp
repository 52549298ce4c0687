// Hand-written matchers for the BPE pre-tokenizer regexes (see pretokenize.h for the split semantics).
// Each matcher answers "does the regex match at position pos of the piece [.., end), and where does the match
// end?" following the regex's alternative order and greedy backtracking; the driver finds matches leftmost
// first and keeps the unmatched gaps as pieces. The exact regexes are quoted above each matcher.
#include "tokenizer/pretokenize.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace fathom::tok_detail {

using namespace fathom::unicode;

namespace {

// Returns the end of the match starting at pos, or pos when there is none (no regex here matches empty).
using matcher = uint32_t (*)(const pre_unit *u, uint32_t pos, uint32_t end);

inline bool has(const pre_unit &x, uint8_t f) { return (x.flags & f) != 0; }
inline bool is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }
inline bool is_ascii_alpha(uint32_t c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
inline uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

template <typename Pred>
inline uint32_t run_while(const pre_unit *u, uint32_t p, uint32_t end, Pred pred) {
    while (p < end && pred(u[p])) ++p;
    return p;
}
inline uint32_t run_flags(const pre_unit *u, uint32_t p, uint32_t end, uint8_t f) {
    return run_while(u, p, end, [f](const pre_unit &x) { return has(x, f); });
}

// Contractions 's|'t|'re|'ve|'m|'ll|'d (case-insensitive for the llama3/qwen2 family).
inline uint32_t match_contraction(const pre_unit *u, uint32_t pos, uint32_t end, bool fold) {
    if (u[pos].cpt != '\'' || pos + 1 >= end) return pos;
    const uint32_t c1 = fold ? ascii_lower(u[pos + 1].cpt) : u[pos + 1].cpt;
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return pos + 2;
    if (pos + 2 < end) {
        const uint32_t c2 = fold ? ascii_lower(u[pos + 2].cpt) : u[pos + 2].cpt;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return pos + 3;
    }
    return pos;
}

// The whitespace tail shared by the llama3 family: `\s*[\r\n]+|\s+(?!\S)|\s+` (with_newline_alt) or the GPT-2
// tail `\s+(?!\S)|\s+`. Precondition: u[pos] is whitespace.
inline uint32_t match_ws_tail(const pre_unit *u, uint32_t pos, uint32_t end, bool with_newline_alt) {
    const uint32_t q = run_flags(u, pos, end, flag_ws);
    if (with_newline_alt) {
        // \s*[\r\n]+ : \s* backtracks to the last CR/LF of the run; [\r\n]+ then takes just that one.
        for (uint32_t k = q; k > pos; --k) {
            if (is_crlf(u[k - 1].cpt)) return k;
        }
    }
    if (q == end) return q;          // \s+(?!\S) at the piece end
    if (q - pos > 1) return q - 1;   // \s+(?!\S): leave the last space for the next word
    return q;                        // \s+
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
uint32_t match_gpt2(const pre_unit *u, uint32_t pos, uint32_t end) {
    if (uint32_t m = match_contraction(u, pos, end, false); m != pos) return m;
    const uint32_t p = pos + (u[pos].cpt == ' ' ? 1 : 0);
    if (p < end) {
        if (has(u[p], flag_l)) return run_flags(u, p, end, flag_l);
        if (has(u[p], flag_n)) return run_flags(u, p, end, flag_n);
        if (!has(u[p], flag_ws | flag_l | flag_n)) {
            return run_while(u, p, end, [](const pre_unit &x) { return !has(x, flag_ws | flag_l | flag_n); });
        }
    }
    if (has(u[pos], flag_ws)) return match_ws_tail(u, pos, end, false);
    return pos;
}

// llama3 (max_digits 3) and qwen2 (max_digits 1):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
template <uint32_t max_digits>
uint32_t match_llama3(const pre_unit *u, uint32_t pos, uint32_t end) {
    if (uint32_t m = match_contraction(u, pos, end, true); m != pos) return m;
    const pre_unit &c = u[pos];
    if (!has(c, flag_l | flag_n) && !is_crlf(c.cpt) && pos + 1 < end && has(u[pos + 1], flag_l)) {
        return run_flags(u, pos + 1, end, flag_l);
    }
    if (has(c, flag_l)) return run_flags(u, pos, end, flag_l);
    if (has(c, flag_n)) {
        uint32_t q = pos;
        while (q < end && q - pos < max_digits && has(u[q], flag_n)) ++q;
        return q;
    }
    const uint32_t p = pos + (c.cpt == ' ' ? 1 : 0);
    if (p < end && !has(u[p], flag_ws | flag_l | flag_n)) {
        uint32_t q = run_while(u, p, end, [](const pre_unit &x) { return !has(x, flag_ws | flag_l | flag_n); });
        return run_while(u, q, end, [](const pre_unit &x) { return is_crlf(x.cpt); });
    }
    if (has(c, flag_ws)) return match_ws_tail(u, pos, end, true);
    return pos;
}

// \p{N}  and  \p{N}{1,3}  and  \p{N}+
template <uint32_t max_n>
uint32_t match_digits(const pre_unit *u, uint32_t pos, uint32_t end) {
    uint32_t q = pos;
    while (q < end && q - pos < max_n && has(u[q], flag_n)) ++q;
    return q;
}

// deepseek-v3 stage 2: [一-龥぀-ゟ゠-ヿ]+  (U+4E00..U+9FA5, U+3040..U+309F, U+30A0..U+30FF)
uint32_t match_ds3_cjk(const pre_unit *u, uint32_t pos, uint32_t end) {
    return run_while(u, pos, end, [](const pre_unit &x) {
        return (x.cpt >= 0x4E00 && x.cpt <= 0x9FA5) || (x.cpt >= 0x3040 && x.cpt <= 0x30FF);
    });
}

inline bool is_ascii_punct(uint32_t c) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
}

// deepseek-v3 stage 3:
// [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*
// |\s*[\r\n]+|\s+(?!\S)|\s+
uint32_t match_ds3_main(const pre_unit *u, uint32_t pos, uint32_t end) {
    const pre_unit &c = u[pos];
    if (is_ascii_punct(c.cpt) && pos + 1 < end && is_ascii_alpha(u[pos + 1].cpt)) {
        return run_while(u, pos + 1, end, [](const pre_unit &x) { return is_ascii_alpha(x.cpt); });
    }
    if (!has(c, flag_l | flag_p | flag_s) && !is_crlf(c.cpt) && pos + 1 < end && has(u[pos + 1], flag_l | flag_m)) {
        return run_flags(u, pos + 1, end, flag_l | flag_m);
    }
    if (has(c, flag_l | flag_m)) return run_flags(u, pos, end, flag_l | flag_m);
    const uint32_t p = pos + (c.cpt == ' ' ? 1 : 0);
    if (p < end && has(u[p], flag_p | flag_s)) {
        uint32_t q = run_flags(u, p, end, flag_p | flag_s);
        return run_while(u, q, end, [](const pre_unit &x) { return is_crlf(x.cpt); });
    }
    if (has(c, flag_ws)) return match_ws_tail(u, pos, end, true);
    return pos;
}

// deepseek-llm stage 1: [\r\n]
uint32_t match_crlf(const pre_unit *u, uint32_t pos, uint32_t end) {
    return is_crlf(u[pos].cpt) ? pos + 1 : pos;
}

struct cpt_span {
    uint32_t lo, hi;
};

// The explicit cased-letter class of deepseek-llm's stage 2 (A-Za-zµÀ-ÖØ-öø-ƺ ... 𞤀-𞥃), sorted and merged.
constexpr cpt_span k_dsllm_letters[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA},
    {0x1BC, 0x1BF}, {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377}, {0x37B, 0x37D},
    {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C}, {0x38E, 0x3A1}, {0x3A3, 0x3F5},
    {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15},
    {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4},
    {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC},
    {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124},
    {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F},
    {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE},
    {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787}, {0xA78B, 0xA78E},
    {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F},
    {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF},
    {0x1E900, 0x1E943},
};

template <size_t N>
bool in_spans(const cpt_span (&spans)[N], uint32_t c) {
    const cpt_span *it = std::upper_bound(spans, spans + N, c, [](uint32_t v, const cpt_span &s) { return v < s.lo; });
    return it != spans && c <= (it - 1)->hi;
}

inline bool is_dsllm_letter(uint32_t c) { return in_spans(k_dsllm_letters, c); }

// [!-/:-~！-／：-～‘-‟　-。]
inline bool is_dsllm_punct(uint32_t c) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x7E) || (c >= 0xFF01 && c <= 0xFF0F) ||
           (c >= 0xFF1A && c <= 0xFF5E) || (c >= 0x2018 && c <= 0x201F) || (c >= 0x3000 && c <= 0x3002);
}

// \s?X+ for a code point class X.
template <bool (*in_class)(uint32_t)>
uint32_t match_opt_ws_run(const pre_unit *u, uint32_t pos, uint32_t end) {
    auto pred = [](const pre_unit &x) { return in_class(x.cpt); };
    if (has(u[pos], flag_ws) && pos + 1 < end && in_class(u[pos + 1].cpt)) return run_while(u, pos + 1, end, pred);
    return run_while(u, pos, end, pred);
}

// deepseek-llm stage 5: [一-龥ࠀ-一가-퟿]+  (U+4E00..U+9FA5, U+0800..U+4E00, U+AC00..U+D7FF)
uint32_t match_dsllm_cjk(const pre_unit *u, uint32_t pos, uint32_t end) {
    return run_while(u, pos, end, [](const pre_unit &x) {
        return (x.cpt >= 0x0800 && x.cpt <= 0x9FA5) || (x.cpt >= 0xAC00 && x.cpt <= 0xD7FF);
    });
}

// default stage 1: [\p{P}\$\+<=>\^~\|]+
uint32_t match_default_punct(const pre_unit *u, uint32_t pos, uint32_t end) {
    return run_while(u, pos, end, [](const pre_unit &x) {
        const uint32_t c = x.cpt;
        return has(x, flag_p) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
               c == '~' || c == '|';
    });
}

// default stage 4: [0-9][0-9][0-9]
uint32_t match_three_ascii_digits(const pre_unit *u, uint32_t pos, uint32_t end) {
    auto d = [&](uint32_t i) { return i < end && u[i].cpt >= '0' && u[i].cpt <= '9'; };
    return (d(pos) && d(pos + 1) && d(pos + 2)) ? pos + 3 : pos;
}

// One Isolated split stage: matches and the gaps between them become pieces.
void split_stage(const pre_unit *u, const std::vector<pre_range> &in, std::vector<pre_range> &out, matcher m) {
    out.clear();
    for (const pre_range &r : in) {
        uint32_t gap = r.begin;
        uint32_t pos = r.begin;
        while (pos < r.end) {
            const uint32_t e = m(u, pos, r.end);
            if (e == pos) {
                ++pos;
                continue;
            }
            if (gap < pos) out.push_back({gap, pos});
            out.push_back({pos, e});
            pos = gap = e;
        }
        if (gap < r.end) out.push_back({gap, r.end});
    }
}

// deepseek-llm stage 4, \s+$: the only possible match is the maximal whitespace run that ends the piece
// (found directly, avoiding a quadratic scan over long runs that do not reach the end).
void split_trailing_ws(const pre_unit *u, const std::vector<pre_range> &in, std::vector<pre_range> &out) {
    out.clear();
    for (const pre_range &r : in) {
        uint32_t p = r.end;
        while (p > r.begin && has(u[p - 1], flag_ws)) --p;
        if (p > r.begin) out.push_back({r.begin, p});
        if (p < r.end) out.push_back({p, r.end});
    }
}

}  // namespace

pre_kind pre_kind_from_name(std::string_view name) {
    if (name == "gpt-2" || name == "phi-2" || name == "jina-es" || name == "jina-de" || name == "gigachat" ||
        name == "jina-v2-es" || name == "jina-v2-de" || name == "mpt" || name == "olmo" || name == "jais" ||
        name == "exaone4" || name == "mellum" || name == "a.x-4.0" || name == "trillion" ||
        name == "granite-docling" || name == "roberta-bpe" || name == "jina-v1-en" || name == "jina-v2-code") {
        return pre_kind::gpt2;
    }
    if (name == "llama3" || name == "llama-v3" || name == "llama-bpe" || name == "falcon3" || name == "dbrx" ||
        name == "smaug-bpe" || name == "pixtral" || name == "chatglm-bpe" || name == "glm4") {
        return pre_kind::llama3;
    }
    if (name == "qwen2" || name == "deepseek-r1-qwen" || name == "stablelm2" || name == "megrez" ||
        name == "hunyuan" || name == "grok-2") {
        return pre_kind::qwen2;
    }
    if (name == "smollm" || name == "starcoder" || name == "refact" || name == "command-r" || name == "codeshell" ||
        name == "exaone" || name == "minerva-7b") {
        return pre_kind::smollm;
    }
    if (name == "deepseek-llm") return pre_kind::deepseek_llm;
    if (name == "deepseek-v3" || name == "joyai-llm" || name == "hunyuan-dense") return pre_kind::deepseek_v3;
    if (name == "default") return pre_kind::default_bpe;
    throw fathom::error("tokenizer: unknown BPE pre-tokenizer '" + std::string(name) + "' (tokenizer.ggml.pre)");
}

void pretokenize(pre_kind kind, std::string_view text, pre_scratch &s,
                 std::vector<std::pair<uint32_t, uint32_t>> &words) {
    words.clear();
    if (text.empty()) return;
    // Decode into units (+ sentinel with the end offset).
    s.units.clear();
    const uint8_t invalid_flags = cpt_flags(0xFFFD);
    for (size_t pos = 0; pos < text.size();) {
        const utf8_unit d = utf8_decode(text, pos);
        const uint8_t f = d.cpt == k_invalid_cpt ? invalid_flags : cpt_flags(d.cpt);
        s.units.push_back({d.cpt, static_cast<uint32_t>(pos), f});
        pos += d.len;
    }
    const uint32_t n = static_cast<uint32_t>(s.units.size());
    s.units.push_back({0, static_cast<uint32_t>(text.size()), 0});
    const pre_unit *u = s.units.data();

    s.a.assign(1, pre_range{0, n});
    auto stage = [&](matcher m) {
        split_stage(u, s.a, s.b, m);
        s.a.swap(s.b);
    };
    switch (kind) {
        case pre_kind::gpt2: stage(match_gpt2); break;
        case pre_kind::llama3: stage(match_llama3<3>); break;
        case pre_kind::qwen2: stage(match_llama3<1>); break;
        case pre_kind::smollm:
            stage(match_digits<1>);
            stage(match_gpt2);
            break;
        case pre_kind::deepseek_v3:
            stage(match_digits<3>);
            stage(match_ds3_cjk);
            stage(match_ds3_main);
            break;
        case pre_kind::deepseek_llm:
            stage(match_crlf);
            stage(match_opt_ws_run<is_dsllm_letter>);
            stage(match_opt_ws_run<is_dsllm_punct>);
            split_trailing_ws(u, s.a, s.b);
            s.a.swap(s.b);
            stage(match_dsllm_cjk);
            stage(match_digits<UINT32_MAX>);
            break;
        case pre_kind::default_bpe:
            stage(match_default_punct);
            stage(match_gpt2);
            stage(match_digits<UINT32_MAX>);
            stage(match_three_ascii_digits);
            break;
    }
    words.reserve(s.a.size());
    for (const pre_range &r : s.a) words.emplace_back(u[r.begin].off, u[r.end].off);
}

}  // namespace fathom::tok_detail
