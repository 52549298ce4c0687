// Request parsing and validation for the OpenAI (chat completions, completions) and Anthropic
// (messages, count_tokens) APIs: JSON body -> gen_request, with every type/range error reported as
// an api_error carrying the HTTP status. Conversations with tools are rendered to plain chat
// messages here through a tool_format (see tool_calls.h), so any chat template can take them.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "grammar/json_schema.h"
#include "server/prompt_compression.h"
#include "server/tool_calls.h"

namespace fathom::server {

// A client-visible error: HTTP status, a type from the API's error vocabulary, and the offending
// parameter (may be empty). Rendered as OpenAI or Anthropic error JSON by the HTTP layer.
class api_error : public std::runtime_error {
public:
    api_error(int status, std::string type, const std::string &msg, std::string param = {}, std::string code = {})
        : std::runtime_error(msg), status(status), type(std::move(type)), param(std::move(param)), code(std::move(code)) {}
    int status;
    std::string type;   // OpenAI vocabulary: invalid_request_error, authentication_error, not_found_error, ...
    std::string param;
    std::string code;   // OpenAI error code when the API defines one (e.g. previous_response_not_found); "" = derived
    int retry_after_s = 0;  // > 0: the response's Retry-After header (seconds; a full queue's 503)
};

// Shorthand for a 400 invalid_request_error.
[[noreturn]] void bad_request(const std::string &msg, const std::string &param = {});

enum class api_kind { openai_chat, openai_completion, anthropic_messages };

struct gen_request {
    api_kind kind = api_kind::openai_chat;
    std::string model;                        // as sent ("" if absent)
    std::vector<chat_message> messages;       // chat kinds, tools already rendered in
    // Completions: either text or token ids.
    std::string prompt_text;
    std::vector<int32_t> prompt_tokens;
    bool prompt_is_tokens = false;

    sampling_params sampling;
    int32_t max_tokens = -1;                  // -1: until end of generation or full context
    std::vector<std::string> stop;
    bool stream = false;
    bool include_usage = false;               // OpenAI stream_options.include_usage
    bool logprobs = false;
    int32_t top_logprobs = 0;

    // PFlash overrides: prefill_compression (off|auto|always), prefill_keep_ratio ([0, 1]),
    // prefill_threshold (tokens); absent = the server's settings.
    compression_request compression;

    // Thinking (docs/server.md "Thinking"): OpenAI reasoning_effort, Anthropic (and DeepSeek-style
    // OpenAI) thinking {type, budget_tokens}. nullopt = absent (the server's --reasoning applies).
    // think_budget: thinking tokens before the end-of-thinking marker is forced (-1 = none given;
    // checked against the context when the prompt is built).
    std::optional<chat_thinking> thinking;
    int64_t think_budget = -1;

    // Speculative decoding (server --spec): "speculative": false turns it off for this request, true
    // or absent keeps the server's, {"draft_max": N} caps the drafts per step (0..64; 0 = off).
    int32_t draft_max = -1;
    // Structured output (docs/server.md "Structured output"): OpenAI response_format / Anthropic
    // output_format, compiled; null = unconstrained. A forced tool call replaces it (generate.cpp).
    std::shared_ptr<const grammar::json_grammar> grammar;
    nlohmann::json response_schema;  // the json_schema's schema (null if none), described in the prompt by formats that do

    nlohmann::json tools = nlohmann::json::array();  // OpenAI form [{type:function, function:{...}}]
    tool_choice choice;
    std::vector<std::string> tool_names;
    // OpenAI parallel_tool_calls / Anthropic tool_choice.disable_parallel_tool_use (negated): false =
    // at most one call; generation stops once the first call is complete.
    bool parallel_calls = true;
    bool tools_active() const { return !tool_names.empty() && choice.kind != tool_choice::none; }
};

// `defaults` are the server's sampling defaults (command line); a request overrides fields it sets.
// A request without a seed gets a random one.
gen_request parse_openai_chat(const nlohmann::json &body, const sampling_params &defaults, const tool_format &fmt);
gen_request parse_openai_completion(const nlohmann::json &body, const sampling_params &defaults);
// count_only: /v1/messages/count_tokens (max_tokens not required, sampling fields ignored).
gen_request parse_anthropic(const nlohmann::json &body, const sampling_params &defaults, const tool_format &fmt,
                            bool count_only);

// Parses a request body; invalid JSON or a non-object -> api_error 400.
nlohmann::json parse_body(const std::string &body);

}  // namespace fathom::server
