// text_stream: stop-string and UTF-8 hold-back for streamed generation (see text_stream.h).
#include "sched/text_stream.h"

#include <algorithm>

namespace fathom::sched {

text_stream::text_stream(std::vector<std::string> stops) {
    for (auto &s : stops)
        if (!s.empty()) stops_.push_back(std::move(s));  // an empty stop string would match everything
}

size_t utf8_incomplete_tail(std::string_view s) {
    // Walk back over at most 3 continuation bytes to the lead byte of the last sequence.
    const size_t n = s.size();
    for (size_t back = 1; back <= 4 && back <= n; ++back) {
        const unsigned char c = static_cast<unsigned char>(s[n - back]);
        if ((c & 0xC0) == 0x80) continue;  // continuation byte
        size_t need = 1;
        if ((c & 0xE0) == 0xC0) need = 2;
        else if ((c & 0xF0) == 0xE0) need = 3;
        else if ((c & 0xF8) == 0xF0) need = 4;
        return need > back ? back : 0;  // lead byte whose sequence is not complete yet
    }
    return 0;  // only continuation bytes (invalid): nothing to wait for
}

size_t partial_stop_suffix(std::string_view text, std::string_view stop) {
    const size_t max_k = std::min(text.size(), stop.size() - 1);
    for (size_t k = max_k; k > 0; --k)
        if (text.substr(text.size() - k) == stop.substr(0, k)) return k;
    return 0;
}

std::string text_stream::push(std::string_view bytes) {
    if (stopped_) return {};
    pending_.append(bytes);
    // Earliest complete stop string; ties at the same position go to the longer string.
    size_t best = std::string::npos;
    for (const auto &s : stops_) {
        const size_t p = pending_.find(s);
        if (p != std::string::npos && (p < best || (p == best && s.size() > matched_.size()))) {
            best = p;
            matched_ = s;
        }
    }
    if (best != std::string::npos) {
        stopped_ = true;
        std::string out = pending_.substr(0, best);
        pending_.clear();
        return out;
    }
    size_t hold = 0;
    for (const auto &s : stops_) hold = std::max(hold, partial_stop_suffix(pending_, s));
    size_t cut = pending_.size() - hold;
    cut -= utf8_incomplete_tail(std::string_view(pending_).substr(0, cut));
    std::string out = pending_.substr(0, cut);
    pending_.erase(0, cut);
    return out;
}

std::string text_stream::flush() {
    if (stopped_) return {};
    std::string out;
    out.swap(pending_);
    return out;
}

}  // namespace fathom::sched
