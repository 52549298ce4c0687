// call_stream: ids, parallel_tool_calls and the collected turn around a format's call_decoder.
#include "server/tool_stream.h"

namespace fathom::server {

call_stream::call_stream(const tool_format &fmt, const std::vector<std::string> &known, std::string id_prefix,
                         bool parallel)
    : dec_(fmt.decoder(known)), id_prefix_(std::move(id_prefix)), parallel_(parallel) {}

void call_stream::push(std::string_view text, std::vector<call_event> &out) {
    if (stopped_) return;
    std::vector<call_event> evs;
    dec_->push(text, evs);
    take(evs, out);
}

void call_stream::finish(std::vector<call_event> &out) {
    if (stopped_) return;
    std::vector<call_event> evs;
    dec_->finish(evs);
    take(evs, out);
}

// Decoder events -> the client's events: ids given at a call's start, the turn collected, and with
// parallel_tool_calls false everything after the first complete call dropped.
void call_stream::take(std::vector<call_event> &evs, std::vector<call_event> &out) {
    for (call_event &e : evs) {
        if (stopped_) return;
        if (e.kind == call_event::content) {
            if (e.text.empty()) continue;
            out_.content += e.text;
        } else {
            if (e.begin) out_.calls.push_back({random_id(id_prefix_), e.name, {}});
            if (e.index >= out_.calls.size()) continue;  // a decoder never sends these; kept safe anyway
            tool_call &c = out_.calls[e.index];
            c.arguments += e.text;
            e.id = c.id;
            if (!e.begin && e.text.empty() && !e.end) continue;
            if (e.end) {
                ++n_complete_;
                if (!parallel_) stopped_ = true;
            }
        }
        out.push_back(std::move(e));
    }
}

}  // namespace fathom::server
