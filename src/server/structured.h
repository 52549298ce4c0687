// Structured output at the API (docs/server.md "Structured output"): the request fields that ask for
// it, turned into a grammar for the scheduler (src/grammar): OpenAI response_format, Anthropic
// output_format, and the arguments of a call forced by tool_choice. Bad or unsupported schemas are
// 400s naming the keyword and where it is.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>

#include "grammar/json_schema.h"
#include "server/tool_calls.h"

namespace fathom::server {

// OpenAI response_format: {"type": "text"} -> null (unconstrained); {"type": "json_object"} -> any
// JSON object; {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
// -> the schema's grammar. Throws api_error (400, param response_format...).
std::shared_ptr<const grammar::json_grammar> parse_response_format(const nlohmann::json &rf);

// OpenAI Responses API text.format: the same three types with the json_schema fields flattened
// ({"type": "json_schema", "name", "schema", "strict", "description"}). For POST /v1/responses; errors
// name text.format.*. Throws api_error (400).
std::shared_ptr<const grammar::json_grammar> parse_text_format(const nlohmann::json &format);

// Anthropic output_format: {"type": "json_schema", "schema": {...}}. Throws api_error (400).
std::shared_ptr<const grammar::json_grammar> parse_output_format(const nlohmann::json &of);

// tool_choice required / a named function: the grammar of the generated rest of the call (after the
// format's forced_call_prefix) with the arguments following the tool's parameters schema. `tools`
// in OpenAI form. null when the format's calls do not carry the arguments as one JSON value.
// Throws api_error (400, param tools) for an unsupported schema.
std::shared_ptr<const grammar::json_grammar> forced_call_grammar(const nlohmann::json &tools, const tool_choice &choice,
                                                                 const tool_format &fmt);

}  // namespace fathom::server
