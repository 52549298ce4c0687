// The OpenAI Responses API (POST /v1/responses), request side: validation of the body and the
// conversion of its input items into an OpenAI chat-completions body, which the chat parser
// (api.h parse_openai_chat) then turns into a gen_request like any chat request: one tool format,
// one thinking set-up, one exact-replay path for every OpenAI-style API. Model-free (unit-tested in
// tests/server/test_responses.cpp); the HTTP side is responses.cpp. Wire format: docs/server.md
// "Responses API".
//
// Input items (a string input is one user message):
//   {"type": "message" (optional), "role": user|system|developer|assistant,
//    "content": string | [{"type": "input_text"|"output_text", "text"} | {"type": "refusal", "refusal"}]}
//   {"type": "function_call", "call_id", "name", "arguments": string}
//   {"type": "function_call_output", "call_id", "output": string | [input_text parts]}
//   {"type": "reasoning", "summary": [...], "content"?: [...]}   -- accepted, dropped from the prompt
// Conversion (items_to_messages): instructions -> a first system message; a message -> a chat
// message of its role with the parts' texts joined; function_call items -> tool_calls of the
// assistant message right before them (a new assistant message with null content when there is
// none: reasoning items in between do not count); function_call_output -> a "tool" message.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace fathom::server {

struct responses_request {
    // What the chat parser takes besides `messages`: sampling fields and extensions copied through
    // (temperature, top_p, seed, top_k, stop, prefill_*, ...), max_tokens (from max_output_tokens),
    // tools and tool_choice in chat form, reasoning_effort (from reasoning.effort), response_format
    // (from text.format).
    nlohmann::json chat = nlohmann::json::object();
    nlohmann::json input_items = nlohmann::json::array();  // this request's input, normalised (below)
    std::string instructions;                              // "" = none
    std::string previous_response_id;                      // "" = none
    bool stream = false;
    bool store = true;
    bool parallel_tool_calls = true;
    int64_t max_output_tokens = -1;                        // -1 = none
    // Echoed in the Response object: tools (flat form, as validated), tool_choice (as given; "auto"
    // when absent), reasoning ({effort, summary}), text ({format}), metadata (object or null).
    nlohmann::json tools = nlohmann::json::array();
    nlohmann::json tool_choice = "auto";
    nlohmann::json reasoning = {{"effort", nullptr}, {"summary", nullptr}};
    nlohmann::json text = {{"format", {{"type", "text"}}}};
    nlohmann::json metadata = nullptr;
};

// Validates a /v1/responses body (api_error 400 naming the field, e.g. "input[2].call_id", on any
// malformed or unsupported value). Input items are normalised: every item gets its "type" and an "id"
// (the client's, else a fresh msg_ / fc_ / fco_ / rs_ id); message
// content becomes a list of {"type": "input_text"|"output_text", "text"} parts (output_text for
// assistant messages, refusals included as their text); function_call_output output becomes a string.
responses_request parse_responses_request(const nlohmann::json &body);

// Checks that every function_call_output in `items` answers a function_call before it in `items`
// (400 naming "input[k].call_id"; k counts from `first_input`, the index of the request's first own
// input item in `items`, which may follow a stored history).
void check_call_outputs(const nlohmann::json &items, size_t first_input);

// Normalised items (+ instructions, "" = none) -> OpenAI chat `messages`.
nlohmann::json items_to_messages(const nlohmann::json &items, const std::string &instructions);

}  // namespace fathom::server
