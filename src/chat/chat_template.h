// Chat template rendering: turns a GGUF tokenizer.chat_template (Jinja) plus an OpenAI-style
// message list into the prompt string, byte-identical to what HF transformers'
// apply_chat_template renders with Python jinja2 (ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, its own tojson / raise_exception / strftime_now).
//
// Usage:
//   fathom::chat_template tmpl(gguf_chat_template_string);       // parses once; throws fathom::error
//   fathom::chat_template_inputs in;
//   in.messages = nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi"}])");
//   in.add_generation_prompt = true;
//   in.bos_token = "<s>";
//   std::string prompt = tmpl.render(in);                          // thread-safe, const
//
// Use nlohmann::ordered_json so object keys keep their order: Python dicts do, and templates print
// tool schemas and arguments with tojson in that order. See docs/chat-templates.md.
#pragma once
#include <ctime>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/jinja_value.h"  // jinja::template_exception
#include "core/error.h"
#include "fathom/chat.h"  // chat_thinking

namespace fathom {

namespace jinja {
struct template_ast;
}

struct chat_template_inputs {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // [{role, content, tool_calls?, ...}]
    nlohmann::ordered_json tools;                                       // array of tool schemas, or null (template sees None)
    bool add_generation_prompt = false;
    std::string bos_token;
    std::string eos_token;
    // Extra template variables (e.g. {"enable_thinking": false}); override the ones above on clash.
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    // What strftime_now() formats; nullopt = the current local time. Set it for reproducible prompts.
    std::optional<std::tm> now;
    // Statements and loop iterations the render may run before it stops with an error (the sandbox's limit,
    // docs/chat-templates.md); the fuzz target lowers it so that a runaway template ends fast under ASan.
    int64_t max_steps = jinja::kMaxRenderSteps;
};


// Errors: a template's raise_exception("msg") throws jinja::template_exception (a fathom::error)
// whose what() is exactly "msg"; every other failure (syntax, unknown filter, type error, undefined
// access) throws fathom::error "chat template line N: ...".
class chat_template {
public:
    explicit chat_template(const std::string &source);
    ~chat_template();
    chat_template(chat_template &&) noexcept;
    chat_template &operator=(chat_template &&) noexcept;

    std::string render(const chat_template_inputs &in) const;
    const std::string &source() const { return source_; }

private:
    std::string source_;
    std::unique_ptr<jinja::template_ast> ast_;
};

// The engine's thinking mode as template variables: off/on/max set enable_thinking (Qwen3 and the
// HF convention) and thinking (DeepSeek V3.1's templates) to false/true in in.extra;
// template_default sets nothing.
void set_thinking_vars(chat_template_inputs &in, chat_thinking t);

// One-shot convenience: parse + render.
std::string chat_template_render(const std::string &source, const chat_template_inputs &in);

}  // namespace fathom
