// libFuzzer target: the HTTP API's request parsers (src/server/api.cpp, responses_api.cpp, structured.cpp):
// a client's JSON body -> a generation request, for OpenAI Chat Completions and Completions, Anthropic
// Messages (and count_tokens) and the Responses API, with the Hermes and DSML tool formats. Input: the
// first byte picks the endpoint and the format; the rest is the request body. Oracle: a body is either
// parsed or refused with an api_error of status 4xx (what the server turns into a client error); any other
// exception would reach the client as "500 internal error", and a crash or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "server/tool_calls.h"
#include "server/api.h"
#include "server/responses_api.h"

namespace fs = fathom::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    static const auto hermes = fs::make_tool_format("hermes");
    static const auto dsml = fs::make_tool_format("dsml");
    const uint8_t sel = data[0];
    const auto &fmt = sel & 8 ? *dsml : *hermes;
    const std::string body(reinterpret_cast<const char *>(data + 1), size - 1);
    fathom::sampling_params defaults;
    try {
        const nlohmann::json b = fs::parse_body(body);
        switch (sel % 5) {
            case 0: (void)fs::parse_openai_chat(b, defaults, fmt); break;
            case 1: (void)fs::parse_openai_completion(b, defaults); break;
            case 2: (void)fs::parse_anthropic(b, defaults, fmt, false); break;
            case 3: (void)fs::parse_anthropic(b, defaults, fmt, true); break;
            default: (void)fs::parse_responses_request(b); break;
        }
    } catch (const fs::api_error &e) {
        if (e.status < 400 || e.status >= 500) __builtin_trap();  // a bad body is the client's error
    } catch (...) {
        __builtin_trap();  // the server would answer 500
    }
    return 0;
}
