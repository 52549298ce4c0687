// Chat messages and the thinking mode of a chat rendering (engine::apply_chat_template). Its own header
// because the chat layer below the engine (src/chat: templates, DS4's format) renders them too.
#pragma once
#include <string>

namespace fathom {

struct chat_message {
    std::string role;     // system | user | assistant | tool
    std::string content;
};

// Thinking mode asked of a chat rendering (apply_chat_template; docs/server.md "Thinking").
//   template_default — what the model's format does by itself (DS4's built-in format: non-thinking;
//                      a Jinja template: its own default, no variable set);
//   off / on         — DS4: the official encoder's "chat" / "thinking" mode; a Jinja template gets
//                      enable_thinking (and thinking) = false / true, which templates that support
//                      thinking read (Qwen3 and kin) and others ignore;
//   max              — on, plus DS4's Think-Max paragraph (reasoning_effort "max"); Jinja: as on.
enum class chat_thinking { template_default, off, on, max };

}  // namespace fathom
