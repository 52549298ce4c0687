// Tool calling, per model family: how tool definitions are described to the model, how earlier
// calls and results are written back into the conversation, and how calls are parsed out of the
// model's generated text (whole output, and a streaming-safe content prefix).
//
// The server renders tools itself (in the system message) so it works with any chat template. The
// engine names its model's format (model_info::tool_format, include/fathom/engine.h) and
// make_tool_format() builds it: "hermes" (Hermes / Qwen <tool_call>{json}</tool_call>, plus plain JSON
// function-call output; chat/tool_format.cpp), the default, or "dsml" (DeepSeek V4; chat/dsml.cpp).
// Another format is added by implementing tool_format and naming it in make_tool_format().
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fathom::toolcall {

struct tool_call {
    std::string id;         // "call_..." (OpenAI) / "toolu_..." (Anthropic), assigned by the server
    std::string name;
    std::string arguments;  // JSON object text
};

struct parsed_output {
    std::string content;             // generated text without call markup (untrimmed: a streamed
                                     // prefix stays a prefix of it)
    std::vector<tool_call> calls;
};

// tool_choice, normalised across both APIs.
struct tool_choice {
    enum kind_t { none, auto_, required, function } kind = auto_;
    std::string name;  // kind == function
};

// Streaming decode of calls (see call_decoder): one event of the generated text.
struct call_event {
    enum kind_t { content, call } kind = content;
    std::string text;   // content: visible text; call: a fragment of the call's arguments text
    size_t index = 0;   // call: 0-based number of the call in the turn
    bool begin = false; // call: the call's first event (name set; text may hold a first fragment)
    bool end = false;   // call: the arguments are complete (the last event of the call)
    std::string name;   // call, begin: the function name
    std::string id;     // call: the id the server gave the call (set by call_stream, not by decoders)
};

// Decodes a turn's calls while it is generated, for streamed responses: push() the generated text in
// order, then finish(). Content comes out as soon as it is certainly not call markup (markup never
// does); a call is announced (begin) as soon as its name is known and its arguments text follows in
// fragments whose concatenation is the call's arguments; a call ends (end) when its arguments are
// complete. Whatever the split of the text into pushes, the events concatenate to the same content
// and calls. A call that began and never ended (output cut off, markup broken) keeps the arguments
// it streamed.
class call_decoder {
public:
    virtual ~call_decoder() = default;
    virtual void push(std::string_view text, std::vector<call_event> &out) = 0;
    virtual void finish(std::vector<call_event> &out) = 0;
};

class tool_format {
public:
    virtual ~tool_format() = default;
    virtual std::string name() const = 0;
    // System-prompt text that describes `tools` (OpenAI form: [{type:"function", function:{name,
    // description, parameters}}]) and how to call them; obeys tool_choice (never called with none).
    virtual std::string system_prompt(const nlohmann::json &tools, const tool_choice &choice) const = 0;
    // An assistant turn's calls as the model would have written them.
    virtual std::string render_calls(const std::vector<tool_call> &calls) const = 0;
    // A tool result as text of the following user turn.
    virtual std::string render_result(std::string_view tool_name, std::string_view content) const = 0;
    // Parses a finished output. Calls whose name is not in `known_names` stay plain content.
    virtual parsed_output parse(std::string_view text, const std::vector<std::string> &known_names) const = 0;
    // Streaming: length of the prefix of `text` (generated so far) that is certainly content, i.e.
    // no call markup can begin inside it whatever is generated next.
    virtual size_t safe_content_prefix(std::string_view text) const = 0;
    // tool_choice required / a named function, enforced: the opening of a call (with the function's
    // name for a named one) written after the generation prompt, so the model continues inside a
    // call; the output (this text + the generated one) must then parse into calls. "" = this format
    // cannot force a call (such requests get 400): the default.
    virtual std::string forced_call_prefix(const tool_choice &) const { return {}; }
    // A streaming decoder of this format's calls; names outside `known_names` are not calls (as in
    // parse()).
    virtual std::unique_ptr<call_decoder> decoder(const std::vector<std::string> &known_names) const = 0;
    // What joins consecutive tool results inside one user turn (Hermes "\n"; DS4's official encoder
    // "\n\n", merge_tool_messages).
    virtual std::string_view result_separator() const { return "\n"; }
    // Whether consecutive results are put in the order of the calls of the latest assistant turn
    // (DS4's official encoder does; Hermes keeps the client's order).
    virtual bool results_in_call_order() const { return false; }
    // Structured output of a forced call (server/structured.h): after forced_call_prefix, the output is
    // `before` + the arguments (one JSON value) + `after` for the tool `name`; nullopt (the default):
    // this format's arguments are not one JSON value, and the call is not constrained.
    struct call_frame {
        std::string before, after;
    };
    virtual std::optional<call_frame> forced_call_frame(const tool_choice &, const std::string &name) const {
        return std::nullopt;
    }
    // A json_schema response format as the model's format describes it in the system message ("" = not
    // described: the default; DS4: its encoder's "## Response Format" section).
    virtual std::string response_format_prompt(const nlohmann::json &schema) const { return {}; }
};

// The format called `name` ("hermes" | "dsml"; model_info::tool_format); throws fathom::error for
// another name.
std::unique_ptr<tool_format> make_tool_format(std::string_view name);

// A fresh id: prefix + 24 random alphanumerics (the ids parse() gives calls, "call_...").
std::string random_id(std::string_view prefix);

}  // namespace fathom::toolcall
