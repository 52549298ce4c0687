// Reasoning / content split of generated text (see reasoning.h).
#include "chat/reasoning.h"

#include <algorithm>

namespace fathom::chat {

namespace {

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// Longest k < marker.size() such that text ends with marker[0, k).
size_t partial_suffix(std::string_view text, std::string_view marker) {
    for (size_t k = std::min(text.size(), marker.size() - 1); k > 0; --k)
        if (text.substr(text.size() - k) == marker.substr(0, k)) return k;
    return 0;
}

}  // namespace

reasoning_splitter::reasoning_splitter(bool in_reasoning)
    : state_(in_reasoning ? state::reasoning : state::opening) {}

reasoning_delta reasoning_splitter::push(std::string_view piece) {
    reasoning_delta out;
    held_.append(piece);
    drain(out, false);
    return out;
}

reasoning_delta reasoning_splitter::flush() {
    reasoning_delta out;
    drain(out, true);
    return out;
}

void reasoning_splitter::drain(reasoning_delta &out, bool at_end) {
    if (state_ == state::opening) {
        size_t ws = 0;
        while (ws < held_.size() && is_space(held_[ws])) ++ws;
        const std::string_view rest = std::string_view(held_).substr(ws);
        if (rest.size() >= k_think_open.size() && rest.substr(0, k_think_open.size()) == k_think_open) {
            held_.erase(0, ws + k_think_open.size());
            state_ = state::reasoning;
        } else if (!at_end && k_think_open.substr(0, rest.size()) == rest) {
            return;  // whitespace and/or a prefix of "<think>": wait
        } else {
            state_ = state::content;
        }
    }
    if (state_ == state::reasoning) {
        const size_t e = held_.find(k_think_close);
        if (e != std::string::npos) {
            out.reasoning += held_.substr(0, e);
            held_.erase(0, e + k_think_close.size());
            state_ = state::content;
            closed_ = true;
        } else {
            const size_t keep = at_end ? 0 : partial_suffix(held_, k_think_close);
            out.reasoning += held_.substr(0, held_.size() - keep);
            held_.erase(0, held_.size() - keep);
            return;
        }
    }
    out.content += held_;  // state::content
    held_.clear();
}

reasoning_delta split_reasoning(std::string_view text, bool in_reasoning) {
    reasoning_splitter sp(in_reasoning);
    reasoning_delta a = sp.push(text), b = sp.flush();
    return {a.reasoning + b.reasoning, a.content + b.content};
}

}  // namespace fathom::chat
