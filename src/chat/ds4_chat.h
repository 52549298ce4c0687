// DeepSeek V4 (Flash/Pro) prompt rendering: OpenAI-style structured messages -> the prompt text,
// byte-identical to the official encoder encoding_dsv4.py (encode_messages) for the inputs it
// accepts. The text is then tokenized with the DS4 "rendered chat" tokenizer (special markers
// recognised in text).
//
// Layout (official rules; docs/ds4-chat-format.md gives each rule with its source):
//   BOS [Think-Max paragraph] system-text [\n\n## Tools ...] [\n\n## Response Format ...]
//   <｜User｜>user text                              (consecutive user/tool messages share one
//   <｜User｜><tool_result>r1</tool_result>\n\n<tool_result>r2</tool_result>   User marker,
//                                                     parts joined by "\n\n")
//   <｜Assistant｜></think>content\n\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls><｜end▁of▁sentence｜>
//   <｜Assistant｜><think>reasoning</think>content<｜end▁of▁sentence｜>   (reasoning kept when tools
//                                                     are present or the turn follows the last user)
//   <｜Assistant｜><think>   (generation prefix, thinking)   or   <｜Assistant｜></think>   (chat)
//
// Usage:
//   fathom::ds4chat::render_options o;            // thinking on, drop old reasoning
//   std::string prompt = fathom::ds4chat::render_prompt(messages, tools, o);
//   ... generate ...
//   auto r = fathom::ds4chat::dsml_parse(output, {.thinking = o.thinking});   // see dsml.h
//
// Pass nlohmann::ordered_json so object keys keep the client's order (Python dicts do, and tool
// schemas / arguments are printed in that order). The nlohmann::json overload sorts keys.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "chat/dsml.h"

namespace fathom::ds4chat {

// REASONING_EFFORT_MAX of the official encoder: prepended after BOS in thinking mode with
// reasoning_effort "max" ("Think Max"; the model card asks for a context of at least 384K).
extern const std::string_view k_think_max_prefix;

// Where request-level tools (and response_format) are attached before encoding.
enum class tools_placement {
    // The official test harness (load_cases: messages[0]["tools"] = tools): on the first message
    // when it is system or developer, else on a new empty system message inserted first.
    // Result: "<system text>\n\n## Tools...".
    first_message,
    // vLLM's DeepSeek V4 apply_chat_template: always a new {"role":"system"} at index 0.
    // Result: "\n\n## Tools...<system text>" (the tools block comes first).
    new_system_message,
};

struct render_options {
    bool thinking = true;        // thinking_mode "thinking" (true) or "chat" (false)
    bool think_max = false;      // reasoning_effort "max"; ignored when !thinking
    bool drop_thinking = true;   // drop reasoning of turns before the last user message (disabled
                                 // automatically when tools are present, as officially)
    bool add_bos = true;
    tools_placement placement = tools_placement::first_message;
    // Exact replay: an assistant turn whose tool-call ids all map to one record renders those
    // sampled bytes instead of the canonical DSML. May be null.
    const dsml_replay_map *replay = nullptr;
};

struct render_input {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    nlohmann::ordered_json tools;            // null or array (OpenAI form or bare function objects)
    nlohmann::ordered_json response_format;  // null or the schema object
};

// Messages: objects with "role" in system, developer, user, assistant, tool, latest_reminder;
// "content" string, null or a list of {"type":"text","text":...} parts (joined by "\n\n");
// assistant "reasoning_content" and "tool_calls" ([{id, type, function:{name, arguments}}],
// arguments a JSON string; an object is accepted and serialised); tool "tool_call_id".
// Encoder-level keys "tools", "response_format" (on system/developer) and "wo_eos" (assistant
// without EOS) are honoured. Throws fathom::error naming the message index on invalid input.
std::string render_prompt(const render_input &in, const render_options &opts);
std::string render_prompt(const nlohmann::ordered_json &messages, const nlohmann::ordered_json &tools,
                          const render_options &opts);
std::string render_prompt(const nlohmann::json &messages, const nlohmann::json &tools, const render_options &opts);

// The text the model continues from after a user turn: "<｜Assistant｜><think>" or
// "<｜Assistant｜></think>".
std::string generation_prefix(bool thinking);

}  // namespace fathom::ds4chat
