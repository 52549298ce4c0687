// Streamed tool calls, server side: runs the tool format's call_decoder (tool_calls.h) over a turn's
// generated text, gives each call its id when it begins, applies parallel_tool_calls (false: nothing
// after the first complete call), and collects the turn — content and calls — exactly as the events
// went out, so the final response, the finish reason and the exact-replay record agree with what the
// client was sent. Used by both the streaming and the whole-response paths of generate.cpp.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/tool_calls.h"

namespace fathom::server {

class call_stream {
public:
    // known: the names that count as calls; id_prefix: "call_" (OpenAI) or "toolu_" (Anthropic);
    // parallel: false = stop after the first call whose arguments are complete.
    call_stream(const tool_format &fmt, const std::vector<std::string> &known, std::string id_prefix, bool parallel);
    // Feeds generated text; appends the events it made certain (call events carry their id).
    void push(std::string_view text, std::vector<call_event> &out);
    // End of the output: flushes what the decoder held.
    void finish(std::vector<call_event> &out);
    // parallel false and the first call is complete: the rest of the output is dropped, and the
    // generation can be stopped.
    bool stopped() const { return stopped_; }
    size_t n_calls() const { return out_.calls.size(); }
    size_t n_complete() const { return n_complete_; }
    bool call_open() const { return n_complete_ < out_.calls.size(); }  // a call began and has not ended
    // The turn as streamed: content and calls (ids, names, concatenated argument fragments).
    const parsed_output &output() const { return out_; }

private:
    void take(std::vector<call_event> &evs, std::vector<call_event> &out);
    std::unique_ptr<call_decoder> dec_;
    std::string id_prefix_;
    bool parallel_;
    bool stopped_ = false;
    size_t n_complete_ = 0;
    parsed_output out_;
};

}  // namespace fathom::server
