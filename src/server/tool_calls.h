// Tool calling, per model family: how tool definitions are described to the model, how earlier
// calls and results are written back into the conversation, and how calls are parsed out of the
// model's generated text (whole output, and a streaming-safe content prefix).
//
// The server renders tools itself (in the system message) so it works with any chat template.
// Formats are pluggable: make_tool_format() picks one by model architecture; "hermes" (Hermes /
// Qwen <tool_call>{json}</tool_call>, plus plain JSON function-call output) is the default.
// Another format (e.g. DeepSeek's DSML) is added by implementing tool_format and registering it
// in make_tool_format().
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fathom::server {

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
};

// "hermes" for every architecture at present.
std::unique_ptr<tool_format> make_tool_format(std::string_view arch);

// A fresh id: prefix + 24 random alphanumerics.
std::string random_id(std::string_view prefix);

}  // namespace fathom::server
