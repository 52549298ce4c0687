// libFuzzer target: the chat template engine (src/chat: Jinja lexer, parser and interpreter, the
// filters and builtins). A GGUF file carries its chat template, so the template is untrusted input, as
// are the messages a client sends. Input: the template source, a NUL byte, then the messages as JSON
// (absent or not a JSON array: a fixed conversation with a system prompt, a tool call and its result).
// Oracles: no crash, hang, leak or sanitizer report; every failure is a fathom::error (the contract of
// chat_template.h, which the server turns into one error message); a render that succeeds gives the same
// bytes a second time (rendering is a pure function of its inputs once `now` is fixed).
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/error.h"

namespace {

const nlohmann::ordered_json &default_messages() {
    static const nlohmann::ordered_json m = nlohmann::ordered_json::parse(R"([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? \u00e9\u4e16"},
        {"role": "assistant", "content": "", "reasoning_content": "call it",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Paris", "n": [1, 2.5, null]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"t\": 21}"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}])");
    return m;
}

const nlohmann::ordered_json &default_tools() {
    static const nlohmann::ordered_json t = nlohmann::ordered_json::parse(R"([
        {"type": "function", "function": {"name": "weather", "description": "Current weather",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
    return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string in(reinterpret_cast<const char *>(data), size);
    const size_t cut = in.find('\0');
    const std::string source = in.substr(0, cut), rest = cut == std::string::npos ? "" : in.substr(cut + 1);
    fathom::chat_template_inputs inputs;
    nlohmann::ordered_json msgs = nlohmann::ordered_json::parse(rest, nullptr, false);
    inputs.messages = msgs.is_array() ? msgs : default_messages();
    inputs.tools = size % 2 ? default_tools() : nlohmann::ordered_json();
    inputs.add_generation_prompt = size % 3 != 0;
    inputs.bos_token = "<s>";
    inputs.eos_token = "</s>";
    inputs.extra["enable_thinking"] = size % 5 == 0;
    std::tm now{};
    now.tm_year = 126;
    now.tm_mon = 11;
    now.tm_mday = 7;
    inputs.now = now;
    inputs.max_steps = 20000;  // a runaway template stops in well under a second under ASan (4,000,000: ~100 s)
    try {
        const fathom::chat_template t(source);
        const std::string a = t.render(inputs);
        if (t.render(inputs) != a) __builtin_trap();  // not deterministic
    } catch (const fathom::error &) {
        return 0;  // refused: the server reports the template's error
    } catch (...) {
        __builtin_trap();  // any other exception breaks chat_template.h's contract
    }
    return 0;
}
