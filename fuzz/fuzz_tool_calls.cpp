// libFuzzer target: the parsers of tool calls in model output (src/chat: DeepSeek V4's DSML stream
// parser, and both tool formats' whole-output parse and streaming call decoders, Hermes and DSML).
// Model output is not trusted to be well formed. Input: the first byte picks the options (thinking mode,
// malformed-as-text, the format); the rest is the generated text, cut into pieces at offsets drawn from
// the text itself. Oracles (the parsers' documented invariants): no crash, hang or sanitizer report; the
// DSML stream parser gives the same result for any split of the same text as dsml_parse does on the
// whole; the calls it reports were streamed as call deltas whose fragments concatenate to their arguments;
// a format's streaming decoder spells the same content and calls for any split of the text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "chat/dsml.h"
#include "chat/tool_format.h"
#include "core/error.h"

namespace fc = fathom::ds4chat;
namespace ft = fathom::toolcall;

namespace {

// Pieces of `text` at cut points derived from its bytes (deterministic for an input).
std::vector<std::string_view> split(std::string_view text, uint8_t seed) {
    std::vector<std::string_view> out;
    size_t i = 0, k = seed;
    while (i < text.size()) {
        k = k * 131 + static_cast<uint8_t>(text[i]) + 7;
        const size_t n = 1 + k % 9;
        out.push_back(text.substr(i, n));
        i += n;
    }
    return out;
}

bool same(const fc::dsml_result &a, const fc::dsml_result &b) {
    if (a.reasoning != b.reasoning || a.content != b.content || a.raw_dsml != b.raw_dsml || a.error != b.error ||
        a.error_text != b.error_text || a.reasoning_closed != b.reasoning_closed || a.saw_eos != b.saw_eos ||
        a.replay_exact != b.replay_exact || a.calls.size() != b.calls.size())
        return false;
    for (size_t i = 0; i < a.calls.size(); ++i)
        if (a.calls[i].name != b.calls[i].name || a.calls[i].arguments != b.calls[i].arguments) return false;
    return true;
}

void dsml(std::string_view text, uint8_t opts) {
    fc::dsml_parser_options o;
    o.thinking = opts & 1;
    o.malformed_as_text = opts & 2;
    const fc::dsml_result whole = fc::dsml_parse(text, o);
    fc::dsml_stream_parser p(o);
    std::vector<std::string> args, names;  // per call index: the concatenated fragments, the name
    std::vector<bool> ended;
    auto take = [&](const fc::dsml_delta &d) {
        for (const auto &c : d.call_deltas) {
            if (c.index >= args.size()) {
                args.resize(c.index + 1);
                names.resize(c.index + 1);
                ended.resize(c.index + 1, false);
            }
            if (c.begin) names[c.index] = c.name;
            args[c.index] += c.arguments;
            if (c.end) ended[c.index] = true;
        }
    };
    for (std::string_view piece : split(text, opts)) take(p.feed(piece));
    take(p.finish());
    if (!same(p.result(), whole)) __builtin_trap();  // depends on the split
    // Every call of a closed block was streamed: in order, among the deltas of invokes that ended, with the
    // same name and its arguments as the concatenated fragments (deltas of a block that later failed come
    // between them).
    size_t j = 0;
    for (size_t i = 0; i < args.size() && j < whole.calls.size(); ++i)
        if (ended[i] && names[i] == whole.calls[j].name && args[i] == whole.calls[j].arguments) ++j;
    if (j != whole.calls.size()) __builtin_trap();
}

// A format's streaming decoder over `pieces`: the content and the calls (name, arguments) its events spell.
struct streamed {
    std::string content;
    std::vector<std::string> names, args;
    bool operator==(const streamed &) const = default;
};
streamed decode(const ft::tool_format &f, const std::vector<std::string> &known,
                const std::vector<std::string_view> &pieces) {
    const auto dec = f.decoder(known);
    std::vector<ft::call_event> ev;
    for (std::string_view piece : pieces) dec->push(piece, ev);
    dec->finish(ev);
    streamed s;
    for (const auto &e : ev) {
        if (e.kind == ft::call_event::content) {
            s.content += e.text;
            continue;
        }
        if (e.index >= s.args.size()) {
            s.args.resize(e.index + 1);
            s.names.resize(e.index + 1);
        }
        if (e.begin) s.names[e.index] = e.name;
        s.args[e.index] += e.text;
    }
    return s;
}

void format(std::string_view name, std::string_view text, uint8_t opts) {
    const auto f = ft::make_tool_format(name);
    const std::vector<std::string> known = {"weather", "search", "f"};
    (void)f->parse(text, known);
    if (f->safe_content_prefix(text) > text.size()) __builtin_trap();
    // Whatever the split of the text into pushes, the events spell the same content and calls.
    if (!(decode(*f, known, split(text, opts)) == decode(*f, known, {text}))) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const uint8_t opts = data[0];
    const std::string_view text(reinterpret_cast<const char *>(data + 1), size - 1);
    try {
        dsml(text, opts);
        format(opts & 4 ? "dsml" : "hermes", text, opts);
    } catch (const fathom::error &) {
        __builtin_trap();  // the parsers report malformed output in their results, never by throwing
    }
    return 0;
}
