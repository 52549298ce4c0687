// Chat-turn, tool-call and JSON-block detection for PFlash's structure rules (see structure.h).
#include "pflash/structure.h"

#include <algorithm>
#include <iterator>

namespace fathom::pflash {

namespace {

struct chat_format {
    std::string_view begin;      // opens a turn
    std::string_view role_end;   // ends the role name
    std::string_view end;        // closes the turn
};

constexpr chat_format k_formats[] = {
    {"<|im_start|>", "\n", "<|im_end|>"},
    {"<start_of_turn>", "\n", "<end_of_turn>"},
    {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"},
};

// Tool-call style blocks: never cut inside. DS4: DSML call blocks (canonical and the ASCII-bar
// spelling a replayed generation may hold) and tool results.
constexpr std::pair<std::string_view, std::string_view> k_blocks[] = {
    {"<tool_call>", "</tool_call>"},
    {"<tool_response>", "</tool_response>"},
    {"<function_call>", "</function_call>"},
    {"<function_calls>", "</function_calls>"},
    {"<tools>", "</tools>"},
    {"```json", "```"},
    {"<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C" "tool_calls>", "</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C" "tool_calls>"},
    {"<|DSML|tool_calls>", "</|DSML|tool_calls>"},
    {"<tool_result>", "</tool_result>"},
};

// DeepSeek V4 (docs/ds4-chat-format.md): BOS, the system text (no marker), then "<｜User｜>" turns
// and "<｜Assistant｜>" turns ("<think>"/"</think>" right after the marker, EOS at the end).
constexpr std::string_view k_ds4_bos = "<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
constexpr std::string_view k_ds4_eos = "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
constexpr std::pair<std::string_view, std::string_view> k_ds4_markers[] = {
    {"<\xEF\xBD\x9C" "User\xEF\xBD\x9C>", "user"},
    {"<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>", "assistant"},
    {"<\xEF\xBD\x9C" "latest_reminder\xEF\xBD\x9C>", "latest_reminder"},
};

constexpr uint64_t k_max_role_bytes = 64;
constexpr uint64_t k_max_json_bytes = uint64_t{1} << 20;

bool is_role_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

void find_turns(std::string_view text, const chat_format &f, std::vector<chat_turn> &turns) {
    for (size_t b = text.find(f.begin); b != std::string_view::npos; b = text.find(f.begin, b + 1)) {
        const size_t r0 = b + f.begin.size();
        const size_t r1 = text.find(f.role_end, r0);
        if (r1 == std::string_view::npos || r1 - r0 > k_max_role_bytes) continue;
        const std::string_view role = text.substr(r0, r1 - r0);
        if (!std::all_of(role.begin(), role.end(), is_role_char)) continue;
        chat_turn t;
        t.role = std::string(role);
        uint64_t h_end = r1 + f.role_end.size();
        while (h_end < text.size() && text[h_end] == '\n') ++h_end;  // Llama 3 puts "\n\n" after the header
        t.header = {b, h_end};
        size_t c_end = text.find(f.end, h_end);
        const size_t next = text.find(f.begin, h_end);
        if (c_end == std::string_view::npos || (next != std::string_view::npos && next < c_end)) {
            c_end = next == std::string_view::npos ? text.size() : next;  // unterminated (generation prompt)
            t.footer = {c_end, c_end};
        } else {
            uint64_t f_end = c_end + f.end.size();
            if (f_end < text.size() && text[f_end] == '\n') ++f_end;
            t.footer = {c_end, f_end};
        }
        t.content = {h_end, c_end};
        turns.push_back(std::move(t));
    }
}

// DS4 turns: a "system" turn for the text before the first marker (header = BOS when present),
// then one turn per marker; an assistant turn's header takes the "<think>" / "</think>" after the
// marker, its footer the EOS; a turn without EOS runs to the next marker (the generation prompt:
// to the end).
void find_ds4_turns(std::string_view text, std::vector<chat_turn> &turns) {
    std::vector<std::pair<size_t, size_t>> at;  // (position, index in k_ds4_markers)
    for (size_t k = 0; k < std::size(k_ds4_markers); ++k)
        for (size_t b = text.find(k_ds4_markers[k].first); b != std::string_view::npos;
             b = text.find(k_ds4_markers[k].first, b + 1))
            at.emplace_back(b, k);
    if (at.empty()) return;
    std::sort(at.begin(), at.end());
    const uint64_t h0 = text.substr(0, k_ds4_bos.size()) == k_ds4_bos ? k_ds4_bos.size() : 0;
    if (h0 > 0 || at[0].first > 0)
        turns.push_back({"system", {0, h0}, {h0, at[0].first}, {at[0].first, at[0].first}});
    for (size_t i = 0; i < at.size(); ++i) {
        const auto &[b, k] = at[i];
        const uint64_t next = i + 1 < at.size() ? at[i + 1].first : text.size();
        chat_turn t;
        t.role = std::string(k_ds4_markers[k].second);
        uint64_t h_end = b + k_ds4_markers[k].first.size();
        uint64_t c_end = next;
        t.footer = {next, next};
        if (t.role == "assistant") {
            for (std::string_view th : {std::string_view("<think>"), std::string_view("</think>")})
                if (text.substr(h_end, th.size()) == th) {
                    h_end += th.size();
                    break;
                }
            const size_t e = text.substr(0, next).find(k_ds4_eos, h_end);
            if (e != std::string_view::npos) {
                c_end = e;
                t.footer = {e, e + k_ds4_eos.size()};
            }
        }
        t.header = {b, h_end};
        t.content = {h_end, c_end};
        turns.push_back(std::move(t));
    }
}

}  // namespace

uint64_t json_block_end(std::string_view text, uint64_t b, uint64_t max_bytes) {
    if (b >= text.size() || (text[b] != '{' && text[b] != '[')) return 0;
    std::vector<char> stack;
    bool in_str = false, esc = false;
    const uint64_t lim = std::min<uint64_t>(text.size(), b + max_bytes);
    for (uint64_t i = b; i < lim; ++i) {
        const char c = text[i];
        if (in_str) {
            if (esc) {
                esc = false;
            } else if (c == '\\') {
                esc = true;
            } else if (c == '"') {
                in_str = false;
            }
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            stack.push_back(c == '{' ? '}' : ']');
        } else if (c == '}' || c == ']') {
            if (stack.empty() || stack.back() != c) return 0;
            stack.pop_back();
            if (stack.empty()) return i + 1;
        }
    }
    return 0;
}

prompt_structure find_structure(std::string_view text, bool verbatim_system, bool verbatim_last_user) {
    prompt_structure s;
    for (const chat_format &f : k_formats) find_turns(text, f, s.turns);
    find_ds4_turns(text, s.turns);
    std::sort(s.turns.begin(), s.turns.end(),
              [](const chat_turn &a, const chat_turn &b) { return a.header.begin < b.header.begin; });

    std::vector<byte_span> forced;
    int64_t last_user = -1;
    for (size_t i = 0; i < s.turns.size(); ++i) {
        const chat_turn &t = s.turns[i];
        forced.push_back(t.header);
        forced.push_back(t.footer);
        if (verbatim_system && t.role == "system") forced.push_back(t.content);
        if (t.role == "user") last_user = static_cast<int64_t>(i);
    }
    if (verbatim_last_user && last_user >= 0) forced.push_back(s.turns[static_cast<size_t>(last_user)].content);
    s.forced = merge_ranges(std::move(forced));

    std::vector<byte_span> atomic;
    for (const auto &[open, close] : k_blocks) {
        for (size_t b = text.find(open); b != std::string_view::npos;) {
            const size_t e = text.find(close, b + open.size());
            if (e == std::string_view::npos) break;  // unterminated: not a block
            atomic.push_back({b, e + close.size()});
            b = text.find(open, e + close.size());
        }
    }
    // JSON opening a line (after optional indentation): '{' or '[' that balances.
    for (uint64_t i = 0; i < text.size();) {
        uint64_t j = i;
        while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
        if (j < text.size() && (text[j] == '{' || text[j] == '[')) {
            if (const uint64_t e = json_block_end(text, j, k_max_json_bytes); e > j) {
                atomic.push_back({j, e});
                i = e;
                continue;
            }
        }
        const size_t nl = text.find('\n', j);
        if (nl == std::string_view::npos) break;
        i = nl + 1;
    }
    s.atomic = merge_ranges(std::move(atomic));
    return s;
}

}  // namespace fathom::pflash
