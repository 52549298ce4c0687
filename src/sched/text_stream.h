// text_stream: turns the byte pieces of generated tokens into text that is safe to send to a client.
// It holds back (a) the bytes of an incomplete UTF-8 sequence and (b) any tail that could still grow
// into one of the request's stop strings, so a stop string never leaks, not even partially, into
// streamed output. When a stop string appears, everything before it is released and the stream ends.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace fathom::sched {

class text_stream {
public:
    explicit text_stream(std::vector<std::string> stops = {});

    // Appends the bytes of one token; returns the newly releasable text (possibly empty).
    // After a stop string matched, further pushes return "" and are ignored.
    std::string push(std::string_view bytes);
    // End of generation: releases everything still held back (an incomplete UTF-8 tail included).
    std::string flush();

    bool stopped() const { return stopped_; }
    const std::string &matched_stop() const { return matched_; }

private:
    std::vector<std::string> stops_;
    std::string pending_;  // received, not yet released
    bool stopped_ = false;
    std::string matched_;
};

// Number of bytes at the end of `s` that form an incomplete (truncated) UTF-8 sequence, 0..3.
size_t utf8_incomplete_tail(std::string_view s);

// Longest k < stop.size() such that `text` ends with stop[0:k].
size_t partial_stop_suffix(std::string_view text, std::string_view stop);

}  // namespace fathom::sched
